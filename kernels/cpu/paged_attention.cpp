// paged_attention: every sequence of a step over its blocks where they lie in the cache ([num_blocks, block_size,
// kv heads, head dim]): no gather, an online softmax per block; against kernels/reference.py's paged_attention.
// New token i of a sequence with q_len new tokens sees the keys at positions < seq_len - q_len + i + 1.
//
// One task per (sequence, kv head, tile of new tokens): its query heads (a GQA group) and up to ROWS query rows
// walk the sequence's blocks; per block, the scores of its tokens, one online-softmax update (rescale by
// exp(old max - new max)), then the weighted values.
//
// The arithmetic runs W lanes wide (16 with AVX-512, 8 with AVX2) and reads K and V rows 2W values at a time as two
// vectors: float32 as two halves, bfloat16 as its even and its odd elements (one load, a shift and a mask for 2W
// values, where widening them in order costs two loads, two extensions and two shifts). q and the accumulators are
// kept in that same order, so the dot products and the weighted sums are those of the rows in order; only the
// output is put back. W keys at a time share one reduction of their dot products.
//
// Decodes only, four or more of them (two per thread): a task per sequence instead, its kv heads side by side block
// by block, so that each block's cache rows are read whole. Decodes too few for a kv head per task to share out
// (fewer tasks than twice the threads: one decode of SmolLM2's 3 kv heads on 2 threads): each sequence's blocks split
// in a part per thread, a task per part over all kv heads, the parts' softmaxes merged after (flash-decoding's split
// of the keys). One decode, 30 layers' caches cycled, alternating in one process, median of 21 (AVX-512 EPYC,
// 2026-12-04), by kv head -> split, ms a call: bf16 cache, 70 keys 0.0073 -> 0.0070, 150 0.0125 -> 0.0124, 300
// 0.0151 -> 0.0139, 500 0.0225 -> 0.0192, 1,000 0.0458 -> 0.0372, 4,000 0.229 -> 0.156; fp32, 1,000 0.0766 ->
// 0.0606; the AVX2 build, bf16, 1,000 0.0478 -> 0.0369.
//
// Every task asks for the next block's rows (into L2) while it computes the block before, a share of them before each
// piece of the arithmetic (NextBlock); a sequence's task on its last block asks for the first block of the thread's
// next sequence. A block's 16 keys are one short run per kv head, which the hardware prefetcher barely starts on, and
// the whole block asked for at once (as on 2026-12-03, into L1) filled the core's queue of misses: the arithmetic
// waited behind it, and a call took about the time of touching its blocks (0.40-0.43 ms at 64 decodes of 137 keys,
// bf16) plus that of its arithmetic with the cache in L3 (0.36 ms). The op alone, SmolLM2's 9/3 heads, 30 layers'
// caches cycled so that each call reads from memory, alternating in one process, median of 11 (AVX-512 EPYC,
// 2026-12-04), ms a call, the whole block at once -> shared out: 64 decodes of 137 keys over scattered blocks, bf16
// cache 1.018 -> 0.543, fp32 1.120 -> 0.780; over contiguous blocks 0.765 -> 0.460; 16 decodes of 1,024 keys 1.294
// -> 0.622; 4 of 500 0.225 -> 0.108; one of 300 0.0166 -> 0.0157, one of 70 0.0107 -> 0.0110. The next sequence's
// first block then took 64 x 137 from 0.561 to 0.512 ms (fp32 1.009 -> 0.910). Asked for two or more blocks ahead,
// a call ran slower.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace {

using namespace wbcpu;

constexpr int ROWS = 8;

// ---- the two vector widths ---------------------------------------------------------------------------------------
struct Lanes8 {
  using V = __m256;
  static constexpr int W = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static float sum(V v) { return hsum(v); }
  // lane j: the sum of a[j]'s lanes (one reduction for W keys' dot products instead of one per key)
  static V sums(const V a[W]) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
  }
  static void load2(const float* p, V& a, V& b) { a = load(p); b = load(p + W); }
  static void load2(const at::BFloat16* p, V& a, V& b) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    a = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
    b = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(-65536)));
  }
};

#if defined(__AVX512F__)
struct Lanes16 {
  using V = __m512;
  static constexpr int W = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
  // Four rounds of halving, each adding a pair of vectors' halves into one vector (45 instructions for 16 sums).
  // The rounds leave a[j]'s sum in lane ORDER[j], an involution, so reading the inputs through it puts sum j in lane j.
  static V sums(const V a[W]) {
    static constexpr int ORDER[W] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};
    V b[8], c[4], d[2];
    for (int j = 0; j < 8; ++j) {
      const V x = a[ORDER[j]], y = a[ORDER[j + 8]];
      b[j] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
    }
    for (int j = 0; j < 4; ++j)
      c[j] = _mm512_add_ps(_mm512_shuffle_f32x4(b[j], b[j + 4], 0x88), _mm512_shuffle_f32x4(b[j], b[j + 4], 0xDD));
    for (int j = 0; j < 2; ++j)
      d[j] = _mm512_add_ps(_mm512_shuffle_ps(c[j], c[j + 2], 0x44), _mm512_shuffle_ps(c[j], c[j + 2], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
  }
  static void load2(const float* p, V& a, V& b) { a = load(p); b = load(p + W); }
  static void load2(const at::BFloat16* p, V& a, V& b) {
    const __m512i x = _mm512_loadu_si512(p);
    a = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    b = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(-65536)));
  }
};
#endif

// A row of D values times `scale` into the lane order (into_lanes) or back out of it: bf16 chunks of 2W hold their
// even elements first; float32, and the columns past the last whole chunk (Dv), stay in order.
template <typename L, typename C>
inline void reorder_row(const float* src, float* dst, int64_t Dv, int64_t D, float scale, bool into_lanes) {
  constexpr int W = L::W;
  int64_t d = std::is_same_v<C, float> ? 0 : Dv;
  for (int64_t c = 0; c < d; c += 2 * W)
    for (int i = 0; i < 2 * W; ++i) {
      const int64_t lane = c + (i & 1) * W + i / 2;  // where element c + i sits in lane order
      if (into_lanes) dst[lane] = src[c + i] * scale;
      else dst[c + i] = src[lane] * scale;
    }
  for (; d < D; ++d) dst[d] = src[d] * scale;
}

// q . k over the columns past the last whole chunk (a head dim that is not a multiple of 2W)
template <typename C>
inline float tail_dot(const float* q, const C* k, int64_t Dv, int64_t D) {
  float s = 0.f;
  for (int64_t d = Dv; d < D; ++d) s += q[d] * to_float(k[d]);
  return s;
}

// q . k_t for the n keys of a block (token stride `stride`) into p, W keys at a time, then one by one; q in lane
// order and already scaled.
template <typename L, typename C>
inline void block_scores(const float* q, const C* kb, int64_t stride, int64_t n, int64_t Dv, int64_t D, float* p) {
  using V = typename L::V;
  constexpr int W = L::W;
  int64_t t = 0;
  for (; t + W <= n; t += W) {
    V acc[W];
    for (int j = 0; j < W; ++j) acc[j] = L::zero();
    for (int64_t d = 0; d < Dv; d += 2 * W) {
      const V qa = L::load(q + d), qb = L::load(q + d + W);
      for (int j = 0; j < W; ++j) {
        V ka, kb2;
        L::load2(kb + (t + j) * stride + d, ka, kb2);
        acc[j] = L::fmadd(qa, ka, L::fmadd(qb, kb2, acc[j]));
      }
    }
    L::store(p + t, L::sums(acc));
  }
  for (; t < n; ++t) {
    V acc = L::zero();
    for (int64_t d = 0; d < Dv; d += 2 * W) {
      V ka, kb2;
      L::load2(kb + t * stride + d, ka, kb2);
      acc = L::fmadd(L::load(q + d), ka, L::fmadd(L::load(q + d + W), kb2, acc));
    }
    p[t] = L::sum(acc);
  }
  if (Dv < D)
    for (int64_t u = 0; u < n; ++u) p[u] += tail_dot(q, kb + u * stride, Dv, D);
}

// acc = acc * corr + sum_u p[u] v_u for R rows at once (the query heads of a GQA group read the same values): each
// chunk of 2W columns of V is loaded once for all R rows, whose accumulators stay in registers across the block; p
// holds row r's weights at p + r * p_stride.
template <typename L, typename C, int R>
inline void block_values_rows(const float* p, int64_t p_stride, const C* vb, int64_t stride, int64_t n, int64_t Dv,
                              int64_t D, const float* corr, float* acc) {
  using V = typename L::V;
  constexpr int W = L::W;
  for (int64_t d = 0; d < Dv; d += 2 * W) {
    V a0[R], a1[R];
    for (int r = 0; r < R; ++r) {
      const V c = L::set1(corr[r]);
      a0[r] = L::mul(L::load(acc + r * D + d), c);
      a1[r] = L::mul(L::load(acc + r * D + d + W), c);
    }
    for (int64_t u = 0; u < n; ++u) {
      V v0, v1;
      L::load2(vb + u * stride + d, v0, v1);
      for (int r = 0; r < R; ++r) {
        const V pu = L::set1(p[r * p_stride + u]);
        a0[r] = L::fmadd(pu, v0, a0[r]);
        a1[r] = L::fmadd(pu, v1, a1[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      L::store(acc + r * D + d, a0[r]);
      L::store(acc + r * D + d + W, a1[r]);
    }
  }
}

// Rows in groups of at most 4 (8 accumulators and the two V vectors fit AVX2's 16 registers), as even as possible:
// 6 rows (2 tokens of a 3-head group) as 3 + 3, not 4 + 2; then the columns past the last whole chunk one by one.
template <typename L, typename C>
inline void block_values(const float* p, int64_t p_stride, int rows, const C* vb, int64_t stride, int64_t n,
                         int64_t Dv, int64_t D, const float* corr, float* acc) {
  const int groups = (rows + 3) / 4;
  for (int g = 0, r0 = 0; g < groups; ++g) {
    const int r1 = rows * (g + 1) / groups;
    const float* pg = p + r0 * p_stride;
    float* ag = acc + r0 * D;
    switch (r1 - r0) {
      case 1: block_values_rows<L, C, 1>(pg, p_stride, vb, stride, n, Dv, D, corr + r0, ag); break;
      case 2: block_values_rows<L, C, 2>(pg, p_stride, vb, stride, n, Dv, D, corr + r0, ag); break;
      case 3: block_values_rows<L, C, 3>(pg, p_stride, vb, stride, n, Dv, D, corr + r0, ag); break;
      default: block_values_rows<L, C, 4>(pg, p_stride, vb, stride, n, Dv, D, corr + r0, ag); break;
    }
    r0 = r1;
  }
  for (int r = 0; r < rows; ++r)
    for (int64_t d = Dv; d < D; ++d) {
      float a = acc[r * D + d] * corr[r];
      for (int64_t u = 0; u < n; ++u) a += p[r * p_stride + u] * to_float(vb[u * stride + d]);
      acc[r * D + d] = a;
    }
}

// Turn row scores pr[0, visible) into exp(score - new max) in place and zero pr[visible, padded) (padded: visible
// rounded up to 8, within the row's room); returns the row's correction of its old sums, exp(old max - new max)
// (about 1e-38 on the first block, where m = -inf: it scales sums that are 0), and updates its max m and sum l.
inline float softmax_update(float* pr, int64_t visible, float& m, float& l) {
  const int64_t padded = (visible + 7) / 8 * 8;
  std::fill(pr + visible, pr + padded, -std::numeric_limits<float>::infinity());
  __m256 mx = _mm256_loadu_ps(pr);
  for (int64_t t = 8; t < padded; t += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(pr + t));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  const float new_m = std::max(m, std::max(_mm_cvtss_f32(h), _mm_cvtss_f32(_mm_movehdup_ps(h))));
  const __m256 mv = _mm256_set1_ps(new_m);
  for (int64_t t = 0; t < padded; t += 8) _mm256_storeu_ps(pr + t, exp8(_mm256_sub_ps(_mm256_loadu_ps(pr + t), mv)));
  std::fill(pr + visible, pr + padded, 0.f);
  __m256 sums = _mm256_loadu_ps(pr);
  for (int64_t t = 8; t < padded; t += 8) sums = _mm256_add_ps(sums, _mm256_loadu_ps(pr + t));
  const float corr = _mm256_cvtss_f32(exp8(_mm256_set1_ps(m - new_m)));
  l = l * corr + hsum(sums);
  m = new_m;
  return corr;
}

// The next block's cache rows (`lines` 64-byte lines of K and as many of V, `row_lines` to a token), asked for into
// L2 a share at a time between the pieces of the current block's arithmetic. Asked for all at once, they filled the
// core's queue of misses and the arithmetic waited behind them: the op ran at about the time of its loads plus
// the time of its arithmetic, with no overlap.
struct NextBlock {
  int64_t row_lines, token_bytes;
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t lines = 0, share = 0, done = 0;

  // the rows of `tokens` tokens from k and v, in `pieces` shares
  void aim(const void* k_rows, const void* v_rows, int64_t tokens, int64_t pieces) {
    k = static_cast<const char*>(k_rows);
    v = static_cast<const char*>(v_rows);
    lines = tokens * row_lines;
    share = (lines + pieces - 1) / pieces;
    done = 0;
  }

  void ask_some() {
    for (const int64_t stop = std::min(lines, done + share); done < stop; ++done) {
      const int64_t at = done / row_lines * token_bytes + done % row_lines * 64;
      _mm_prefetch(k + at, _MM_HINT_T1);
      _mm_prefetch(v + at, _MM_HINT_T1);
    }
  }
};

// The rows of `heads` consecutive kv heads (kv head h: its `rows` query rows at q + h * rows * q_stride, its keys
// and values at h * D of each cache row, its outputs as its query rows) over one sequence's blocks; `limits[r]`: the
// keys row r of each head sees. The next block's rows are asked for while a block is computed (NextBlock); after the
// last block, `then_tokens` keys' rows of block `then_block` (the next task's first, or none where it is -1).
template <typename L, typename C>
void attend_rows(const float* q, int64_t q_stride, int rows, const int64_t* limits, const C* k_cache,
                 const C* v_cache, const int32_t* table, int64_t block_size, int64_t token_stride,
                 int64_t block_stride, int64_t D, float scale, float* out, int64_t out_stride, int64_t heads,
                 int64_t then_block = -1, int64_t then_tokens = 0, int64_t first = 0,
                 int64_t stop = std::numeric_limits<int64_t>::max(), float* partial = nullptr) {
  const int64_t Dv = D - D % (2 * L::W), all_rows = heads * rows;
  // per thread, grown once: no allocation per task
  thread_local std::vector<float> acc, p, qs, m, l, corr;
  acc.assign(static_cast<size_t>(all_rows) * D, 0.f);
  const int64_t p_stride = (block_size + 7) / 8 * 8;  // a row's weights of one block, with room to round up to 8
  p.resize(static_cast<size_t>(rows) * p_stride);
  qs.resize(static_cast<size_t>(all_rows) * D);  // q in lane order, times the scale
  m.assign(all_rows, -std::numeric_limits<float>::infinity());
  l.assign(all_rows, 0.f);
  corr.resize(all_rows);
  for (int64_t r = 0; r < all_rows; ++r) reorder_row<L, C>(q + r * q_stride, qs.data() + r * D, Dv, D, scale, true);
  int64_t end = 0;
  for (int r = 0; r < rows; ++r) end = std::max(end, limits[r]);
  end = std::min(end, stop);
  const int64_t row_bytes = heads * D * static_cast<int64_t>(sizeof(C));  // of a cache row, what this task reads
  NextBlock next{(row_bytes + 63) / 64, token_stride * static_cast<int64_t>(sizeof(C))};
  for (int64_t start = first; start < end; start += block_size) {
    const int64_t blk = table[start / block_size];
    const int64_t n_tok = std::min(block_size, end - start);
    // the rows to ask for during this block: the sequence's next block, or after its last the next task's first
    const bool last = start + block_size >= end;
    const int64_t nb = last ? then_block : table[start / block_size + 1];
    const int64_t n_next = nb < 0 ? 0 : std::min(block_size, last ? then_tokens : end - start - block_size);
    next.aim(k_cache + std::max<int64_t>(nb, 0) * block_stride, v_cache + std::max<int64_t>(nb, 0) * block_stride,
             n_next, heads * (rows + 1));  // a share before each row's scores, and one before the values
    for (int64_t h = 0; h < heads; ++h) {
      const C* kb = k_cache + blk * block_stride + h * D;
      const C* vb = v_cache + blk * block_stride + h * D;
      const int64_t r0 = h * rows;  // this head's first row
      int64_t n_any = 0;            // keys any row sees in the block: the values read for all rows
      for (int r = 0; r < rows; ++r) {
        const int64_t visible = std::max<int64_t>(0, std::min(n_tok, limits[r] - start));  // keys this row sees
        float* pr = p.data() + r * p_stride;
        n_any = std::max(n_any, visible);
        corr[r0 + r] = 1.f;
        next.ask_some();
        if (visible > 0) {
          block_scores<L>(qs.data() + (r0 + r) * D, kb, token_stride, visible, Dv, D, pr);
          corr[r0 + r] = softmax_update(pr, visible, m[r0 + r], l[r0 + r]);
        }
        std::fill(pr + visible, pr + n_tok, 0.f);  // keys past the row's causal limit weigh nothing
      }
      next.ask_some();
      if (n_any > 0)
        block_values<L>(p.data(), p_stride, rows, vb, token_stride, n_any, Dv, D, corr.data() + r0,
                        acc.data() + r0 * D);
    }
  }
  for (int64_t r = 0; r < all_rows; ++r) {
    if (partial) {  // a part of the keys: its max, its sum and its unnormalised weighted values, merged later
      float* pr = partial + r * (D + 2);
      pr[0] = m[r];
      pr[1] = l[r];
      reorder_row<L, C>(acc.data() + r * D, pr + 2, Dv, D, 1.f, false);
      continue;
    }
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    reorder_row<L, C>(acc.data() + r * D, out + r * out_stride, Dv, D, inv, false);
  }
}

// Each sequence's rows from P parts of its keys ([S, P, Hq, D + 2]: a row's max, sum and unnormalised values), as
// one softmax.
inline void merge_parts(const float* parts, int64_t S, int64_t P, int64_t Hq, int64_t D, float* out) {
  for (int64_t s = 0; s < S; ++s)
    for (int64_t r = 0; r < Hq; ++r) {
      const auto part = [&](int64_t p) { return parts + ((s * P + p) * Hq + r) * (D + 2); };
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t p = 0; p < P; ++p) mx = std::max(mx, part(p)[0]);
      float* o = out + (s * Hq + r) * D;
      std::fill(o, o + D, 0.f);
      float den = 0.f;
      for (int64_t p = 0; p < P; ++p) {
        if (part(p)[1] == 0.f) continue;  // no keys in this part
        const float w = std::exp(part(p)[0] - mx);
        den += part(p)[1] * w;
        for (int64_t d = 0; d < D; ++d) o[d] += part(p)[2 + d] * w;
      }
      const float inv = den > 0.f ? 1.f / den : 0.f;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
}

template <typename L, typename C>
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
  if (static_cast<int64_t>(tasks.size()) == S && qsl[S] == S && S >= 2 * at::get_num_threads()) {
    // Decodes only, enough of them to share out: a task per sequence, all its kv heads block by block, so each
    // block's rows are read whole while they are in cache (kv head h of a row lies beside h + 1).
    at::parallel_for(0, S, 1, [&](int64_t s0, int64_t s1) {
      for (int64_t s = s0; s < s1; ++s) {
        int64_t limits[ROWS];
        std::fill(limits, limits + G, static_cast<int64_t>(lens[s]));
        attend_rows<L, C>(qp + s * Hq * D, D, G, limits, kc, vc, tables + s * max_blocks, block_size, token_stride,
                          block_stride, D, static_cast<float>(scale), op + s * Hq * D, D, Hkv,
                          s + 1 < s1 ? tables[(s + 1) * max_blocks] : -1, s + 1 < s1 ? lens[s + 1] : 0);
      }
    });
    return;
  }
  const int64_t threads = at::get_num_threads();
  if (qsl[S] == S && S * Hkv < 2 * threads && threads > 1) {
    // Decodes too few to share out by kv head (one of SmolLM2's 3 kv heads on 2 threads: one thread does two
    // heads' work while the other does one): each sequence's blocks in a part per thread, every kv head of a
    // part in one task, and the parts' softmaxes merged after.
    const int64_t P = threads;
    thread_local std::vector<float> parts;
    parts.resize(static_cast<size_t>(S * P * Hq * (D + 2)));
    float* pp = parts.data();
    at::parallel_for(0, S * P, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t s = t / P, p = t % P, blocks = (lens[s] + block_size - 1) / block_size;
        int64_t limits[ROWS];
        std::fill(limits, limits + G, static_cast<int64_t>(lens[s]));
        attend_rows<L, C>(qp + s * Hq * D, D, G, limits, kc, vc, tables + s * max_blocks, block_size, token_stride,
                          block_stride, D, static_cast<float>(scale), nullptr, D, Hkv, -1, 0,
                          blocks * p / P * block_size, blocks * (p + 1) / P * block_size, pp + t * Hq * (D + 2));
      }
    });
    merge_parts(pp, S, P, Hq, D, op);
    return;
  }
  // The tasks taken one at a time from a shared count, the last (a chunk's last tiles, which see the most keys)
  // first. at::parallel_for's static split had given one thread the first half of a prefill's tiles, a quarter of
  // the causal work, and left it waiting: a 512-token prefill (SmolLM2's 9/3 heads, fp32 cache, the op alone,
  // median of 30, 2026-12-04, AVX-512 EPYC) 7.62 -> 3.7-4.2 ms a call, the AVX2 build 7.78 -> 3.6-4.2. Tiles of 32
  // rows instead of 8, balanced so, ran level.
  const int64_t n_tasks = static_cast<int64_t>(tasks.size()) * Hkv;
  std::atomic<int64_t> taken{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t i; (i = taken.fetch_add(1)) < n_tasks;) {
      const int64_t t = n_tasks - 1 - i;
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
        attend_rows<L, C>(qp + row0 * D, D, rows, limits, kc + h * D, vc + h * D, tables + s * max_blocks,
                          block_size, token_stride, block_stride, D, static_cast<float>(scale), op + row0 * D, D, 1);
      } else {
        // several tokens: gather their rows into a dense [rows, D] tile, then scatter the outputs back
        thread_local std::vector<float> qt, ot;
        qt.resize(static_cast<size_t>(rows) * D);
        ot.resize(static_cast<size_t>(rows) * D);
        for (int64_t i = 0; i < n_tok; ++i)
          std::memcpy(qt.data() + i * G * D, qp + (row0 + i * Hq) * D, sizeof(float) * G * D);
        attend_rows<L, C>(qt.data(), D, rows, limits, kc + h * D, vc + h * D, tables + s * max_blocks, block_size,
                          token_stride, block_stride, D, static_cast<float>(scale), ot.data(), D, 1);
        for (int64_t i = 0; i < n_tok; ++i)
          std::memcpy(op + (row0 + i * Hq) * D, ot.data() + i * G * D, sizeof(float) * G * D);
      }
    }
  });
}

// 16 lanes where the CPU has AVX-512 and the head dim is whole chunks of 32; else 8 (any head dim: the columns past
// the last chunk of 16 one by one).
template <typename C>
void paged_attention_any(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& block_tables, const at::Tensor& seq_lens,
                         const at::Tensor& query_start_loc, double scale, at::Tensor& out) {
#if defined(__AVX512F__)
  if (q.size(2) % 32 == 0)
    return paged_attention_impl<Lanes16, C>(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out);
#endif
  paged_attention_impl<Lanes8, C>(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out);
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const at::Tensor& query_start_loc, double scale) {
  const PagedInputs in = paged_inputs("paged_attention", q, k_cache, v_cache, block_tables, seq_lens, query_start_loc);
  TORCH_CHECK(q.size(1) / k_cache.size(2) <= ROWS, "paged_attention: at most ", ROWS, " query heads per kv head");
  auto out = at::empty_like(in.q);
  with_cache_type("paged_attention", k_cache, [&](auto c) {
    paged_attention_any<decltype(c)>(in.q, k_cache, v_cache, in.tables, in.lens, in.qsl, scale, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(workbench_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_start_loc, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(workbench_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
