"""The simulated executor's tables and cost model, against hand arithmetic: parameter counts of the built-in models,
vLLM's KV capacity split, and one step's roofline per operation."""

from __future__ import annotations

from dataclasses import astuple

import pytest

from engine.executor.sim.cost_model import CostModel, ScheduledShape, StepCost
from engine.executor.sim.hardware import Hardware, get_hardware, hardware_table
from engine.executor.sim.model_spec import ModelSpec, builtin_models, load_model_spec


# published sizes: the models' cards give 8.03B, 70.6B, 8.19B, 32.8B and 30.5B (3.3B active)
@pytest.mark.parametrize(
    "name, params, active",
    [
        ("llama-3.1-8b", 8_030_261_248, 8_030_261_248),
        ("llama-3.1-70b", 70_553_706_496, 70_553_706_496),
        ("qwen3-8b", 8_190_735_360, 8_190_735_360),
        ("qwen3-32b", 32_762_123_264, 32_762_123_264),
        ("qwen3-30b-a3b", 30_532_122_624, 3_353_032_704),
    ],
)
def test_builtin_models_have_their_published_sizes(name, params, active) -> None:
    spec = load_model_spec(name)
    assert (spec.num_params(), spec.num_active_params()) == (params, active)


def test_tables_name_what_the_issue_lists() -> None:
    assert set(builtin_models()) == {"llama-3.1-8b", "llama-3.1-70b", "qwen3-8b", "qwen3-32b", "qwen3-30b-a3b"}
    assert set(hardware_table()) == {"h100-sxm", "h200", "a100-80gb", "l4", "cpu"}


def test_local_folder_config(tmp_path, smollm2_path) -> None:
    spec = load_model_spec(smollm2_path)
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.vocab_size) == (30, 9, 3, 64, 49152)
    assert spec.tie_word_embeddings and spec.num_params() == 134_515_008  # SmolLM2-135M, embeddings tied
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "hidden_size": 8}')
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        load_model_spec(tmp_path)
    with pytest.raises(ValueError, match="unknown model 'no-such-model'"):
        load_model_spec("no-such-model")


def test_kv_capacity_as_vllm_splits_memory() -> None:
    """Llama-3.1-70B on 8 H100s: 0.92 (vLLM 0.33's default) x 81559 MiB, minus 1/8 of the split weights plus the
    norms (bf16), minus a
    2048-token forward's activations and 256 rows of float32 logits, minus 2 GiB reserved; blocks of 16 tokens of
    one KV head (8 heads over 8 ranks) x 128 x 2 bytes x K and V x 80 layers."""
    model = CostModel(load_model_spec("llama-3.1-70b"), get_hardware("h100-sxm"), 8, "bfloat16")
    cap = model.kv_capacity(block_size=16)
    replicated = 80 * 2 * 8192 + 8192
    weights = ((70_553_706_496 - replicated) // 8 + replicated) * 2
    activations = 2048 * (2 * 8192 + 1024 + 2 * 128 + 1024 + 3 * 28672 // 8) * 2 + 256 * 128256 * 4
    requested = int(85_520_809_984 * 0.92)
    per_block = 16 * 2 * 128 * 2 * 80
    assert (cap.weight_bytes, cap.activation_bytes, cap.bytes_per_block) == (weights, activations, per_block)
    assert cap.num_blocks == (requested - weights - activations - 2 * 2**30) // per_block + 1 == 89477
    with pytest.raises(ValueError, match="gpu_memory_utilization"):  # 141 GB of weights on one 24 GB L4
        CostModel(load_model_spec("llama-3.1-70b"), get_hardware("l4"), 1, "bfloat16").kv_capacity(16)


def _tiny() -> tuple[ModelSpec, Hardware]:
    spec = ModelSpec(
        name="t",
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        vocab_size=256,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    hw = get_hardware(
        {
            "memory_bytes": 10**9,
            "memory_bandwidth": 1e9,
            "flops": {"float32": 1e9},
            "interconnect_bandwidth": 1e8,
            "interconnect_latency_s": 1e-6,
        }
    )
    return spec, hw


def test_decode_step_is_memory_bound_by_hand() -> None:
    """One decode (context 10) at 1 GB/s and 1 GFLOP/s, fp32: per layer 36864 linear weights (q, o: 64x64; k, v:
    64x32; MLP 3 x 64x128) read as 147456 bytes plus 832 activations per token x 4 bytes (> 73728 FLOPs), attention
    reads 11 tokens of K and V (2 x 32 x 4 bytes each) plus q in and out (3328 bytes > 2816 FLOPs), the LM head
    reads 64x256 weights and writes 256 logits, sampling reads the logits 3 times."""
    spec, hw = _tiny()
    cost = CostModel(spec, hw, 1, "float32").step_cost([ScheduledShape(10, 1, 1)])
    expected = StepCost(
        linears_s=(2 * 150784 + 256) * 1e-9,
        attention_s=2 * 3328e-9,
        lm_head_s=66560e-9,
        communication_s=0.0,
        overhead_s=0.0,
        sampling_s=3072e-9,
    )
    assert astuple(cost) == pytest.approx(astuple(expected), rel=1e-12)
    assert cost.total_s == pytest.approx(378.112e-6, rel=1e-12)


def test_prefill_is_compute_bound_and_tp_adds_collectives() -> None:
    spec, hw = _tiny()
    prefill = CostModel(spec, hw, 1, "float32").step_cost([ScheduledShape(0, 1000, 1)])
    # 2 x 1000 x 36864 FLOPs per layer; causal attention 4 x 4 heads x 16 x 1000 x 1001 / 2 FLOPs per layer
    assert prefill.linears_s == pytest.approx(2 * 73.728e-3 + 1000 * 64 * 4e-9, rel=1e-12)
    assert prefill.attention_s == pytest.approx(2 * 128.128e-3, rel=1e-12)
    tp2 = CostModel(spec, hw, 2, "float32").step_cost([ScheduledShape(10, 1, 1)])
    # 2 layers x 2 all-reduces of 64 x 4 bytes (ring: 2 (tp-1)/tp = 1 x bytes / 1e8 + 1 us), then an all-gather of
    # 256 float32 logits (1/2 x 1024 bytes / 1e8 + 1 us)
    assert tp2.communication_s == pytest.approx(4 * (2.56e-6 + 1e-6) + 5.12e-6 + 1e-6, rel=1e-12)
    with pytest.raises(ValueError, match="tensor_parallel_size: 3"):
        CostModel(spec, hw, 3, "float32")


def test_efficiency_and_overheads_apply() -> None:
    spec, hw = _tiny()
    slow = get_hardware(
        {
            **hw.to_dict(),
            "name": "slow",
            "efficiency": {
                "memory": 0.5,
                "step_overhead_s": 1e-3,
                "request_overhead_s": 1e-4,
                "token_overhead_s": 1e-5,
            },
        }
    )
    base = CostModel(spec, hw, 1, "float32").step_cost([ScheduledShape(10, 1, 1), ScheduledShape(20, 1, 1)])
    cost = CostModel(spec, slow, 1, "float32").step_cost([ScheduledShape(10, 1, 1), ScheduledShape(20, 1, 1)])
    assert cost.overhead_s == pytest.approx(1e-3 + 2e-4 + 2e-5)
    assert cost.sampling_s == pytest.approx(2 * base.sampling_s)  # memory-bound: half the bandwidth, twice the time
    with pytest.raises(ValueError, match="hardware.efficiency.memory"):
        get_hardware({**hw.to_dict(), "efficiency": {"memory": 1.5}})
    with pytest.raises(ValueError, match="hardware.memory_bandwidth: required"):
        get_hardware({"memory_bytes": 1, "flops": {"float32": 1.0}, "interconnect_bandwidth": 1.0})
    with pytest.raises(ValueError, match="hardware: must be one of"):
        get_hardware("tpu-v9")


def test_gemm_fill_rows_price_small_gemms_by_hand() -> None:
    """A GEMM of M rows costs as M + gemm_fill_rows (its tiles' unfilled rows); up to gemv_max_rows rows a linear is
    a GEMV and fills nothing. At 1 GFLOP/s, fill 16 above 8 rows: 9 decodes compute 2 x (9 + 16) x 36864 FLOPs per
    layer (1.8432 ms; its 177408 bytes take less) and the LM head 2 x (9 + 16) x 64 x 256; 8 decodes are priced as
    without the term."""
    spec, hw = _tiny()
    filled = get_hardware({**hw.to_dict(), "name": "filled", "efficiency": {"gemm_fill_rows": 16, "gemv_max_rows": 8}})
    nine, eight = [ScheduledShape(10, 1, 1)] * 9, [ScheduledShape(10, 1, 1)] * 8
    cost = CostModel(spec, filled, 1, "float32").step_cost(nine)
    assert cost.linears_s == pytest.approx(2 * 1.8432e-3 + 9 * 64 * 4e-9, rel=1e-12)
    assert cost.lm_head_s == pytest.approx(0.8192e-3, rel=1e-12)
    plain = CostModel(spec, hw, 1, "float32").step_cost(nine)
    assert (plain.linears_s, plain.lm_head_s) == pytest.approx((2 * 663.552e-6 + 9 * 64 * 4e-9, 294.912e-6), rel=1e-12)
    assert CostModel(spec, filled, 1, "float32").step_cost(eight) == CostModel(spec, hw, 1, "float32").step_cost(eight)
    with pytest.raises(ValueError, match="hardware.efficiency.gemm_fill_rows"):
        get_hardware({**hw.to_dict(), "efficiency": {"gemm_fill_rows": -1}})
