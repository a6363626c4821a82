"""`make gpu-check`: everything the first GPU run must answer, in one script, checks first and timings last.

This module is the compile check and the command line. Without a GPU (here) it does what a CPU can: every Triton
kernel compiled for Hopper (sm_90) with the dtypes, alignments and constexprs the engine really passes
(``compile_check``: the engine runs tiny-llama on the torch kernels while each Triton launch it would make on CUDA is
compiled for sm_90 instead of run), and it says plainly which GPU sections it skipped. With one (``TRITON_INTERPRET``
unset) it adds the GPU run: the sections of gpu_run.py.

Run it as ``python -m workbench.gpu_check`` (``make gpu-check``). It imports the engine and the kernels only, never
Panel, so it runs on a bare GPU image with torch, triton and transformers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from workbench.gpu_run import (
    CARRY_DIR,
    CUDA_DTYPE,
    HEAD_LAYOUTS,
    gpu_sections,
    gpu_versions,
    markdown,
    prepare_carry,
    write_docs,
)

# Compiled kernels only: decided when triton is first imported, so before anything below imports it.
if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("gpu_check: TRITON_INTERPRET is set; unset it (this checks compiled kernels, not the interpreter)")


def _retyped(t: Any, dtype: torch.dtype) -> Any:
    """A tensor of ``dtype`` laid out as ``t`` (same element strides and storage offset, so the same alignment
    facts a ``dtype`` tensor has on CUDA); non-float arguments unchanged. Contents are not copied: only
    compiled, never run."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dtype == dtype:
        return t
    storage = torch.empty(t.untyped_storage().nbytes() // t.element_size(), dtype=dtype)
    return storage.as_strided(t.shape, t.stride(), t.storage_offset())


@contextlib.contextmanager
def triton_beside_torch(num_sms: int, dtype: torch.dtype = CUDA_DTYPE) -> Iterator[None]:
    """While active, every ``kernels.<name>`` call on a CPU tensor runs the torch kernel (the result the engine
    uses) and also calls ``kernels.triton.<name>`` as it would be called on CUDA: attention and cache tensors in
    ``dtype``, the split choice for a GPU of ``num_sms`` SMs. Under a ``LaunchRecorder`` those launches are
    compiled, not run."""
    from unittest import mock

    import kernels
    from kernels import triton as kt

    on_cpu = kernels._impl

    def impl(name: str, device_type: str) -> Callable:
        torch_fn, triton_fn = on_cpu(name, device_type), getattr(kt, name, None)
        if triton_fn is None:
            return torch_fn
        # Rejection sampling takes float32 probabilities on CUDA as here (the sampler's softmax is float32).
        cast = (lambda a: a) if name == "rejection_sample" else (lambda a: _retyped(a, dtype))

        def both(*args: Any) -> Any:
            triton_fn(*map(cast, args))
            if name == "rejection_sample" and args[2] is not None:
                # The n-gram path: the same tensors from the same RejectionSampler code, without draft
                # probabilities. Replayed here because tiny-llama's text rarely repeats, so n-gram drafts are rare.
                triton_fn(args[0], args[1], None, *args[3:])
            return torch_fn(*args)

        return both

    # on CUDA each layer runs op by op: no whole-layer CPU op may take the launches this is here to see
    with (
        mock.patch.object(kernels, "_impl", impl),
        mock.patch.object(kt.attention, "_num_sms", lambda _: num_sms),
        mock.patch.object(kernels, "FUSED_LAYERS", False),
    ):
        yield


def engine_workloads() -> Iterator[tuple[str, Any, list[list[int]], list[Any]]]:
    """(name, an LLM, prompts, params), each LLM built when its turn comes.

    1. Chunked prefill (a 256-token budget) over prompts of 17 to 1100 tokens, greedy, the longest leaving first:
       decode-only batches shrink from 6 sequences to 1 while their longest context falls, so the split choice
       walks through its counts.
    2. Draft-model speculation (tiny-llama drafting for itself), greedy and random requests; each verification is
       also launched as the n-gram path launches it (``triton_beside_torch``).
    """
    from engine import LLM, SamplingParams

    gen = torch.Generator().manual_seed(0)
    base = dict(model="tiny-llama", device="cpu", block_size=16, seed=0)
    lens = [17, 60, 130, 300, 520, 1100]
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in lens]
    params = [
        SamplingParams(temperature=0.0, max_tokens=4 + 6 * (len(lens) - i), ignore_eos=True) for i in range(len(lens))
    ]
    yield "chunked prefill, contexts of every size", LLM(**base, max_num_batched_tokens=256), prompts, params
    prompts = [torch.randint(3, 49152, (12,), generator=gen).tolist() for _ in range(2)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.9, seed=2, max_tokens=12, ignore_eos=True),
    ]
    llm = LLM(**base, speculative_config={"method": "draft_model", "model": "tiny-llama", "num_speculative_tokens": 3})
    yield "draft-model speculation", llm, prompts, params


def kernel_workloads(dtype: torch.dtype = CUDA_DTYPE) -> Iterator[str]:
    """Launches the engine's tiny model does not make: SmolLM2's head layout at every split count the wrapper can
    choose, and Llama-8B's (the largest head) unsplit, with the index dtypes the runner passes (int32 tables,
    lengths and query starts; int64 slots). Yields a name per layout, after its launches."""
    from kernels import triton as kt

    for (num_heads, num_kv_heads, head_dim), splits in zip(HEAD_LAYOUTS, (kt.attention.KV_SPLIT_COUNTS, (1,))):
        k_cache = torch.empty(8, 16, num_kv_heads, head_dim, dtype=dtype)
        qkv = torch.empty(4, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        q, k, v = (t.view(4, -1, head_dim) for t in (q, k, v))
        kt.store_kvcache(k, v, k_cache, k_cache, torch.zeros(4, dtype=torch.int64))
        tables, lens = torch.zeros(4, 8, dtype=torch.int32), torch.full((4,), 100, dtype=torch.int32)
        qsl = torch.arange(5, dtype=torch.int32)
        for n in splits:
            kt.attention.unified_attention(q, k_cache, k_cache, tables, lens, qsl, 0.125, num_kv_splits=n)
        yield f"{num_heads}/{num_kv_heads} x {head_dim}"


def warm_up_workload(dtype: torch.dtype = CUDA_DTYPE) -> None:
    """What the runner compiles when it starts on CUDA (``kernels.warm_up_paged_attention``), for tiny-llama's
    head layout: the serving loop of ``engine_workloads`` should then need no attention variant of its own."""
    from transformers import AutoConfig

    from engine.model import resolve_model
    from kernels import triton as kt

    config = AutoConfig.from_pretrained(resolve_model("tiny-llama"))
    head_dim = config.hidden_size // config.num_attention_heads
    k_cache = torch.empty(8, 16, config.num_key_value_heads, head_dim, dtype=dtype)
    kt.attention.warm_up(config.num_attention_heads, k_cache, k_cache, dtype)


COMPILE_PARTS = ("kernels", "engine")
WARM_UP = "the runner's warm-up"


def compile_check(parts: tuple[str, ...] = COMPILE_PARTS, num_sms: int = 132) -> dict[str, Any]:
    """The Triton launches of ``kernel_workloads`` (part "kernels") and of the engine's ``engine_workloads`` (part
    "engine": those it would make on CUDA), compiled for sm_90. Returns per workload the distinct variants per
    kernel, the signature each kernel was given, the compile failures, and the time spent."""
    from kernels.triton.compile_check import LaunchRecorder

    result: dict[str, Any] = {"target": "cuda sm_90", "num_sms": num_sms, "workloads": {}, "failures": []}
    start = time.perf_counter()
    recorders = {}
    if "kernels" in parts:
        with LaunchRecorder() as rec:
            names = list(kernel_workloads())
        recorders["kernels: " + ", ".join(names)] = rec
    if "engine" in parts:
        with LaunchRecorder() as rec:
            warm_up_workload()
        recorders[WARM_UP] = rec
        for name, llm, prompts, params in engine_workloads():
            with LaunchRecorder() as rec, triton_beside_torch(num_sms):
                llm.generate(prompts, params, use_tqdm=False)
            recorders[name] = rec
    for name, rec in recorders.items():
        result["workloads"][name] = {
            "launches": len(rec.launches),
            "variants": {k: len(rec.variants_of(k)) for k in sorted({v.kernel for v in rec.launches})},
            "signatures": {v.kernel: dict(v.signature) for v in rec.launches},
            "described": sorted(v.describe() for v in rec.variants),
        }
        result["failures"] += [{"workload": name, "variant": v.describe(), "error": e} for v, e in rec.failures]
    result["compile_s"] = sum(r.compile_seconds for r in recorders.values())
    result["wall_s"] = time.perf_counter() - start
    return result


def print_compile(result: dict[str, Any]) -> None:
    """The compile check in a few lines: launches and variants per workload, each failure with its cause."""
    for name, w in result["workloads"].items():
        print(f"[sm_90] {name}: {w['launches']} launches, variants {w['variants']}")
    for f in result["failures"]:
        print(f"[sm_90] COMPILE FAILED ({f['workload']}) {f['variant']}:\n{f['error']}")
    print(f"[sm_90] {result['compile_s']:.1f} s compiling, {result['wall_s']:.1f} s in all")


def main(argv: list[str] | None = None) -> int:
    """The command line: the compile check, then the GPU run where there is a GPU; 1 when anything failed."""
    parser = argparse.ArgumentParser(prog="python -m workbench.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--compile-only",
        choices=COMPILE_PARTS + ("all",),
        help="only the sm_90 compile check, or one part of it (no GPU needed)",
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        default=os.environ.get("OUT") or CARRY_DIR,
        help="where result.json and gpu-check.md go (default: $OUT, what a device run brings back, else %(default)s)",
    )
    parser.add_argument(
        "--write-docs",
        action="store_true",
        help="rewrite the gpu-check section of docs/BENCHMARKS.md (only after a run on a GPU)",
    )
    parser.add_argument(
        "--docs-from",
        metavar="RESULT_JSON",
        help="only rewrite that section from a GPU run's result.json brought back from the machine",
    )
    args = parser.parse_args(argv)
    if args.docs_from:
        return write_docs(json.loads(open(args.docs_from, encoding="utf-8").read()))
    parts = COMPILE_PARTS if args.compile_only in (None, "all") else (args.compile_only,)
    report: dict[str, Any] = {"compile": compile_check(parts), "sections": {}, "skipped": []}
    print_compile(report["compile"])
    if args.compile_only is None:
        if torch.cuda.is_available():
            report["machine"] = gpu_versions()
            gpu_sections(report)
        else:
            print("[gpu] carried for the GPU run:", prepare_carry())
            report["skipped"].append("every GPU section: torch.cuda.is_available() is False on this machine")
        for skipped in report["skipped"]:
            print(f"[gpu] SKIPPED {skipped}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "result.json"), "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=1, default=str)
    if "machine" in report:
        with open(os.path.join(args.out, "gpu-check.md"), "w", encoding="utf-8") as fh:
            fh.write(markdown(report) + "\n")
        if args.write_docs:
            write_docs(report)
    failed = report["compile"]["failures"] or not all(s["ok"] for s in report["sections"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
