// Matrix products for CPUs with AVX512-BF16, as an XLA FFI custom call.
//
// out_j = x @ w_j in float32, for x and one or more weights w_j packed ahead of time (see
// pallas_paged/matmul.py: pack), all bfloat16 or all float32. One call for several weights
// of one input (a layer's Q, K and V) shares its work out better than a call for each: K
// and V alone have three panels each, for two workers.
//
// XLA:CPU converts a bfloat16 product's operands and multiplies in float32, and reads its
// weights a few columns at a time, a page apart; the core's VDPBF16PS multiplies pairs of
// bfloat16 into float32 sums, twice the work per instruction, and packed weights are read
// in memory order. XLA's float32 product is also slower at the engine's shapes: 30 layers of
// SmolLM2 at 32 rows took 31.6 ms against this kernel's 24.5.
//
// Shapes, bfloat16: x [M, K]; each w_j uint32 [P_j, K/2, kPanel]: panel p holds w_j's
// columns p*kPanel .. (p+1)*kPanel, each word the bfloat16 pair (w[2s, n], w[2s+1, n]) that
// one VDPBF16PS lane reduces, low half first. float32: x [M, K]; w_j float32 [P_j, K,
// kPanel], one FMA per step. out_j float32 [M, P_j*kPanel].
//
// A gated product (SwiGLU's) takes a gate and an up weight of one shape and returns one
// [M, N]: silu(x @ gate) * (x @ up). Each tile keeps its gate sums in L1 while its up sums
// accumulate, so neither product reaches memory: XLA's separate gating took 2.4 ms a layer
// on a 1760-row prefill, and the two products' [M, N] results cost their writes.
//
// A call may also RMS-normalize float32 rows of x and round them to bfloat16 before the
// products (Prologue), and add a residual to its one product, so that a decoder layer's
// products need no XLA kernels between them for the norms, the casts and the residual adds.
//
// Work items are panels of every weight: with many rows, every panel of one block of rows,
// then of the next; with few rows and few panels, groups of rows of each panel. The caller
// and XLA's intra-op threads claim them from a shared counter, or with a single tile of rows
// from both ends of the list, the caller from the front. The kernel keeps a tile of
// kRows x kPanel float32 sums in registers and streams its panel once per tile; when a panel
// takes several tiles, it requests the lines of the panel it will likely take next (Ahead)
// along the way.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int kPanel = 64;  // outputs per panel: four 16-lane registers

// One panel of one weight, and where its columns go.
struct Panel {
  const uint32_t* w;             // [steps, kPanel]
  float* out;                    // the panel's first column of row 0 of its weight's [M, n] output
  int64_t n;                     // that output's row stride
  const uint32_t* up = nullptr;  // a gated product's up panel of the same columns: out = silu(x @ w) * (x @ up)
  const float* residual = nullptr;  // added to the product: the panel's first column of row 0 of [M, n]
  // A screened head's panel (see argmax_head): its 64 columns' norms, and where each row's
  // largest sum - bound and sum + bound over them go (row r's at extremes[r * stride]).
  const float* norms = nullptr;
  float* extremes = nullptr;
};

// A screened head's bounds: column j's bound in row r is per_norm[r] * norms[j] + fixed[r].
struct Bounds {
  std::vector<float> per_norm, fixed;
  int64_t stride = 0;  // of Panel::extremes, floats per row
};

// A product's input made from float32 rows before the products start: each row RMS-normalized
// (x / sqrt(mean(x^2) + eps) * scale) if there is a scale, then rounded to bfloat16 for
// bfloat16 weights, into Product::x. Doing it here, not in XLA, takes about ten small XLA
// kernels out of every layer (see pallas_paged/matmul.py: matmuls).
struct Prologue {
  const float* x = nullptr;        // [M, K]; null: Product::x is the input as it is
  const void* scale = nullptr;     // [K], float32 or bfloat16 (scale_bf16); null: no norm
  bool scale_bf16 = false;
  float eps = 0;
  int64_t k = 0;
  uint32_t* prepared = nullptr;    // [M, steps], what Product::x points to (scratch_words)
};

struct Product {
  const uint32_t* x;  // [M, steps]: pairs of bfloat16 along K, or float32
  std::vector<Panel> panels;  // of every weight, in order
  int64_t m, steps;           // steps = K / 2 for bfloat16, K for float32
  bool f32;                   // float32 x and weights
  const Bounds* bounds = nullptr;  // a screened head's
  std::shared_ptr<Prologue> prologue;  // if x is made from float32 rows first
};

#if defined(__AVX512BF16__)

constexpr int kRows = 6;    // rows per register tile: 6 x 4 sums, 4 weights, 1 broadcast

// 16 elements of a prologue's scale from s on (the lanes of `mask`), as float32.
inline __m512 scale_at(const Prologue& in, int64_t s, __mmask16 mask) {
  if (!in.scale_bf16) return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(in.scale) + s);
  const __m256i bits = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(in.scale) + s);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// Row `row` of p's input, from the prologue's float32 rows (see Prologue), 16 elements at a
// time. The rounding to bfloat16 is to nearest even, as XLA's convert, except that it
// flushes values below 2^-126 to zero, which VDPBF16PS would count as zero anyway.
void prepare_row(const Product& p, int64_t row) {
  const Prologue& in = *p.prologue;
  const float* x = in.x + row * in.k;
  const auto lanes = [&](int64_t s) { return __mmask16(in.k - s >= 16 ? 0xFFFF : (1u << (in.k - s)) - 1); };
  __m512 factor = _mm512_set1_ps(1.0f);
  if (in.scale) {
    __m512 squares = _mm512_setzero_ps();
    for (int64_t s = 0; s < in.k; s += 16) {
      const __m512 v = _mm512_maskz_loadu_ps(lanes(s), x + s);
      squares = _mm512_fmadd_ps(v, v, squares);
    }
    factor = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(squares) / float(in.k) + in.eps));
  }
  uint32_t* out = in.prepared + row * p.steps;
  for (int64_t s = 0; s < in.k; s += 16) {
    const __mmask16 mask = lanes(s);
    __m512 v = _mm512_maskz_loadu_ps(mask, x + s);
    if (in.scale) v = _mm512_mul_ps(_mm512_mul_ps(v, factor), scale_at(in, s, mask));
    if (p.f32) _mm512_mask_storeu_ps(reinterpret_cast<float*>(out) + s, mask, v);
    else _mm256_mask_storeu_epi16(reinterpret_cast<uint16_t*>(out) + s, mask, __m256i(_mm512_cvtneps_pbh(v)));
  }
}

// Cache lines of a panel to request ahead of its use, spread over the steps of the tiles
// before it: the first pass over a panel otherwise waits on memory, and the passes after it
// on arithmetic, so a worker that fetches its next panel during those keeps both busy.
struct Ahead {
  const char* lines = nullptr;  // the first line to request
  int64_t count = 0, per_step = 0;
};

// sum = x[row : row + R] @ w, for w one panel's [steps, kPanel].
template <int R, bool kF32>
inline void accumulate(const Product& p, const uint32_t* w, int64_t row, Ahead ahead, __m512 (&sum)[R][4]) {
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) sum[r][j] = _mm512_setzero_ps();
  const uint32_t* x = p.x + row * p.steps;
  for (int64_t s = 0; s < p.steps; ++s) {
    for (int64_t line = s * ahead.per_step; line < std::min(ahead.count, (s + 1) * ahead.per_step); ++line)
      _mm_prefetch(ahead.lines + 64 * line, _MM_HINT_T1);
    if constexpr (kF32) {
      __m512 ws[4];
      for (int j = 0; j < 4; ++j) ws[j] = _mm512_loadu_ps(w + s * kPanel + 16 * j);
      for (int r = 0; r < R; ++r) {
        const __m512 a = _mm512_set1_ps(reinterpret_cast<const float*>(x)[r * p.steps + s]);
        for (int j = 0; j < 4; ++j) sum[r][j] = _mm512_fmadd_ps(a, ws[j], sum[r][j]);
      }
    } else {
      __m512bh pairs[4];
      for (int j = 0; j < 4; ++j) pairs[j] = __m512bh(_mm512_loadu_si512(w + s * kPanel + 16 * j));
      for (int r = 0; r < R; ++r) {
        const __m512bh a = __m512bh(_mm512_set1_epi32(int(x[r * p.steps + s])));
        for (int j = 0; j < 4; ++j) sum[r][j] = _mm512_dpbf16_ps(sum[r][j], a, pairs[j]);
      }
    }
  }
}

// x * sigmoid(x) = x / (1 + exp(-x)), with exp from Cephes' polynomial (about 2 ulp) and -x
// clamped to 88, where exp stays finite and the result is already 0 to float32.
inline __m512 silu(__m512 x) {
  const __m512 t = _mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), x), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(t, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), t);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 poly = _mm512_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(c));
  poly = _mm512_fmadd_ps(_mm512_mul_ps(poly, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512 one = _mm512_set1_ps(1.0f);
  return _mm512_mul_ps(x, _mm512_div_ps(one, _mm512_add_ps(one, _mm512_scalef_ps(poly, n))));
}

// A screened head's tile (see argmax_head): each row's largest sum - bound and sum + bound
// over the panel's columns, from the sums in registers, so no pass over the logits is needed.
template <int R>
void record_extremes(const Product& p, const Panel& panel, int64_t row, const __m512 (&sum)[R][4]) {
  for (int r = 0; r < R; ++r) {
    const __m512 per = _mm512_set1_ps(p.bounds->per_norm[row + r]), fixed = _mm512_set1_ps(p.bounds->fixed[row + r]);
    __m512 low = _mm512_set1_ps(-INFINITY), high = low;
    for (int j = 0; j < 4; ++j) {
      const __m512 bound = _mm512_fmadd_ps(per, _mm512_loadu_ps(panel.norms + 16 * j), fixed);
      low = _mm512_max_ps(low, _mm512_sub_ps(sum[r][j], bound));
      high = _mm512_max_ps(high, _mm512_add_ps(sum[r][j], bound));
    }
    float* extremes = panel.extremes + (row + r) * p.bounds->stride;
    extremes[0] = _mm512_reduce_max_ps(low);
    extremes[1] = _mm512_reduce_max_ps(high);
  }
}

// out[row : row + R, panel's columns] = x[row : row + R] @ panel, or for a gated panel
// silu(x @ panel) * (x @ up), the gate's sums kept in L1 while the up panel's accumulate.
template <int R, bool kF32>
void tile(const Product& p, const Panel& panel, int64_t row, Ahead ahead, Ahead up_ahead) {
  __m512 sum[R][4];
  accumulate<R, kF32>(p, panel.w, row, ahead, sum);
  if (panel.up) {
    alignas(64) float gate[R][kPanel];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) _mm512_store_ps(gate[r] + 16 * j, sum[r][j]);
    accumulate<R, kF32>(p, panel.up, row, up_ahead, sum);
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) sum[r][j] = _mm512_mul_ps(silu(_mm512_load_ps(gate[r] + 16 * j)), sum[r][j]);
  }
  if constexpr (!kF32)  // a screened head is bfloat16
    if (panel.extremes) record_extremes<R>(p, panel, row, sum);
  if (panel.residual)  // XLA's add, bitwise: one rounding of the same two float32 values
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) sum[r][j] = _mm512_add_ps(_mm512_loadu_ps(panel.residual + (row + r) * panel.n + 16 * j), sum[r][j]);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(panel.out + (row + r) * panel.n + 16 * j, sum[r][j]);
}

// Rows first .. last of a panel (first < last), in register tiles, requesting the lines of
// panel `next` (if any) along the way.
void rows(const Product& p, const Panel& panel, int64_t first, int64_t last, const Panel* next) {
  const int64_t tiles = (last - first + kRows - 1) / kRows, lines = next ? p.steps * kPanel * 4 / 64 : 0;
  const int64_t per_tile = (lines + tiles - 1) / tiles;
  for (int64_t t = 0, row = first; row < last; ++t, row += kRows) {
    const int64_t begin = std::min(lines, t * per_tile), count = std::min(lines, begin + per_tile) - begin;
    const auto ahead = [&](const uint32_t* w) {  // this tile's share of panel w's lines
      return w ? Ahead{reinterpret_cast<const char*>(w) + 64 * begin, count, (count + p.steps - 1) / p.steps} : Ahead{};
    };
    const Ahead a = ahead(next ? next->w : nullptr), u = ahead(next ? next->up : nullptr);
    switch (std::min<int64_t>(kRows, last - row)) {
      case 6: p.f32 ? tile<6, true>(p, panel, row, a, u) : tile<6, false>(p, panel, row, a, u); break;
      case 5: p.f32 ? tile<5, true>(p, panel, row, a, u) : tile<5, false>(p, panel, row, a, u); break;
      case 4: p.f32 ? tile<4, true>(p, panel, row, a, u) : tile<4, false>(p, panel, row, a, u); break;
      case 3: p.f32 ? tile<3, true>(p, panel, row, a, u) : tile<3, false>(p, panel, row, a, u); break;
      case 2: p.f32 ? tile<2, true>(p, panel, row, a, u) : tile<2, false>(p, panel, row, a, u); break;
      default: p.f32 ? tile<1, true>(p, panel, row, a, u) : tile<1, false>(p, panel, row, a, u); break;
    }
  }
}

// Many rows: blocks of rows of about this many bytes of x, each staying in a worker's L2
// while the workers take its panels in turn. Streaming all of x from L3 for every panel
// instead, and splitting 9 or 15 panels between two workers, cost 5-10% at 1760 rows.
constexpr int64_t kBlockBytes = 256 << 10;

// One work item: rows first .. last of one panel.
struct Item {
  int64_t panel, first, last;
};

struct Shared {
  Product p;
  int64_t row_groups, rows_per_group, total;
  bool by_block;  // item i: row group i / panels and panel i % panels; else group i % row_groups, panel i / row_groups
  // Items from `split_from` on share the panels that would otherwise leave one worker alone at
  // the end (9 panels for two): each such panel's rows are split `split_parts` ways.
  int64_t split_from, split_panel = 0, split_parts = 1, split_rows = 0;
  std::atomic<int64_t> next{0}, done{0};
  // One tile of rows (decode of a few sequences), whose items are whole panels, adjacent in
  // memory: the caller claims them from the front and helpers from the back, so that each
  // reads one stream of memory in order, not every other panel. 30 layers of one-row
  // products took 0-10% less time so (7.03-7.75 ms against 7.05-8.62, six alternating runs).
  bool two_ended = false;
  std::atomic<uint64_t> ends{0};  // the first unclaimed item, and one past the last (high half)
  // The prologue's rows (if any), in chunks that the workers claim before any item.
  int64_t chunk_rows = 16, chunks = 0;
  std::atomic<int64_t> next_chunk{0}, prepared_chunks{0};

  Item item(int64_t i) const {
    if (i >= split_from) {
      const int64_t first = (i - split_from) % split_parts * split_rows;
      return {split_panel + (i - split_from) / split_parts, first, std::min(p.m, first + split_rows)};
    }
    const int64_t panels = int64_t(p.panels.size());
    const int64_t group = by_block ? i / panels : i % row_groups, first = group * rows_per_group;
    return {by_block ? i % panels : i / row_groups, first, std::min(p.m, first + rows_per_group)};
  }
};

// Every worker helps prepare the input (if a prologue makes it), then waits until it is whole.
void prepare(Shared& shared) {
  for (int64_t c; (c = shared.next_chunk.fetch_add(1)) < shared.chunks;) {
    for (int64_t row = c * shared.chunk_rows; row < std::min(shared.p.m, (c + 1) * shared.chunk_rows); ++row)
      prepare_row(shared.p, row);
    shared.prepared_chunks.fetch_add(1, std::memory_order_release);
  }
  while (shared.prepared_chunks.load(std::memory_order_acquire) < shared.chunks) std::this_thread::yield();
}

// The next item for a worker claiming from the front or the back, or -1 when none is left.
int64_t claim(Shared& shared, bool from_back) {
  uint64_t ends = shared.ends.load(std::memory_order_relaxed);
  while (true) {
    const uint64_t front = ends & 0xFFFFFFFFu, back = ends >> 32;
    if (front >= back) return -1;
    const uint64_t claimed = from_back ? (back - 1) << 32 | front : back << 32 | (front + 1);
    if (shared.ends.compare_exchange_weak(ends, claimed)) return int64_t(from_back ? back - 1 : front);
  }
}

void run_items(Shared& shared, int64_t workers, bool caller = false) {
  const Product& p = shared.p;
  prepare(shared);
  const auto next_item = [&] {
    if (shared.two_ended) return claim(shared, !caller);
    const int64_t i = shared.next.fetch_add(1);
    return i < shared.total ? i : -1;
  };
  for (int64_t i; (i = next_item()) >= 0;) {
    const Item item = shared.item(i);
    // The item a worker likely claims next is `workers` on; fetch its panel if it is another
    // and this one takes more than one pass (a tile of rows each). With a single pass there is
    // no arithmetic to hide the fetch behind, and it only competes with the panel's own lines:
    // one row's products took about 6% longer with it (median of eight side-by-side runs; -1% to +15%).
    const int64_t next = i + workers < shared.total ? shared.item(i + workers).panel : item.panel;
    const bool fetch = next != item.panel && item.last - item.first > kRows;
    rows(p, p.panels[item.panel], item.first, item.last, fetch ? &p.panels[next] : nullptr);
    shared.done.fetch_add(1, std::memory_order_release);
  }
}

void run(Product p, ffi::ThreadPool& pool) {
  const int64_t workers = std::max<int64_t>(1, pool.num_threads());
  auto shared = std::make_shared<Shared>();
  const int64_t panels = int64_t(p.panels.size());
  shared->p = std::move(p);
  if (shared->p.prologue) shared->chunks = (shared->p.m + shared->chunk_rows - 1) / shared->chunk_rows;
  const int64_t tiles = (shared->p.m + kRows - 1) / kRows;
  const int64_t block = std::max<int64_t>(1, kBlockBytes / (shared->p.steps * 4) / kRows) * kRows;
  shared->by_block = shared->p.m > 2 * block;
  if (shared->by_block) {
    shared->rows_per_group = block;
  } else {
    // Few panels (a narrow product): split the rows too, in whole register tiles, so every
    // worker has about four items.
    const int64_t groups = std::clamp<int64_t>((4 * workers + panels - 1) / panels, 1, tiles);
    shared->rows_per_group = (tiles + groups - 1) / groups * kRows;
  }
  shared->row_groups = (shared->p.m + shared->rows_per_group - 1) / shared->rows_per_group;
  shared->total = shared->split_from = panels * shared->row_groups;
  // Whole panels, one each, until fewer are left than workers; those are split by rows. In the
  // engine at 32 rows this took the 9- and 15-panel products from 121, 313 and 207 us a call
  // to 114, 281 and 192: the share of the call a worker waited fell from 11-17% to 3-13%.
  if (!shared->by_block && shared->row_groups == 1 && panels % workers && tiles >= 2 * workers) {
    shared->split_panel = panels - panels % workers;
    shared->split_rows = (tiles + workers - 1) / workers * kRows;
    // As many parts as hold rows: 9 tiles for 4 workers make 3 parts of 3 tiles, not 4.
    shared->split_parts = (shared->p.m + shared->split_rows - 1) / shared->split_rows;
    shared->split_from = shared->split_panel;
    shared->total = shared->split_from + panels % workers * shared->split_parts;
  }
  shared->two_ended = shared->p.m <= kRows;
  shared->ends = uint64_t(shared->total) << 32;
  const int64_t helpers = std::min<int64_t>(workers - 1, shared->total - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([shared, workers] { run_items(*shared, workers); });
  run_items(*shared, workers, true);
  while (shared->done.load(std::memory_order_acquire) < shared->total) std::this_thread::yield();
}

// -- A head for steps that only take each row's arg-max ------------------------------------
//
// A float32 head's product is about an eighth of a float32 decode step (8.7 of 61 ms for 32
// rows of SmolLM2). A greedy step needs only each row's largest logit, so it multiplies a
// bfloat16 copy of the head (half the arithmetic and half the bytes), and computes exactly
// only the columns that could hold the largest:
//
// |exact_j - approx_j| <= c_K * ||h||_2 * ||w_j||_2, for approx_j the VDPBF16PS sum of
// bfloat16(h) and bfloat16(w_j) and exact_j the float32 kernel's. Rounding h and w_j to
// bfloat16 (8 significant bits, round to nearest, u = 2^-8) moves each product h_i w_ij by at
// most (2u + u^2) |h_i w_ij|; each float32 sum of K terms, rounded at most K times, is off
// by at most gamma_K = K 2^-24 / (1 - K 2^-24) of the sum of its terms' sizes, and the
// bfloat16 terms' sizes are at most (1 + 2u + u^2) |h_i w_ij|. Together that is
// (2u + u^2 + gamma_K (2 + 2u + u^2)) sum_i |h_i w_ij|, which Cauchy-Schwarz bounds by
// ||h|| ||w_j||: 0.00790 for SmolLM2's K = 576. c_K is that and 2.5% more, for the float32
// rounding of the norms, the bounds and the comparisons below (each relative 2^-22 at most
// of a size no more than ||h|| times the largest column's norm). VDPBF16PS counts inputs
// below 2^-126 as zero and flushes sums below it, each then at most 2^-126 off: a small fixed
// term covers those.
//
// With bound_j that bound, every column j whose approx_j + bound_j reaches
// L = max_i (approx_i - bound_i) is a candidate: the largest exact logit is at least L, so
// every column that holds it, ties included, is one, and every other column's approx_j is
// below it. The tiles record each row's largest approx - bound and approx + bound per panel
// (record_extremes), so only the panels that can hold a candidate are read again. Each
// candidate's logit is computed as the float32 kernel computes it, one fused multiply-add per
// step of K, in order from zero, from the head's rows in memory order (a tied embedding), so
// it is bitwise the full product's; the other columns keep approx_j. The arg-max of the row,
// ties to the lowest index, is then the full product's.

// c_K (see above).
double screen_factor(int64_t k) {
  const double u = 0x1p-8, gamma = k * 0x1p-24 / (1 - k * 0x1p-24);
  return 1.025 * (2 * u + u * u + gamma * (2 + 2 * u + u * u));
}

// More candidates than this in a row (a flat distribution, or a row of zeros), and the row is
// computed in full instead: candidates cost a row of the head each.
constexpr int64_t kMaxCandidates = 512;

// The head's columns given by their rows: out[c] = sum_s h[s] * rows[c][s], fused
// multiply-adds in order from s = 0 (as a float32 tile's lanes), eight independent chains.
void exact_columns(const float* h, const float* rows, int64_t k, const std::vector<int64_t>& columns, float* out) {
  constexpr int kChains = 8;
  for (size_t first = 0; first < columns.size(); first += kChains) {
    const int count = int(std::min<size_t>(kChains, columns.size() - first));
    const float* w[kChains];
    float sum[kChains] = {};
    for (int c = 0; c < kChains; ++c) w[c] = rows + columns[first + std::min(c, count - 1)] * k;
    for (int64_t s = 0; s < k; ++s)
      for (int c = 0; c < kChains; ++c) sum[c] = std::fma(h[s], w[c][s], sum[c]);
    for (int c = 0; c < count; ++c) out[columns[first + c]] = sum[c];
  }
}

// Row `row` of the full float32 product, as `run` computes it.
void exact_row(const Product& exact, int64_t row) {
  for (const Panel& panel : exact.panels) tile<1, true>(exact, panel, row, Ahead{}, Ahead{});
}

// Each row's bound terms (see above) from x float32 [M, K]; a row that is not finite gets NaN.
Bounds bounds_of(const float* x, int64_t m, int64_t k, int64_t stride) {
  Bounds bounds{std::vector<float>(m), std::vector<float>(m), stride};
  const double factor = screen_factor(k), root_k = std::sqrt(double(k)), tiny = 0x1p-100;
  for (int64_t row = 0; row < m; ++row) {
    double squares = 0;
    for (int64_t s = 0; s < k; ++s) squares += double(x[row * k + s]) * x[row * k + s];
    const double norm = std::sqrt(squares);
    bounds.per_norm[row] = float(factor * norm + tiny * root_k);
    bounds.fixed[row] = std::isfinite(norm) ? float(tiny * (root_k * norm + 2 * k)) : NAN;
  }
  return bounds;
}

// Row `row` of out [M, n] holds the approximate logits, and extremes [M, n / 64, 2] the
// tiles' (record_extremes): compute the candidates' logits exactly (see above).
void screen_row(const Product& exact, const Bounds& bounds, const float* extremes, const float* rows,
                const float* norms, int64_t row, float* out, int64_t n) {
  const int64_t k = exact.steps, panels = n / kPanel;
  const float* h = reinterpret_cast<const float*>(exact.x) + row * k;
  const float* row_extremes = extremes + row * bounds.stride;
  float least_max = -INFINITY;  // the least the largest exact logit can be
  bool finite = std::isfinite(bounds.fixed[row]);
  for (int64_t panel = 0; panel < panels; ++panel) {
    least_max = std::max(least_max, row_extremes[2 * panel]);
    finite = finite && std::isfinite(row_extremes[2 * panel]) && !std::isnan(row_extremes[2 * panel + 1]);
  }
  std::vector<int64_t> candidates;
  float* logits = out + row * n;
  for (int64_t panel = 0; finite && panel < panels && int64_t(candidates.size()) <= kMaxCandidates; ++panel) {
    if (!(row_extremes[2 * panel + 1] >= least_max)) continue;
    for (int64_t j = panel * kPanel; j < (panel + 1) * kPanel; ++j)
      if (logits[j] + std::fma(bounds.per_norm[row], norms[j], bounds.fixed[row]) >= least_max) candidates.push_back(j);
  }
  if (!finite || int64_t(candidates.size()) > kMaxCandidates) return exact_row(exact, row);
  exact_columns(h, rows, k, candidates, logits);
}

#endif  // __AVX512BF16__

// A float32 head (see above): x float32 [M, K]; x_bf16, x in bfloat16; exact, the head packed
// in float32 [N/64, K, 64]; screen, in bfloat16 pairs, uint32 [N/64, K/2, 64]; rows, the head's
// columns in memory order, float32 [N, K] (a tied embedding); norms, float32 [N], each row's
// Euclidean norm; argmax_rows, int32 []. Returns float32 [M, N]: with argmax_rows 0, x @ head,
// the plain product's; otherwise rows below argmax_rows exact where they may be the row's
// largest and the bfloat16 product's elsewhere (below it), and zeros from argmax_rows on.
using F32Vector = ffi::Buffer<ffi::F32, 1>;
using F32Matrix = ffi::Buffer<ffi::F32, 2>;
using BF16Matrix = ffi::Buffer<ffi::BF16, 2>;
using F32Panels = ffi::Buffer<ffi::F32, 3>;
using PairPanels = ffi::Buffer<ffi::U32, 3>;
using Int32Scalar = ffi::Buffer<ffi::S32, 0>;

ffi::Error argmax_head(ffi::ThreadPool pool, F32Matrix x, BF16Matrix x_bf16, F32Panels exact, PairPanels screen,
                       F32Matrix rows, F32Vector norms, Int32Scalar argmax_rows, ffi::Result<F32Matrix> out) {
  const int64_t m = x.dimensions()[0], k = x.dimensions()[1], panels = exact.dimensions()[0], n = panels * kPanel;
  const int64_t screened = *argmax_rows.typed_data();
  if (x_bf16.dimensions()[0] != m || x_bf16.dimensions()[1] != k || k % 2 || exact.dimensions()[1] != k || exact.dimensions()[2] != 64 ||
      screen.dimensions()[0] != panels || screen.dimensions()[1] != k / 2 || screen.dimensions()[2] != 64 ||
      rows.dimensions()[0] != n || rows.dimensions()[1] != k || norms.dimensions()[0] != n ||
      out->dimensions()[0] != m || out->dimensions()[1] != n)
    return ffi::Error::InvalidArgument("argmax head: needs x [M, K] (K even) twice, float32 and bfloat16, the head "
                                       "packed [N/64, K, 64] and [N/64, K/2, 64], its rows [N, K], their norms [N] "
                                       "and a result [M, N]");
  if (screened < 0 || screened > m)
    return ffi::Error::InvalidArgument("argmax head: argmax_rows must be between 0 and the rows of x");
#if defined(__AVX512BF16__)
  if (m == 0 || n == 0) return ffi::Error::Success();
  float* logits = out->typed_data();
  const auto panels_of = [&](const uint32_t* w, int64_t steps) {
    std::vector<Panel> list;
    for (int64_t panel = 0; panel < panels; ++panel) list.push_back({w + panel * steps * kPanel, logits + panel * kPanel, n});
    return list;
  };
  const Product full{reinterpret_cast<const uint32_t*>(x.typed_data()),
                     panels_of(reinterpret_cast<const uint32_t*>(exact.typed_data()), k), m, k, true};
  if (screened == 0 || k == 0) {
    if (k == 0) std::fill(logits, logits + m * n, 0.0f);
    else run(full, pool);
    return ffi::Error::Success();
  }
  const Bounds bounds = bounds_of(x.typed_data(), screened, k, 2 * panels);
  std::vector<float> extremes(screened * bounds.stride);
  Product approx{reinterpret_cast<const uint32_t*>(x_bf16.typed_data()), panels_of(screen.typed_data(), k / 2),
                 screened, k / 2, false, &bounds};
  for (int64_t panel = 0; panel < panels; ++panel) {
    approx.panels[panel].norms = norms.typed_data() + panel * kPanel;
    approx.panels[panel].extremes = extremes.data() + 2 * panel;
  }
  run(std::move(approx), pool);
  for (int64_t row = 0; row < screened; ++row)
    screen_row(full, bounds, extremes.data(), rows.typed_data(), norms.typed_data(), row, logits, n);
  std::fill(logits + screened * n, logits + m * n, 0.0f);
  return ffi::Error::Success();
#else
  return ffi::Error::Internal("argmax head: built for a CPU without AVX512-BF16");
#endif
}


// A buffer of at least `words` for the calling thread's current call: kept from call to call,
// as a fresh one cost its page faults on every call (0.3 ms of a 1024-row prefill's product).
uint32_t* scratch_words(int64_t words) {
  thread_local std::unique_ptr<uint32_t[]> buffer;
  thread_local int64_t capacity = 0;
  if (words > capacity) {
    buffer.reset(new uint32_t[words]);
    capacity = words;
  }
  return buffer.get();
}

// x, then the packed weights; one float32 [M, N_j] result per weight. x bfloat16 with uint32
// weights [N/64, K/2, 64], or x float32 with float32 weights [N/64, K, 64]; or x float32 with
// bfloat16 weights, rounded here. Gated: the weights are a gate and an up of one shape, and
// the one result is silu(x @ gate) * (x @ up). rms_scale: [K] (float32 or bfloat16), each row
// of x RMS-normalized and scaled first (eps the attribute), or [0]: none (see Prologue).
// residual: float32 [M, N] added to the one product, or [0, 0]: none.
ffi::Error product(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer rms_scale, ffi::AnyBuffer residual,
                   ffi::RemainingArgs weights, ffi::RemainingRets outs, float eps, bool gated) {
  if (x.dimensions().size() != 2 || (x.element_type() != ffi::DataType::F32 && x.element_type() != ffi::DataType::BF16))
    return ffi::Error::InvalidArgument("matmul: x must be a bfloat16 or float32 matrix");
  if (weights.size() == 0 || weights.get<ffi::AnyBuffer>(0).has_error())
    return ffi::Error::InvalidArgument("matmul: needs at least one packed weight");
  const bool f32 = weights.get<ffi::AnyBuffer>(0)->element_type() == ffi::DataType::F32;
  const bool x_f32 = x.element_type() == ffi::DataType::F32;
  const int64_t m = x.dimensions()[0], k = x.dimensions()[1], steps = f32 ? k : k / 2;
  if (gated ? weights.size() != 2 || outs.size() != 1 : weights.size() != outs.size())
    return ffi::Error::InvalidArgument(gated ? "gated matmul: needs a gate and an up weight, and one result"
                                             : "matmul: needs one result per packed weight");
  const bool normalize = rms_scale.element_count() > 0, add = residual.element_count() > 0;
  const auto scale_type = rms_scale.element_type();
  if (normalize && (rms_scale.dimensions().size() != 1 || rms_scale.dimensions()[0] != k || !x_f32 ||
                    (scale_type != ffi::DataType::F32 && scale_type != ffi::DataType::BF16)))
    return ffi::Error::InvalidArgument("matmul: an RMS norm needs float32 x [M, K] and a scale [K], float32 or bfloat16");
  if (f32 && !x_f32) return ffi::Error::InvalidArgument("matmul: float32 weights need float32 x");
  Product product{static_cast<const uint32_t*>(x.untyped_data()), {}, m, steps, f32};
  if (normalize || (x_f32 && !f32)) {
    product.prologue = std::make_shared<Prologue>();
    Prologue& in = *product.prologue;
    in.x = static_cast<const float*>(x.untyped_data());
    in.scale = normalize ? rms_scale.untyped_data() : nullptr;
    in.scale_bf16 = scale_type == ffi::DataType::BF16;
    in.eps = eps;
    in.k = k;
    in.prepared = scratch_words(m * steps);
    product.x = in.prepared;
  }
  for (size_t j = 0; j < weights.size(); ++j) {
    auto w = weights.get<ffi::AnyBuffer>(j);
    auto out = outs.get<ffi::Buffer<ffi::F32, 2>>(gated ? 0 : j);
    if (w.has_error() || out.has_error() || w->element_type() != (f32 ? ffi::DataType::F32 : ffi::DataType::U32))
      return ffi::Error::InvalidArgument("matmul: weights must be all uint32 (bfloat16 pairs) or all float32");
    const auto dims = w->dimensions();
    if (dims.size() != 3 || (!f32 && k % 2) || steps != dims[1] || dims[2] != 64 || (*out)->dimensions()[0] != m ||
        (*out)->dimensions()[1] != 64 * dims[0])
      return ffi::Error::InvalidArgument("matmul: needs x [M, K], each w [N/64, K/2 (K for float32), 64] and its "
                                         "result [M, N]");
    if (add && (outs.size() != 1 || residual.element_type() != ffi::DataType::F32 ||
                residual.dimensions().size() != 2 || residual.dimensions()[0] != m ||
                residual.dimensions()[1] != (*out)->dimensions()[1]))
      return ffi::Error::InvalidArgument("matmul: a residual must be float32 [M, N], added to the only result");
    if (steps == 0) {
      float* result = (*out)->typed_data();
      if (add) std::memcpy(result, residual.untyped_data(), (*out)->size_bytes());
      else std::memset(result, 0, (*out)->size_bytes());
    }
    // A gated product's up weight: shaped as the gate (the checks above give it the gate's
    // result), its panels go with the gate's.
    if (gated && j == 1) {
      for (int64_t panel = 0; panel < int64_t(product.panels.size()); ++panel)
        product.panels[panel].up = static_cast<const uint32_t*>(w->untyped_data()) + panel * steps * kPanel;
      continue;
    }
    for (int64_t panel = 0; steps > 0 && panel < dims[0]; ++panel) {
      product.panels.push_back({static_cast<const uint32_t*>(w->untyped_data()) + panel * steps * kPanel,
                                (*out)->typed_data() + panel * kPanel, 64 * dims[0]});
      if (add) product.panels.back().residual = static_cast<const float*>(residual.untyped_data()) + panel * kPanel;
    }
  }
#if defined(__AVX512BF16__)
  if (m > 0 && !product.panels.empty()) run(std::move(product), pool);
  return ffi::Error::Success();
#else
  return ffi::Error::Internal("matmul: built for a CPU without AVX512-BF16");
#endif
}

ffi::Error matmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer rms_scale, ffi::AnyBuffer residual,
                  ffi::RemainingArgs weights, ffi::RemainingRets outs, float eps) {
  return product(pool, x, rms_scale, residual, weights, outs, eps, false);
}

ffi::Error gated_matmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer rms_scale, ffi::AnyBuffer residual,
                        ffi::RemainingArgs weights, ffi::RemainingRets outs, float eps) {
  return product(pool, x, rms_scale, residual, weights, outs, eps, true);
}

}  // namespace

// Whether this build has the kernel (the CPU it was built for has AVX512-BF16).
extern "C" int PallasPagedMatmulAvailable() {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(PallasPagedMatmul, matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // rms_scale
                                  .Arg<ffi::AnyBuffer>()  // residual
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(PallasPagedGatedMatmul, gated_matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // rms_scale
                                  .Arg<ffi::AnyBuffer>()  // residual
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(PallasPagedArgmaxHead, argmax_head,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32Matrix>()
                                  .Arg<BF16Matrix>()
                                  .Arg<F32Panels>()
                                  .Arg<PairPanels>()
                                  .Arg<F32Matrix>()
                                  .Arg<F32Vector>()
                                  .Arg<Int32Scalar>()
                                  .Ret<F32Matrix>());
