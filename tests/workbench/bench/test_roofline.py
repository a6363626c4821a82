"""The roofline: the model's per-step cost from its shapes, the machine measurements, and a reduced run on
tiny-llama through the CLI. No timed assertions."""

import pytest
import torch
from torch import nn

from kernels.cpu.build import has_isa
from workbench.bench import roofline
from workbench.cli import main


class _Toy(nn.Module):
    """Two linear layers, an embedding and a norm, with the LM head tied or not."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(100, 8)
        self.model.norm = nn.LayerNorm(8, bias=False)
        self.model.up = nn.Linear(8, 16, bias=False)
        self.model.down = nn.Linear(16, 8, bias=False)
        self.lm_head = nn.Linear(8, 100, bias=False)
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight


@pytest.mark.parametrize("tied", [True, False])
def test_model_cost_counts_each_weight_read_once(tied):
    cost = roofline.model_cost(_Toy(tied), num_layers=2, num_heads=4, num_kv_heads=2, head_dim=2)
    # read per step: norm + up + down + the LM head (the embedding lookup only reads B rows)
    assert cost.weight_bytes == 4 * (8 + 128 + 128 + 800)
    assert cost.num_params == (8 + 128 + 128 + 800) + (0 if tied else 800)
    assert cost.linear_flops_per_token == 2 * (128 + 128 + 800)
    assert cost.kv_bytes_per_context_token == 2 * 2 * 2 * 2 * 4
    assert cost.attn_flops_per_context_token == 2 * 2 * 2 * 4 * 2
    assert cost.linear_shapes == {(16, 8): 1, (8, 16): 1, (100, 8): 1}
    nbytes, flops = cost.step(batch=3, context=10)
    assert nbytes == cost.weight_bytes + 3 * 10 * 64 and flops == 3 * (2112 + 10 * 64)


def test_machine_measurements_are_positive_rates():
    bandwidth = roofline.measure_bandwidth(1 << 22, runs=1)
    assert bandwidth["read"] > 1e6 and bandwidth["copy"] > 1e6
    rates = roofline.measure_matmul(64, runs=1)
    assert "mkl" in rates and all(rate > 1e6 for rate in rates.values())
    peaks = roofline.measure_arithmetic_peaks(123.0, 64, runs=1)
    assert set(peaks) == {"float32", "bfloat16", "int8"} and peaks["float32"] == 123.0
    assert peaks["int8"] > 1e6
    # without AVX512-BF16 the engine widens bf16 weights: float32's arithmetic and peak
    assert peaks["bfloat16"] > 1e6 if has_isa("avx512_bf16") else peaks["bfloat16"] == 123.0


def test_the_floors_take_each_machine_figure_at_its_best_of_before_and_after():
    before = {"bandwidth": {"read": 30e9, "copy": 20e9}, "peaks": {"bfloat16": 220e9, "int8": 700e9}}
    after = {"bandwidth": {"read": 25e9, "copy": 24e9}, "peaks": {"bfloat16": 421e9, "int8": 600e9}}
    assert roofline.best_of([before, after]) == {
        "bandwidth": {"read": 30e9, "copy": 24e9},
        "peaks": {"bfloat16": 421e9, "int8": 700e9},
    }


def test_reduced_roofline_through_the_cli(tmp_path, capsys):
    doc = tmp_path / "BENCHMARKS.md"
    argv = [
        "bench",
        "roofline",
        "--model",
        "tiny-llama",
        "--num-kv-blocks",
        "256",
        "--batch-sizes",
        "1",
        "3",
        "--prompt-len",
        "8",
        "--steps",
        "2",
        "--runs",
        "1",
        "--bandwidth-mib",
        "4",
        "--matmul-n",
        "64",
        "--write-docs",
        "--docs-path",
        str(doc),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "weights read per decode step float32" in out and "forward / floor" in out and "torch's GEMMs ms" in out
    assert "<!-- bench:roofline:start -->" in doc.read_text()


def test_a_bfloat16_kv_cache_halves_the_bytes_a_step_reads_beyond_its_weights():
    def run(kv_cache_dtype: str) -> dict:
        return roofline.run_roofline(
            model="tiny-llama",
            batch_sizes=(2,),
            prompt_len=8,
            weight_formats=("float32",),
            steps=2,
            runs=1,
            bandwidth_bytes=4 << 20,
            matmul_n=64,
            kv_cache_dtype=kv_cache_dtype,
            engine_kwargs={"num_kv_blocks": 64},
            log=lambda line: None,
        )

    full, half = run("auto"), run("bfloat16")
    weights = full["weight_bytes"]["float32"]
    assert half["weight_bytes"]["float32"] == weights
    (row_full,), (row_half,) = full["rows"], half["rows"]
    assert row_full["context"] == row_half["context"]
    assert row_full["bytes"] - weights == 2 * (row_half["bytes"] - weights) > 0
    assert "| float32, bfloat16 KV | 2 |" in roofline.format_markdown(half, "workbench bench roofline")


@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int8"])
def test_torchs_gemm_beside_each_format_is_the_product_its_peak_is_measured_with(weights):
    """The column "torch's GEMMs": the library's product at the linear's shape, in the format's arithmetic."""
    out = roofline.library_linear(weights, 3, 96, 64)()
    expected = {"float32": torch.float32, "int8": torch.int32}.get(weights)
    if expected is None:  # bf16 products where the CPU has them (else the weights would be widened to float32)
        expected = torch.bfloat16 if torch.backends.mkldnn.is_available() and has_isa("avx512_bf16") else torch.float32
    assert out.shape == (3, 96) and out.dtype == expected


def test_roofline_floor_is_the_larger_bound():
    result = roofline.run_roofline(
        model="tiny-llama",
        batch_sizes=(2,),
        prompt_len=8,
        steps=2,
        runs=1,
        weight_formats=("float32", "int8"),
        bandwidth_bytes=1 << 22,
        matmul_n=64,
        engine_kwargs={"num_kv_blocks": 256},
        log=lambda _: None,
    )
    fp32, int8 = result["rows"]
    assert (fp32["weights"], int8["weights"]) == ("float32", "int8") and int8["bytes"] < fp32["bytes"] / 2
    row = fp32
    assert row["floor_ms"] == max(row["memory_floor_ms"], row["compute_floor_ms"]) > 0
    # the machine measured before and after the steps; the floors take the better of each figure
    assert len(result["machine_before_after"]) == 2
    assert result["arithmetic_peaks"] == roofline.best_of(result["machine_before_after"])["peaks"]
    # each format's compute floor is at its own arithmetic's peak
    for r in (fp32, int8):
        assert r["compute_floor_ms"] == pytest.approx(r["flops"] / result["arithmetic_peaks"][r["weights"]] * 1e3)
    assert row["context"] == 8 + 1 + 2 + 1 and row["forward_ms"] > 0 and row["total_ms"] >= row["forward_ms"]
    assert (
        result["weight_bytes"]["float32"] == result["num_params"] * torch.float32.itemsize
    )  # tiny-llama ties its head
