"""kernels.llama_decoder_layers: the Llama decoder layers of a step of a few rows as one C++ call. It calls the same
ops in the same order as the layers' modules do one by one, so everything it makes must be bit for bit theirs: the
logprobs of every sampled token, in every weight format, for decodes and short prefills of several sequences, and
the EAGLE-3 states read between layers."""

from __future__ import annotations

import pytest
import torch

import kernels
from engine import LLM, SamplingParams
from kernels import reference
from kernels.cpu import ops
from kernels.cpu.build import available

pytestmark = pytest.mark.skipif(not available(), reason="the C++ CPU ops are not built here (no compiler?)")

FORMATS = {"float32": {}, "bfloat16": {"dtype": "bfloat16"}, "int8": {"quantization": "int8"}}
# three prompts of three tokens: a first step of 9 rows (<= SMALL_M) from three sequences, then decodes of 3 rows;
# the fourth prompt is longer than SMALL_M: its prefill is fused too (the GEMMs over packed panels and paged
# attention's prefill tiles in the one call)
PROMPTS = [[11, 12, 13], [21, 22, 23], [31, 32, 33], list(range(100, 130))]


def _generate(llm: LLM, fused: bool, monkeypatch) -> list[list[dict[int, float]]]:
    monkeypatch.setattr(kernels, "FUSED_LAYERS", fused)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    outputs = llm.generate([list(p) for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].logprobs for o in outputs]


@pytest.mark.parametrize("weights", FORMATS)
def test_fused_layers_are_bit_for_bit_the_ops_one_by_one(tiny_model_path, weights, monkeypatch):
    llm = LLM(model=str(tiny_model_path), seed=0, enable_prefix_caching=False, **FORMATS[weights])
    calls = []
    fused_op = ops.llama_decoder_layers

    def counted(*args):
        out = fused_op(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setitem(kernels._IMPLS, ("llama_decoder_layers", "cpu"), counted)  # what kernels dispatches to
    fused = _generate(llm, True, monkeypatch)
    assert calls and all(calls)  # every step fused, the 30-token prefill too
    calls.clear()
    by_op = _generate(llm, False, monkeypatch)
    assert not calls
    assert fused == by_op  # exact floats, not close ones


def test_runs_end_at_eagle3_layers_and_states_match(tiny_model_path, monkeypatch):
    llm = LLM(model=str(tiny_model_path), seed=0, enable_prefix_caching=False)
    model = llm.engine.runner.model
    assert model.model.layer_runs() == [(0, 4, True)]  # one call for the whole stack
    model.set_aux_hidden_state_layers((1, 2))
    assert model.model.layer_runs() == [(0, 1, True), (1, 2, True), (2, 4, True)]
    states = {}
    for fused in (True, False):
        logprobs = _generate(llm, fused, monkeypatch)
        states[fused] = (logprobs, model.model.aux_hidden_states.clone())
    assert torch.equal(states[True][1], states[False][1]) and states[True][0] == states[False][0]


def test_gathered_tensors_are_forgotten_where_weights_are_replaced(tiny_model_path, monkeypatch):
    from engine.model.llama import iter_safetensors

    llm = LLM(model=str(tiny_model_path), seed=0)
    model = llm.engine.runner.model
    _generate(llm, True, monkeypatch)
    assert model.model._run_params  # gathered at the first fused step
    model.load_weights(iter_safetensors(tiny_model_path))
    assert not model.model._run_params
    _generate(llm, True, monkeypatch)
    model.store_weights(torch.float32)
    assert not model.model._run_params


def _stack_args(llm: LLM, num_layers: int, rows: int, hidden_dtype=torch.float32, params=None, kv_caches=None):
    """kernels.cpu.ops.llama_decoder_layers' arguments for the model's first `num_layers` layers over `rows` tokens
    of one sequence, its KV written to slots 0.. of block 0 (to no slot where `kv_caches` are the engine's own)."""
    model = llm.engine.runner.model
    layers = model.model.layers[:num_layers]
    attention = layers[0].self_attn
    engine_caches = [c for layer_caches in llm.engine.runner.kv_caches[:num_layers] for c in layer_caches]
    return (
        torch.randn(rows, model.config.hidden_size, dtype=hidden_dtype),
        None,
        [p for layer in layers for p in layer.fused_params()] if params is None else params,
        engine_caches if kv_caches is None else kv_caches,
        model.model.rotary_emb(torch.arange(rows), torch.float32),
        torch.full((rows,), -1) if kv_caches is None else torch.arange(rows),
        torch.zeros(1, rows, dtype=torch.int32),  # block 0 for each block the rows cover (with room to spare)
        torch.tensor([rows], dtype=torch.int32),
        torch.tensor([0, rows], dtype=torch.int32),
        None,
        attention.num_heads,
        attention.num_kv_heads,
        attention.scale,
        1e-5,
    )


def test_fused_layers_are_left_to_the_ops_where_they_would_not_all_run(tiny_model_path):
    llm = LLM(model=str(tiny_model_path), seed=0)
    assert llm.engine.runner.model.model.layers[0].fusable
    params = llm.engine.runner.model.model.layers[0].fused_params()
    caches = list(llm.engine.runner.kv_caches[0])
    assert ops.llama_decoder_layers(*_stack_args(llm, 1, 1)) is not None
    # float32 and int8 linears take any number of rows; the bf16 op up to BF16_ROW_LIMIT (any number where the CPU
    # has AVX512-BF16; the fused steps of that many rows: test_fused_layers_are_bit_for_bit_the_ops_one_by_one)
    assert ops.llama_decoder_layers(*_stack_args(llm, 1, ops.SMALL_M + 1)) is not None
    # each linear's (weight, scale, bias, packed panels) at 1, 5, 10 and 14; float32 panels go with float32 weights
    bf16 = [
        p.to(torch.bfloat16) if i in (1, 5, 10, 14) else None if i in (4, 8, 13, 17) else p
        for i, p in enumerate(params)
    ]
    assert ops.fused_row_limit(bf16) == ops.BF16_ROW_LIMIT and ops.fused_row_limit(params) == ops.ANY_ROWS
    assert kernels.fused_row_limit(params) == ops.ANY_ROWS and reference.fused_row_limit(params) == 0
    # a caller's kept limit stands in for the dtypes' (LlamaModel works it out once for the params it keeps)
    assert ops.llama_decoder_layers(*_stack_args(llm, 1, 2), 1) is None
    assert ops.llama_decoder_layers(*_stack_args(llm, 1, 2), 2) is not None
    assert ops.llama_decoder_layers(*_stack_args(llm, 1, 1, hidden_dtype=torch.bfloat16)) is None
    float16_linear = [*params[:1], params[1].to(torch.float16), *params[2:]]
    assert ops.llama_decoder_layers(*_stack_args(llm, 1, 1, params=float16_linear)) is None
    # int8 weights go to the W8A8 op only with their scales, and the other ops take none
    unscaled_int8 = [*params[:1], params[1].to(torch.int8), *params[2:]]
    assert ops.llama_decoder_layers(*_stack_args(llm, 1, 1, params=unscaled_int8)) is None
    scaled_bf16 = [*params[:1], params[1].to(torch.bfloat16), torch.ones(params[1].shape[0]), *params[3:]]
    assert ops.llama_decoder_layers(*_stack_args(llm, 1, 1, params=scaled_bf16)) is None
    no_norm = [None, *params[1:]]
    assert ops.llama_decoder_layers(*_stack_args(llm, 1, 1, params=no_norm)) is None
    float16_caches = [c.to(torch.float16) for c in caches]
    assert ops.llama_decoder_layers(*_stack_args(llm, 1, 1, kv_caches=float16_caches)) is None


def test_the_fake_kernel_gives_the_ops_shapes_and_declares_the_cache_writes(tiny_model_path):
    """torch.compile traces the op by its fake kernel (kernels/cpu/fake.py): opcheck runs both and compares them,
    and checks that the op writes only the caches its schema says it writes."""
    llm = LLM(model=str(tiny_model_path), seed=0)
    caches = [c.clone() for layer_caches in llm.engine.runner.kv_caches[:2] for c in layer_caches]
    hidden, residual, params, kv_caches, (cos, sin), *rest = _stack_args(llm, 2, 3, kv_caches=caches)
    op = torch.ops.workbench_cpu.llama_decoder_layers.default
    torch.library.opcheck(op, (hidden, residual, params, kv_caches, cos, sin, *rest))


def test_a_draft_tree_verification_fuses_with_its_mask(tiny_model_path, monkeypatch):
    from engine.model.attention import AttentionMetadata

    llm = LLM(model=str(tiny_model_path), seed=0)
    model, kv_caches = llm.engine.runner.model, llm.engine.runner.kv_caches
    # four new tokens, a tree: 1 and 2 are children of 0, 3 a child of 1; bit d of a row's mask: it sees the row d
    # before it (bit 0: itself)
    masks = {"tree": torch.tensor([0b1, 0b11, 0b101, 0b1101]), "causal": None}
    input_ids, positions = torch.tensor([5, 6, 7, 8]), torch.tensor([0, 1, 1, 2])

    def forward(fused: bool, mask: torch.Tensor | None) -> torch.Tensor:
        monkeypatch.setattr(kernels, "FUSED_LAYERS", fused)
        attn = AttentionMetadata(
            slot_mapping=torch.arange(4),
            block_tables=torch.tensor([[0]], dtype=torch.int32),
            seq_lens=torch.tensor([4], dtype=torch.int32),
            query_start_loc=torch.tensor([0, 4], dtype=torch.int32),
            tree_mask=mask,
        )
        return model(input_ids, positions, attn, kv_caches)

    calls = []
    fused_op = ops.llama_decoder_layers
    monkeypatch.setitem(kernels._IMPLS, ("llama_decoder_layers", "cpu"), lambda *a: calls.append(1) or fused_op(*a))
    tree = forward(True, masks["tree"])
    assert calls
    assert torch.equal(tree, forward(False, masks["tree"]))
    assert not torch.equal(tree[2:], forward(True, masks["causal"])[2:])  # rows 2 and 3 see another past
