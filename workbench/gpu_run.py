"""The GPU half of `make gpu-check`: on a CUDA machine, the kernels against their references, the engine end to end
against the same runs on the torch references, then timings (``gpu_sections``), and the docs section that reports a
whole run (``markdown``). The compile check, which needs no GPU, and the command line are gpu_check.py's.

Triton is imported inside the sections only: gpu_check.py refuses TRITON_INTERPRET before anything imports it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

# The engine's CUDA default (EngineConfig: bfloat16 on CUDA): what activations and the KV cache are there.
CUDA_DTYPE = torch.bfloat16
# Head layouts (query heads / KV heads x head dim): SmolLM2-135M, Llama-3-8B, Qwen2.5-0.5B.
HEAD_LAYOUTS = ((9, 3, 64), (32, 8, 128), (14, 2, 64))


# What travels to a GPU machine (no network there; smollm2's weights are too big to carry): `make gpu-check` here
# copies tiny-llama (16 MB: weights, config, SmolLM2's tokenizer) into this ignored folder; carry it along.
CARRY_DIR = os.path.join("build", "gpu-check")
TINY_LLAMA = os.path.join(CARRY_DIR, "tiny-llama")
BF16_REL_ERROR = 2e-2  # max |triton - reference| / max |reference|, the reference in fp32 on the same bf16 inputs


def prepare_carry() -> str:
    """The tiny-llama folder the GPU run needs, copied once from the registry's (built here if need be)."""
    import shutil

    from engine.model.loader import resolve_model

    if not os.path.isdir(TINY_LLAMA):
        shutil.copytree(resolve_model("tiny-llama"), TINY_LLAMA)
    return TINY_LLAMA


def _section(name: str, fn: Callable[[], Any], report: dict[str, Any]) -> Any:
    """Run one GPU section; a failure is recorded with its traceback and the next section still runs."""
    import traceback

    start = time.perf_counter()
    try:
        value = fn()
        report["sections"][name] = {"ok": True, "s": time.perf_counter() - start, "result": value}
    except Exception:  # noqa: BLE001 - one broken section must not hide what the others found
        report["sections"][name] = {"ok": False, "s": time.perf_counter() - start, "error": traceback.format_exc()}
        value = None
    print(
        f"[gpu] {name}: {'ok' if report['sections'][name]['ok'] else 'FAILED'} ({report['sections'][name]['s']:.1f} s)",
        flush=True,
    )
    if not report["sections"][name]["ok"]:
        print(report["sections"][name]["error"], flush=True)
    return value


def gpu_versions() -> dict[str, Any]:
    """Versions, the device and its compute capability; the kernels must be compiled, not interpreted."""
    import importlib.metadata

    import triton
    from triton.runtime.jit import JITFunction

    from kernels.triton import attention

    if not isinstance(attention._unified_attention_kernel, JITFunction):
        raise RuntimeError("kernels.triton runs under the interpreter: unset TRITON_INTERPRET")
    return {
        "device": torch.cuda.get_device_name(),
        "capability": ".".join(map(str, torch.cuda.get_device_capability())),
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": importlib.metadata.version("transformers"),
    }


def gpu_rejection() -> list[dict[str, Any]]:
    """Triton against the reference (`torch.equal`) with the engine's dtypes (int64 offsets, draft and bonus ids),
    greedy/random mixes, zero-draft requests, n-gram and draft probabilities, SmolLM2's vocabulary."""
    from kernels import reference
    from kernels import triton as kt
    from workbench.bench.gpu_kernels import rejection_case

    rows = []
    for batch, k, ngram in ((1, 1, False), (7, 4, True), (64, 4, False), (256, 5, True)):
        case = rejection_case(batch, k, 49152, ngram)
        for name in ("cu_num_draft_tokens", "draft_token_ids", "bonus_token_ids"):
            case[name] = case[name].long()  # as RejectionSampler passes them
        same = torch.equal(kt.rejection_sample(**case), reference.rejection_sample(**case))
        rows.append({"case": f"batch {batch}, <= {k} drafts, {'n-gram' if ngram else 'draft probs'}", "ok": same})
    if not all(r["ok"] for r in rows):
        raise AssertionError(f"rejection sampling differs from the reference: {rows}")
    return rows


def gpu_attention() -> list[dict[str, Any]]:
    """bf16 paged attention against the fp32 reference for each head layout: decodes at block boundaries, a chunk
    over cached context, a verification batch, a whole prefill, at every split count and at the wrapper's choice."""
    from kernels import reference
    from kernels import triton as kt
    from workbench.bench.gpu_kernels import AttentionShape, paged_case

    mixes = {
        "decodes at block boundaries": ([1] * 6, [1, 15, 16, 17, 32, 4097]),
        "chunk over cached context": ([1, 256, 1], [40, 1024, 16]),
        "verification (k=4) + decode": ([5, 5, 1], [133, 16, 2000]),
        "whole prefill": ([300], [300]),
    }
    rows = []
    for heads, kv_heads, dim in HEAD_LAYOUTS:
        shape = AttentionShape(f"{heads}/{kv_heads} x {dim}", heads, kv_heads, dim)
        for mix, (q_lens, seq_lens) in mixes.items():
            case = paged_case(q_lens, seq_lens, shape, CUDA_DTYPE)
            ref = reference.paged_attention(
                **{k: v.float() if k in ("q", "k_cache", "v_cache") else v for k, v in case.items()}
            )
            decode = all(n == 1 for n in q_lens)
            for splits in (*kt.attention.KV_SPLIT_COUNTS, None) if decode else (1, None):
                out = (
                    kt.paged_attention(**case)
                    if splits is None
                    else kt.attention.unified_attention(**case, num_kv_splits=splits)
                )
                err = float((out.float() - ref).abs().max() / ref.abs().max())
                rows.append(
                    {
                        "case": f"{shape.name}, {mix}, splits {splits or 'chosen'}",
                        "error": err,
                        "ok": err <= BF16_REL_ERROR,
                    }
                )
    bad = [r for r in rows if not r["ok"]]
    if bad:
        raise AssertionError(f"attention beyond {BF16_REL_ERROR}: {bad}")
    return rows


def gpu_large_cache() -> dict[str, Any]:
    """A KV cache past 2**31 elements: tokens written into and attended from its last blocks (int64 offsets)."""
    from kernels import reference
    from kernels import triton as kt

    kv_heads, dim, bs = 8, 128, 16
    num_blocks = (1 << 31) // (bs * kv_heads * dim) + 64
    k_cache = torch.zeros(num_blocks, bs, kv_heads, dim, dtype=CUDA_DTYPE, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    n = 40
    blocks = torch.arange(num_blocks - 3, num_blocks, device="cuda", dtype=torch.int32)
    slots = (blocks.long()[:, None] * bs + torch.arange(bs, device="cuda")).flatten()[:n]
    key, value = (torch.randn(n, kv_heads, dim, dtype=CUDA_DTYPE, device="cuda") for _ in range(2))
    kt.store_kvcache(key, value, k_cache, v_cache, slots)
    if not (
        torch.equal(k_cache.view(-1, kv_heads, dim)[slots], key)
        and torch.equal(v_cache.view(-1, kv_heads, dim)[slots], value)
    ):
        raise AssertionError("store_kvcache past 2**31 elements wrote the wrong place")
    q = torch.randn(1, 32, dim, dtype=CUDA_DTYPE, device="cuda")
    meta = dict(
        block_tables=blocks[None],
        seq_lens=torch.tensor([n], dtype=torch.int32, device="cuda"),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device="cuda"),
        scale=dim**-0.5,
    )
    out = kt.paged_attention(q, k_cache, v_cache, **meta)
    small = torch.stack([k_cache[num_blocks - 3 :], v_cache[num_blocks - 3 :]]).float()
    ref = reference.paged_attention(
        q.float(),
        small[0],
        small[1],
        **{**meta, "block_tables": torch.arange(3, device="cuda", dtype=torch.int32)[None]},
    )
    err = float((out.float() - ref).abs().max() / ref.abs().max())
    del k_cache, v_cache
    torch.cuda.empty_cache()
    if err > BF16_REL_ERROR:
        raise AssertionError(f"attention past 2**31 elements: error {err}")
    return {"elements": num_blocks * bs * kv_heads * dim, "error": err}


def _jit_variants() -> dict[str, int]:
    """Compiled variants per kernel, from the JIT's own cache (triton 3.x: device_caches[device][0])."""
    from kernels.triton import attention, cache, rejection

    kernels = {
        "_unified_attention_kernel": attention._unified_attention_kernel,
        "_reduce_splits_kernel": attention._reduce_splits_kernel,
        "_store_kvcache_kernel": cache._store_kvcache_kernel,
        "_recovered_tokens_kernel": rejection._recovered_tokens_kernel,
        "_rejection_sample_kernel": rejection._rejection_sample_kernel,
    }
    dev = torch.cuda.current_device()
    return {name: len(fn.device_caches[dev][0]) for name, fn in kernels.items()}


def gpu_engine(model: str) -> dict[str, Any]:
    """The engine end to end on CUDA (tiny-llama, chunked prefill, n-gram and draft-model speculation) against the
    same runs on the torch references on CUDA: greedy tokens equal in float32; in bfloat16 the share that match.
    Also the attention variants compiled over a decode loop whose contexts grow to ~1.5k tokens, and per step the
    host's wall time against the GPU's kernel time."""
    from unittest import mock

    import kernels
    from engine import LLM, SamplingParams
    from kernels import reference
    from kernels.triton.attention import KV_SPLIT_COUNTS

    on_device = kernels._impl
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (5, 40, 300, 900)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    setups: dict[str, dict[str, Any]] = {
        "chunked prefill": dict(max_num_batched_tokens=128),
        "n-gram": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 4}),
        "draft model": dict(speculative_config={"method": "draft_model", "model": model, "num_speculative_tokens": 3}),
    }
    rows = []
    for dtype in ("float32", "bfloat16"):
        for name, extra in setups.items():
            runs = []
            for impl in (on_device, lambda n, _: getattr(reference, n)):
                with mock.patch.object(kernels, "_impl", impl):
                    llm = LLM(model=model, device="cuda", dtype=dtype, seed=0, **extra)
                    runs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
            same = sum(a == b for x, y in zip(*runs) for a, b in zip(x, y)) / sum(len(x) for x in runs[0])
            rows.append({"dtype": dtype, "setup": name, "tokens_equal": same, "ok": same == 1.0 or dtype != "float32"})
    before = _jit_variants()
    llm = LLM(model=model, device="cuda", seed=0)
    llm.generate([prompts[0]] * 8, SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True), use_tqdm=False)
    grown = {k: v - before[k] for k, v in _jit_variants().items()}
    # Host wall time per step (synchronised) against the GPU's kernel time in the same steps (the profiler's
    # device time): with 60-90 launches per step and no CUDA graph, the gap is launch overhead.
    eng, host = llm.engine, []
    for _ in range(3):
        eng.add_request(prompts[3], SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        while eng.has_unfinished_requests():
            t0 = time.perf_counter()
            eng.step()
            torch.cuda.synchronize()
            host.append((time.perf_counter() - t0) * 1e3)
    gpu_ms = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3 / len(host)
    host.sort()
    result = {
        "runs": rows,
        "new_variants_over_decode_loop": grown,
        "step_ms": {"host_wall_median": host[len(host) // 2], "gpu_kernels_mean": gpu_ms},
    }
    if not all(r["ok"] for r in rows) or grown["_unified_attention_kernel"] > len(KV_SPLIT_COUNTS):
        raise AssertionError(json.dumps(result, default=str))
    return result


def gpu_timings() -> list[dict[str, Any]]:
    """`do_bench` medians of decode, prefill, cache write and rejection (workbench bench gpu_kernels' workloads)."""
    from workbench.bench import gpu_kernels as bench

    copy = bench.copy_bandwidth()
    shapes = (*bench.SHAPES, bench.AttentionShape("qwen2.5-0.5b heads (14/2 x 64)", 14, 2, 64))
    rows = [bench.time_decode(shape, batch, 4096, copy) for shape in shapes for batch in (8, 256)]
    rows += [bench.time_prefill(shape, 8, 2048) for shape in shapes]
    rows += [bench.time_cache_write(bench.SHAPES[0], 65536, copy), bench.time_rejection(256, 4, 49152)]
    return rows


def gpu_sections(report: dict[str, Any]) -> None:
    """Checks first, timings last (only when every check passed)."""
    model = TINY_LLAMA if os.path.isdir(TINY_LLAMA) else "tiny-llama"
    _section("versions", gpu_versions, report)
    _section("rejection sampling vs reference", gpu_rejection, report)
    _section("bf16 attention vs fp32 reference", gpu_attention, report)
    _section("KV cache past 2^31 elements", gpu_large_cache, report)
    _section("engine end to end vs torch references", lambda: gpu_engine(model), report)
    if all(s["ok"] for s in report["sections"].values()):
        _section("timings (do_bench medians)", gpu_timings, report)
    else:
        report["skipped"].append("timings: a check failed")


def markdown(report: dict[str, Any]) -> str:
    """The docs section: what ran, what passed, what was skipped and why, the timings."""
    from workbench.bench.report import markdown_table

    lines = [
        "## GPU check (`make gpu-check`)",
        "",
        "One script for the first GPU run: the sm_90 compile check (also in `make test`), then on a GPU the "
        "kernels against their references, the engine end to end, and timings. Machine: "
        + ", ".join(f"{k} {v}" for k, v in report["machine"].items())
        + ".",
        "",
    ]
    comp = report["compile"]
    lines += [
        f"Compiled for sm_90: {sum(sum(w['variants'].values()) for w in comp['workloads'].values())} variants, "
        f"{len(comp['failures'])} failures, {comp['compile_s']:.1f} s compiling.",
        "",
    ]
    for name, sec in report["sections"].items():
        lines.append(f"- **{name}**: {'passed' if sec['ok'] else 'FAILED'} ({sec['s']:.1f} s)")
    for skipped in report["skipped"]:
        lines.append(f"- skipped: {skipped}")
    timings = report["sections"].get("timings (do_bench medians)", {}).get("result")
    if timings:
        lines += [
            "",
            markdown_table(
                ("kernel", "workload", "median ms", "achieved", "torch reference ms"),
                [
                    [t["kernel"], t["workload"], f"{t['ms']:.3f}", t["achieved"], f"{t['torch_ms']:.3f}"]
                    for t in timings
                ],
            ),
        ]
    engine = report["sections"].get("engine end to end vs torch references", {}).get("result")
    if engine:
        lines += [
            "",
            markdown_table(
                ("dtype", "setup", "greedy tokens equal to the references' run"),
                [[r["dtype"], r["setup"], f"{r['tokens_equal']:.1%}"] for r in engine["runs"]],
            ),
            "",
            f"Attention variants compiled over a growing-context decode loop: "
            f"{engine['new_variants_over_decode_loop']}; per step: host wall (median) "
            f"{engine['step_ms']['host_wall_median']:.2f} ms, GPU kernels (mean) "
            f"{engine['step_ms']['gpu_kernels_mean']:.2f} ms.",
        ]
    return "\n".join(lines)


def write_docs(report: dict[str, Any]) -> int:
    from workbench.bench.report import write_section

    write_section(os.path.join("docs", "BENCHMARKS.md"), "gpu-check", markdown(report))
    return 0
