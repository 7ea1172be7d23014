// 4-bit weight-only linear layers on x86 CPUs with AVX2, in integers as llama.cpp runs its Q4 files: each block of
// 32 inputs of the activations is rounded to integers with its own scale, and a block's 32 products of 4-bit codes
// and int8 activations are one `vpmaddubsw` (unsigned 8 x signed 8 bits, pairs summed to 16) and one `vpmaddwd`
// (to 32). Unlike llama.cpp, the activations are kept to 14 bits as two int8 parts (quantize_row).
//
// Why: PyTorch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`) converts every code to a float and multiplies in
// float; at batch 1 on a 2-core AMD EPYC without AVX-512 it read SmolLM2's weights at 2.7 GB/s, 72% of a decode
// step, and llama.cpp decoded the same Q4_1 file 2.4x as fast. Integer products do 32 multiply-adds an
// instruction where float does 8, and the codes are used as they are stored.
//
// Weights are Int4Linear's portable layout, read in place: (N, K/2) uint8, input 2j in the high nibble of byte j
// and 2j+1 in the low one, with a bf16 scale d and zero z per group of inputs, w = (code - 8) d + z. So that a
// block's 16 bytes unpack into one register without shuffles (high nibbles, then low ones), the activations are
// quantized in that order: a block's even inputs, then its odd ones. The result is the exact product of the
// dequantized weights and the rounded activations, up to the order of float32 sums.
//
// Built at run time by scalenlp.compress.quantized (through scalenlp.native), -O3 -march=native.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t BLOCK = 32;  // inputs per activation scale: one 256-bit register of int8
constexpr int64_t ROWS = 4;    // output rows computed together, sharing each block of activations

inline float bf16_to_float(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// 8 consecutive inputs as floats.
inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const at::BFloat16* x) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// The even inputs of a (8) and b (the next 8) in order, or with ODD the odd ones.
template <bool ODD>
inline __m256 alternate(__m256 a, __m256 b) {
  const __m256 picked = _mm256_shuffle_ps(a, b, ODD ? 0xDD : 0x88);  // per 128-bit lane: a's two, then b's two
  return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(picked), 0xD8));
}

// Four vectors of 8 int32 (each within int8) as 32 int8 in their order.
inline __m256i narrow(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
  return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));  // undo the lane split
}

inline float lanes_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline int32_t lanes_sum_int(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// One row of activations, per block: two int8 vectors in the weights' order (int4's: even inputs, then odd), q1
// rounded to d = max |x| / 127 (as llama.cpp rounds activations, Q8_1) and q2 the remainder to a 128th of that
// step, so that x ~ (d / 128)(128 q1 + q2): 14 bits, as fine as bf16 or finer. One pass (8 bits) was 7% faster
// at one row, but 2-5x further from the float products on SmolLM2, whose int4 model then answered "What is the
// capital of France?" wrongly (as llama.cpp does on the same file). Also the unit d / 128 of the block's integers,
// and the unit times their sum (the zeros' part of the int4 product).
template <bool NIBBLE_ORDER, typename T>
void quantize_row(const T* x, int64_t K, int8_t* q, float* unit, float* sum) {
  // Rounded to nearest, ties to even (as nearbyint and torch.round); products and differences unfused, as the
  // tests' float64 reference computes them.
  constexpr int ROUND = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t b = 0; b < K / BLOCK; ++b) {
    const T* xb = x + b * BLOCK;
    __m256 v[4] = {load8(xb), load8(xb + 8), load8(xb + 16), load8(xb + 24)};
    if (NIBBLE_ORDER) {
      const __m256 even0 = alternate<false>(v[0], v[1]), even1 = alternate<false>(v[2], v[3]);
      const __m256 odd0 = alternate<true>(v[0], v[1]), odd1 = alternate<true>(v[2], v[3]);
      v[0] = even0, v[1] = even1, v[2] = odd0, v[3] = odd1;
    }
    __m256 largest = _mm256_and_ps(v[0], magnitude);
    for (int i = 1; i < 4; ++i) largest = _mm256_max_ps(largest, _mm256_and_ps(v[i], magnitude));
    const float amax = lanes_max(largest);
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    __m256i coarse[4], fine[4], total = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      const __m256 scaled = _mm256_mul_ps(v[i], inv), rounded = _mm256_round_ps(scaled, ROUND);
      const __m256 rest = _mm256_mul_ps(_mm256_sub_ps(scaled, rounded), _mm256_set1_ps(128.0f));
      coarse[i] = _mm256_cvtps_epi32(rounded);
      fine[i] = _mm256_cvtps_epi32(  // within +-64; clamped as int8
          _mm256_min_ps(_mm256_max_ps(_mm256_round_ps(rest, ROUND), _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f)));
      total = _mm256_add_epi32(total, _mm256_add_epi32(_mm256_slli_epi32(coarse[i], 7), fine[i]));
    }
    int8_t* qb = q + 2 * b * BLOCK;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), narrow(coarse[0], coarse[1], coarse[2], coarse[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb + BLOCK), narrow(fine[0], fine[1], fine[2], fine[3]));
    unit[b] = amax / (127.0f * 128.0f);
    sum[b] = unit[b] * static_cast<float>(lanes_sum_int(total));
  }
}

// A block's 32 codes, 0..15, in the activations' order: the high nibbles (even inputs), then the low ones. The 16
// bytes are loaded into both halves of a register and shifted by 4 bits in the lower half only.
inline __m256i codes(const uint8_t* p) {
  const __m256i bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_and_si256(_mm256_srlv_epi64(bytes, _mm256_set_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0F));
}

// The 32 products of a block's codes and its activations' integers 128 q1 + q2, summed into 8 float lanes. Pairs
// of products fit 16 bits (|15 * 127 * 2|), and the sums, 32.
inline __m256 block_products(__m256i q, __m256i x1, __m256i x2) {
  const __m256i coarse = _mm256_madd_epi16(_mm256_maddubs_epi16(q, x1), _mm256_set1_epi16(128));
  const __m256i fine = _mm256_madd_epi16(_mm256_maddubs_epi16(q, x2), _mm256_set1_epi16(1));
  return _mm256_cvtepi32_ps(_mm256_add_epi32(coarse, fine));
}

inline float lanes_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

constexpr int64_t MAX_BLOCKS = 1024;  // blocks a row's scales are staged for at once (32K inputs)

// out[n0 + r] for R output rows against one quantized activation row. First, per row, each block's scale times
// the activations' (staged for the products' loop) and the zeros' part, sum_b (z - 8 d) S_b; then the blocks'
// integer products, one scaled multiply-add each.
template <int R>
void rows_dot(const uint8_t* w, const uint16_t* sz, int64_t n0, int64_t K, const int8_t* xq, const float* xscale,
              const float* xsum, float* out) {
  const int64_t blocks = K / BLOCK, row_bytes = K / 2;
  alignas(64) float scale[R][MAX_BLOCKS];
  float zero_part[R];
  for (int r = 0; r < R; ++r) {
    const uint16_t* p = sz + (n0 + r) * blocks * 2;
    // Eight blocks at a time: each (d, z) pair of bf16 is one 32-bit lane, d its low half and z its high one.
    __m256 zp8 = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= blocks; b += 8) {
      const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2 * b));
      const __m256 d = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
      const __m256 z = _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(-65536)));
      _mm256_store_ps(&scale[r][b], _mm256_mul_ps(d, _mm256_loadu_ps(xscale + b)));
      zp8 = _mm256_fmadd_ps(_mm256_fnmadd_ps(_mm256_set1_ps(8.0f), d, z), _mm256_loadu_ps(xsum + b), zp8);
    }
    float zp = lanes_sum(zp8);
    for (; b < blocks; ++b) {
      const float d = bf16_to_float(p[2 * b]), z = bf16_to_float(p[2 * b + 1]);
      scale[r][b] = d * xscale[b];
      zp += (z - 8.0f * d) * xsum[b];
    }
    zero_part[r] = zp;
  }
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const uint8_t* next = w + (n0 + R) * row_bytes;  // the next tile's codes, fetched while this one computes
  for (int64_t b = 0; b < blocks; ++b) {
    if (b % 4 == 0)
      for (int r = 0; r < R; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(next + r * row_bytes + b * BLOCK / 2), _MM_HINT_T0);
    const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 2 * b * BLOCK));
    const __m256i x2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (2 * b + 1) * BLOCK));
    for (int r = 0; r < R; ++r)
      acc[r] = _mm256_fmadd_ps(block_products(codes(w + (n0 + r) * row_bytes + b * BLOCK / 2), x1, x2),
                               _mm256_broadcast_ss(&scale[r][b]), acc[r]);
  }
  for (int r = 0; r < R; ++r) out[n0 + r] = lanes_sum(acc[r]) + zero_part[r];
}

// out[n0 + r] for R rows of int8 weights (a scale per row) against one quantized activation row: |w| times the
// activations with w's sign (vpmaddubsw takes one unsigned operand), as llama.cpp multiplies Q8_0 blocks.
template <int R>
void int8_rows_dot(const int8_t* w, const uint16_t* scales, int64_t n0, int64_t K, const int8_t* xq,
                   const float* xunit, float* out) {
  const int64_t blocks = K / BLOCK;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const int8_t* next = w + (n0 + R) * K;  // as rows_dot: the next tile, fetched while this one computes
  for (int64_t b = 0; b < blocks; ++b) {
    if (b % 2 == 0)
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(next + r * K + b * BLOCK), _MM_HINT_T0);
    const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 2 * b * BLOCK));
    const __m256i x2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (2 * b + 1) * BLOCK));
    const __m256 unit = _mm256_broadcast_ss(xunit + b);
    for (int r = 0; r < R; ++r) {
      const __m256i wb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (n0 + r) * K + b * BLOCK));
      const __m256i magnitude = _mm256_abs_epi8(wb);  // -128 becomes 128, read unsigned
      const __m256i coarse = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x1, wb)),
                                               _mm256_set1_epi16(128));
      const __m256i fine = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x2, wb)),
                                             _mm256_set1_epi16(1));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(coarse, fine)), unit, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[n0 + r] = lanes_sum(acc[r]) * bf16_to_float(scales[n0 + r]);
}

// The (M, N) float32 products of x's rows (float32 or bf16, quantized here) and N rows of weights: tile(n0, rows,
// quantized row, its units, their sums, output row) computes rows n0 .. n0 + rows - 1 of one activation row.
template <bool NIBBLE_ORDER, typename T, typename Tile>
at::Tensor run(const at::Tensor& x, int64_t N, const Tile& tile) {
  const int64_t M = x.size(0), K = x.size(1), blocks = K / BLOCK;
  // The rounded activations in buffers of the calling thread, kept between calls: three tensors allocated a call
  // were a third of a batch-1 call's fixed cost (about 5 us at K = 576), 120 calls a SmolLM2 step.
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xunit, xsum;
  xq.resize(std::max<size_t>(xq.size(), M * 2 * K));
  xunit.resize(std::max<size_t>(xunit.size(), M * blocks));
  xsum.resize(std::max<size_t>(xsum.size(), M * blocks));
  auto out = at::empty({M, N}, x.options().dtype(at::kFloat));
  const T* xp = x.data_ptr<T>();
  int8_t* qp = xq.data();
  float *sp = xunit.data(), *up = xsum.data(), *op = out.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      quantize_row<NIBBLE_ORDER>(xp + m * K, K, qp + 2 * m * K, sp + m * blocks, up + m * blocks);
  });
  // Threads split the output rows, ROWS at a time; each tile of rows stays in cache while every activation row
  // is multiplied with it, so the weights are read from memory once per call.
  at::parallel_for(0, (N + ROWS - 1) / ROWS, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t m = 0; m < M; ++m)
        tile(t * ROWS, std::min(ROWS, N - t * ROWS), qp + 2 * m * K, sp + m * blocks, up + m * blocks, op + m * N);
  });
  return out;
}

// x's rows checked and made contiguous; K / 32 blocks of them.
at::Tensor rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % BLOCK == 0 && x.size(1) / BLOCK <= MAX_BLOCKS, op, ": x (M, K), K a "
              "multiple of 32 and at most 32768");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op, ": x float32 or bfloat16");
  return x.contiguous();
}

// x: (M, K) float32 or bfloat16 rows; weight: (N, K/2) uint8; block_scales: (N, K/32, 2) bf16, the scale and zero
// of each block of 32 inputs (a group's, repeated over its blocks). Returns (M, N) float32.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& block_scales) {
  const auto xc = rows(x, "int4 linear");
  const int64_t K = xc.size(1), N = weight.size(0);
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte && weight.size(1) * 2 == K &&
                  weight.is_contiguous(), "int4 linear: weight (N, K/2) contiguous uint8");
  TORCH_CHECK(block_scales.dim() == 3 && block_scales.scalar_type() == at::kBFloat16 && block_scales.is_contiguous()
                  && block_scales.size(0) == N && block_scales.size(1) == K / BLOCK && block_scales.size(2) == 2,
              "int4 linear: block_scales (N, K/32, 2) contiguous bf16");
  const uint8_t* w = weight.data_ptr<uint8_t>();
  const uint16_t* sz = reinterpret_cast<const uint16_t*>(block_scales.data_ptr<at::BFloat16>());
  auto tile = [&](int64_t n0, int64_t n, const int8_t* xq, const float* unit, const float* sum, float* out) {
    if (n == ROWS)
      rows_dot<ROWS>(w, sz, n0, K, xq, unit, sum, out);
    else
      for (int64_t i = n0; i < n0 + n; ++i) rows_dot<1>(w, sz, i, K, xq, unit, sum, out);
  };
  return xc.scalar_type() == at::kFloat ? run<true, float>(xc, N, tile) : run<true, at::BFloat16>(xc, N, tile);
}

// x: (M, K) float32 or bfloat16 rows; weight: (N, K) int8; scales: (N,) bf16, one per output. Returns (M, N)
// float32.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  const auto xc = rows(x, "int8 linear");
  const int64_t K = xc.size(1), N = weight.size(0);
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.size(1) == K &&
                  weight.is_contiguous(), "int8 linear: weight (N, K) contiguous int8");
  TORCH_CHECK(scales.dim() == 1 && scales.scalar_type() == at::kBFloat16 && scales.is_contiguous() &&
                  scales.size(0) == N, "int8 linear: scales (N,) contiguous bf16");
  const int8_t* w = weight.data_ptr<int8_t>();
  const uint16_t* s = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  auto tile = [&](int64_t n0, int64_t n, const int8_t* xq, const float* unit, const float*, float* out) {
    if (n == ROWS)
      int8_rows_dot<ROWS>(w, s, n0, K, xq, unit, out);
    else
      for (int64_t i = n0; i < n0 + n; ++i) int8_rows_dot<1>(w, s, i, K, xq, unit, out);
  };
  return xc.scalar_type() == at::kFloat ? run<false, float>(xc, N, tile) : run<false, at::BFloat16>(xc, N, tile);
}

}  // namespace

TORCH_LIBRARY(scalenlp_lowbit, m) {
  m.def("int4_linear(Tensor x, Tensor weight, Tensor block_scales) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(scalenlp_lowbit, CPU, m) {
  m.impl("int4_linear", int4_linear);
  m.impl("int8_linear", int8_linear);
}
