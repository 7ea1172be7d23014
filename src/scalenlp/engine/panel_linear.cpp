// Float32 products on weights laid out in panels of 16 output rows, for the engine's CPU inference (x86, AVX2 + FMA).
//
// Why our own layout: oneDNN's packed float32 weight (what the engine used before) streamed at 10-15 GB/s at one
// row, which made its products alone as long as llama.cpp's whole float32 token. Here the weight of output rows
// 16j..16j+15 is one contiguous (K, 16) panel: a product reads every weight once, in order, two 8-lane vectors a
// step of k, with no horizontal sums and no repacking of x. SmolLM2's 121 products of a decode step, each weight
// streamed from memory (benchmarks/packed_products.py products), against oneDNN packed for 32 rows: 1.16x as fast at
// 1 row, 1.25x at 4, 1.18x at 16, 1.11x at 64 on 1 thread; 1.30x, 1.32x, 1.29x, 1.14x on 2.
//
// Rows of x are taken six at a time (12 accumulators, 2 weight vectors and a broadcast: 15 of AVX2's 16 registers),
// each panel staying in L1/L2 while the blocks of rows pass over it; threads split the panels. The accumulators
// are named variables: as an array, GCC stored them to the stack every step of k (2x slower from 16 rows up).
//
// Built at run time by scalenlp.engine.packing (through scalenlp.native).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstring>

namespace {

constexpr int64_t NR = 16;  // output rows of a panel: two 8-float AVX2 vectors

// One output row of a panel: the 16 sums (lo, hi) plus bias, the first `cols` of them.
inline void store(__m256 lo, __m256 hi, const float* bias, float* out, int64_t cols) {
  if (bias != nullptr) {
    lo = _mm256_add_ps(lo, _mm256_loadu_ps(bias));
    hi = _mm256_add_ps(hi, _mm256_loadu_ps(bias + 8));
  }
  if (cols == NR) {
    _mm256_storeu_ps(out, lo);
    _mm256_storeu_ps(out + 8, hi);
  } else {  // the last panel of a weight whose rows are not a multiple of 16
    alignas(32) float tail[NR];
    _mm256_store_ps(tail, lo);
    _mm256_store_ps(tail + 8, hi);
    std::memcpy(out, tail, cols * sizeof(float));
  }
}

// out[r, 0:cols] = x[r, :] . panel (+ bias) for the MR rows of x at x (row stride ldx).
template <int MR>
inline void rows_times_panel(const float* x, int64_t ldx, const float* panel, int64_t K, const float* bias,
                             float* out, int64_t ldo, int64_t cols) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
         c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(panel + k * NR), w1 = _mm256_loadu_ps(panel + k * NR + 8);
    const auto fma_row = [&](const float* row, __m256& lo, __m256& hi) {
      const __m256 b = _mm256_broadcast_ss(row + k);
      lo = _mm256_fmadd_ps(b, w0, lo);
      hi = _mm256_fmadd_ps(b, w1, hi);
    };
    fma_row(x, c00, c01);
    if constexpr (MR > 1) fma_row(x + ldx, c10, c11);
    if constexpr (MR > 2) fma_row(x + 2 * ldx, c20, c21);
    if constexpr (MR > 3) fma_row(x + 3 * ldx, c30, c31);
    if constexpr (MR > 4) fma_row(x + 4 * ldx, c40, c41);
    if constexpr (MR > 5) fma_row(x + 5 * ldx, c50, c51);
  }
  const __m256 sums[12] = {c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51};
  for (int r = 0; r < MR; ++r) store(sums[2 * r], sums[2 * r + 1], bias, out + r * ldo, cols);
}

// One row: k four steps at a time into separate sums, so that each FMA does not wait for the one before (a decode
// step's products, where the weight streams from memory and nothing else hides that latency).
void row_times_panel(const float* x, const float* panel, int64_t K, const float* bias, float* out, int64_t cols) {
  __m256 s[8];
  for (auto& v : s) v = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 4 <= K; k += 4) {
    for (int u = 0; u < 4; ++u) {
      const __m256 b = _mm256_broadcast_ss(x + k + u);
      s[2 * u] = _mm256_fmadd_ps(b, _mm256_loadu_ps(panel + (k + u) * NR), s[2 * u]);
      s[2 * u + 1] = _mm256_fmadd_ps(b, _mm256_loadu_ps(panel + (k + u) * NR + 8), s[2 * u + 1]);
    }
  }
  for (; k < K; ++k) {
    const __m256 b = _mm256_broadcast_ss(x + k);
    s[0] = _mm256_fmadd_ps(b, _mm256_loadu_ps(panel + k * NR), s[0]);
    s[1] = _mm256_fmadd_ps(b, _mm256_loadu_ps(panel + k * NR + 8), s[1]);
  }
  store(_mm256_add_ps(_mm256_add_ps(s[0], s[2]), _mm256_add_ps(s[4], s[6])),
        _mm256_add_ps(_mm256_add_ps(s[1], s[3]), _mm256_add_ps(s[5], s[7])), bias, out, cols);
}

// x (..., K) float32 times the weight in `panels` (ceil(N / 16), K, 16), plus `bias` padded to the panels' rows.
at::Tensor linear(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                  int64_t out_features) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat && panels.dim() == 3 &&
                  panels.size(2) == NR && panels.is_contiguous(),
              "panel linear: float32 x and (P, K, 16) contiguous float32 panels expected");
  const int64_t P = panels.size(0), K = panels.size(1), N = out_features;
  TORCH_CHECK(x.size(-1) == K && (N + NR - 1) / NR == P, "panel linear: x has ", x.size(-1), " inputs and the ",
              P, " panels take ", K, " for ", N, " outputs");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->numel() == P * NR && bias->is_contiguous() && bias->scalar_type() == at::kFloat),
              "panel linear: the bias must be padded to the panels' ", P * NR, " rows");
  const auto rows = x.reshape({-1, K}).contiguous();
  const int64_t M = rows.size(0);
  auto out = at::empty({M, N}, rows.options());
  const float* xs = rows.data_ptr<float>();
  const float* ws = panels.data_ptr<float>();
  const float* bs = has_bias ? bias->data_ptr<float>() : nullptr;
  float* os = out.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const float* panel = ws + j * K * NR;
      const float* b = bs == nullptr ? nullptr : bs + j * NR;
      float* o = os + j * NR;
      const int64_t cols = std::min(NR, N - j * NR);
      if (M == 1) {
        row_times_panel(xs, panel, K, b, o, cols);
        continue;
      }
      int64_t m = 0;
      for (; m + 6 <= M; m += 6) rows_times_panel<6>(xs + m * K, K, panel, K, b, o + m * N, N, cols);
      const float* xm = xs + m * K;
      float* om = o + m * N;
      switch (M - m) {
        case 1: rows_times_panel<1>(xm, K, panel, K, b, om, N, cols); break;
        case 2: rows_times_panel<2>(xm, K, panel, K, b, om, N, cols); break;
        case 3: rows_times_panel<3>(xm, K, panel, K, b, om, N, cols); break;
        case 4: rows_times_panel<4>(xm, K, panel, K, b, om, N, cols); break;
        case 5: rows_times_panel<5>(xm, K, panel, K, b, om, N, cols); break;
        default: break;
      }
    }
  });
  auto shape = x.sizes().vec();
  shape.back() = N;
  return out.view(shape);
}

}  // namespace

TORCH_LIBRARY(scalenlp_panel, m) { m.def("linear(Tensor x, Tensor panels, Tensor? bias, int out_features) -> Tensor"); }

TORCH_LIBRARY_IMPL(scalenlp_panel, CPU, m) { m.impl("linear", linear); }
