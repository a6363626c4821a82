"""The machine's limit for a decode step, and where the engine stands against it.

A decode step must read every weight once (the tied LM head counted once; the embedding lookup reads only B rows,
ignored) and each sequence's K/V, and must compute 2 FLOPs per weight per token plus attention's QK^T and PV.
Over this machine's measured memory bandwidth and matmul throughput, that gives the floor of a step:
max(bytes / bandwidth, FLOPs / throughput), the throughput of the arithmetic the weights' format runs in (float32,
bf16 dot products, int8 into int32). Batch 1 is memory-bound (weights dominate); as the batch grows the
same weights serve more tokens, until compute binds.
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypedDict

import torch
from torch import nn

from engine import LLM, SamplingParams
from engine.model.linear import Linear
from kernels.cpu.build import has_isa
from workbench.bench.args import add_common_args, add_positive_ints, positive_int, run_with_flags
from workbench.bench.datasets import random_requests, token_id_range
from workbench.bench.decode import WEIGHT_FORMATS, add_weight_formats_arg
from workbench.bench.report import Line, Part, Table, described, formatters, run_settings
from workbench.bench.timing import LoadAverage, load_line, timed

HELP = "a decode step against the machine's bandwidth and matmul floor"
IN_ALL: tuple[int, list[str]] = (7, [])  # `workbench bench all` runs it: (place, flags)


@dataclass(frozen=True)
class ModelCost:
    """What a decode step of one model reads and computes, from its shapes and dtype."""

    num_params: int
    weight_bytes: int  # read once per step, whatever the batch
    linear_flops_per_token: int  # 2 x the weights of every linear layer, the LM head included
    kv_bytes_per_context_token: int  # K and V of one context token, all layers
    attn_flops_per_context_token: int  # QK^T and PV: 2 x 2 x query heads x head dim, all layers
    linear_shapes: dict[tuple[int, int], int]  # (out, in) -> how many linear layers have it

    def step(self, batch: int, context: int) -> tuple[int, int]:
        """(bytes read, FLOPs) of one decode step of `batch` sequences of `context` tokens each."""
        nbytes = self.weight_bytes + batch * context * self.kv_bytes_per_context_token
        flops = batch * (self.linear_flops_per_token + context * self.attn_flops_per_context_token)
        return nbytes, flops


def linear_layers(model: nn.Module) -> list[nn.Linear | Linear]:
    """The model's linear layers in forward order (torch's or the engine's `Linear`, whatever they store)."""
    return [m for m in model.modules() if isinstance(m, (nn.Linear, Linear))]


def model_cost(
    model: nn.Module, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int, kv_element_size: int = 4
) -> ModelCost:
    """The decode cost of `model` (an engine LlamaForCausalLM: parameters shared by tying are counted once, each in
    the dtype it is stored in, int8 weights with their per-row scales)."""
    params = {p.data_ptr(): p for p in model.parameters()}  # tied parameters once
    linears = linear_layers(model)
    scales = [s for m in linears if (s := getattr(m, "weight_scale", None)) is not None]  # the engine's int8 only
    tensors = {**params, **{s.data_ptr(): s for s in scales}}
    embed = model.get_submodule("model.embed_tokens").weight
    assert isinstance(embed, torch.Tensor)  # a Module's attribute types as Tensor | Module
    tied = any(m.weight.data_ptr() == embed.data_ptr() for m in linears)
    stored = sum(t.numel() * t.element_size() for t in tensors.values())
    return ModelCost(
        num_params=sum(p.numel() for p in params.values()),
        weight_bytes=stored - (0 if tied else embed.numel() * embed.element_size()),  # a lookup reads B rows
        linear_flops_per_token=2 * sum(m.weight.numel() for m in linears),
        kv_bytes_per_context_token=2 * num_layers * num_kv_heads * head_dim * kv_element_size,
        attn_flops_per_context_token=2 * 2 * num_layers * num_heads * head_dim,
        linear_shapes=dict(Counter((m.weight.shape[0], m.weight.shape[1]) for m in linears)),
    )


def measure_bandwidth(nbytes: int = 1 << 30, runs: int = 5) -> dict[str, float]:
    """Memory bandwidth (bytes/s), median of `runs` after a warm-up (this machine is shared, and one run reads
    44-74 GB/s from the next), with the engine's threads (torch's intra-op pool): a sum over an fp32 array of
    `nbytes` (read) and a copy into another (read + write, 2 x nbytes moved)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    read = nbytes / timed(src.sum, runs).median_s
    copy = 2 * nbytes / timed(lambda: dst.copy_(src), runs).median_s
    return {"read": read, "copy": copy, "threads": torch.get_num_threads()}


def library_linear(weights: str, m: int, n: int, k: int) -> Callable[[], object]:
    """A call of the library's product in a format's arithmetic, m rows of x by an n x k weight of its own: oneDNN's
    float32 or bf16 GEMM (bf16 where the CPU has AVX512-BF16), torch._int_mm for int8 (int8 in, int32 out: no
    scales, no quantization of x, no bias). The machine's peaks are measured with it at n x n x n, the "torch's
    GEMMs" column at each linear's shape."""
    if weights == "int8":
        xq, wq = torch.randint(-127, 128, (m, k), dtype=torch.int8), torch.randint(-127, 128, (n, k), dtype=torch.int8)
        return partial(torch._int_mm, xq, wq.t())
    onednn = torch.backends.mkldnn.is_available()
    dtype = torch.bfloat16 if weights == "bfloat16" and onednn and has_isa("avx512_bf16") else torch.float32
    x, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
    if onednn:
        return partial(torch.ops.mkldnn._linear_pointwise, x, w, None, "none", [], "")
    return partial(torch.nn.functional.linear, x, w)


def measure_matmul(n: int = 2048, runs: int = 5) -> dict[str, float]:
    """fp32 matmul throughput (FLOP/s) of an n x n by n x n product, median of `runs`: torch's default (MKL) and
    oneDNN with the weight as is (where torch has it); the better one is the machine's compute peak."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    rates = {"mkl": 2 * n**3 / timed(lambda: a @ b, runs).median_s}
    if torch.backends.mkldnn.is_available():
        rates["onednn"] = 2 * n**3 / timed(library_linear("float32", n, n, n), runs).median_s
    return rates


def measure_arithmetic_peaks(fp32_peak: float, n: int = 2048, runs: int = 5) -> dict[str, float]:
    """Each weight format's compute peak (FLOP/s of an n x n by n x n product, median of `runs`) in the arithmetic
    the engine's linear uses for it: float32 FMAs (`fp32_peak`, the better of measure_matmul's); bfloat16 dot
    products (oneDNN's bf16 GEMM) where the C++ op has AVX512-BF16, else float32's, since the weights are then
    widened; int8 products summed in int32 (torch._int_mm, oneDNN's VNNI or AVX2 kernels)."""
    peaks = {"float32": fp32_peak, "bfloat16": fp32_peak}
    if torch.backends.mkldnn.is_available() and has_isa("avx512_bf16"):
        peaks["bfloat16"] = 2 * n**3 / timed(library_linear("bfloat16", n, n, n), runs).median_s
    peaks["int8"] = 2 * n**3 / timed(library_linear("int8", n, n, n), runs).median_s
    return peaks


def measure_machine(bandwidth_bytes: int, matmul_n: int, runs: int) -> dict[str, dict[str, float]]:
    """The machine once: bandwidth, fp32 matmul rates and each format's arithmetic peak."""
    bandwidth = measure_bandwidth(bandwidth_bytes, runs)
    rates = measure_matmul(matmul_n, runs)
    return {
        "bandwidth": bandwidth,
        "rates": rates,
        "peaks": measure_arithmetic_peaks(max(rates.values()), matmul_n, runs),
    }


def best_of(measurements: Sequence[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Each figure's highest over `measurements`: this host's speed drifts (its bf16 peak read 421 and then 220
    GFLOP/s a minute apart, 2026-12-03), and a floor from a slow moment would flatter the steps measured beside it."""
    return {
        kind: {name: max(m[kind][name] for m in measurements) for name in measurements[0][kind]}
        for kind in measurements[0]
    }


@torch.inference_mode()
def time_linears(model: nn.Module, batch: int, runs: int = 5) -> float:
    """Seconds the model's own linear layers take at `batch` rows, one after another as in a step: the weights
    are read from memory as a decode step reads them (all of them exceed the caches), not reused hot from a
    cache, which would put the time below the memory floor. What the matmuls cost without anything around them."""
    layers = linear_layers(model)
    inputs = {m.in_features: torch.randn(batch, m.in_features) for m in layers}
    return timed(lambda: [m(inputs[m.in_features]) for m in layers], runs).median_s


def time_library_linears(model: nn.Module, weights: str, batch: int, runs: int = 5) -> float:
    """Seconds torch's own GEMMs take over the model's linear shapes at `batch` rows, each with its own weight (read
    from memory, as in a step), in the arithmetic of `weights`' peak: what the library gets at these shapes, where
    the floor takes its peak from one large square product."""
    calls = [library_linear(weights, batch, m.out_features, m.in_features) for m in linear_layers(model)]
    return timed(lambda: [call() for call in calls], runs).median_s


class DecodeStep(TypedDict):
    forward_ms: float
    total_ms: float
    context: int  # the tokens each sequence attends to at the middle step


def decode_step_ms(llm: LLM, batch: int, prompt_len: int, steps: int, warmup: int = 2, seed: int = 0) -> DecodeStep:
    """Steady decode of `batch` requests with `prompt_len`-token prompts: after their prefills and `warmup`
    decode steps, the median forward and total ms of `steps` steps in which all of them decode."""
    eng = llm.engine
    reqs = random_requests(batch, (prompt_len, prompt_len), (1, 1), token_id_range(llm.tokenizer), seed)
    # requests whose prefill ends early decode while the others prefill: room for those steps too
    prefill_steps = -(-batch * prompt_len // eng.config.max_num_batched_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=prefill_steps + warmup + steps + 2, ignore_eos=True)
    ids = [eng.add_request(r.prompt_token_ids, params) for r in reqs]
    forward: list[float] = []
    total: list[float] = []
    seen = 0
    while len(forward) < steps and eng.has_unfinished_requests():
        record = eng.step()
        if len(record.scheduled) != batch or any(p != "decode" for p in record.phases.values()):
            continue
        seen += 1
        if seen > warmup:
            forward.append(record.timing["forward"])
            total.append(record.timing["total"])
    for rid in ids:
        eng.abort(rid)
        eng.pop_output(rid)
    if len(forward) < steps:
        raise RuntimeError(
            f"roofline: only {len(forward)} of {steps} steps decoded all {batch} requests "
            "(max_num_seqs or the KV cache too small for the batch?)"
        )
    return {
        "forward_ms": statistics.median(forward),
        "total_ms": statistics.median(total),
        "context": prompt_len + 1 + warmup + steps // 2,
    }


def log_machine(machine: dict[str, dict[str, float]], log: Callable[[str], None]) -> None:
    """One measurement of the machine, as a progress line."""
    bandwidth, rates, peaks = machine["bandwidth"], machine["rates"], machine["peaks"]
    log(
        f"bandwidth {bandwidth['read'] / 1e9:.1f} GB/s read ({bandwidth['threads']:.0f} threads), matmul "
        + ", ".join(f"{name} {rate / 1e9:.0f}" for name, rate in rates.items())
        + " GFLOP/s; each format's arithmetic "
        + ", ".join(f"{name} {rate / 1e9:.0f}" for name, rate in peaks.items())
        + " GFLOP/s"
    )


def run_roofline(
    model: str = "smollm2-135m",
    batch_sizes: Sequence[int] = (1, 8, 64),
    prompt_len: int = 128,
    weight_formats: Sequence[str] = tuple(WEIGHT_FORMATS),
    steps: int = 10,
    runs: int = 5,
    bandwidth_bytes: int = 1 << 30,
    matmul_n: int = 2048,
    seed: int = 0,
    max_num_batched_tokens: int = 2048,
    kv_cache_dtype: str = "auto",
    engine_kwargs: dict[str, Any] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Measure the machine (bandwidth, matmul peak) before and after timing the engine's decode step at each batch
    size, compute the model's per-step cost; returns the floors (from the better of each machine figure) and where
    the engine stands. `kv_cache_dtype` (the engine's): how every format's K and V are stored; the step's bytes
    count them so."""
    load = LoadAverage()
    engine_kwargs = dict(engine_kwargs or {})
    machine = [measure_machine(bandwidth_bytes, matmul_n, runs)]  # again after the steps: the floors take the best
    log_machine(machine[0], log)
    rows: list[dict[str, Any]] = []
    costs = {}
    for weights in weight_formats:
        llm = LLM(
            model=model,
            max_num_batched_tokens=max_num_batched_tokens,
            seed=seed,
            kv_cache_dtype=kv_cache_dtype,
            **{**engine_kwargs, **WEIGHT_FORMATS[weights]},
        )
        model_ = llm.engine.runner.model
        shape = model_.shape
        costs[weights] = cost = model_cost(
            model_,
            shape.num_layers,
            shape.num_heads,
            shape.num_kv_heads,
            shape.head_dim,
            llm.engine.config.kv_cache_torch_dtype.itemsize,
        )
        decode_step_ms(llm, 1, prompt_len, 1, warmup=0, seed=seed)  # first steps pay for allocation: untimed
        for batch in batch_sizes:
            measured = decode_step_ms(llm, batch, prompt_len, steps, seed=seed)
            nbytes, flops = cost.step(batch, measured["context"])
            rows.append(
                {
                    "weights": weights,
                    "kv_cache_dtype": kv_cache_dtype,
                    "batch": batch,
                    **measured,
                    "bytes": nbytes,
                    "flops": flops,
                    "linears_ms": time_linears(model_, batch, runs) * 1e3,
                    "library_ms": time_library_linears(model_, weights, batch, runs) * 1e3,
                }
            )
            log(f"{weights} batch {batch}: forward {measured['forward_ms']:.1f} ms")
        del llm, model_
    machine.append(measure_machine(bandwidth_bytes, matmul_n, runs))
    log_machine(machine[1], log)
    best = best_of(machine)
    bandwidth, rates, peaks = best["bandwidth"], best["rates"], best["peaks"]
    peak = max(rates.values())
    for row in rows:
        memory_ms, compute_ms = row["bytes"] / bandwidth["read"] * 1e3, row["flops"] / peaks[row["weights"]] * 1e3
        row |= {"memory_floor_ms": memory_ms, "compute_floor_ms": compute_ms, "floor_ms": max(memory_ms, compute_ms)}
    first = costs[weight_formats[0]]
    return {
        "model": model,
        "settings": run_settings(run_roofline, locals()),
        "num_params": first.num_params,
        "weight_bytes": {w: c.weight_bytes for w, c in costs.items()},
        "flops_per_token": first.linear_flops_per_token,
        "bandwidth": bandwidth,
        "matmul_flops": peak,
        "matmul_rates": rates,
        "arithmetic_peaks": peaks,
        "machine_before_after": machine,
        "load_average": load.done(),
        "rows": rows,
    }


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser, engine=["kv_cache_dtype"])
    parser.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1, 8, 64])
    add_weight_formats_arg(parser)
    add_positive_ints(parser, prompt_len=128)
    parser.add_argument("--steps", type=positive_int, default=10, help="decode steps timed per batch size")
    parser.add_argument("--bandwidth-mib", type=positive_int, default=1024, help="array size for the bandwidth test")
    parser.add_argument("--matmul-n", type=positive_int, default=2048, help="square matmul size for the compute peak")


def main(args: argparse.Namespace) -> dict[str, Any]:
    """`workbench bench roofline`: run_roofline with the command line's settings."""
    return run_with_flags(run_roofline, args, bandwidth_bytes=args.bandwidth_mib << 20)


_HEADERS = (
    "weights",
    "batch",
    "context",
    "MB read",
    "GFLOP",
    "memory floor ms",
    "compute floor ms",
    "floor ms",
    "linears alone ms",
    "torch's GEMMs ms",
    "forward ms",
    "step ms",
    "forward / floor",
)


def _rows(result: dict[str, Any]) -> list[list[object]]:
    return [
        [
            r.get("weights", "float32")
            + ("" if r.get("kv_cache_dtype", "auto") == "auto" else f", {r['kv_cache_dtype']} KV"),
            r["batch"],
            r["context"],
            r["bytes"] / 1e6,
            r["flops"] / 1e9,
            r["memory_floor_ms"],
            r["compute_floor_ms"],
            r["floor_ms"],
            r["linears_ms"],
            r.get("library_ms", "-"),
            r["forward_ms"],
            r["total_ms"],
            f"{r['forward_ms'] / r['floor_ms']:.2f}x",
        ]
        for r in result["rows"]
    ]


_MACHINE = (
    "{model}: {params_m:.1f} M parameters, weights read per decode step {weight_mb}, {mflop:.0f} MFLOP "
    "per token in linear layers. "
    "Machine: {read_gbs:.1f} GB/s read ({copy_gbs:.1f} "
    "GB/s copy) with {threads} threads, fp32 matmul {gflops:.0f} GFLOP/s ({matmul_n}^3, {rates}); the peak of "
    "each format's own arithmetic ({matmul_n}^3): {peaks} GFLOP/s"
)
_DOCS = _MACHINE + (
    ". Bandwidth: median of {runs} sums over (and copies of) a {array_mib} MiB array. The machine is measured "
    "before the engine's steps and again after them, and each figure is the higher of the two. A step of B "
    "sequences reads every weight once plus their K/V (MB read) and computes 2 FLOPs per linear weight "
    "per token plus attention (GFLOP); floor = max(bytes / read bandwidth, FLOPs / the peak of the format's "
    "arithmetic: float32 FMAs, bf16 dot products (oneDNN's bf16 GEMM, where the CPU has AVX512-BF16; else the "
    "weights are widened and float32's peak counts), int8 products summed in int32 (torch._int_mm)). "
    "Linears alone: the model's own linear layers run one after another at B rows (weights read from "
    "memory, as in a step), without the model around them. Torch's GEMMs: the product each format's peak is "
    "measured with, at the same shapes and rows, one weight per layer (int8: torch._int_mm, without scales or "
    "quantizing the input). Engine: "
    "B requests of {prompt_len}-token prompts in steady decode, median of {steps} steps (forward = "
    "model + LM head; step = the whole engine step).{note}"
)


def _machine_values(result: dict[str, Any]) -> dict[str, float]:
    """The model's and the machine's numbers in the units the text gives them."""
    stored = result["weight_bytes"] if isinstance(result["weight_bytes"], dict) else {"float32": result["weight_bytes"]}
    return {
        "params_m": result["num_params"] / 1e6,
        "weight_mb": ", ".join(f"{w} {n / 1e6:.0f} MB" for w, n in stored.items()),
        "mflop": result["flops_per_token"] / 1e6,
        "read_gbs": result["bandwidth"]["read"] / 1e9,
        "copy_gbs": result["bandwidth"]["copy"] / 1e9,
        "gflops": result["matmul_flops"] / 1e9,
        "array_mib": result["settings"]["bandwidth_bytes"] >> 20,
        "threads": result["bandwidth"].get("threads", "?"),
        "rates": ", ".join(f"{k} {v / 1e9:.0f}" for k, v in result.get("matmul_rates", {}).items()),
        # results from before the per-format peaks: every format's floor was float32's
        "peaks": ", ".join(
            f"{k} {v / 1e9:.0f}" for k, v in result.get("arithmetic_peaks", {"float32": result["matmul_flops"]}).items()
        ),
    }


def _parts(result: dict[str, Any]) -> list[Part]:
    return [
        described(result, _MACHINE, _DOCS, **_machine_values(result)),
        Table(_HEADERS, _rows(result)),
        Line(load_line(result)),
    ]


format_text, format_markdown = formatters("The limit: a decode step against the machine's floor", _parts)
