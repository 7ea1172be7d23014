// Causal attention for float32 on CPUs, forward and backward, for head sizes 16 and 32.
//
// Why: PyTorch's CPU flash-attention kernel computes each block of scores with a GEMM, writes it out, runs the
// softmax over it and reads it back for the next GEMM. With small heads (16-64, common in small models) each
// score costs only 2*head_size FLOPs per product, so that round trip through memory, not arithmetic, sets the
// pace (measured here: ~40% of one core's SGEMM rate forward, ~33% backward at head size 16). This kernel keeps
// a tile of 8 query rows x 32 keys in registers from the scores to the output (forward) and to all three
// gradients (backward), in the usual flash-attention order: online softmax forward (log-sum-exp kept per row),
// then the backward recomputes the probabilities from it (Dao et al. 2022, "FlashAttention", Algorithms 1-2).
//
// Built at run time by scalenlp.models.cpu_attention with -O3 -march=native, on vectors of 16 floats (GCC/Clang
// vector extensions: one AVX-512 register, two AVX2 ones, four NEON ones).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t W = 16;       // floats per vector (one AVX-512 register; the compiler splits it elsewhere)
// Tiles of R query rows x BK keys (C vectors per row), forward and backward: each key/value row loaded
// serves R rows, and the tile's scores stay in registers (R x C = 16 of the 32 AVX-512 registers).
constexpr int64_t R = 8, BK = 32, C = BK / W;
// Key columns (the transposed K and V) are padded with zeros to whole blocks: S_pad of them.
inline int64_t padded(int64_t S) { return (S + BK - 1) / BK * BK; }

typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));

inline vf load(const float* p) {
  vf x;
  std::memcpy(&x, p, sizeof(vf));
  return x;
}
inline void store(float* p, vf x) { std::memcpy(p, &x, sizeof(vf)); }
inline vf splat(float a) { return vf{} + a; }
inline vf vmax(vf a, vf b) { return a > b ? a : b; }
inline float hmax(vf x) {  // halving: 4 shuffles and maxes, not 15 scalar ones
  x = vmax(x, __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  x = vmax(x, __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  x = vmax(x, __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  x = vmax(x, __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return x[0];
}
inline float hsum(vf x) {
  float m = 0.0f;
  for (int64_t i = 0; i < W; ++i) m += x[i];
  return m;
}
const vi LANE = [] {
  vi x;
  for (int64_t i = 0; i < W; ++i) x[i] = static_cast<int32_t>(i);
  return x;
}();

// e^x for x <= 0 (a score minus its row's maximum or log-sum-exp): Cody-Waite reduction to r in
// [-ln2/2, ln2/2], a degree-6 Taylor polynomial (relative error < 2e-7), and 2^n put in the exponent bits.
// x below -87 counts as -87 (e^-87 ~ 1.6e-38: nothing next to the row's largest term, which is 1).
inline vf exp_nonpos(vf x) {
  x = vmax(x, splat(-87.0f));
  const vf shift = splat(12582912.0f);  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const vf n = (x * 1.44269504088896341f + shift) - shift;
  const vf r = (x - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f;
  vf p = splat(1.0f / 720.0f);
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof(vf));
  return p * scale;
}

// A head's [S, D] rows (row stride `stride`) as [D, S_pad] columns, zero past S, so that the d-th components
// of W consecutive keys are one vector load in the score loops.
template <int64_t D>
void transpose_rows(const float* src, int64_t S, int64_t stride, int64_t S_pad, float* dst) {
  std::fill(dst, dst + D * S_pad, 0.0f);
  for (int64_t j = 0; j < S; ++j)
    for (int64_t d = 0; d < D; ++d) dst[d * S_pad + j] = src[j * stride + d];
}

// s[r][c] = a[r] . cols[:, j0 + c*W .. j0 + c*W + W): R x BK dot products of head size D.
template <int64_t D>
inline void row_dots(const float (&a)[R][D], const float* cols, int64_t S_pad, int64_t j0, vf (&s)[R][C]) {
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) s[r][c] = vf{};
  for (int64_t d = 0; d < D; ++d) {
    vf col[C];
    for (int64_t c = 0; c < C; ++c) col[c] = load(cols + d * S_pad + j0 + c * W);
    for (int64_t r = 0; r < R; ++r) {
      const float ad = a[r][d];
      for (int64_t c = 0; c < C; ++c) s[r][c] += ad * col[c];
    }
  }
}

// Lanes of block row r at or before the diagonal (key j0 + lane <= query i0 + r): the causal mask. Blocks
// wholly below the diagonal (most of them) take the unmasked path: MASKED is false there.
template <bool MASKED>
inline vf visible(vf x, vf hidden, int64_t i0, int64_t r, int64_t j0, int64_t c) {
  if constexpr (!MASKED) return x;
  return LANE < static_cast<int32_t>(std::clamp<int64_t>(i0 + r + 1 - j0 - c * W, 0, W)) ? x : hidden;
}

// Online softmax over one block of scores: the rows' running maxima m and (per lane) sums l move to the
// block's, the output accumulators are rescaled to match, and p gets the block's exp(s - m).
template <int64_t D, bool MASKED>
inline void softmax_block(const vf (&s)[R][C], int64_t i0, int64_t j0, float (&m)[R], vf (&l)[R],
                          vf (&acc)[R][D / W], float (&p)[R][BK]) {
  const vf hidden = splat(-1e30f);
  for (int64_t r = 0; r < R; ++r) {
    vf mx = splat(m[r]);
    for (int64_t c = 0; c < C; ++c) mx = vmax(mx, visible<MASKED>(s[r][c], hidden, i0, r, j0, c));
    const float row_max = hmax(mx);
    const float alpha = row_max == m[r] ? 1.0f : exp_nonpos(splat(m[r] - row_max))[0];
    vf sum = l[r] * alpha;
    for (int64_t c = 0; c < C; ++c) {
      const vf pc = visible<MASKED>(exp_nonpos(s[r][c] - row_max), vf{}, i0, r, j0, c);
      store(p[r] + c * W, pc);
      sum += pc;
    }
    m[r] = row_max;
    l[r] = sum;
    for (int64_t e = 0; e < D / W; ++e) acc[r][e] *= alpha;
  }
}

struct Strides {  // element strides of one [S, D] head view: rows of q/k/v/out/grads
  int64_t q, k, v, o, dout;
};

template <int64_t D>
void forward_head(const float* q, const float* k, const float* v, float* out, float* lse, int64_t S,
                  const Strides& st, float scale, float* kt) {
  constexpr int64_t DV = D / W;
  const int64_t S_pad = padded(S);
  transpose_rows<D>(k, S, st.k, S_pad, kt);
  for (int64_t i0 = 0; i0 < S; i0 += R) {
    const int64_t rows = std::min(R, S - i0);
    float qr[R][D], m[R], p[R][BK];
    vf acc[R][DV], s[R][C], l[R];
    for (int64_t r = 0; r < R; ++r) {
      m[r] = -1e30f;
      l[r] = vf{};
      for (int64_t d = 0; d < D; ++d) qr[r][d] = r < rows ? q[(i0 + r) * st.q + d] * scale : 0.0f;
      for (int64_t e = 0; e < DV; ++e) acc[r][e] = vf{};
    }
    const int64_t keys = i0 + rows;  // causal: row i sees keys 0..i
    for (int64_t j0 = 0; j0 < keys; j0 += BK) {
      row_dots<D>(qr, kt, S_pad, j0, s);
      if (j0 + BK <= i0 + 1)
        softmax_block<D, false>(s, i0, j0, m, l, acc, p);
      else
        softmax_block<D, true>(s, i0, j0, m, l, acc, p);
      const int64_t nb = std::min(BK, keys - j0);  // p is 0 past nb: pairs may read one key past it
      for (int64_t t = 0; t < nb; t += 2) {
        vf va[DV], vb[DV];
        for (int64_t e = 0; e < DV; ++e) {
          va[e] = load(v + (j0 + t) * st.v + e * W);
          vb[e] = t + 1 < nb ? load(v + (j0 + t + 1) * st.v + e * W) : vf{};
        }
        for (int64_t r = 0; r < R; ++r)
          for (int64_t e = 0; e < DV; ++e) acc[r][e] += p[r][t] * va[e] + p[r][t + 1] * vb[e];
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const float sum = hsum(l[r]);
      for (int64_t e = 0; e < DV; ++e) store(out + (i0 + r) * st.o + e * W, acc[r][e] * (1.0f / sum));
      lse[i0 + r] = m[r] + std::log(sum);
    }
  }
}

// The backward's block: P = exp(S - lse) from the saved log-sum-exp, and dS = P (dP - delta).
template <bool MASKED>
inline void probabilities(const vf (&sc)[R][C], const vf (&dp)[R][C], const float (&rl)[R], const float (&delta)[R],
                          int64_t i0, int64_t j0, float (&p)[R][BK], float (&ds)[R][BK]) {
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) {
      const vf pc = visible<MASKED>(exp_nonpos(sc[r][c] - rl[r]), vf{}, i0, r, j0, c);
      store(p[r] + c * W, pc);
      store(ds[r] + c * W, pc * (dp[r][c] - delta[r]));
    }
}

// One query head's share of the gradients; dk and dv ([S, D], contiguous) are accumulated into, so that the
// query heads sharing a key/value head (GQA) add up in one buffer.
template <int64_t D>
void backward_head(const float* q, const float* k, const float* out, const float* dout, const float* lse,
                   float* dq, int64_t dq_stride, float* dk, float* dv, int64_t S, const Strides& st, float scale,
                   const float* kt, const float* vt) {
  constexpr int64_t DV = D / W;
  const int64_t S_pad = padded(S);
  for (int64_t i0 = 0; i0 < S; i0 += R) {
    const int64_t rows = std::min(R, S - i0);
    float qr[R][D], dor[R][D], rl[R], delta[R], p[R][BK], ds[R][BK];
    vf g[R][DV], sc[R][C], dp[R][C];
    for (int64_t r = 0; r < R; ++r) {
      float dot = 0.0f;
      for (int64_t d = 0; d < D; ++d) {
        qr[r][d] = r < rows ? q[(i0 + r) * st.q + d] * scale : 0.0f;
        dor[r][d] = r < rows ? dout[(i0 + r) * st.dout + d] : 0.0f;
        dot += r < rows ? dor[r][d] * out[(i0 + r) * st.o + d] : 0.0f;
      }
      for (int64_t e = 0; e < DV; ++e) g[r][e] = vf{};
      delta[r] = dot;  // sum_j P_ij dP_ij = dO_i . O_i
      rl[r] = r < rows ? lse[i0 + r] : 0.0f;
    }
    const int64_t keys = i0 + rows;
    for (int64_t j0 = 0; j0 < keys; j0 += BK) {
      row_dots<D>(qr, kt, S_pad, j0, sc);   // scores
      row_dots<D>(dor, vt, S_pad, j0, dp);  // dP = dO V^T
      if (j0 + BK <= i0 + 1)
        probabilities<false>(sc, dp, rl, delta, i0, j0, p, ds);
      else
        probabilities<true>(sc, dp, rl, delta, i0, j0, p, ds);
      const int64_t nb = std::min(BK, keys - j0);
      for (int64_t t = 0; t < nb; ++t) {
        float* dvr = dv + (j0 + t) * D;
        float* dkr = dk + (j0 + t) * D;
        const float* kr = k + (j0 + t) * st.k;
        for (int64_t e = 0; e < DV; ++e) {
          const vf ke = load(kr + e * W);
          // Even and odd rows in separate sums: half the FMA latency chain.
          vf dva{}, dvb{}, dka{}, dkb{};
          for (int64_t r = 0; r < R; r += 2) {
            dva += p[r][t] * load(dor[r] + e * W);
            dvb += p[r + 1][t] * load(dor[r + 1] + e * W);
            dka += ds[r][t] * load(qr[r] + e * W);  // qr holds q * scale: dK = dS^T Q scale
            dkb += ds[r + 1][t] * load(qr[r + 1] + e * W);
          }
          for (int64_t r = 0; r < R; ++r) g[r][e] += ds[r][t] * ke;
          store(dvr + e * W, load(dvr + e * W) + (dva + dvb));
          store(dkr + e * W, load(dkr + e * W) + (dka + dkb));
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t e = 0; e < DV; ++e) store(dq + (i0 + r) * dq_stride + e * W, g[r][e] * scale);
  }
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "causal_attention: q, k, v must be [B, H, S, D]");
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat,
              "causal_attention: float32 CPU tensors only");
  TORCH_CHECK(k.sizes() == v.sizes() && q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(3) == k.size(3),
              "causal_attention: k and v must be [B, H_kv, S, D] beside q's [B, H, S, D]");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "causal_attention: query heads must be a multiple of key/value heads");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "causal_attention: the head dimension must be contiguous");
}

// [B, H, S, D] with the memory layout of [B, S, H, D]: what the model's (B, S, H*D) reshape wants.
at::Tensor empty_bshd(const at::Tensor& like) {
  return at::empty({like.size(0), like.size(2), like.size(1), like.size(3)}, like.options()).transpose(1, 2);
}

template <int64_t D>
std::tuple<at::Tensor, at::Tensor> forward_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const int64_t B = q.size(0), H = q.size(1), Hkv = k.size(1), S = q.size(2), S_pad = padded(S);
  at::Tensor out = empty_bshd(q);
  at::Tensor lse = at::empty({B, H, S}, q.options());
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const Strides st{q.stride(2), k.stride(2), v.stride(2), out.stride(2), 0};
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float *op = out.data_ptr<float>(), *lp = lse.data_ptr<float>();
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kt(D * S_pad);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H, hk = h / (H / Hkv);
      forward_head<D>(qp + b * q.stride(0) + h * q.stride(1), kp + b * k.stride(0) + hk * k.stride(1),
                      vp + b * v.stride(0) + hk * v.stride(1), op + b * out.stride(0) + h * out.stride(1),
                      lp + bh * S, S, st, scale, kt.data());
    }
  });
  return {out, lse};
}

template <int64_t D>
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_impl(const at::Tensor& dout, const at::Tensor& q,
                                                             const at::Tensor& k, const at::Tensor& v,
                                                             const at::Tensor& out, const at::Tensor& lse) {
  const int64_t B = q.size(0), H = q.size(1), Hkv = k.size(1), S = q.size(2), S_pad = padded(S);
  const int64_t group = H / Hkv;
  at::Tensor dq = empty_bshd(q), dk = empty_bshd(k), dv = empty_bshd(v);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const Strides st{q.stride(2), k.stride(2), v.stride(2), out.stride(2), dout.stride(2)};
  // Work items are (batch, key/value head): the query heads of a group add into the same dK/dV rows.
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kt(D * S_pad), vt(D * S_pad), dk_acc(S * D), dv_acc(S * D);
    for (int64_t bk = begin; bk < end; ++bk) {
      const int64_t b = bk / Hkv, hk = bk % Hkv;
      const float* kh = k.data_ptr<float>() + b * k.stride(0) + hk * k.stride(1);
      const float* vh = v.data_ptr<float>() + b * v.stride(0) + hk * v.stride(1);
      transpose_rows<D>(kh, S, st.k, S_pad, kt.data());
      transpose_rows<D>(vh, S, st.v, S_pad, vt.data());
      std::fill(dk_acc.begin(), dk_acc.end(), 0.0f);
      std::fill(dv_acc.begin(), dv_acc.end(), 0.0f);
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
        backward_head<D>(q.data_ptr<float>() + b * q.stride(0) + h * q.stride(1), kh,
                         out.data_ptr<float>() + b * out.stride(0) + h * out.stride(1),
                         dout.data_ptr<float>() + b * dout.stride(0) + h * dout.stride(1),
                         lse.data_ptr<float>() + (b * H + h) * S,
                         dq.data_ptr<float>() + b * dq.stride(0) + h * dq.stride(1), dq.stride(2), dk_acc.data(),
                         dv_acc.data(), S, st, scale, kt.data(), vt.data());
      }
      float* dkh = dk.data_ptr<float>() + b * dk.stride(0) + hk * dk.stride(1);
      float* dvh = dv.data_ptr<float>() + b * dv.stride(0) + hk * dv.stride(1);
      for (int64_t j = 0; j < S; ++j)
        for (int64_t d = 0; d < D; ++d) {
          dkh[j * dk.stride(2) + d] = dk_acc[j * D + d];
          dvh[j * dv.stride(2) + d] = dv_acc[j * D + d];
        }
    }
  });
  return {dq, dk, dv};
}

#define SCALENLP_HEAD_SIZES(X) X(16) X(32)

std::tuple<at::Tensor, at::Tensor> causal_attention_fwd(const at::Tensor& q, const at::Tensor& k,
                                                        const at::Tensor& v) {
  check_inputs(q, k, v);
  switch (q.size(3)) {
#define CASE(n) \
  case n:       \
    return forward_impl<n>(q, k, v);
    SCALENLP_HEAD_SIZES(CASE)
#undef CASE
  }
  TORCH_CHECK(false, "causal_attention: head size must be 16 or 32, got ", q.size(3));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> causal_attention_bwd(const at::Tensor& dout, const at::Tensor& q,
                                                                    const at::Tensor& k, const at::Tensor& v,
                                                                    const at::Tensor& out, const at::Tensor& lse) {
  check_inputs(q, k, v);
  TORCH_CHECK(dout.sizes() == q.sizes() && dout.stride(3) == 1 && out.stride(3) == 1 && lse.is_contiguous(),
              "causal_attention_bwd: dout/out like q, lse contiguous");
  switch (q.size(3)) {
#define CASE(n) \
  case n:       \
    return backward_impl<n>(dout, q, k, v, out, lse);
    SCALENLP_HEAD_SIZES(CASE)
#undef CASE
  }
  TORCH_CHECK(false, "causal_attention: head size must be 16 or 32, got ", q.size(3));
}

}  // namespace

TORCH_LIBRARY(scalenlp_cpu, m) {
  m.def("causal_attention(Tensor q, Tensor k, Tensor v) -> (Tensor, Tensor)");
  m.def("causal_attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse)"
        " -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(scalenlp_cpu, CPU, m) {
  m.impl("causal_attention", causal_attention_fwd);
  m.impl("causal_attention_backward", causal_attention_bwd);
}
