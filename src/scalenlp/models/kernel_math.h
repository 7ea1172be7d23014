// Loops shared by scalenlp's CPU kernels (paged_attention.cpp, lora_decode.cpp), which are built on first use with
// -O3 -march=native: written so that the compiler's vectorizer keeps the sums in vector registers.
#pragma once

#include <cstdint>

namespace scalenlp_kernels {

constexpr int64_t L = 16;  // independent partial sums: a float sum the vectorizer may keep in vector lanes

// a (float32) . b (float or BFloat16, read as float32), over n elements
template <typename T>
inline float dot(const float* __restrict__ a, const T* __restrict__ b, int64_t n) {
  float part[L] = {};
  int64_t i = 0;
  for (; i + L <= n; i += L)
    for (int64_t j = 0; j < L; ++j) part[j] += a[i + j] * static_cast<float>(b[i + j]);
  float s = 0.0f;
  for (; i < n; ++i) s += a[i] * static_cast<float>(b[i]);
  for (int64_t j = 0; j < L; ++j) s += part[j];
  return s;
}

}  // namespace scalenlp_kernels
