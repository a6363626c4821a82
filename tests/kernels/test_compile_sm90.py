"""Every Triton kernel compiled for Hopper (sm_90) on this CPU, with the dtypes, alignments and constexprs the
engine passes: what the interpreter cannot check (the int64 draft offsets it forgave), and how many kernel variants
a serving loop compiles.

The compiling runs in two child processes started together (one core each): this pytest process has
``TRITON_INTERPRET=1`` (tests/kernels/conftest.py), under which nothing compiles. One compiles the kernels on their
own (SmolLM2's head layout at every split count, Llama-8B's); the other runs the engine on tiny-llama with the torch
kernels while each Triton launch it would make on CUDA is compiled for sm_90 (``workbench.gpu_check``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.triton.attention import KV_SPLIT_COUNTS

ROOT = Path(__file__).resolve().parents[2]
KERNELS = {
    "_unified_attention_kernel",
    "_reduce_splits_kernel",
    "_store_kvcache_kernel",
    "_recovered_tokens_kernel",
    "_rejection_sample_kernel",
}
GROWING = "chunked prefill, contexts of every size"
SPEC = "draft-model speculation"
WARM_UP = "the runner's warm-up"  # workbench.gpu_check.WARM_UP (that module refuses TRITON_INTERPRET, set here)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    """Both parts of ``python -m workbench.gpu_check --compile-only``, merged; their output on failure."""
    out = tmp_path_factory.mktemp("sm90")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    procs = {
        part: subprocess.Popen(
            [sys.executable, "-m", "workbench.gpu_check", "--compile-only", part, "--out", str(out / part)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for part in ("kernels", "engine")
    }
    merged: dict = {"workloads": {}, "failures": [], "log": ""}
    for part, proc in procs.items():
        log, _ = proc.communicate(timeout=900)
        merged["log"] += log
        path = out / part / "result.json"
        assert path.exists(), f"gpu_check --compile-only {part} wrote no result (exit {proc.returncode}):\n{log}"
        result = json.loads(path.read_text())["compile"]
        merged["workloads"].update(result["workloads"])
        merged["failures"] += result["failures"]
    return merged


def test_every_kernel_compiles_for_sm90(compiled):
    failures = "\n\n".join(f"[{f['workload']}] {f['variant']}\n{f['error']}" for f in compiled["failures"])
    assert not compiled["failures"], f"Triton kernels that do not compile for sm_90:\n{failures}"
    launched = {k for w in compiled["workloads"].values() for k in w["variants"]}
    assert launched == KERNELS, compiled["log"]


def test_the_engine_was_compiled_with_its_own_dtypes(compiled):
    """The check covers what broke: the engine's rejection sampler passes int64 draft offsets and ids, and its
    attention runs in bfloat16 on CUDA with int32 tables and int64 slots."""
    rejection = compiled["workloads"][SPEC]["signatures"]["_rejection_sample_kernel"]
    assert rejection["cu_num_draft_tokens_ptr"] == "*i64" and rejection["draft_token_ids_ptr"] == "*i64"
    attention = compiled["workloads"][GROWING]["signatures"]["_unified_attention_kernel"]
    assert attention["q_ptr"] == attention["k_cache_ptr"] == "*bf16"
    assert attention["block_tables_ptr"] == attention["query_start_loc_ptr"] == "*i32"
    assert compiled["workloads"][GROWING]["signatures"]["_store_kvcache_kernel"]["slot_mapping_ptr"] == "*i64"
    variants = compiled["workloads"][SPEC]["variants"]
    assert variants["_rejection_sample_kernel"] == variants["_recovered_tokens_kernel"] == 2  # draft and n-gram


def test_a_serving_loop_compiles_one_attention_variant_per_split_count(compiled):
    """Batches of 6 sequences down to 1, contexts from 1100 tokens down: the split choice changes with them, but
    neither the number of sequences nor where the runner's packed index arrays start makes a new variant."""
    variants = compiled["workloads"][GROWING]["variants"]
    described = [d for d in compiled["workloads"][GROWING]["described"] if d.startswith("_unified_attention_kernel")]
    splits = [d.split("NUM_SPLITS=")[1].split(",")[0] for d in described]
    assert len(splits) == len(set(splits)) == variants["_unified_attention_kernel"], described
    assert 2 <= len(splits) <= len(KV_SPLIT_COUNTS)  # the loop did split, into few counts
    assert variants["_reduce_splits_kernel"] == len(splits) - 1
    assert variants["_store_kvcache_kernel"] == 1


def test_the_runners_warm_up_compiles_every_attention_variant_the_serving_loop_uses(compiled):
    """What `kernels.warm_up_paged_attention` launches when a runner starts on CUDA covers every attention
    variant the loop above launched: no request waits on a compile."""

    def attention(workload: str) -> set[str]:
        return {
            d
            for d in compiled["workloads"][workload]["described"]
            if d.startswith(("_unified_attention_kernel", "_reduce_splits_kernel"))
        }

    assert attention(GROWING) <= attention(WARM_UP), sorted(attention(GROWING) - attention(WARM_UP))
    assert len([d for d in attention(WARM_UP) if d.startswith("_unified")]) == len(KV_SPLIT_COUNTS)
