// CPU kernels for the engine's hot path, as torch ops (torch.ops.workbench_cpu.*), each beside a torch reference
// in kernels/reference.py that it must equal within float32 tolerance:
//   paged_attention every sequence of a step over its blocks in place: no gather, online softmax per block
//   store_kvcache   each new token's K and V into its flat slot (-1: skipped), converted to the cache's dtype
//   rms_norm        RMS normalisation, with the residual add fused in front of it (vLLM's fused_add_rms_norm)
//   rotary          rotate-half RoPE of q and k read where the fused q/k/v projection left them
//   silu_and_mul    SiLU(gate) * up of the fused gate/up projection
// The last three replace a dozen small torch ops per layer each (what bounds a small batch after the weights).
// The linear layers are in linear.cpp. Built with -march=native by kernels/cpu/build.py: AVX2/FMA everywhere.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "vec.h"

namespace {

using namespace wbcpu;

// ---- paged attention -------------------------------------------------------------------------------------------
// One task per (sequence, kv head): its query heads (a GQA group) and its new tokens, up to ROWS query rows at a
// time, walk the sequence's blocks where they lie in the cache ([num_blocks, block_size, kv heads, head dim]):
// per block, the scores of its tokens, then one online-softmax update (rescale by exp(old max - new max)). New
// token i of a sequence with q_len new tokens sees the keys at positions < seq_len - q_len + i + 1.
constexpr int ROWS = 8;

// The sums of 8 vectors at once, [sum(a[0]), ..., sum(a[7])]: one reduction for 8 keys' dot products instead of a
// horizontal sum per key (which cost as much as the dot product itself at head_dim 64).
inline __m256 hsum8(const __m256 a[8]) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// scale * q . k_t for the n keys of a block (token stride `stride`) into p, 8 keys at a time where D allows.
template <typename C>
inline void block_scores(const float* q, const C* kb, int64_t stride, int64_t n, int64_t D, float scale, float* p) {
  int64_t t = 0;
  if (D % 8 == 0) {
    const __m256 sv = _mm256_set1_ps(scale);
    for (; t + 8 <= n; t += 8) {
      __m256 acc[8];
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv, load8(kb + (t + j) * stride + d), acc[j]);
      }
      _mm256_storeu_ps(p + t, _mm256_mul_ps(hsum8(acc), sv));
    }
  }
  for (; t < n; ++t) p[t] = dot(q, kb + t * stride, D) * scale;
}

// acc = acc * corr + sum_u p[u] v_u over the n values of a block: each 8-wide slice of acc stays in a register
// across the block's tokens (one load and store per slice instead of one per token).
template <typename C>
inline void block_values(const float* p, const C* vb, int64_t stride, int64_t n, int64_t D, float corr, float* acc) {
  int64_t d = 0;
  const __m256 cv = _mm256_set1_ps(corr);
  for (; d + 8 <= D; d += 8) {
    __m256 a = _mm256_mul_ps(_mm256_loadu_ps(acc + d), cv);
    for (int64_t u = 0; u < n; ++u) a = _mm256_fmadd_ps(_mm256_set1_ps(p[u]), load8(vb + u * stride + d), a);
    _mm256_storeu_ps(acc + d, a);
  }
  for (; d < D; ++d) {
    float a = acc[d] * corr;
    for (int64_t u = 0; u < n; ++u) a += p[u] * to_float(vb[u * stride + d]);
    acc[d] = a;
  }
}

// The same for R rows at once (the query heads of a GQA group read the same values): each 16-column slice of V is
// loaded once for all R rows, whose accumulators stay in registers across the block; p holds row r's weights at
// p + r * p_stride. Per key that is R broadcasts and 2 loads for 2R FMAs, against 2R loads one row at a time.
template <typename C, int R>
inline void block_values_rows(const float* p, int64_t p_stride, const C* vb, int64_t stride, int64_t n, int64_t D,
                              const float* corr, float* acc) {
  for (int64_t d = 0; d < D; d += 16) {
    __m256 a0[R], a1[R];
    for (int r = 0; r < R; ++r) {
      const __m256 c = _mm256_set1_ps(corr[r]);
      a0[r] = _mm256_mul_ps(_mm256_loadu_ps(acc + r * D + d), c);
      a1[r] = _mm256_mul_ps(_mm256_loadu_ps(acc + r * D + d + 8), c);
    }
    for (int64_t u = 0; u < n; ++u) {
      const __m256 v0 = load8(vb + u * stride + d), v1 = load8(vb + u * stride + d + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 pu = _mm256_set1_ps(p[r * p_stride + u]);
        a0[r] = _mm256_fmadd_ps(pu, v0, a0[r]);
        a1[r] = _mm256_fmadd_ps(pu, v1, a1[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(acc + r * D + d, a0[r]);
      _mm256_storeu_ps(acc + r * D + d + 8, a1[r]);
    }
  }
}

// Rows in groups of at most 4 (8 accumulators and the two V slices fit AVX2's 16 registers), as even as possible:
// 6 rows (2 tokens of a 3-head group) as 3 + 3, not 4 + 2. D not a multiple of 16: a row at a time.
template <typename C>
inline void block_values_all(const float* p, int64_t p_stride, int rows, const C* vb, int64_t stride, int64_t n,
                             int64_t D, const float* corr, float* acc) {
  if (D % 16 != 0) {
    for (int r = 0; r < rows; ++r) block_values(p + r * p_stride, vb, stride, n, D, corr[r], acc + r * D);
    return;
  }
  const int groups = (rows + 3) / 4;
  for (int g = 0, r0 = 0; g < groups; ++g) {
    const int r1 = rows * (g + 1) / groups;
    const float* pg = p + r0 * p_stride;
    float* ag = acc + r0 * D;
    switch (r1 - r0) {
      case 1: block_values_rows<C, 1>(pg, p_stride, vb, stride, n, D, corr + r0, ag); break;
      case 2: block_values_rows<C, 2>(pg, p_stride, vb, stride, n, D, corr + r0, ag); break;
      case 3: block_values_rows<C, 3>(pg, p_stride, vb, stride, n, D, corr + r0, ag); break;
      default: block_values_rows<C, 4>(pg, p_stride, vb, stride, n, D, corr + r0, ag); break;
    }
    r0 = r1;
  }
}

template <typename C>
void attend_rows(const float* q, int64_t q_stride, int rows, const int64_t* limits, const C* k_cache,
                 const C* v_cache, const int32_t* table, int64_t block_size, int64_t token_stride,
                 int64_t block_stride, int64_t D, float scale, float* out, int64_t out_stride) {
  float m[ROWS], l[ROWS], corr[ROWS];
  thread_local std::vector<float> acc, p;  // per thread, grown once: no allocation per task
  acc.assign(static_cast<size_t>(rows) * D, 0.f);
  p.resize(static_cast<size_t>(rows) * block_size);  // every row's weights of one block
  for (int r = 0; r < rows; ++r) { m[r] = -std::numeric_limits<float>::infinity(); l[r] = 0.f; }
  int64_t end = 0;
  for (int r = 0; r < rows; ++r) end = std::max(end, limits[r]);
  for (int64_t start = 0; start < end; start += block_size) {
    const int64_t blk = table[start / block_size];
    const int64_t n_tok = std::min(block_size, end - start);
    const C* kb = k_cache + blk * block_stride;
    const C* vb = v_cache + blk * block_stride;
    // Blocks lie anywhere in the cache (a new page each), so the hardware prefetcher cannot see the next one coming:
    // ask for its rows of this head while this block is computed, K's before the scores and V's before the values
    // (all at once stalled this block's own loads: 6-13% slower at 64 x 134 and 32 x 300, level at 1 x 4000). Into
    // L2 (_MM_HINT_T1), not L1: into L1 decodes ran 1.4-2x slower (64 sequences x 134 tokens, fp32 1.43 -> 1.01 ms,
    // bf16 1.50 -> 0.88; 8 x 1000 bf16 1.14 -> 0.58; 1 x 4000 fp32 0.86 -> 0.53: the op alone, caches of 6000
    // blocks, a 256 MiB write between calls, same process, alternating, median of 25, AVX-512 EPYC, 2026-12-03).
    // Two or three blocks ahead ran level with one.
    const bool has_next = start + block_size < end;
    const int64_t next = has_next ? table[start / block_size + 1] * block_stride : 0;
    const auto prefetch_next = [&](const C* cache) {
      const int64_t row_bytes = D * static_cast<int64_t>(sizeof(C));
      for (int64_t u = 0; u < block_size; ++u)
        for (int64_t b = 0; b < row_bytes; b += 64)
          _mm_prefetch(reinterpret_cast<const char*>(cache + next + u * token_stride) + b, _MM_HINT_T1);
    };
    if (has_next) prefetch_next(k_cache);
    int64_t n_any = 0;  // keys any row sees in the block: the values read for all rows
    for (int r = 0; r < rows; ++r) {
      const int64_t visible = std::max<int64_t>(0, std::min(n_tok, limits[r] - start));  // keys this row sees
      float* pr = p.data() + r * block_size;
      n_any = std::max(n_any, visible);
      std::fill(pr + visible, pr + n_tok, 0.f);  // keys past the row's causal limit weigh nothing
      corr[r] = 1.f;
      if (visible == 0) continue;
      block_scores(q + r * q_stride, kb, token_stride, visible, D, scale, pr);
      float bmax = -std::numeric_limits<float>::infinity();
      for (int64_t t = 0; t < visible; ++t) bmax = std::max(bmax, pr[t]);
      const float new_m = std::max(m[r], bmax);
      corr[r] = std::exp(m[r] - new_m);  // 0 on the first block (m = -inf)
      int64_t t = 0;
      const __m256 mv = _mm256_set1_ps(new_m);
      float sum = 0.f;
      for (; t + 8 <= visible; t += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(pr + t), mv));
        _mm256_storeu_ps(pr + t, e);
        sum += hsum(e);
      }
      for (; t < visible; ++t) { pr[t] = std::exp(pr[t] - new_m); sum += pr[t]; }
      l[r] = l[r] * corr[r] + sum;
      m[r] = new_m;
    }
    if (has_next) prefetch_next(v_cache);
    if (n_any > 0) block_values_all(p.data(), block_size, rows, vb, token_stride, n_any, D, corr, acc.data());
  }
  for (int r = 0; r < rows; ++r) {
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    for (int64_t d = 0; d < D; ++d) out[r * out_stride + d] = acc[r * D + d] * inv;
  }
}

template <typename C>
void paged_attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& block_tables, const at::Tensor& seq_lens,
                          const at::Tensor& query_start_loc, double scale, at::Tensor& out) {
  const int64_t Hq = q.size(1), D = q.size(2);
  const int64_t block_size = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t G = Hq / Hkv, S = seq_lens.size(0), max_blocks = block_tables.size(1);
  const int64_t token_stride = Hkv * D, block_stride = block_size * Hkv * D;
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const C* kc = k_cache.data_ptr<C>();
  const C* vc = v_cache.data_ptr<C>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  // a task per (sequence, kv head, tile of new tokens): decodes are one tile, a long prefill chunk many
  const int64_t tokens_per_tile = std::max<int64_t>(1, ROWS / G);
  std::vector<int64_t> tasks;  // (s, first new token) pairs, for each kv head
  for (int64_t s = 0; s < S; ++s)
    for (int64_t i = 0; i < qsl[s + 1] - qsl[s]; i += tokens_per_tile) tasks.push_back(s << 32 | i);
  const int64_t n_tasks = static_cast<int64_t>(tasks.size()) * Hkv;
  at::parallel_for(0, n_tasks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t task = tasks[t / Hkv], h = t % Hkv;
      const int64_t s = task >> 32, i0 = task & 0xffffffff;
      const int64_t q_len = qsl[s + 1] - qsl[s], seq_len = lens[s];
      const int64_t n_tok = std::min(tokens_per_tile, q_len - i0);
      int64_t limits[ROWS];
      int rows = 0;
      for (int64_t i = 0; i < n_tok; ++i)
        for (int64_t g = 0; g < G; ++g) limits[rows++] = seq_len - q_len + i0 + i + 1;
      // rows (token i, head g) of q/out: token stride Hq * D, head stride D; heads h*G .. h*G+G-1 are contiguous
      const int64_t row0 = (qsl[s] + i0) * Hq + h * G;
      if (n_tok == 1) {  // a decode (or a last chunk token): its rows are contiguous in q and out
        attend_rows<C>(qp + row0 * D, D, rows, limits, kc + h * D, vc + h * D, tables + s * max_blocks, block_size, token_stride,
                       block_stride, D, static_cast<float>(scale), op + row0 * D, D);
      } else {
        // several tokens: gather their rows into a dense [rows, D] tile, then scatter the outputs back
        thread_local std::vector<float> qt, ot;
        qt.resize(static_cast<size_t>(rows) * D);
        ot.resize(static_cast<size_t>(rows) * D);
        for (int64_t i = 0; i < n_tok; ++i)
          std::memcpy(qt.data() + i * G * D, qp + (row0 + i * Hq) * D, sizeof(float) * G * D);
        attend_rows<C>(qt.data(), D, rows, limits, kc + h * D, vc + h * D, tables + s * max_blocks, block_size, token_stride,
                       block_stride, D, static_cast<float>(scale), ot.data(), D);
        for (int64_t i = 0; i < n_tok; ++i)
          std::memcpy(op + (row0 + i * Hq) * D, ot.data() + i * G * D, sizeof(float) * G * D);
      }
    }
  });
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const at::Tensor& query_start_loc, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "paged_attention: q must be [T, Hq, D] float32");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_attention: caches must be contiguous [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "paged_attention: query heads must be a multiple of kv heads");
  TORCH_CHECK(q.size(1) / k_cache.size(2) <= ROWS, "paged_attention: at most ", ROWS, " query heads per kv head");
  auto qc = q.contiguous();
  auto out = at::empty_like(qc);
  auto tables = block_tables.to(at::kInt).contiguous();
  auto lens = seq_lens.to(at::kInt).contiguous();
  auto qsl = query_start_loc.to(at::kInt).contiguous();
  if (k_cache.scalar_type() == at::kFloat)
    paged_attention_impl<float>(qc, k_cache, v_cache, tables, lens, qsl, scale, out);
  else if (k_cache.scalar_type() == at::kBFloat16)
    paged_attention_impl<at::BFloat16>(qc, k_cache, v_cache, tables, lens, qsl, scale, out);
  else
    TORCH_CHECK(false, "paged_attention: the cache must be float32 or bfloat16");
  return out;
}


// ---- KV cache write ----------------------------------------------------------------------------------------------
template <typename C>
inline void store_row(const float* src, C* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<C>(src[i]);
}

void store_kvcache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                   const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && key.scalar_type() == at::kFloat && value.scalar_type() == at::kFloat,
              "store_kvcache: key and value must be [T, Hkv, D] float32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "store_kvcache: caches must be contiguous");
  auto k = key.contiguous(), v = value.contiguous();
  auto slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t T = k.size(0), row = k.size(1) * k.size(2), num_slots = k_cache.numel() / row;
  const int64_t* sp = slots.data_ptr<int64_t>();
  const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] < num_slots, "store_kvcache: slot ", sp[t], " is past the cache's ", num_slots, " slots");
  auto write = [&](auto* kc, auto* vc) {
    for (int64_t t = 0; t < T; ++t) {
      if (sp[t] < 0) continue;  // a token that must not be written (its slot is -1)
      store_row(kp + t * row, kc + sp[t] * row, row);
      store_row(vp + t * row, vc + sp[t] * row, row);
    }
  };
  if (k_cache.scalar_type() == at::kFloat)
    write(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  else if (k_cache.scalar_type() == at::kBFloat16)
    write(k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>());
  else
    TORCH_CHECK(false, "store_kvcache: the cache must be float32 or bfloat16");
}

// ---- the small per-layer ops -----------------------------------------------------------------------------------
// Rows are independent; a task takes whole rows, enough of them to be worth a thread (a decode step's single row
// runs inline). The arithmetic follows the torch reference's order where it is a sequence of roundings.
constexpr int64_t ELEMENTS_PER_TASK = 16384;

inline int64_t row_grain(int64_t row_len) { return std::max<int64_t>(1, ELEMENTS_PER_TASK / std::max<int64_t>(row_len, 1)); }

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
    for (int64_t d = 0; d < half; ++d) {
      oi[d] = xi[d] * c[d] + (-xi[d + half]) * s[d];
      oi[d + half] = xi[d + half] * c[d + half] + xi[d] * s[d + half];
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
        const __m256 pos = _mm256_div_ps(one, _mm256_add_ps(one, e));
        const __m256 neg = _mm256_div_ps(e, _mm256_add_ps(one, e));
        const __m256 sig = _mm256_blendv_ps(pos, neg, g);  // g's sign bit picks
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(g, sig), _mm256_loadu_ps(up + i)));
      }
      for (; i < I; ++i) o[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(workbench_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_start_loc, float scale) -> Tensor");
  m.def("store_kvcache(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(workbench_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("store_kvcache", &store_kvcache);
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rotary", &rotary);
  m.impl("silu_and_mul", &silu_and_mul);
}
