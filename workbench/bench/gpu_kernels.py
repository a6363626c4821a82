"""The Triton kernels on a CUDA GPU: first checked against their torch references in bf16, then timed.

Timings are medians of many runs after warm-up (`triton.testing.do_bench`, CUDA events, L2 flushed between
runs): decode attention's achieved bandwidth (batch 256, 4k contexts) against the device-to-device copy
bandwidth measured on the same GPU, prefill attention's TFLOP/s, the KV cache write's bandwidth, and rejection
sampling; then the whole engine's throughput on the model against transformers `generate` on the same GPU
(bf16 both). Refuses to run without CUDA.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from workbench.bench.args import add_common_args, positive_int, run_with_flags
from workbench.bench.report import (
    Line,
    Part,
    Table,
    docs_only,
    machine_info,
    markdown_report,
    run_settings,
    text_report,
)
from workbench.bench.timing import alternate

HELP = "the Triton kernels on a CUDA GPU: checks, timings, engine vs transformers"
NO_CUDA = "bench gpu_kernels needs a CUDA GPU (torch.cuda.is_available() is False)"
BF16_REL_ERROR = 2e-2  # max |triton - reference| / max |reference|, reference in fp32 on the same bf16 inputs
DECODE_BANDWIDTH_GOAL = 0.6
# transformers static batches on the GPU: larger than the CPU bench's 8, which would leave the GPU idle.
HF_BATCH_SIZE = 32


@dataclass(frozen=True)
class AttentionShape:
    """The head layout of one attention workload."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16


SHAPES = (
    AttentionShape("llama-8b heads (32/8 x 128)", 32, 8, 128),
    AttentionShape("smollm2 heads (9/3 x 64)", 9, 3, 64),
)


def paged_case(
    q_lens: list[int], seq_lens: list[int], shape: AttentionShape, dtype: torch.dtype, device: str = "cuda"
) -> dict[str, Any]:
    """Random queries and a random KV cache behind scrambled block tables (arguments of `paged_attention`)."""
    bs = shape.block_size
    blocks = [-(-n // bs) for n in seq_lens]
    perm = torch.randperm(sum(blocks)).to(torch.int32)
    block_tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    for s, start in enumerate([0, *torch.tensor(blocks).cumsum(0).tolist()[:-1]]):
        block_tables[s, : blocks[s]] = perm[start : start + blocks[s]]
    cache_shape = (sum(blocks), bs, shape.num_kv_heads, shape.head_dim)
    return dict(
        q=torch.randn(sum(q_lens), shape.num_heads, shape.head_dim, dtype=dtype, device=device),
        k_cache=torch.randn(cache_shape, dtype=dtype, device=device),
        v_cache=torch.randn(cache_shape, dtype=dtype, device=device),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device),
        scale=shape.head_dim**-0.5,
    )


def _rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max())


def _attention_checks(shape: AttentionShape) -> list[dict[str, Any]]:
    from kernels import reference
    from kernels import triton as kt

    mixed = paged_case([1, 1, 1, 37, 64, 5, 1], [1, 17, 2000, 37, 300, 129, 4096], shape, torch.bfloat16)
    decode = paged_case([1] * 8, [1, 15, 16, 17, 1000, 2048, 3001, 4096], shape, torch.bfloat16)
    rows = []
    for case_name, case, splits in (
        ("mixed batch", mixed, 1),
        ("mixed batch, 4 KV splits", mixed, 4),
        ("decode, 8 KV splits", decode, 8),
        ("decode, wrapper's choice", decode, None),
    ):
        fp32 = {k: v.float() if k in ("q", "k_cache", "v_cache") else v for k, v in case.items()}
        ref = reference.paged_attention(**fp32)
        out = (
            kt.paged_attention(**case)
            if splits is None
            else kt.attention.unified_attention(**case, num_kv_splits=splits)
        )
        err = _rel_error(out, ref)
        rows.append(
            {
                "kernel": "paged_attention",
                "case": f"{shape.name}, {case_name}",
                "error": err,
                "bound": BF16_REL_ERROR,
                "ok": err <= BF16_REL_ERROR,
            }
        )
    return rows


def _cache_check() -> dict[str, Any]:
    from kernels import reference
    from kernels import triton as kt

    qkv = torch.randn(300, 48 * 128, dtype=torch.bfloat16, device="cuda")
    key, value = qkv[:, 32 * 128 : 40 * 128].view(300, 8, 128), qkv[:, 40 * 128 :].view(300, 8, 128)
    slots = torch.randperm(64 * 16, device="cuda")[:300]
    slots[::7] = -1
    caches = [torch.zeros(64, 16, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    reference.store_kvcache(key, value, caches[0], caches[1], slots)
    kt.store_kvcache(key, value, caches[2], caches[3], slots)
    same = torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    return {
        "kernel": "store_kvcache",
        "case": "bf16 strided views, slot -1",
        "error": 0.0 if same else float("inf"),
        "bound": 0.0,
        "ok": same,
    }


def rejection_case(
    batch_size: int, max_spec_len: int, vocab_size: int, ngram: bool, device: str = "cuda"
) -> dict[str, Any]:
    """Arguments of `rejection_sample`: random distributions, greedy and random requests, some with no drafts."""
    from kernels import reference

    counts = torch.randint(0, max_spec_len + 1, (batch_size,)).tolist()
    counts[0] = max_spec_len
    n = sum(counts)
    target = torch.randn(n, vocab_size, device=device).mul_(3).softmax(-1)
    draft = torch.randn(n, vocab_size, device=device).mul_(3).softmax(-1)
    return dict(
        draft_token_ids=torch.multinomial(draft, 1)[:, 0].to(torch.int32),
        cu_num_draft_tokens=torch.tensor(counts, device=device).cumsum(0).to(torch.int32),
        draft_probs=None if ngram else draft,
        target_probs=target,
        bonus_token_ids=torch.randint(0, vocab_size, (batch_size,), dtype=torch.int32, device=device),
        is_greedy=torch.rand(batch_size, device=device) < 0.3,
        uniform_probs=reference.generate_uniform_probs(counts, {}, device),
        recovery_noise=reference.generate_recovery_noise(counts, vocab_size, {}, device),
        max_spec_len=max_spec_len,
    )


def _rejection_checks() -> list[dict[str, Any]]:
    from kernels import reference
    from kernels import triton as kt

    rows = []
    for ngram in (False, True):
        case = rejection_case(256, 4, 49152, ngram)
        same = torch.equal(kt.rejection_sample(**case), reference.rejection_sample(**case))
        rows.append(
            {
                "kernel": "rejection_sample",
                "case": "n-gram" if ngram else "draft probs",
                "error": 0.0 if same else float("inf"),
                "bound": 0.0,
                "ok": same,
            }
        )
    return rows


def check_kernels() -> list[dict[str, Any]]:
    """Every Triton kernel against its torch reference on the GPU (bf16 where it applies)."""
    rows = [row for shape in SHAPES for row in _attention_checks(shape)]
    return [*rows, _cache_check(), *_rejection_checks()]


def median_ms(fn: Callable[[], Any]) -> float:
    """Median time of `fn` in ms after warm-up, CUDA events, L2 flushed before each run."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=50, rep=300, return_mode="median"))


def copy_bandwidth() -> float:
    """Device-to-device copy of 1 GiB, in GB/s counting the read and the write."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / median_ms(lambda: dst.copy_(src)) / 1e6


def _attention_bytes(case: dict[str, Any]) -> int:
    """Bytes decode attention must move: each sequence's K and V once, plus q and the output."""
    kc = case["k_cache"]
    per_token = 2 * kc.shape[2] * kc.shape[3] * kc.element_size()
    return int(case["seq_lens"].sum()) * per_token + 2 * case["q"].numel() * case["q"].element_size()


def time_decode(shape: AttentionShape, batch_size: int, context_len: int, copy_gbs: float) -> dict[str, Any]:
    from kernels import reference
    from kernels import triton as kt

    case = paged_case([1] * batch_size, [context_len] * batch_size, shape, torch.bfloat16)
    ms = median_ms(lambda: kt.paged_attention(**case))
    gbs = _attention_bytes(case) / ms / 1e6
    return {
        "kernel": "decode attention",
        "workload": f"{shape.name}, batch {batch_size} x {context_len} ctx",
        "ms": ms,
        "achieved": f"{gbs:.0f} GB/s",
        "of_copy": gbs / copy_gbs,
        "torch_ms": median_ms(lambda: reference.paged_attention(**case)),
    }


def time_prefill(shape: AttentionShape, num_seqs: int, seq_len: int) -> dict[str, Any]:
    from kernels import reference
    from kernels import triton as kt

    case = paged_case([seq_len] * num_seqs, [seq_len] * num_seqs, shape, torch.bfloat16)
    ms = median_ms(lambda: kt.paged_attention(**case))
    # Causal: QK^T and PV over seq_len * (seq_len + 1) / 2 query-key pairs, 2 FLOPs per multiply-add.
    flops = 4 * num_seqs * shape.num_heads * shape.head_dim * seq_len * (seq_len + 1) / 2
    return {
        "kernel": "prefill attention",
        "workload": f"{shape.name}, {num_seqs} x {seq_len} tokens",
        "ms": ms,
        "achieved": f"{flops / ms / 1e9:.1f} TFLOP/s",
        "of_copy": None,
        "torch_ms": median_ms(lambda: reference.paged_attention(**case)),
    }


def time_cache_write(shape: AttentionShape, num_tokens: int, copy_gbs: float) -> dict[str, Any]:
    from kernels import reference
    from kernels import triton as kt

    kv = torch.randn(2, num_tokens, shape.num_kv_heads, shape.head_dim, dtype=torch.bfloat16, device="cuda")
    caches = torch.empty(
        2,
        num_tokens // shape.block_size + 1,
        shape.block_size,
        shape.num_kv_heads,
        shape.head_dim,
        dtype=torch.bfloat16,
        device="cuda",
    )
    slots = torch.randperm(caches.shape[1] * shape.block_size, device="cuda")[:num_tokens]
    args = (kv[0], kv[1], caches[0], caches[1], slots)
    ms = median_ms(lambda: kt.store_kvcache(*args))
    gbs = 2 * kv.numel() * kv.element_size() / ms / 1e6  # read once, written once
    return {
        "kernel": "store_kvcache",
        "workload": f"{shape.name}, {num_tokens} tokens",
        "ms": ms,
        "achieved": f"{gbs:.0f} GB/s",
        "of_copy": gbs / copy_gbs,
        "torch_ms": median_ms(lambda: reference.store_kvcache(*args)),
    }


def time_rejection(batch_size: int, max_spec_len: int, vocab_size: int) -> dict[str, Any]:
    from kernels import reference
    from kernels import triton as kt

    case = rejection_case(batch_size, max_spec_len, vocab_size, ngram=False)
    return {
        "kernel": "rejection_sample",
        "workload": f"batch {batch_size}, <= {max_spec_len} drafts, V {vocab_size}",
        "ms": median_ms(lambda: kt.rejection_sample(**case)),
        "achieved": "",
        "of_copy": None,
        "torch_ms": median_ms(lambda: reference.rejection_sample(**case)),
    }


def _hf_on_gpu(model: str, requests: list, batch_size: int, runs: int, log: Callable[[str], None]) -> dict[str, Any]:
    """transformers `generate` on the GPU in bf16 over the engine's workload (the throughput bench's baseline)."""
    from engine.model import resolve_model
    from workbench.bench.throughput import HFBaseline

    hf = HFBaseline(resolve_model(model), batch_size)
    hf.model.to("cuda", torch.bfloat16)
    with torch.device("cuda"):  # HFBaseline builds its input tensors with torch.tensor: put them on the GPU
        hf.run(requests[:2])
        times = []
        for turn in alternate({"transformers on GPU": partial(hf.run, requests)}, runs):  # its RunStats time it
            times.append(turn.value.elapsed_s)
            log(f"run {turn.run + 1}/{runs}: {turn.side} {times[-1]:.2f} s")
    elapsed = statistics.median(times)
    num_output = sum(r.output_len for r in requests)
    return {"elapsed_s": elapsed, "output_tok_s": num_output / elapsed, "runs_s": times}


def engine_vs_transformers(
    model: str,
    num_requests: int,
    runs: int,
    seed: int,
    max_num_batched_tokens: int,
    hf_batch_size: int,
    engine_kwargs: dict[str, Any],
    log: Callable[[str], None],
) -> dict:
    """The engine (CUDA, bf16, Triton kernels) and transformers on one seeded workload; medians."""
    from transformers import AutoTokenizer

    from engine.model import resolve_model
    from workbench.bench.datasets import random_requests, token_id_range
    from workbench.bench.throughput import run_throughput

    input_len_range, output_len_range = (32, 512), (16, 128)
    ours = run_throughput(
        model=model,
        num_requests=num_requests,
        runs=runs,
        seed=seed,
        baseline=False,
        max_num_batched_tokens=max_num_batched_tokens,
        engine_kwargs=engine_kwargs,
        log=log,
        input_len_range=input_len_range,
        output_len_range=output_len_range,
    )
    # The same requests run_throughput drew: same generator, same tokenizer as the engine's.
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(model))
    requests = random_requests(num_requests, input_len_range, output_len_range, token_id_range(tokenizer), seed)
    theirs = _hf_on_gpu(model, requests, hf_batch_size, runs, log)
    return {
        "model": model,
        "num_requests": num_requests,
        "input_len_range": input_len_range,
        "output_len_range": output_len_range,
        "hf_batch_size": hf_batch_size,
        "engine_tok_s": ours["engine"]["output_tok_s"],
        "hf_tok_s": theirs["output_tok_s"],
        "ratio": ours["engine"]["output_tok_s"] / theirs["output_tok_s"],
    }


def run_kernels(
    model: str = "smollm2-135m",
    seed: int = 0,
    max_num_batched_tokens: int = 2048,
    engine_kwargs: dict[str, Any] | None = None,
    log: Callable[[str], None] = print,
    runs: int = 3,
    batch_size: int = 256,
    context_len: int = 4096,
    num_requests: int = 256,
    throughput: bool = True,
) -> dict[str, Any]:
    """Check every kernel, then (if all pass) time them and the engine. Raises ValueError without CUDA."""
    if not torch.cuda.is_available():
        raise ValueError(NO_CUDA)
    torch.manual_seed(seed)
    checks = check_kernels()
    result: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(),
        "checks": checks,
        "timings": None,
        "copy_gbs": None,
        "throughput": None,
        "settings": run_settings(run_kernels, locals(), omit=("throughput",)),  # the result's throughput is its own
    }
    if not all(c["ok"] for c in checks):
        log("a kernel failed its check: no timings")
        return result
    copy_gbs = copy_bandwidth()
    log(f"device-to-device copy: {copy_gbs:.0f} GB/s")
    timings = [time_decode(shape, batch_size, context_len, copy_gbs) for shape in SHAPES]
    timings += [time_prefill(shape, 8, 2048) for shape in SHAPES]
    timings += [time_cache_write(SHAPES[0], 65536, copy_gbs), time_rejection(256, 4, 49152)]
    result.update(copy_gbs=copy_gbs, timings=timings)
    if throughput:
        result["throughput"] = engine_vs_transformers(
            model, num_requests, runs, seed, max_num_batched_tokens, HF_BATCH_SIZE, dict(engine_kwargs or {}), log
        )
    return result


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser)
    parser.add_argument("--batch-size", type=positive_int, default=256, help="decode sequences (default: %(default)s)")
    parser.add_argument("--context-len", type=positive_int, default=4096, help="decode context (default: %(default)s)")
    parser.add_argument("--num-requests", type=positive_int, default=256, help="engine throughput workload")
    parser.add_argument("--no-throughput", action="store_true", help="kernels only: skip engine vs transformers")


def main(args: argparse.Namespace) -> dict[str, Any]:
    """`workbench bench gpu_kernels`: run_kernels with the command line's settings (a ValueError without CUDA)."""
    return run_with_flags(run_kernels, args, throughput=not args.no_throughput)


_CHECK_HEADERS = ("kernel", "case", "rel. error", "bound", "ok")
_TIME_HEADERS = ("kernel", "workload", "median ms", "achieved", "of copy bw", "torch reference ms")


def _check_rows(result: dict[str, Any]) -> list[list[object]]:
    return [
        [c["kernel"], c["case"], f"{c['error']:.2e}", f"{c['bound']:.0e}", "yes" if c["ok"] else "NO"]
        for c in result["checks"]
    ]


def _time_rows(result: dict[str, Any]) -> list[list[object]]:
    return [
        [
            t["kernel"],
            t["workload"],
            f"{t['ms']:.3f}",
            t["achieved"],
            "" if t["of_copy"] is None else f"{100 * t['of_copy']:.0f}%",
            f"{t['torch_ms']:.3f}",
        ]
        for t in result["timings"]
    ]


def _throughput_line(tp: dict[str, Any]) -> str:
    return (
        f"{tp['model']}, {tp['num_requests']} requests: engine {tp['engine_tok_s']:.0f} output tok/s, "
        f"transformers generate (bf16, batches of {tp['hf_batch_size']}) {tp['hf_tok_s']:.0f} tok/s, "
        f"ratio {tp['ratio']:.2f}x"
    )


_METHOD = (
    "Each Triton kernel is first checked against its torch reference (bf16 inputs; the reference in fp32; "
    "max |error| / max |reference|), then timed: median of many runs after warm-up "
    "(`triton.testing.do_bench`, L2 flushed). Decode bandwidth counts each sequence's K and V read once; "
    f"the goal is {DECODE_BANDWIDTH_GOAL:.0%} of the device-to-device copy bandwidth."
)


def _timing_parts(result: dict[str, Any]) -> list[Part]:
    if result["timings"] is None:
        return [Line("timings skipped: a kernel failed its check", "**Timings skipped: a kernel failed its check.**")]
    copy = f"{result['copy_gbs']:.0f} GB/s"
    return [
        Line(f"device-to-device copy: {copy}", f"Device-to-device copy (1 GiB, read + write): **{copy}**."),
        Table(_TIME_HEADERS, _time_rows(result)),
    ]


def _parts(result: dict[str, Any]) -> list[Part]:
    parts = [
        Line(f"GPU: {result['gpu']}", ""),
        docs_only(_METHOD),
        Table(_CHECK_HEADERS, _check_rows(result)),
        *_timing_parts(result),
    ]
    if result["throughput"]:  # printed only after timings, as it runs only after them
        line = _throughput_line(result["throughput"])
        parts.append(
            Line(
                line if result["timings"] is not None else "",
                f"**{line}** (prompts 32..512, outputs 16..128 tokens, greedy, EOS ignored, medians).",
            )
        )
    return parts


def format_text(result: dict[str, Any]) -> str:
    return text_report(_parts(result))


def format_markdown(result: dict[str, Any], command: str) -> str:
    """The section names the GPU in its title and with the machine, and Triton's version."""
    machine = {"gpu": result["gpu"], **machine_info(), "triton": _triton_version()}
    return markdown_report(f"Kernels on {result['gpu']}", command, _parts(result), machine)


def _triton_version() -> str:
    import triton

    return triton.__version__
