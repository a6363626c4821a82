// tree_attention: paged attention in which each query row carries a mask of the 64 keys just before it (a draft
// tree verified in one pass: a node sees the context, its ancestors and itself), against kernels/reference.py's
// tree_attention. Query row i of a sequence sits at slot position seq_len - q_len + i and sees the key at position
// j <= its own when its position - j >= 64 or that bit of its mask is set; a mask of -1 is plain causal attention.
// A task per (query token, kv head): its group of query heads read each key once; scores for the keys it sees, a
// softmax, then the weighted values (two passes over its keys: the rows are few, verification's tokens).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "vec.h"

namespace {

using namespace wbcpu;

constexpr int64_t MASK_BITS = 64;

template <typename C>
inline void axpy(float w, const C* v, float* out, int64_t D) {
  const __m256 wv = _mm256_set1_ps(w);
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) _mm256_storeu_ps(out + d, _mm256_fmadd_ps(wv, load8(v + d), _mm256_loadu_ps(out + d)));
  for (; d < D; ++d) out[d] += w * to_float(v[d]);
}

template <typename C>
void tree_attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& block_tables, const at::Tensor& seq_lens,
                         const at::Tensor& query_start_loc, const at::Tensor& tree_mask, double scale,
                         at::Tensor& out) {
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t block_size = k_cache.size(1), Hkv = k_cache.size(2), G = Hq / Hkv;
  const int64_t S = seq_lens.size(0), max_blocks = block_tables.size(1);
  const int64_t token_stride = Hkv * D, block_stride = block_size * Hkv * D;
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const C* kc = k_cache.data_ptr<C>();
  const C* vc = v_cache.data_ptr<C>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int64_t* masks = tree_mask.data_ptr<int64_t>();
  std::vector<int64_t> seq_of(T);  // each query token's sequence
  for (int64_t s = 0; s < S; ++s)
    for (int64_t t = qsl[s]; t < qsl[s + 1]; ++t) seq_of[t] = s;
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, T * Hkv, 1, [&](int64_t w0, int64_t w1) {
    thread_local std::vector<float> scores;
    thread_local std::vector<int64_t> keys;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t t = w / Hkv, h = w % Hkv, s = seq_of[t];
      const int64_t pos = lens[s] - (qsl[s + 1] - qsl[s]) + (t - qsl[s]);  // the row's own slot position
      const int64_t mask = masks[t];
      const int32_t* table = tables + s * max_blocks;
      keys.clear();  // the slots of the keys this row sees, in order
      for (int64_t j = 0; j <= pos; ++j) {
        const int64_t off = pos - j;
        if (off < MASK_BITS && !((mask >> off) & 1)) continue;
        keys.push_back(table[j / block_size] * block_stride + (j % block_size) * token_stride + h * D);
      }
      const int64_t n = static_cast<int64_t>(keys.size());
      scores.resize(static_cast<size_t>(n));
      for (int64_t g = 0; g < G; ++g) {
        const float* qr = qp + (t * Hq + h * G + g) * D;
        float* o = op + (t * Hq + h * G + g) * D;
        std::fill(o, o + D, 0.f);
        if (n == 0) continue;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < n; ++i) {
          scores[i] = dot(qr, kc + keys[i], D) * sc;
          m = std::max(m, scores[i]);
        }
        float l = 0.f;
        for (int64_t i = 0; i < n; ++i) {
          scores[i] = std::exp(scores[i] - m);
          l += scores[i];
        }
        const float inv = 1.f / l;
        for (int64_t i = 0; i < n; ++i) axpy(scores[i] * inv, vc + keys[i], o, D);
      }
    }
  });
}

at::Tensor tree_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& block_tables, const at::Tensor& seq_lens,
                          const at::Tensor& query_start_loc, const at::Tensor& tree_mask, double scale) {
  const PagedInputs in = paged_inputs("tree_attention", q, k_cache, v_cache, block_tables, seq_lens, query_start_loc);
  TORCH_CHECK(tree_mask.dim() == 1 && tree_mask.size(0) == q.size(0), "tree_attention: one mask per query row");
  auto masks = tree_mask.to(at::kLong).contiguous();
  auto out = at::empty_like(in.q);
  with_cache_type("tree_attention", k_cache, [&](auto c) {
    tree_attention_impl<decltype(c)>(in.q, k_cache, v_cache, in.tables, in.lens, in.qsl, masks, scale, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(workbench_cpu, m) {
  m.def("tree_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_start_loc, Tensor tree_mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(workbench_cpu, CPU, m) { m.impl("tree_attention", &tree_attention); }
