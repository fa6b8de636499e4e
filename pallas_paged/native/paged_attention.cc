// Ragged paged attention for CPUs, as an XLA FFI custom call.
//
// The same math as the Pallas kernels (pallas_paged/ragged.py): each query row attends,
// causally, to its sequence's keys through the block table, with an online softmax in
// float32. Decode is the case of one query row per sequence.
//
// Work is split into items of (sequence, KV head, tile of query tokens); the caller and
// XLA's intra-op threads claim items from a shared counter, so the call uses every core
// and finishes even if no helper thread ever starts.
//
// Shapes: q, out [tokens, q_heads, d]; k_cache, v_cache [kv_heads, blocks, block_size, d];
// block_tables int32[seqs, max_blocks]; context_lens int32[seqs]; query_start_loc
// int32[seqs + 1]. Rows past query_start_loc[seqs], and the rows of a sequence with context 0
// (a padding row of a decode batch), come out as zeros. Arguments that would make a read go
// out of range (a block table entry past the cache, a context longer than its table) are an
// error, not a crash.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int kChunk = 64;         // keys per online-softmax step
constexpr int kTileTokens = 16;    // query tokens per work item

inline float load(float x) { return x; }
inline float load(uint16_t bf16) {
  uint32_t bits = uint32_t(bf16) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}
inline void store(float x, float* out) { *out = x; }
inline void store(float x, uint16_t* out) {  // round to nearest even
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  *out = uint16_t(bits >> 16);
}

struct Problem {
  const void* q;
  const void* k_cache;
  const void* v_cache;
  const int32_t* block_tables;
  const int32_t* context_lens;
  const int32_t* query_start_loc;
  void* out;
  int64_t num_tokens, q_heads, head_dim;
  int64_t kv_heads, num_blocks, block_size;
  int64_t num_seqs, max_blocks;
  float scale;
};

// Query tokens [first_token, first_token + num_tokens) of `seq`, the query heads of
// `kv_head`, against keys [key_begin, key_end). An item that is one of `parts` > 1 key ranges
// of the same rows leaves its unnormalised result at `partial` (see merge_parts).
struct Item {
  int32_t seq, kv_head, first_token, num_tokens;
  int64_t key_begin, key_end;
  int32_t part = 0, parts = 1;
  int64_t partial = -1;  // offset into the partial results, in floats
};

using v16 = float __attribute__((vector_size(64), aligned(4), may_alias));
using v8 = float __attribute__((vector_size(32)));
using u16x16 = uint16_t __attribute__((vector_size(32), aligned(2), may_alias));
using u32x16 = uint32_t __attribute__((vector_size(64)));

inline v16 load16(const float* x) { return *reinterpret_cast<const v16*>(x); }
inline v16 load16(const uint16_t* x) {
  u32x16 wide = __builtin_convertvector(*reinterpret_cast<const u16x16*>(x), u32x16) << 16;
  v16 out;
  std::memcpy(&out, &wide, sizeof out);
  return out;
}
inline float sum(v16 a) {
#if defined(__clang__) || __GNUC__ >= 12
  v8 half = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
#else  // GCC 11 has no __builtin_shufflevector
  v8 half;
  for (int i = 0; i < 8; ++i) half[i] = a[i] + a[i + 8];
#endif
  float total = 0.0f;
  for (int i = 0; i < 8; ++i) total += half[i];
  return total;
}

using i32x16 = int32_t __attribute__((vector_size(64)));

inline i32x16 lane_indices() { return i32x16{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}; }

// exp(x) for x <= 0, 16 lanes at a time, to about 2 ulp (Cephes' polynomial).
inline v16 exp16(v16 x) {
  x = x < -87.0f ? v16{} - 87.0f : x;
  const v16 n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;  // round to nearest
  const v16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  v16 poly = v16{} + 1.9875691500e-4f;
  poly = poly * r + 1.3981999507e-3f;
  poly = poly * r + 8.3334519073e-3f;
  poly = poly * r + 4.1665795894e-2f;
  poly = poly * r + 1.6666665459e-1f;
  poly = poly * r + 5.0000001201e-1f;
  poly = poly * r * r + r + 1.0f;
  const i32x16 bits = (__builtin_convertvector(n, i32x16) + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return poly * scale;
}

// The largest of s[0, visible).
inline float row_max(const float* s, int visible) {
  v16 best = v16{} - INFINITY;
  for (int c = 0; c < visible; c += 16) {
    const v16 x = load16(s + c);
    best = (lane_indices() + c < visible) & (x > best) ? x : best;
  }
  float out = best[0];
  for (int i = 1; i < 16; ++i) out = std::max(out, best[i]);
  return out;
}

// s[c] = exp(s[c] - max) for c < visible and 0 for the rest of the chunk; returns the sum.
inline float exponentiate(float* s, int visible, float max) {
  v16 total{};
  for (int c = 0; c < kChunk; c += 16) {
    const v16 e = exp16(load16(s + c) - max);
    const v16 weight = lane_indices() + c < visible ? e : v16{};
    *reinterpret_cast<v16*>(s + c) = weight;
    total += weight;
  }
  return sum(total);
}

// Row blocks sized so a block's accumulators fill 16 vector registers.
template <int kD>
constexpr int kRowBlock = kD ? std::max(1, 16 / (kD / 16)) : 1;

// s[r, c] = q[r] . k[c] for every row and key; kD = 0 reads the head size from D.
template <int kD, int kRows>
inline void scores_block(const float* q, const float* const* k_rows, int keys, int D, float* s) {
  constexpr int kFixed = kD / 16;
  const int vectors = kD ? kFixed : D / 16;
  for (int c = 0; c < keys; ++c) {
    v16 dot[kRows];
    for (int r = 0; r < kRows; ++r) dot[r] = load16(q + size_t(r) * D) * load16(k_rows[c]);
    for (int j = 1; j < vectors; ++j) {
      const v16 k = load16(k_rows[c] + 16 * j);
      for (int r = 0; r < kRows; ++r) dot[r] += load16(q + size_t(r) * D + 16 * j) * k;
    }
    for (int r = 0; r < kRows; ++r) s[size_t(r) * kChunk + c] = sum(dot[r]);
  }
}

// Runs block(rows_in_block, first_row) over all rows: blocks of kMax rows, then one block of
// the remainder, each a compile-time size, so its accumulators stay in registers.
template <int kMax, typename Block>
inline void in_row_blocks(int rows, Block&& block) {
  int r = 0;
  for (; r + kMax <= rows; r += kMax) block(std::integral_constant<int, kMax>{}, r);
  switch (rows - r) {
    case 1: block(std::integral_constant<int, 1>{}, r); break;
    case 2: if constexpr (kMax > 2) block(std::integral_constant<int, 2>{}, r); break;
    case 3: if constexpr (kMax > 3) block(std::integral_constant<int, 3>{}, r); break;
    default: for (; r < rows; ++r) block(std::integral_constant<int, 1>{}, r);
  }
}

#if defined(__clang__) || __GNUC__ >= 12
#define PALLAS_PAGED_SUM16 1
// Sixteen vectors → one whose lane i is the sum of x[i]'s lanes: each level adds the two
// halves of every group of lanes of a pair of vectors (groups of 16, 8, 4, then 2 lanes),
// about 3 operations a sum where a lone horizontal sum (sum) takes about 10.
inline v16 sum16(const v16* x) {
  v16 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(x[2 * i], x[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// s[r, c] = q[r] . k[c] for a head size known at compile time: a row against sixteen keys at
// a time, whose sums sum16 finishes together. Lanes past `keys` get copies of the last key.
template <int kD>
void scores_by_16(const float* q, const float* const* k_rows, int rows, int keys, float* s) {
  constexpr int kVectors = kD / 16;
  for (int r = 0; r < rows; ++r) {
    v16 q_row[kVectors];
    for (int j = 0; j < kVectors; ++j) q_row[j] = load16(q + size_t(r) * kD + 16 * j);
    for (int c0 = 0; c0 < keys; c0 += 16) {
      v16 dot[16];
      for (int i = 0; i < 16; ++i) {
        const float* k = k_rows[std::min(c0 + i, keys - 1)];
        dot[i] = q_row[0] * load16(k);
        for (int j = 1; j < kVectors; ++j) dot[i] += q_row[j] * load16(k + 16 * j);
      }
      *reinterpret_cast<v16*>(s + size_t(r) * kChunk + c0) = sum16(dot);
    }
  }
}

#if defined(__AVX512BF16__)
#define PALLAS_PAGED_BF16_DOT 1
// s[r, c] = scale * (q[r] . k[c]) for bfloat16 keys, read as they are: VDPBF16PS multiplies
// pairs of bfloat16 elements exactly and adds both products to a float32 lane, so no key is
// converted. q: [rows, kD] bfloat16; with kSplit, a float32 query is its bfloat16 part q_hi
// plus the bfloat16 rounding of the rest, q_lo (both [rows, kD]), so the scores keep about 16
// bits of the query's precision. Lanes past `keys` get copies of the last key.
template <int kD, bool kSplit>
void scores_bf16(const uint16_t* q_hi, const uint16_t* q_lo, const uint16_t* const* k_rows, int rows, int keys,
                 float scale, float* s) {
  constexpr int kVectors = kD / 32;  // 32 bfloat16 elements a register
  for (int r = 0; r < rows; ++r) {
    __m512bh hi[kVectors], lo[kVectors];
    for (int j = 0; j < kVectors; ++j) {
      hi[j] = __m512bh(_mm512_loadu_si512(q_hi + size_t(r) * kD + 32 * j));
      if constexpr (kSplit) lo[j] = __m512bh(_mm512_loadu_si512(q_lo + size_t(r) * kD + 32 * j));
    }
    for (int c0 = 0; c0 < keys; c0 += 16) {
      v16 dot[16];
      for (int i = 0; i < 16; ++i) {
        const uint16_t* k = k_rows[std::min(c0 + i, keys - 1)];
        __m512 sum = _mm512_setzero_ps();
        for (int j = 0; j < kVectors; ++j) {
          const __m512bh key = __m512bh(_mm512_loadu_si512(k + 32 * j));
          sum = _mm512_dpbf16_ps(sum, hi[j], key);
          if constexpr (kSplit) sum = _mm512_dpbf16_ps(sum, lo[j], key);
        }
        dot[i] = v16(sum);
      }
      *reinterpret_cast<v16*>(s + size_t(r) * kChunk + c0) = sum16(dot) * scale;
    }
  }
}
#endif
#endif

template <int kD>
void scores(const float* q, const float* const* k_rows, int rows, int keys, int D, float* s) {
#ifdef PALLAS_PAGED_SUM16
  if constexpr (kD > 0) return scores_by_16<kD>(q, k_rows, rows, keys, s);
#endif
  in_row_blocks<kRowBlock<kD>>(rows, [&](auto size, int r) {
    scores_block<kD, decltype(size)::value>(q + size_t(r) * D, k_rows, keys, D, s + size_t(r) * kChunk);
  });
}

// acc[r] += sum over c of w(r, c) * v[c], with w(r, c) = w[r * row_stride + c * key_stride]
// (scores laid out by row, or by key with rows in lanes), a block of rows at a time, held in
// registers. Values are float32, or bfloat16 converted as they are loaded.
template <int kD, int kRows, typename VT>
inline void accumulate_block(const float* w, int row_stride, int key_stride, const VT* const* v_rows, int keys,
                             float* acc) {
  constexpr int kVectors = kD / 16;
  v16 out[kRows][kVectors];
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < kVectors; ++j) out[r][j] = load16(acc + size_t(r) * kD + 16 * j);
  for (int c = 0; c < keys; ++c) {
    v16 v[kVectors];
    for (int j = 0; j < kVectors; ++j) v[j] = load16(v_rows[c] + 16 * j);
    for (int r = 0; r < kRows; ++r) {
      const float weight = w[size_t(r) * row_stride + size_t(c) * key_stride];
      for (int j = 0; j < kVectors; ++j) out[r][j] += weight * v[j];
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < kVectors; ++j) *reinterpret_cast<v16*>(acc + size_t(r) * kD + 16 * j) = out[r][j];
}

template <int kD, typename VT>
void accumulate_values(const float* w, int row_stride, int key_stride, const VT* const* v_rows, int rows, int keys,
                       int D, float* acc) {
  if constexpr (kD == 0) {  // any head size: one vector at a time
    for (int r = 0; r < rows; ++r)
      for (int j = 0; j < D / 16; ++j) {
        v16 out = load16(acc + size_t(r) * D + 16 * j);
        for (int c = 0; c < keys; ++c)
          out += w[size_t(r) * row_stride + size_t(c) * key_stride] * load16(v_rows[c] + 16 * j);
        *reinterpret_cast<v16*>(acc + size_t(r) * D + 16 * j) = out;
      }
  } else {
    in_row_blocks<kRowBlock<kD>>(rows, [&](auto size, int r) {
      accumulate_block<kD, decltype(size)::value, VT>(w + size_t(r) * row_stride, row_stride, key_stride, v_rows, keys,
                                                  acc + size_t(r) * kD);
    });
  }
}

// Query rows in vector lanes, for items with many rows (prefill): s[c, r] = q[r] . k[c],
// where q_t is [D, R] (R a multiple of 16). Eight keys at a time keep eight sums in flight,
// and each multiply takes its key element straight from memory.
template <int kD>
void scores_in_lanes(const float* q_t, int R, const float* const* k_rows, int keys, int D, float* s) {
  const int dims = kD ? kD : D;
  for (int c = 0; c < keys; c += 8) {
    const float* k[8];
    for (int i = 0; i < 8; ++i) k[i] = k_rows[std::min(c + i, keys - 1)];
    for (int lane = 0; lane < R; lane += 16) {
      v16 dot[8] = {};
      for (int d = 0; d < dims; ++d) {
        const v16 q = load16(q_t + size_t(d) * R + lane);
        for (int i = 0; i < 8; ++i) dot[i] += k[i][d] * q;
      }
      for (int i = 0; i < 8 && c + i < keys; ++i) *reinterpret_cast<v16*>(s + size_t(c + i) * R + lane) = dot[i];
    }
  }
}

// The online-softmax step for rows in lanes: row r sees keys c <= first_visible + r / group.
// Turns s [keys, R] into weights, updates the running max m and sum l, and rescales acc.
void softmax_in_lanes(float* s, int R, int keys, int first_visible, int group, float* m, float* l, float* acc, int D) {
  for (int lane = 0; lane < R; lane += 16) {
    const i32x16 last = (lane_indices() + lane) / group + first_visible;
    const v16 old_max = load16(m + lane);
    v16 new_max = old_max;
    for (int c = 0; c < keys; ++c) {
      const v16 x = load16(s + size_t(c) * R + lane);
      new_max = (last >= c) & (x > new_max) ? x : new_max;
    }
    const v16 rescale = new_max == -INFINITY ? v16{} + 1.0f : exp16(old_max - new_max);
    v16 total{};
    for (int c = 0; c < keys; ++c) {
      v16* x = reinterpret_cast<v16*>(s + size_t(c) * R + lane);
      const v16 weight = last >= c ? exp16(*x - new_max) : v16{};
      *x = weight;
      total += weight;
    }
    *reinterpret_cast<v16*>(m + lane) = new_max;
    *reinterpret_cast<v16*>(l + lane) = load16(l + lane) * rescale + total;
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < D; j += 16) {
        v16* row = reinterpret_cast<v16*>(acc + size_t(lane + i) * D + j);
        *row = *row * rescale[i];
      }
  }
}

// The online-softmax step for rows laid out one after another (few rows: decode).
void softmax_by_row(float* s, int rows, int keys, int64_t first_visible, int group, float* m, float* l, float* acc,
                    int D) {
  for (int r = 0; r < rows; ++r) {
    const int visible = int(std::min<int64_t>(keys, first_visible + r / group + 1));
    float* weights = s + size_t(r) * kChunk;
    if (visible <= 0) {
      std::fill(weights, weights + keys, 0.0f);
      continue;
    }
    const float chunk_max = std::max(m[r], row_max(weights, visible));
    const float rescale = exp16(v16{} + (m[r] - chunk_max))[0];
    m[r] = chunk_max;
    l[r] = l[r] * rescale + exponentiate(weights, visible, chunk_max);
    float* acc_row = acc + size_t(r) * D;
    for (int j = 0; j < D; j += 16) *reinterpret_cast<v16*>(acc_row + j) = load16(acc_row + j) * rescale;
  }
}

// Loads every cache line of a chunk's keys and values once, and discards them. These loads do
// not depend on each other, so the core keeps many cache misses in flight, over blocks
// scattered in memory where the hardware prefetcher does not follow; the attention math
// that then reads the chunk, with its chains of dependent operations, keeps only a few.
// Measured on 32 sequences x 2048 tokens with shuffled blocks: float32 1.7x faster (and
// faster than copying the chunk, or than software prefetching, which did nothing here),
// bfloat16 1.3x; about 15% slower when the blocks are already in cache.
//
// Rows start on a 32-byte boundary and are a multiple of 32 bytes long (head_dim is a
// multiple of 16), so a load every 64 bytes from a row's start reaches each of its lines.
template <typename KVT>
inline void touch(const KVT* k, const KVT* v, const int64_t* offsets, int keys, int D) {
  const int64_t row_bytes = int64_t(D) * int64_t(sizeof(KVT));
  float sum = 0.0f;
  for (int c = 0; c < keys; ++c) {
    const char* k_row = reinterpret_cast<const char*>(k + offsets[c]);
    const char* v_row = reinterpret_cast<const char*>(v + offsets[c]);
    for (int64_t b = 0; b < row_bytes; b += 64) {
      float k_word, v_word;
      std::memcpy(&k_word, k_row + b, sizeof k_word);
      std::memcpy(&v_word, v_row + b, sizeof v_word);
      sum += k_word + v_word;
    }
  }
  volatile float sink = sum;
  (void)sink;
}

// Pointers to kChunk keys' and values' rows: in the cache (k_in_place, v_in_place), and as
// float32 (k_rows, v_rows): a float32 cache is read in place, and a 16-bit one, unless the
// caller reads it as it is (convert false), converted here once rather than once per query row.
template <typename KVT>
struct Chunk {
  const KVT* k_in_place[kChunk];
  const KVT* v_in_place[kChunk];
  const float* k_rows[kChunk];
  const float* v_rows[kChunk];

  void gather(const KVT* k, const KVT* v, const int32_t* table, int64_t start, int keys, int64_t block_size, int D,
              float* converted, bool convert) {
    int64_t offsets[kChunk];  // of each key's row, in elements
    for (int c = 0; c < keys;) {  // a block's keys at a time
      const int64_t key = start + c, within = key % block_size;
      const int64_t first = (int64_t(table[key / block_size]) * block_size + within) * D;
      const int n = int(std::min<int64_t>(block_size - within, keys - c));
      for (int i = 0; i < n; ++i) offsets[c + i] = first + int64_t(i) * D;
      c += n;
    }
    touch(k, v, offsets, keys, D);
    for (int c = 0; c < keys; ++c) {
      k_in_place[c] = k + offsets[c];
      v_in_place[c] = v + offsets[c];
    }
    if (!convert) return;
    for (int c = 0; c < keys; ++c) {
      if constexpr (std::is_same_v<KVT, float>) {
        k_rows[c] = k + offsets[c];
        v_rows[c] = v + offsets[c];
      } else {
        float* k_copy = converted + size_t(c) * D;
        float* v_copy = converted + size_t(kChunk + c) * D;
        for (int j = 0; j < D; j += 16) {
          *reinterpret_cast<v16*>(k_copy + j) = load16(k + offsets[c] + j);
          *reinterpret_cast<v16*>(v_copy + j) = load16(v + offsets[c] + j);
        }
        k_rows[c] = k_copy;
        v_rows[c] = v_copy;
      }
    }
  }
};

// One work item: query tokens [first, first + n) of `seq`, the query heads of `kv_head`.
// Keys and values are read in place, kChunk at a time; head_dim is a multiple of 16. With
// 16 rows or more, the rows sit in vector lanes; with fewer, one after another.
template <typename QT, typename KVT, int kD>
void attend(const Problem& p, const Item& item, std::vector<float>& scratch, float* partials) {
  const int D = kD ? kD : int(p.head_dim);
  const int group = int(p.q_heads / p.kv_heads);
  const int rows = item.num_tokens * group;
  const bool in_lanes = rows >= 16;
  const int R = in_lanes ? (rows + 15) / 16 * 16 : rows;  // rows, padded to whole vectors in lanes
  const int32_t seq = item.seq;
  const int64_t query_len = p.query_start_loc[seq + 1] - p.query_start_loc[seq];
  const int64_t first_pos = p.context_lens[seq] - query_len + (item.first_token - p.query_start_loc[seq]);
  const int64_t num_keys = item.key_end;
#ifdef PALLAS_PAGED_BF16_DOT
  constexpr bool kBf16Dot = std::is_same_v<KVT, uint16_t> && kD > 0;
#else
  constexpr bool kBf16Dot = false;
#endif
  constexpr bool kSplit = std::is_same_v<QT, float>;  // see scores_bf16
  // Few bfloat16 rows (decode) read the cache as it is: see scores_bf16.
  const bool direct = kBf16Dot && !in_lanes;

  scratch.assign(size_t(R) * (2 * D + 2 + kChunk) + (std::is_same_v<KVT, float> || direct ? 0 : 2 * kChunk * D), 0.0f);
  // [R, D], or [D, R] in lanes; scaled. Direct: bfloat16 [R, D], unscaled, or for a float32 q,
  // [2, R, D] scaled, its high and low bfloat16 parts.
  float* q = scratch.data();
  float* acc = q + size_t(R) * D;            // [R, D]
  float* m = acc + size_t(R) * D;            // [R] running max
  float* l = m + R;                          // [R] running sum
  float* s = l + R;                          // [R, kChunk], or [kChunk, R] in lanes: scores, then weights
  float* converted = s + size_t(R) * kChunk;  // [2, kChunk, D] a 16-bit chunk in float32
  std::fill(m, m + R, -INFINITY);

  const KVT* k_in = static_cast<const KVT*>(p.k_cache) + int64_t(item.kv_head) * p.num_blocks * p.block_size * D;
  const KVT* v_in = static_cast<const KVT*>(p.v_cache) + int64_t(item.kv_head) * p.num_blocks * p.block_size * D;
  const int32_t* table = p.block_tables + int64_t(seq) * p.max_blocks;

  const QT* q_in = static_cast<const QT*>(p.q);
  for (int t = 0; t < item.num_tokens; ++t)
    for (int g = 0; g < group; ++g) {
      const QT* src = q_in + ((item.first_token + t) * p.q_heads + item.kv_head * group + g) * D;
      const int r = t * group + g;
      if (direct) {
        uint16_t* hi = reinterpret_cast<uint16_t*>(q) + size_t(r) * D;
        for (int d = 0; d < D; ++d) {
          if constexpr (kSplit) {
            const float x = load(src[d]) * p.scale;
            store(x, hi + d);
            store(x - load(hi[d]), hi + size_t(R) * D + d);
          } else {
            hi[d] = src[d];
          }
        }
        continue;
      }
      for (int d = 0; d < D; ++d) q[in_lanes ? size_t(d) * R + r : size_t(r) * D + d] = load(src[d]) * p.scale;
    }

  Chunk<KVT> chunk;
  for (int64_t start = item.key_begin; start < num_keys; start += kChunk) {
    const int keys = int(std::min<int64_t>(kChunk, num_keys - start));
    chunk.gather(k_in, v_in, table, start, keys, p.block_size, D, converted, !direct);
    const int64_t first_visible = first_pos - start;  // row r sees keys c <= this + r / group
    if constexpr (kBf16Dot) {
      if (direct) {
#ifdef PALLAS_PAGED_BF16_DOT
        const uint16_t* q_hi = reinterpret_cast<const uint16_t*>(q);
        scores_bf16<kD, kSplit>(q_hi, q_hi + size_t(R) * D, chunk.k_in_place, rows, keys, kSplit ? 1.0f : p.scale, s);
#endif
        softmax_by_row(s, rows, keys, first_visible, group, m, l, acc, D);
        accumulate_values<kD>(s, kChunk, 1, chunk.v_in_place, rows, keys, D, acc);
        continue;
      }
    }
    if (in_lanes) {
      scores_in_lanes<kD>(q, R, chunk.k_rows, keys, D, s);
      softmax_in_lanes(s, R, keys, int(std::min<int64_t>(first_visible, kChunk)), group, m, l, acc, D);
      accumulate_values<kD>(s, 1, R, chunk.v_rows, rows, keys, D, acc);
    } else {
      scores<kD>(q, chunk.k_rows, rows, keys, D, s);
      softmax_by_row(s, rows, keys, first_visible, group, m, l, acc, D);
      accumulate_values<kD>(s, kChunk, 1, chunk.v_rows, rows, keys, D, acc);
    }
  }

  if (item.parts > 1) {  // acc [rows, D], then m and l [rows], for merge_parts
    float* partial = partials + item.partial;
    std::copy(acc, acc + size_t(rows) * D, partial);
    std::copy(m, m + rows, partial + size_t(rows) * D);
    std::copy(l, l + rows, partial + size_t(rows) * (D + 1));
    return;
  }
  QT* out = static_cast<QT*>(p.out);
  for (int t = 0; t < item.num_tokens; ++t)
    for (int g = 0; g < group; ++g) {
      const int r = t * group + g;
      const float inverse = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
      QT* dst = out + ((item.first_token + t) * p.q_heads + item.kv_head * group + g) * D;
      for (int d = 0; d < D; ++d) store(acc[size_t(r) * D + d] * inverse, dst + d);
    }
}

// Combines the key ranges of split items: each part's running max m, sum l and unnormalised
// output acc, rescaled to the largest max, then normalised.
template <typename QT>
void merge_parts(const Problem& p, const std::vector<Item>& items, const float* partials) {
  const int64_t D = p.head_dim, group = p.q_heads / p.kv_heads;
  std::vector<float> out_row(D);
  for (size_t first = 0; first < items.size(); first += items[first].parts) {
    const Item& item = items[first];
    if (item.parts == 1) continue;
    const int64_t rows = item.num_tokens * group;
    for (int64_t r = 0; r < rows; ++r) {
      float max = -INFINITY;
      for (int part = 0; part < item.parts; ++part)
        max = std::max(max, partials[items[first + part].partial + rows * D + r]);
      float total = 0.0f;
      std::fill(out_row.begin(), out_row.end(), 0.0f);
      for (int part = 0; part < item.parts; ++part) {
        const float* partial = partials + items[first + part].partial;
        const float weight = partial[rows * D + r] == -INFINITY ? 0.0f : std::exp(partial[rows * D + r] - max);
        total += weight * partial[rows * (D + 1) + r];
        for (int64_t d = 0; d < D; ++d) out_row[d] += weight * partial[r * D + d];
      }
      const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
      QT* dst = static_cast<QT*>(p.out) + ((item.first_token + r / group) * p.q_heads + item.kv_head * group + r % group) * D;
      for (int64_t d = 0; d < D; ++d) store(out_row[d] * inverse, dst + d);
    }
  }
}

ffi::Unexpected<ffi::Error> invalid(const char* message) {
  return ffi::Unexpected<ffi::Error>(ffi::Error::InvalidArgument(std::string("ragged_paged_attention: ") + message));
}

ffi::ErrorOr<std::vector<Item>> work_items(const Problem& p) {
  std::vector<Item> items;
  if (p.query_start_loc[0] != 0 || p.query_start_loc[p.num_seqs] > p.num_tokens)
    return invalid("query_start_loc must start at 0 and end within q's tokens");
  for (int32_t seq = 0; seq < p.num_seqs; ++seq) {
    const int32_t begin = p.query_start_loc[seq], end = p.query_start_loc[seq + 1];
    const int64_t context_len = p.context_lens[seq];
    if (end < begin) return invalid("query_start_loc must not decrease");
    if (end == begin || context_len == 0) continue;  // nothing to attend to: zeros
    if (context_len < end - begin) return invalid("a sequence has more query rows than context tokens");
    if (context_len > p.max_blocks * p.block_size)
      return invalid("a context is longer than its block table holds");
    for (int64_t b = 0; b < (context_len + p.block_size - 1) / p.block_size; ++b) {
      const int32_t block = p.block_tables[seq * p.max_blocks + b];
      if (block < 0 || block >= p.num_blocks) return invalid("a block table entry is out of range");
    }
    for (int32_t first = begin; first < end; first += kTileTokens) {
      const int32_t tokens = std::min(kTileTokens, end - first);
      const int64_t num_keys = context_len - (end - first) + tokens;  // up to the tile's last position
      for (int32_t h = 0; h < p.kv_heads; ++h) items.push_back({seq, h, first, tokens, 0, num_keys});
    }
  }
  return items;
}

// Parts of a split item hold at least this many chunks of keys. A part's own costs (its query
// set-up, its partial result and the merge) outweigh the better balance below that: one
// bfloat16 sequence decoding at context 200 (3 KV heads, 2 workers, between the products of
// 30 layers) spent 0.52-0.62 ms a token in attention unsplit (median 0.55) against 0.57-0.75
// (median 0.70) in 6 parts of 2 chunks, over 8 and 10 alternating runs; at contexts 400 and 800
// the two were within noise of each other.
constexpr int64_t kMinPartChunks = 4;

// With fewer items than twice the workers (a long sequence decoding alone), splits each
// item's keys into parts of whole chunks (kMinPartChunks or more), so every worker has work;
// returns the floats the parts' partial results need.
int64_t split_keys(const Problem& p, std::vector<Item>& items, int64_t workers) {
  if (items.empty() || int64_t(items.size()) >= 2 * workers) return 0;
  const int64_t wanted = (4 * workers + int64_t(items.size()) - 1) / int64_t(items.size());
  std::vector<Item> split;
  int64_t floats = 0;
  for (const Item& item : items) {
    const int64_t chunks = (item.key_end + kChunk - 1) / kChunk;
    const int64_t per_part =
        std::max(kMinPartChunks, (chunks + std::min(wanted, chunks) - 1) / std::min(wanted, chunks));
    const int32_t parts = int32_t((chunks + per_part - 1) / per_part);
    const int64_t rows = int64_t(item.num_tokens) * (p.q_heads / p.kv_heads);
    for (int32_t part = 0; part < parts; ++part) {
      Item piece = item;
      piece.key_begin = part * per_part * kChunk;
      piece.key_end = std::min(item.key_end, (part + 1) * per_part * kChunk);
      piece.part = part;
      piece.parts = parts;
      if (parts > 1) {
        piece.partial = floats;
        floats += rows * (p.head_dim + 2);
      }
      split.push_back(piece);
    }
  }
  items = std::move(split);
  return floats;
}

struct Shared {
  Problem problem;
  std::vector<Item> items;
  std::vector<float> partials;
  std::atomic<int64_t> next{0}, done{0};
};

template <typename QT, typename KVT, int kD>
void run_items(Shared& shared) {
  std::vector<float> scratch;
  for (int64_t i; (i = shared.next.fetch_add(1)) < int64_t(shared.items.size());) {
    attend<QT, KVT, kD>(shared.problem, shared.items[i], scratch, shared.partials.data());
    shared.done.fetch_add(1, std::memory_order_release);
  }
}

template <typename QT, typename KVT, int kD>
void run(const Problem& problem, std::vector<Item> items, ffi::ThreadPool& pool) {
  // The caller works too, so one helper fewer than XLA's threads keeps one worker per core.
  const int64_t workers = std::max<int64_t>(1, pool.num_threads());
  auto shared = std::make_shared<Shared>();
  shared->problem = problem;
  shared->partials.resize(split_keys(problem, items, workers));
  shared->items = std::move(items);
  const int64_t total = int64_t(shared->items.size());
  const int64_t helpers = std::min<int64_t>(workers - 1, total - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([shared] { run_items<QT, KVT, kD>(*shared); });
  run_items<QT, KVT, kD>(*shared);
  while (shared->done.load(std::memory_order_acquire) < total) std::this_thread::yield();
  if (!shared->partials.empty()) merge_parts<QT>(shared->problem, shared->items, shared->partials.data());
}

template <typename QT, typename KVT>
void run_for_head_dim(const Problem& p, std::vector<Item> items, ffi::ThreadPool& pool) {
  if (p.head_dim == 64) return run<QT, KVT, 64>(p, std::move(items), pool);
  if (p.head_dim == 128) return run<QT, KVT, 128>(p, std::move(items), pool);
  run<QT, KVT, 0>(p, std::move(items), pool);
}

ffi::Error ragged_paged_attention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_cache,
                                  ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> block_tables,
                                  ffi::Buffer<ffi::S32> context_lens, ffi::Buffer<ffi::S32> query_start_loc,
                                  float scale, ffi::Result<ffi::AnyBuffer> out) {
  const auto q_dims = q.dimensions();
  const auto kv_dims = k_cache.dimensions();
  const auto table_dims = block_tables.dimensions();
  if (q_dims.size() != 3 || kv_dims.size() != 4 || table_dims.size() != 2)
    return ffi::Error::InvalidArgument("ragged_paged_attention: unexpected ranks");
  if (k_cache.element_type() != v_cache.element_type() || out->element_type() != q.element_type())
    return ffi::Error::InvalidArgument("ragged_paged_attention: mismatched dtypes");
  Problem p{q.untyped_data(), k_cache.untyped_data(), v_cache.untyped_data(),
            block_tables.typed_data(), context_lens.typed_data(), query_start_loc.typed_data(),
            out->untyped_data(), q_dims[0], q_dims[1], q_dims[2], kv_dims[0], kv_dims[1], kv_dims[2],
            table_dims[0], table_dims[1], scale};
  const auto supported = [](ffi::DataType t) { return t == ffi::DataType::F32 || t == ffi::DataType::BF16; };
  if (!supported(q.element_type()) || !supported(k_cache.element_type()))
    return ffi::Error::InvalidArgument("ragged_paged_attention: only float32 and bfloat16 are supported");
  if (p.head_dim % 16 || p.q_heads % p.kv_heads || kv_dims[3] != p.head_dim || context_lens.element_count() != p.num_seqs ||
      query_start_loc.element_count() != p.num_seqs + 1)
    return ffi::Error::InvalidArgument("ragged_paged_attention: inconsistent shapes");
  auto items = work_items(p);
  if (items.has_error()) return items.error();
  std::memset(p.out, 0, out->size_bytes());
  const bool q_bf16 = q.element_type() == ffi::DataType::BF16;
  const bool kv_bf16 = k_cache.element_type() == ffi::DataType::BF16;
  if (q_bf16 && kv_bf16) run_for_head_dim<uint16_t, uint16_t>(p, std::move(*items), pool);
  else if (q_bf16) run_for_head_dim<uint16_t, float>(p, std::move(*items), pool);
  else if (kv_bf16) run_for_head_dim<float, uint16_t>(p, std::move(*items), pool);
  else run_for_head_dim<float, float>(p, std::move(*items), pool);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedRaggedAttention, ragged_paged_attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::AnyBuffer>());
