// CPU kernels for the engine's hot path, as torch ops (torch.ops.workbench_cpu.*), each beside a torch reference
// in kernels/reference.py that it must equal within float32 tolerance:
//   store_kvcache   each new token's K and V into its flat slot (-1: skipped), converted to the cache's dtype
//   rms_norm        RMS normalisation, with the residual add fused in front of it (vLLM's fused_add_rms_norm)
//   rotary          rotate-half RoPE of q and k read where the fused q/k/v projection left them
//   silu_and_mul    SiLU(gate) * up of the fused gate/up projection
// The last three replace a dozen small torch ops per layer each (what bounds a small batch after the weights).
// Paged attention is in paged_attention.cpp, the linear layers in linear.cpp. Built with -march=native by
// kernels/cpu/build.py: AVX2/FMA everywhere.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <tuple>

#include "vec.h"

namespace {

using namespace wbcpu;

// ---- the small per-layer ops -----------------------------------------------------------------------------------
// Rows are independent; a task takes whole rows, enough of them to be worth a thread (a decode step's single row
// runs inline). The arithmetic follows the torch reference's order where it is a sequence of roundings.
constexpr int64_t ELEMENTS_PER_TASK = 16384;

inline int64_t row_grain(int64_t row_len) { return std::max<int64_t>(1, ELEMENTS_PER_TASK / std::max<int64_t>(row_len, 1)); }

// ---- KV cache write ----------------------------------------------------------------------------------------------
inline void store_row(const float* src, float* dst, int64_t n) { std::copy(src, src + n, dst); }
// at::BFloat16's own rounding, 16 values at a time (vec.h's, which linear_bf16 rounds its input with)
inline void store_row(const float* src, at::BFloat16* dst, int64_t n) {
  round_to_bf16(src, reinterpret_cast<uint16_t*>(dst), n);
}

void store_kvcache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                   const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && key.scalar_type() == at::kFloat && value.scalar_type() == at::kFloat,
              "store_kvcache: key and value must be [T, Hkv, D] float32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "store_kvcache: caches must be contiguous");
  TORCH_CHECK(key.sizes() == value.sizes(), "store_kvcache: key and value must have the same shape");
  // A token's rows are read where they lie, at any token stride, once its heads lie side by side: v is a view into
  // the fused q/k/v projection's output, and a contiguous copy of it was an aten clone per layer (8-14 us at 64
  // tokens). Any other layout is copied first.
  const auto rows_of = [](const at::Tensor& x) {
    return x.stride(2) == 1 && x.stride(1) == x.size(2) ? x : x.contiguous();
  };
  const at::Tensor k = rows_of(key), v = rows_of(value);
  auto slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t T = k.size(0), row = k.size(1) * k.size(2), num_slots = k_cache.numel() / row;
  const int64_t k_stride = k.stride(0), v_stride = v.stride(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] < num_slots, "store_kvcache: slot ", sp[t], " is past the cache's ", num_slots, " slots");
  // Tokens split over the threads: a decode step's rows go to as many scattered blocks, and each write waits on its
  // cache lines.
  auto write = [&](auto* kc, auto* vc) {
    at::parallel_for(0, T, row_grain(2 * row), [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        if (sp[t] < 0) continue;  // a token that must not be written (its slot is -1)
        store_row(kp + t * k_stride, kc + sp[t] * row, row);
        store_row(vp + t * v_stride, vc + sp[t] * row, row);
      }
    });
  };
  if (k_cache.scalar_type() == at::kFloat)
    write(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  else if (k_cache.scalar_type() == at::kBFloat16)
    write(k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>());
  else
    TORCH_CHECK(false, "store_kvcache: the cache must be float32 or bfloat16");
}

// out = w * (r * rsqrt(mean(r^2) + eps)), r = x (+ residual, kept in new_residual)
std::tuple<at::Tensor, at::Tensor> rms_norm_impl(const at::Tensor& x, const at::Tensor& weight, double eps,
                                                 const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "rms_norm: x must be [T, H] float32 with a float32 weight");
  auto xc = x.contiguous();
  const int64_t T = xc.size(0), H = xc.size(1);
  auto out = at::empty_like(xc);
  at::Tensor res_in = residual.has_value() ? residual->contiguous() : at::Tensor();
  at::Tensor res_out = residual.has_value() ? at::empty_like(xc) : at::Tensor();
  const float* xp = xc.data_ptr<float>();
  const float* wp = weight.contiguous().data_ptr<float>();
  const float* rp = residual.has_value() ? res_in.data_ptr<float>() : nullptr;
  float* rop = residual.has_value() ? res_out.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, row_grain(H), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* src = xp + t * H;
      if (rp) {
        float* dst = rop + t * H;
        for (int64_t h = 0; h < H; ++h) dst[h] = rp[t * H + h] + src[h];
        src = dst;
      }
      __m256 acc = _mm256_setzero_ps();
      int64_t h = 0;
      for (; h + 8 <= H; h += 8) {
        const __m256 v = _mm256_loadu_ps(src + h);
        acc = _mm256_fmadd_ps(v, v, acc);
      }
      float sum = hsum(acc);
      for (; h < H; ++h) sum += src[h] * src[h];
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(H) + static_cast<float>(eps));
      for (h = 0; h < H; ++h) op[t * H + h] = wp[h] * (src[h] * inv);
    }
  });
  return {out, res_out};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return std::get<0>(rms_norm_impl(x, weight, eps, c10::nullopt));
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps) {
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == at::kFloat,
              "fused_add_rms_norm: the residual must be float32 shaped as x");
  return rms_norm_impl(x, weight, eps, residual);
}

// x1, x2 = halves of a head; out = (x1 cos1 - x2 sin1, x2 cos2 + x1 sin2), cos/sin [T, D] by position
void rotate_heads(const float* x, int64_t token_stride, int64_t heads, int64_t D, const float* cos, const float* sin,
                  float* out, int64_t t) {
  const int64_t half = D / 2;
  const float* c = cos + t * D;
  const float* s = sin + t * D;
  for (int64_t h = 0; h < heads; ++h) {
    const float* xi = x + t * token_stride + h * D;
    float* oi = out + (t * heads + h) * D;
    // 8 lanes by hand: a plain loop was left scalar by the compiler (out may alias x), 32 us a call at 64 tokens of
    // SmolLM2's 12 heads on one thread (7.5 us so); the scalar loop after takes a half head that is not whole vectors
    int64_t d = 0;
    for (; d + 8 <= half; d += 8) {
      const __m256 x1 = _mm256_loadu_ps(xi + d), x2 = _mm256_loadu_ps(xi + d + half);
      _mm256_storeu_ps(oi + d, _mm256_fnmadd_ps(x2, _mm256_loadu_ps(s + d), _mm256_mul_ps(x1, _mm256_loadu_ps(c + d))));
      _mm256_storeu_ps(oi + d + half, _mm256_fmadd_ps(x1, _mm256_loadu_ps(s + d + half),
                                                      _mm256_mul_ps(x2, _mm256_loadu_ps(c + d + half))));
    }
    for (; d < half; ++d) {
      oi[d] = std::fma(-xi[d + half], s[d], xi[d] * c[d]);
      oi[d + half] = std::fma(xi[d], s[d + half], xi[d + half] * c[d + half]);
    }
  }
}

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                          const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat,
              "rotary: q and k must be [T, H, D] float32");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && k.stride(2) == 1 && k.stride(1) == k.size(2),
              "rotary: the heads of a token must be contiguous");
  const int64_t T = q.size(0), D = q.size(2), Hq = q.size(1), Hk = k.size(1);
  auto cc = cos.contiguous(), sc = sin.contiguous();
  TORCH_CHECK(cc.numel() == T * D && sc.numel() == T * D, "rotary: cos and sin must be [T, D]");
  auto q_out = at::empty({T, Hq, D}, q.options()), k_out = at::empty({T, Hk, D}, k.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>();
  const float *cp = cc.data_ptr<float>(), *sp = sc.data_ptr<float>();
  float *qo = q_out.data_ptr<float>(), *ko = k_out.data_ptr<float>();
  at::parallel_for(0, T, row_grain((Hq + Hk) * D), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      rotate_heads(qp, q.stride(0), Hq, D, cp, sp, qo, t);
      rotate_heads(kp, k.stride(0), Hk, D, cp, sp, ko, t);
    }
  });
  return {q_out, k_out};
}

// silu(g) = g * sigmoid(g), sigmoid through exp(-|g|) <= 1 so that exp8's range (x <= 0) covers it
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % 2 == 0,
              "silu_and_mul: x must be [T, 2 * I] float32");
  auto xc = x.contiguous();
  const int64_t T = xc.size(0), I = xc.size(1) / 2;
  auto out = at::empty({T, I}, xc.options());
  const float* xp = xc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, row_grain(2 * I), [&](int64_t t0, int64_t t1) {
    const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
    for (int64_t t = t0; t < t1; ++t) {
      const float* gate = xp + t * 2 * I;
      const float* up = gate + I;
      float* o = op + t * I;
      int64_t i = 0;
      for (; i + 8 <= I; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 e = exp8(_mm256_or_ps(g, sign));  // exp(-|g|)
        // 1 / (1 + e) where g >= 0, e / (1 + e) where g < 0 (its sign bit picks): one division, where two (each
        // computed, one kept) had bound the op
        const __m256 sig = _mm256_div_ps(_mm256_blendv_ps(one, e, g), _mm256_add_ps(one, e));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(g, sig), _mm256_loadu_ps(up + i)));
      }
      for (; i < I; ++i) o[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
    }
  });
  return out;
}

// ---- greedy sampling ------------------------------------------------------------------------------------------
// Each row's argmax, as torch's x.max(dim=-1).indices: the first index of the largest value, or of the first NaN
// (torch's max propagates NaN). Torch's reduction runs one row at a time on one thread, 40-80 us a row of 49,152
// logits here, 2.5 ms for a batch-64 step's greedy rows; here 8 lanes, rows split over the threads.
int64_t argmax_row(const float* x, int64_t K) {
  float top = -INFINITY;
  int64_t arg = -1, k = 0;
  if (K >= 8) {
    // lane j: the largest of the columns j, j + 8, ... and its first index (strictly greater keeps the first of a tie)
    const __m256i step = _mm256_set1_epi32(8);
    __m256 best = _mm256_loadu_ps(x);
    __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), at = idx;
    __m256 nan = _mm256_cmp_ps(best, best, _CMP_UNORD_Q);
    for (k = 8; k + 8 <= K && k + 8 <= INT32_MAX; k += 8) {
      idx = _mm256_add_epi32(idx, step);
      const __m256 v = _mm256_loadu_ps(x + k);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      const __m256 take = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
      best = _mm256_blendv_ps(best, v, take);
      at = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at), _mm256_castsi256_ps(idx), take));
    }
    if (_mm256_movemask_ps(nan)) {  // rare: the first NaN, one by one
      for (int64_t i = 0; i < K; ++i)
        if (std::isnan(x[i])) return i;
    }
    float lanes[8];
    int32_t where[8];
    _mm256_storeu_ps(lanes, best);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(where), at);
    for (int j = 0; j < 8; ++j)  // the largest lane, the lowest index among equals
      if (arg < 0 || lanes[j] > top || (lanes[j] == top && where[j] < arg)) {
        top = lanes[j];
        arg = where[j];
      }
  }
  for (; k < K; ++k) {  // the columns past the last whole vector come after every lane's
    if (std::isnan(x[k])) return k;
    if (arg < 0 || x[k] > top) {
      top = x[k];
      arg = k;
    }
  }
  return arg;
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) > 0,
              "argmax_rows: x must be [N, V] float32 with V > 0");
  auto xc = x.contiguous();
  const int64_t N = xc.size(0), K = xc.size(1);
  auto out = at::empty({N}, xc.options().dtype(at::kLong));
  const float* xp = xc.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, N, row_grain(K), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = argmax_row(xp + r * K, K);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(workbench_cpu, m) {
  m.def("store_kvcache(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(workbench_cpu, CPU, m) {
  m.impl("store_kvcache", &store_kvcache);
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rotary", &rotary);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("argmax_rows", &argmax_rows);
}
