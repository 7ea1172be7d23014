// Decode attention over a paged KV cache on CPUs: one query per row, read through its block table. The pools
// hold float32 or bfloat16 (the engine's dtype); scores, softmax and sums are float32 either way, as bf16 matmuls
// accumulate.
//
// Why: the generic path gathers every row's blocks into one (B, H_kv, S, D) tensor before SDPA, a copy of the
// whole cache the step reads, and SDPA's masked path then reads it again. Here each key and value row is read
// once, in place in the pool, by the query heads that share it (grouped-query attention): scores into a small
// buffer, softmax, then the weighted sum of values. The soft cap (Gemma 2) and a sliding window are applied on
// the way, so every decoder layer the model has runs here.
//
// Built at run time by scalenlp.models.paged_attention with -O3 -march=native; the inner loops over the head
// dimension are left to the compiler's vectorizer.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernel_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using scalenlp_kernels::dot;

template <typename T>
inline void axpy(float* __restrict__ out, const T* __restrict__ x, float w, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] += w * static_cast<float>(x[i]);
}

// T: the pools' element type (float or BFloat16); the query and the result are float32 here.
template <typename T>
at::Tensor attend(const at::Tensor& qc, const at::Tensor& k, const at::Tensor& v, const at::Tensor& table,
                  const at::Tensor& lens, double scale, double softcap, int64_t window, int64_t block_size) {
  const int64_t B = qc.size(0), H = qc.size(1), D = qc.size(2), Hkv = k.size(1), N = table.size(1);
  TORCH_CHECK(H % Hkv == 0 && k.size(2) == D, "paged decode_attention: head shapes do not match");
  const int64_t G = H / Hkv;
  auto out = at::empty({B, H, D}, qc.options());
  const float* qp = qc.data_ptr<float>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);

  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, h = item % Hkv;
      const int64_t len = std::min(lp[b], N * block_size);
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      scores.assign(static_cast<size_t>(G * n), 0.0f);
      const float* qrow = qp + (b * H + h * G) * D;  // the G query heads of this key/value head, one after another
      for (int64_t p = first; p < len; ++p) {
        const int64_t slot = tp[b * N + p / block_size] * block_size + p % block_size;
        const T* krow = kp + (slot * Hkv + h) * D;
        for (int64_t g = 0; g < G; ++g) {
          float s = dot(qrow + g * D, krow, D) * sc;
          if (cap > 0.0f) s = cap * std::tanh(s / cap);
          scores[g * n + (p - first)] = s;
        }
      }
      for (int64_t g = 0; g < G; ++g) {  // softmax of each query head's scores
        float* s = scores.data() + g * n;
        const float m = *std::max_element(s, s + n);
        float sum = 0.0f;
        for (int64_t i = 0; i < n; ++i) sum += (s[i] = std::exp(s[i] - m));
        const float inv = 1.0f / sum;
        for (int64_t i = 0; i < n; ++i) s[i] *= inv;
      }
      float* orow = op + (b * H + h * G) * D;
      std::fill(orow, orow + G * D, 0.0f);
      for (int64_t p = first; p < len; ++p) {
        const int64_t slot = tp[b * N + p / block_size] * block_size + p % block_size;
        const T* vrow = vp + (slot * Hkv + h) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float w = scores[g * n + (p - first)];
          axpy(orow + g * D, vrow, w, D);
        }
      }
    }
  });
  return out;
}

// q: (B, H, D); k, v: (slots, H_kv, D), slot = block * block_size + offset; block_table: (B, N) int64;
// lengths: (B,) int64, the keys each row's query sees (its position + 1). window: the last `window` of them
// only (0: all). softcap: scores become cap * tanh(score / cap) before the softmax (0: not capped).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& block_table, const at::Tensor& lengths, double scale, double softcap,
                            int64_t window, int64_t block_size) {
  const auto dtype = k.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && q.scalar_type() == dtype && v.scalar_type() == dtype,
              "paged decode_attention: q, k and v all float32 or all bfloat16");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "paged decode_attention: q (B, H, D), k/v (slots, H_kv, D)");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "paged decode_attention: the pools must be contiguous");
  auto qc = q.to(at::kFloat).contiguous(), table = block_table.contiguous(), lens = lengths.contiguous();
  auto out = dtype == at::kFloat ? attend<float>(qc, k, v, table, lens, scale, softcap, window, block_size)
                                 : attend<at::BFloat16>(qc, k, v, table, lens, scale, softcap, window, block_size);
  return out.to(dtype);
}

}  // namespace

TORCH_LIBRARY(scalenlp_paged, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor block_table, Tensor lengths, float scale, "
        "float softcap, int window, int block_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(scalenlp_paged, CPU, m) { m.impl("decode_attention", decode_attention); }
