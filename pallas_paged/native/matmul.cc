// bfloat16 matrix products for CPUs with AVX512-BF16, as an XLA FFI custom call.
//
// out_j = x @ w_j in float32, for bfloat16 x and one or more weights w_j packed ahead of time
// (see pallas_paged/matmul.py: pack). One call for several weights of one input (a layer's
// Q, K and V) shares its work out better than a call for each: K and V alone have three
// panels each, for two workers. XLA:CPU converts a bfloat16 product's operands and
// multiplies in float32, and reads its weights a few columns at a time, a page apart; the
// core's VDPBF16PS multiplies pairs of bfloat16 into float32 sums, twice the work per
// instruction, and packed weights are read in memory order.
//
// Shapes: x bf16 [M, K]; each w_j uint32 [P_j, K/2, kPanel]: panel p holds w_j's columns
// p*kPanel .. (p+1)*kPanel, each word the bfloat16 pair (w[2s, n], w[2s+1, n]) that one
// VDPBF16PS lane reduces, low half first; out_j float32 [M, P_j*kPanel].
//
// Work items are panels of every weight (and, when there are few panels, groups of rows
// too), claimed by
// the caller and XLA's intra-op threads from a shared counter. The kernel keeps a tile of
// kRows x kPanel float32 sums in registers and streams its panel once per tile, while it
// requests the lines of the panel it will likely take next (Ahead).

#include <algorithm>
#include <atomic>
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

#if defined(__AVX512BF16__)

constexpr int kPanel = 64;  // outputs per panel: four 16-lane registers
constexpr int kRows = 6;    // rows per register tile: 6 x 4 sums, 4 weights, 1 broadcast

// One panel of one weight, and where its columns go.
struct Panel {
  const uint32_t* w;  // [steps, kPanel]
  float* out;         // the panel's first column of row 0 of its weight's [M, n] output
  int64_t n;          // that output's row stride
};

struct Product {
  const uint32_t* x;  // [M, steps]: pairs of bfloat16 along K
  std::vector<Panel> panels;  // of every weight, in order
  int64_t m, steps;           // steps = K / 2
};

// Cache lines of a panel to request ahead of its use, spread over the steps of the tiles
// before it: the first pass over a panel otherwise waits on memory, and the passes after it
// on arithmetic, so a worker that fetches its next panel during those keeps both busy.
struct Ahead {
  const char* lines = nullptr;  // the first line to request
  int64_t count = 0, per_step = 0;
};

// out[row : row + R, panel's columns] = x[row : row + R] @ panel.
template <int R>
void tile(const Product& p, const Panel& panel, int64_t row, Ahead ahead) {
  __m512 sum[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) sum[r][j] = _mm512_setzero_ps();
  const uint32_t* x = p.x + row * p.steps;
  const uint32_t* w = panel.w;
  for (int64_t s = 0; s < p.steps; ++s) {
    for (int64_t line = s * ahead.per_step; line < std::min(ahead.count, (s + 1) * ahead.per_step); ++line)
      _mm_prefetch(ahead.lines + 64 * line, _MM_HINT_T1);
    __m512bh pairs[4];
    for (int j = 0; j < 4; ++j) pairs[j] = __m512bh(_mm512_loadu_si512(w + s * kPanel + 16 * j));
    for (int r = 0; r < R; ++r) {
      const __m512bh a = __m512bh(_mm512_set1_epi32(int(x[r * p.steps + s])));
      for (int j = 0; j < 4; ++j) sum[r][j] = _mm512_dpbf16_ps(sum[r][j], a, pairs[j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(panel.out + (row + r) * panel.n + 16 * j, sum[r][j]);
}

// Rows first .. last of a panel, in register tiles, requesting the lines of panel `next`
// (if not negative) along the way.
void rows(const Product& p, const Panel& panel, int64_t first, int64_t last, const Panel* next) {
  const int64_t tiles = (last - first + kRows - 1) / kRows, lines = next ? p.steps * kPanel * 4 / 64 : 0;
  const int64_t per_tile = (lines + tiles - 1) / tiles;
  const char* start = next ? reinterpret_cast<const char*>(next->w) : nullptr;
  for (int64_t t = 0, row = first; row < last; ++t, row += kRows) {
    const int64_t begin = std::min(lines, t * per_tile), count = std::min(lines, begin + per_tile) - begin;
    const Ahead ahead{start + 64 * begin, count, (count + p.steps - 1) / p.steps};
    switch (std::min<int64_t>(kRows, last - row)) {
      case 6: tile<6>(p, panel, row, ahead); break;
      case 5: tile<5>(p, panel, row, ahead); break;
      case 4: tile<4>(p, panel, row, ahead); break;
      case 3: tile<3>(p, panel, row, ahead); break;
      case 2: tile<2>(p, panel, row, ahead); break;
      default: tile<1>(p, panel, row, ahead); break;
    }
  }
}

struct Shared {
  Product p;
  int64_t row_groups, rows_per_group, total;
  std::atomic<int64_t> next{0}, done{0};
};

void run_items(Shared& shared, int64_t workers) {
  const Product& p = shared.p;
  for (int64_t i; (i = shared.next.fetch_add(1)) < shared.total;) {
    const int64_t first = (i % shared.row_groups) * shared.rows_per_group, panel = i / shared.row_groups;
    // The item a worker likely claims next is `workers` on; fetch its panel if it is another.
    const int64_t next = (i + workers) / shared.row_groups;
    const bool fetch = i + workers < shared.total && next != panel;
    rows(p, p.panels[panel], first, std::min(p.m, first + shared.rows_per_group), fetch ? &p.panels[next] : nullptr);
    shared.done.fetch_add(1, std::memory_order_release);
  }
}

void run(Product p, ffi::ThreadPool& pool) {
  const int64_t workers = std::max<int64_t>(1, pool.num_threads());
  auto shared = std::make_shared<Shared>();
  const int64_t panels = int64_t(p.panels.size());
  shared->p = std::move(p);
  // Few panels (a narrow product): split the rows too, in whole register tiles, so every
  // worker has about four items.
  const int64_t tiles = (shared->p.m + kRows - 1) / kRows;
  const int64_t groups = std::clamp<int64_t>((4 * workers + panels - 1) / panels, 1, tiles);
  shared->rows_per_group = (tiles + groups - 1) / groups * kRows;
  shared->row_groups = (shared->p.m + shared->rows_per_group - 1) / shared->rows_per_group;
  shared->total = panels * shared->row_groups;
  const int64_t helpers = std::min<int64_t>(workers - 1, shared->total - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([shared, workers] { run_items(*shared, workers); });
  run_items(*shared, workers);
  while (shared->done.load(std::memory_order_acquire) < shared->total) std::this_thread::yield();
}

#endif  // __AVX512BF16__

using Bf16Matrix = ffi::Buffer<ffi::BF16, 2>;

// x, then the packed weights; one float32 [M, N_j] result per weight.
ffi::Error matmul(ffi::ThreadPool pool, Bf16Matrix x, ffi::RemainingArgs weights, ffi::RemainingRets outs) {
  const int64_t m = x.dimensions()[0], k = x.dimensions()[1];
  if (weights.size() == 0 || weights.size() != outs.size())
    return ffi::Error::InvalidArgument("matmul: needs one result per packed weight, and at least one weight");
  std::vector<ffi::Buffer<ffi::U32, 3>> ws;
  std::vector<ffi::Result<ffi::Buffer<ffi::F32, 2>>> results;
  for (size_t j = 0; j < weights.size(); ++j) {
    auto w = weights.get<ffi::Buffer<ffi::U32, 3>>(j);
    auto out = outs.get<ffi::Buffer<ffi::F32, 2>>(j);
    if (w.has_error() || out.has_error()) return ffi::Error::InvalidArgument("matmul: weights must be uint32, results float32");
    const auto dims = w->dimensions();
    if (k != 2 * dims[1] || dims[2] != 64 || (*out)->dimensions()[0] != m || (*out)->dimensions()[1] != 64 * dims[0])
      return ffi::Error::InvalidArgument("matmul: needs x [M, K], each w [N/64, K/2, 64] and its result [M, N]");
    ws.push_back(*w);
    results.push_back(*out);
  }
#if defined(__AVX512BF16__)
  Product product{static_cast<const uint32_t*>(x.untyped_data()), {}, m, k / 2};
  for (size_t j = 0; j < ws.size(); ++j) {
    const int64_t n = results[j]->dimensions()[1];
    if (k == 0) std::memset(results[j]->typed_data(), 0, results[j]->size_bytes());
    for (int64_t panel = 0; k > 0 && panel < ws[j].dimensions()[0]; ++panel)
      product.panels.push_back({ws[j].typed_data() + panel * k / 2 * kPanel, results[j]->typed_data() + panel * kPanel, n});
  }
  if (m > 0 && !product.panels.empty()) run(std::move(product), pool);
  return ffi::Error::Success();
#else
  return ffi::Error::Internal("matmul: built for a CPU without AVX512-BF16");
#endif
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
                                  .Arg<Bf16Matrix>()
                                  .RemainingArgs()
                                  .RemainingRets());
