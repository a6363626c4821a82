// Helpers shared by the CPU ops' sources (inline, in namespace wbcpu): vector helpers (AVX2 + FMA everywhere:
// horizontal sums, 8 weights of any stored dtype as floats, float32 rounded to bf16 as torch rounds it, exp for
// softmax) and the paged attention ops' checked inputs.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace wbcpu {

// ---- vector helpers (AVX2 + FMA) ------------------------------------------------------------------------------
inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// 8 values of a row as floats: fp32 as is, bf16 by a 16-bit shift.
inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 load8(const at::BFloat16* w) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline float to_float(float w) { return w; }
inline float to_float(at::BFloat16 w) { return static_cast<float>(w); }

// x rounded to bfloat16 as torch rounds it (to nearest, ties to even; NaN to 0x7FC0), 8 at a time: each 32-bit lane
// holds its bf16's bits. linear_bf16 rounds its input so (in place of x.to(kBFloat16), a tensor allocated and
// dispatched for each of a step's 121 linears: batch-1 bf16 decode, alternating in one process, median of 8: 84.2 ->
// 84.9 tok/s, AVX-512 EPYC), and store_kvcache a bf16 cache's rows.
inline __m256i bf16_bits8(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
}

inline uint16_t bf16_bits(float x) {
  return static_cast<uint16_t>(_mm256_cvtsi256_si32(bf16_bits8(_mm256_set1_ps(x))));
}

// n values of x into bf16
inline void round_to_bf16(const float* x, uint16_t* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i lo = bf16_bits8(_mm256_loadu_ps(x + i)), hi = bf16_bits8(_mm256_loadu_ps(x + i + 8));
    const __m256i packed = _mm256_packus_epi32(lo, hi);  // 128-bit lanes: lo 0-3, hi 0-3, lo 4-7, hi 4-7
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm256_permute4x64_epi64(packed, 0xD8));
  }
  for (; i < n; ++i) out[i] = bf16_bits(x[i]);
}

// the same rounded values as float32 (the widened path of a CPU without AVX512-BF16)
inline void round_to_bf16(const float* x, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(_mm256_loadu_ps(x + i)), 16)));
  for (; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(bf16_bits(x[i])) << 16;
    std::memcpy(out + i, &bits, sizeof(bits));
  }
}

// exp(x) for x <= 0 (softmax after subtracting the max), Cephes' polynomial: ~2 ulp over the range used.
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f);
  x = _mm256_max_ps(x, lo);
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  __m256 x2 = _mm256_mul_ps(x, x);
  y = _mm256_fmadd_ps(y, x2, _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2));
}

// q . k over D floats, k of any stored dtype (8 wide, then the tail).
template <typename C>
inline float dot(const float* q, const C* k, int64_t D) {
  __m256 acc = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), acc);
  float s = hsum(acc);
  for (; d < D; ++d) s += q[d] * to_float(k[d]);
  return s;
}

// ---- the paged attention ops' inputs (paged_attention, tree_attention) --------------------------------------------
// q [T, Hq, D] float32, made contiguous; the block tables, sequence lengths and query starts as contiguous int32.
struct PagedInputs {
  at::Tensor q, tables, lens, qsl;
};

// The checks both ops make: q float32 [T, Hq, D]; caches contiguous [num_blocks, block_size, Hkv, D], Hkv dividing Hq;
// each sequence's new tokens within its length, and the blocks its length covers in its table and in the cache. The
// ops read wherever a table points: a table too short for its sequence (a test's one-block table under 33 tokens)
// had them read past it and crash now and then.
inline PagedInputs paged_inputs(const char* op, const at::Tensor& q, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                const at::Tensor& query_start_loc) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, op, ": q must be [T, Hq, D] float32");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(), op,
              ": caches must be contiguous [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, op, ": query heads must be a multiple of kv heads");
  PagedInputs in{q.contiguous(), block_tables.to(at::kInt).contiguous(), seq_lens.to(at::kInt).contiguous(),
                 query_start_loc.to(at::kInt).contiguous()};
  const int64_t S = in.lens.numel(), num_blocks = k_cache.size(0), block_size = k_cache.size(1);
  TORCH_CHECK(in.qsl.numel() == S + 1 && in.tables.dim() == 2 && in.tables.size(0) >= S, op,
              ": query_start_loc must have one more entry than seq_lens, block_tables a row per sequence");
  const int32_t *lens = in.lens.data_ptr<int32_t>(), *qsl = in.qsl.data_ptr<int32_t>();
  const int64_t max_blocks = in.tables.size(1);
  TORCH_CHECK(qsl[0] == 0 && qsl[S] == q.size(0), op, ": query_start_loc must run from 0 to q's ", q.size(0), " rows");
  for (int64_t s = 0; s < S; ++s) {
    const int64_t q_len = qsl[s + 1] - qsl[s], blocks = (lens[s] + block_size - 1) / block_size;
    TORCH_CHECK(q_len >= 0 && q_len <= lens[s], op, ": sequence ", s, " has ", q_len, " new tokens of ", lens[s]);
    TORCH_CHECK(blocks <= max_blocks, op, ": sequence ", s, " of ", lens[s], " tokens needs ", blocks,
                " blocks; block_tables has ", max_blocks, " a row");
    const int32_t* row = in.tables.data_ptr<int32_t>() + s * max_blocks;
    for (int64_t b = 0; b < blocks; ++b)
      TORCH_CHECK(row[b] >= 0 && row[b] < num_blocks, op, ": sequence ", s, " block ", b, " is ", row[b],
                  ", not one of the cache's ", num_blocks);
  }
  return in;
}

// f(C{}) for the cache's element type C: float or at::BFloat16.
template <typename F>
inline void with_cache_type(const char* op, const at::Tensor& cache, F&& f) {
  if (cache.scalar_type() == at::kFloat)
    f(float{});
  else if (cache.scalar_type() == at::kBFloat16)
    f(at::BFloat16{});
  else
    TORCH_CHECK(false, op, ": the cache must be float32 or bfloat16");
}

}  // namespace wbcpu
