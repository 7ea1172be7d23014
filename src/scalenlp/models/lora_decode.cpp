// Many LoRA adapters in one decode step on CPUs (Punica's BGMV): each row (one token) adds its own adapter's
// low-rank product to the base layer's output, out[i] += B[s_i] (A[s_i] x[i]), with the scaling already folded
// into B. Weights and activations are float32 or bfloat16 (the engine's dtype); sums are float32.
//
// Why: in PyTorch the per-row choice of adapter is either a gather (a copy of each row's A and B) or a product
// with every served adapter under a mask (S times the arithmetic). Both are tiny matmuls whose cost on one CPU
// thread is the library's per-call overhead, not their arithmetic: SmolLM2-135M's decode step at 16 rows and 4
// adapters spent about 26 ms of 90 in them, 3 ops per layer linear. Here it is one call per linear, reading
// only the adapter each row uses, and rows on the base model cost nothing.
//
// Built at run time by scalenlp.engine.lora (through scalenlp.native) with -O3 -march=native;
// the loops over the input and output features are left to the compiler's vectorizer.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernel_math.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using scalenlp_kernels::dot;

constexpr int64_t W = 64;  // outputs summed at once: four AVX-512 registers of float32
constexpr int64_t G = 4;   // rows of one adapter computed together: each of its weights read (and widened) once

// ``n`` weights as float32: float32 ones where they are, bfloat16 ones widened into ``buffer``.
template <typename T>
inline const float* widened(const T* weights, int64_t n, float* buffer) {
  if constexpr (std::is_same_v<T, float>) {
    return weights;
  } else {
    for (int64_t i = 0; i < n; ++i) buffer[i] = static_cast<float>(weights[i]);
    return buffer;
  }
}

// acc[q] += sum over the rank j of h[q][j] B[j] for Q rows, over a full tile of W outputs (b: the tile's first
// column of B's row 0): fixed trip counts, which the vectorizer keeps in registers.
template <int64_t Q, typename T>
inline void full_tile(float (&acc)[G][W], const float* h, int64_t r, const T* b, int64_t N, float* buffer) {
  for (int64_t j = 0; j < r; ++j) {
    if constexpr (Q == 1) {  // read once: widened as it is read, no copy
      for (int64_t c = 0; c < W; ++c) acc[0][c] += h[j] * static_cast<float>(b[j * N + c]);
    } else {
      const float* brow = widened(b + j * N, W, buffer);
      for (int64_t q = 0; q < Q; ++q)
        for (int64_t c = 0; c < W; ++c) acc[q][c] += h[q * r + j] * brow[c];
    }
  }
}

template <typename T>
void add_rows(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, const at::Tensor& slots) {
  const int64_t R = x.size(0), K = x.size(1), S = a.size(0), r = a.size(1), N = b.size(2);
  const int64_t out_stride = out.stride(0), x_stride = x.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* ap = a.data_ptr<T>();
  const T* bp = b.data_ptr<T>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  // Rows in groups of up to G that use one adapter: the group reads that adapter's A and B once, where row by row
  // each row read them again (4 rows an adapter at 16 rows and 4 adapters). The last slot is the always-zero one
  // base rows point at: they are skipped.
  std::vector<std::vector<int64_t>> rows_of(S);
  for (int64_t i = 0; i < R; ++i)
    if (sp[i] >= 0 && sp[i] < S - 1) rows_of[sp[i]].push_back(i);
  std::vector<std::pair<int64_t, int64_t>> groups;  // (slot, first of its rows in rows_of)
  for (int64_t s = 0; s < S - 1; ++s)
    for (int64_t first = 0; first < static_cast<int64_t>(rows_of[s].size()); first += G) groups.emplace_back(s, first);
  at::parallel_for(0, static_cast<int64_t>(groups.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(G * K), row(std::max(K, W)), h(G * r);
    for (int64_t gi = begin; gi < end; ++gi) {
      const auto [s, first] = groups[gi];
      const int64_t n = std::min<int64_t>(G, static_cast<int64_t>(rows_of[s].size()) - first);
      const int64_t* ids = rows_of[s].data() + first;
      for (int64_t q = 0; q < n; ++q)
        for (int64_t k = 0; k < K; ++k) xf[q * K + k] = static_cast<float>(xp[ids[q] * x_stride + k]);
      const T* as = ap + s * r * K;
      for (int64_t j = 0; j < r; ++j) {
        if (n == 1) {  // read once: widened as it is read, no copy
          h[j] = dot(xf.data(), as + j * K, K);
          continue;
        }
        const float* arow = widened(as + j * K, K, row.data());
        for (int64_t q = 0; q < n; ++q) h[q * r + j] = dot(xf.data() + q * K, arow, K);
      }
      const T* bs = bp + s * r * N;
      // Outputs a tile at a time, the G rows' sums kept in registers over the rank (B's rows of this slot are
      // contiguous over the outputs), rather than r passes over whole output rows.
      for (int64_t n0 = 0; n0 < N; n0 += W) {
        const int64_t w = std::min(W, N - n0);
        float acc[G][W] = {};
        if (w == W && n == G)
          full_tile<G>(acc, h.data(), r, bs + n0, N, row.data());
        else if (w == W && n == 1)  // a lone row on its adapter (a few rows spread over many adapters)
          full_tile<1>(acc, h.data(), r, bs + n0, N, row.data());
        else
          for (int64_t j = 0; j < r; ++j) {
            const float* brow = widened(bs + j * N + n0, w, row.data());
            for (int64_t q = 0; q < n; ++q)
              for (int64_t c = 0; c < w; ++c) acc[q][c] += h[q * r + j] * brow[c];
          }
        for (int64_t q = 0; q < n; ++q) {
          T* orow = op + ids[q] * out_stride + n0;
          for (int64_t c = 0; c < w; ++c) orow[c] = static_cast<T>(static_cast<float>(orow[c]) + acc[q][c]);
        }
      }
    }
  });
}

// out: (R, N), the base layer's output, added to in place; x: (R, K); a: (S, r, K); b: (S, r, N), scaling folded
// in; slots: (R,) int64, each row's slot in a and b, where S - 1 (the zero slot) or a negative one means the base
// model alone. Rows must be contiguous in their last dimension.
void add_lora(at::Tensor out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, const at::Tensor& slots) {
  const auto dtype = out.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && x.scalar_type() == dtype &&
                  a.scalar_type() == dtype && b.scalar_type() == dtype,
              "lora add_lora: out, x, a and b all float32 or all bfloat16");
  TORCH_CHECK(out.dim() == 2 && x.dim() == 2 && a.dim() == 3 && b.dim() == 3 && slots.dim() == 1,
              "lora add_lora: out (R, N), x (R, K), a (S, r, K), b (S, r, N), slots (R,)");
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && out.stride(1) == 1 && x.stride(1) == 1,
              "lora add_lora: a and b contiguous, out and x rows contiguous");
  TORCH_CHECK(x.size(0) == out.size(0) && slots.size(0) == out.size(0) && a.size(2) == x.size(1) &&
                  b.size(2) == out.size(1) && a.size(0) == b.size(0) && a.size(1) == b.size(1),
              "lora add_lora: shapes do not match");
  auto sc = slots.to(at::kLong).contiguous();
  if (dtype == at::kFloat)
    add_rows<float>(out, x, a, b, sc);
  else
    add_rows<at::BFloat16>(out, x, a, b, sc);
}

}  // namespace

TORCH_LIBRARY(scalenlp_lora, m) {
  m.def("add_lora(Tensor(a!) out, Tensor x, Tensor a, Tensor b, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(scalenlp_lora, CPU, m) { m.impl("add_lora", add_lora); }
