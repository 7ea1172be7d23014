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
#include <vector>

namespace {

using scalenlp_kernels::dot;

constexpr int64_t W = 64;  // outputs summed at once: four AVX-512 registers of float32

template <typename T>
void add_rows(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, const at::Tensor& slots) {
  const int64_t R = x.size(0), K = x.size(1), S = a.size(0), r = a.size(1), N = b.size(2);
  const int64_t out_stride = out.stride(0), x_stride = x.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* ap = a.data_ptr<T>();
  const T* bp = b.data_ptr<T>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(K), h(r);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = sp[i];
      if (s < 0 || s >= S - 1) continue;  // the last slot is the always-zero one base rows point at
      for (int64_t k = 0; k < K; ++k) xf[k] = static_cast<float>(xp[i * x_stride + k]);
      const T* as = ap + s * r * K;
      for (int64_t j = 0; j < r; ++j) h[j] = dot(xf.data(), as + j * K, K);
      const T* bs = bp + s * r * N;
      T* orow = op + i * out_stride;
      // Outputs a tile at a time, the tile's sums kept in registers over the rank (B's rows of this slot are
      // contiguous over the outputs), rather than r passes over the whole output row.
      for (int64_t n0 = 0; n0 < N; n0 += W) {
        const int64_t w = std::min(W, N - n0);
        float acc[W] = {};
        for (int64_t j = 0; j < r; ++j) {
          const float hj = h[j];
          const T* brow = bs + j * N + n0;
          if (w == W)
            for (int64_t q = 0; q < W; ++q) acc[q] += hj * static_cast<float>(brow[q]);
          else
            for (int64_t q = 0; q < w; ++q) acc[q] += hj * static_cast<float>(brow[q]);
        }
        for (int64_t q = 0; q < w; ++q) orow[n0 + q] = static_cast<T>(static_cast<float>(orow[n0 + q]) + acc[q]);
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
