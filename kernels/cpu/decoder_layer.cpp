// A run of Llama-family decoder layers for a step, in one call from Python: in each layer the input
// norm (with the residual add), q/k/v, RoPE, the paged KV write, paged attention, o_proj, the post-attention norm,
// gate/up, SiLU and down. It computes nothing itself: it calls this library's own ops, in the order and with the
// arguments that engine/model/llama.py's LlamaDecoderLayer gives them one by one, so its result is bit for bit that
// path's (tests/model/test_decoder_layer.py). What it saves is Python: at one token a step of smollm2-135m made some
// 300 op calls from Python, each through a module, a dispatching function and torch's op lookup, several
// microseconds apiece against a kernel of tens; here the whole stack is one call (a few where EAGLE-3 reads the
// residual stream between layers) and the ops meet through the C++ dispatcher.
// kernels/cpu/ops.py says when it applies (float32 activations; any number of rows over float32 and int8 weights, up
// to its BF16_ROW_LIMIT over bfloat16; no sliding window, q/k norm or TP). A draft tree's verification passes its mask, and each
// layer attends with tree_attention instead.
#include <torch/extension.h>

#include <ATen/core/dispatch/Dispatcher.h>

namespace {

using OptTensor = c10::optional<at::Tensor>;

template <typename Sig>
c10::TypedOperatorHandle<Sig> workbench_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// the linear op kernels/cpu/ops.py's linear picks for float32 input, by how the weight is stored; `packed`: its
// panels for the GEMM, where the layer keeps them (Linear.weight_packed)
at::Tensor linear(const at::Tensor& x, const OptTensor& weight, const OptTensor& scale, const OptTensor& bias,
                  const OptTensor& packed) {
  static const auto w8a8 = workbench_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                   const OptTensor&, const OptTensor&)>("workbench_cpu::linear_w8a8");
  static const auto bf16 = workbench_op<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&,
                                                   const OptTensor&)>("workbench_cpu::linear_bf16");
  static const auto f32 = workbench_op<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&,
                                                  const OptTensor&, const OptTensor&)>("workbench_cpu::linear_f32");
  const at::Tensor& w = *weight;
  if (w.scalar_type() == at::kChar) return w8a8.call(x, w, *scale, bias, packed);
  if (w.scalar_type() == at::kBFloat16) return bf16.call(x, w, bias, packed);
  return f32.call(x, w, scale, bias, packed);
}

constexpr size_t PARAMS_PER_LAYER = 18;

// One layer. p(i): input_layernorm, then q/k/v's weight, scale, bias and packed panels, o_proj's four,
// post_attention_layernorm, gate/up's four, down's four (None where a linear has no scale, bias or panels):
// LlamaDecoderLayer.fused_params's order.
template <typename P>
std::tuple<at::Tensor, at::Tensor> decoder_layer(const at::Tensor& hidden, const OptTensor& residual, const P& p,
                                                 const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                                                 at::Tensor& v_cache, const at::Tensor& slot_mapping,
                                                 const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                                 const at::Tensor& query_start_loc, const OptTensor& tree_mask,
                                                 int64_t num_heads, int64_t num_kv_heads, double scale, double eps) {
  using Pair = std::tuple<at::Tensor, at::Tensor>;
  static const auto rms_norm =
      workbench_op<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("workbench_cpu::rms_norm");
  static const auto add_rms_norm = workbench_op<Pair(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>(
      "workbench_cpu::fused_add_rms_norm");
  static const auto rotary = workbench_op<Pair(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&)>("workbench_cpu::rotary");
  static const auto store = workbench_op<void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                                              const at::Tensor&)>("workbench_cpu::store_kvcache");
  static const auto attention =
      workbench_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, const at::Tensor&, double)>("workbench_cpu::paged_attention");
  static const auto tree_attention =
      workbench_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>(
          "workbench_cpu::tree_attention");
  static const auto silu_and_mul = workbench_op<at::Tensor(const at::Tensor&)>("workbench_cpu::silu_and_mul");
  const int64_t T = hidden.size(0), D = cos.size(1), q_size = num_heads * D, kv_size = num_kv_heads * D;

  at::Tensor h, res;
  if (residual.has_value()) {
    std::tie(h, res) = add_rms_norm.call(hidden, *residual, *p(0), eps);
  } else {
    h = rms_norm.call(hidden, *p(0), eps);
    res = hidden;
  }
  const at::Tensor qkv = linear(h, p(1), p(2), p(3), p(4));
  const at::Tensor q = qkv.narrow(1, 0, q_size).view({T, num_heads, D});
  const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, num_kv_heads, D});
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads, D});
  const auto [q_rot, k_rot] = rotary.call(q, k, cos, sin);
  store.call(k_rot, v, k_cache, v_cache, slot_mapping);
  const at::Tensor out =
      tree_mask.has_value()
          ? tree_attention.call(q_rot, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *tree_mask, scale)
          : attention.call(q_rot, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale);
  const at::Tensor attn_out = linear(out.reshape({T, q_size}), p(5), p(6), p(7), p(8));
  std::tie(h, res) = add_rms_norm.call(attn_out, res, *p(9), eps);
  const at::Tensor gate_up = linear(h, p(10), p(11), p(12), p(13));
  return {linear(silu_and_mul.call(gate_up), p(14), p(15), p(16), p(17)), res};
}

// The layers of `params` (PARAMS_PER_LAYER each) in turn, layer i over kv_caches[2i], kv_caches[2i + 1]; the
// residual stream enters as `residual` (None before the first layer of the model) and leaves as the second result.
std::tuple<at::Tensor, at::Tensor> llama_decoder_layers(
    const at::Tensor& hidden, const OptTensor& residual, const c10::List<OptTensor>& params,
    const at::TensorList kv_caches, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
    const OptTensor& tree_mask, int64_t num_heads, int64_t num_kv_heads, double scale, double eps) {
  const size_t layers = params.size() / PARAMS_PER_LAYER;
  TORCH_CHECK(layers > 0 && params.size() == layers * PARAMS_PER_LAYER && kv_caches.size() == 2 * layers,
              "llama_decoder_layers: ", PARAMS_PER_LAYER, " params and 2 caches per layer, got ", params.size(),
              " and ", kv_caches.size());
  at::Tensor h = hidden;
  OptTensor res = residual;
  for (size_t i = 0; i < layers; ++i) {
    const auto p = [&](size_t j) { return params.get(i * PARAMS_PER_LAYER + j); };
    at::Tensor k_cache = kv_caches[2 * i], v_cache = kv_caches[2 * i + 1];  // handles to the caches, written in place
    auto [out, new_res] = decoder_layer(h, res, p, cos, sin, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
                                        query_start_loc, tree_mask, num_heads, num_kv_heads, scale, eps);
    h = std::move(out);
    res = std::move(new_res);
  }
  return {h, *res};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(workbench_cpu, m) {
  m.def(
      "llama_decoder_layers(Tensor hidden, Tensor? residual, Tensor?[] params, Tensor(a!)[] kv_caches, Tensor cos, "
      "Tensor sin, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, "
      "Tensor? tree_mask, int num_heads, int num_kv_heads, float scale, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(workbench_cpu, CPU, m) { m.impl("llama_decoder_layers", &llama_decoder_layers); }
