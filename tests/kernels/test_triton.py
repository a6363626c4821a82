"""The Triton kernels against their torch references, on CPU under the Triton interpreter.

Shapes stay tiny: the interpreter runs every tile op in numpy. Tolerances: fp32 atol/rtol
1e-4; fp16 atol 2e-3, rtol 1e-3 (the output is rounded to fp16); bf16 atol 3e-2, rtol 1e-2.
The reference always runs in fp32 on the same (rounded) inputs.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import reference
from kernels.cpu import ops as cpu_ops
from kernels.cpu.build import available as cpu_available

TOLERANCES = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.float16: {"atol": 2e-3, "rtol": 1e-3},
    torch.bfloat16: {"atol": 3e-2, "rtol": 1e-2},
}
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
BLOCK_SIZE = 8  # small, so short contexts cross several blocks and tiles (32 positions)


def paged_case(q_lens, seq_lens, num_kv_heads, group, head_dim, dtype, seed=0):
    """Random K/V for each sequence behind a scrambled block table, plus queries.

    Every unused cache slot holds large values, so a kernel that reads past a sequence's
    end or through the wrong block cannot pass.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(blocks) + 3
    k_cache = torch.full((num_blocks, BLOCK_SIZE, num_kv_heads, head_dim), 30.0)
    v_cache = torch.full_like(k_cache, -50.0)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.zeros(len(seq_lens), max(blocks) + 1, dtype=torch.int32)
    for s, (n, nb) in enumerate(zip(seq_lens, blocks)):
        ids = [perm.pop() for _ in range(nb)]
        block_tables[s, :nb] = torch.tensor(ids, dtype=torch.int32)
        slots = torch.tensor([ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(n)])
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        reference.store_kvcache(k, v, k_cache, v_cache, slots)
    q = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=gen)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    return q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), block_tables, seq_lens, qsl


def check_attention(run, case, dtype):
    q, kc, vc, bt, sl, qsl = case
    scale = q.shape[-1] ** -0.5
    out = run(q, kc, vc, bt, sl, qsl, scale)
    expected = reference.paged_attention(q.float(), kc.float(), vc.float(), bt, sl, qsl, scale)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), expected, **TOLERANCES[dtype])


# (q_lens, seq_lens): a single-token sequence, decodes at and across block boundaries, a whole
# prefill, a chunk over cached context ending on a block boundary, multi-token verification.
MIXED = ([1, 1, 1, 7, 5, 3, 1], [1, 8, 19, 7, 16, 12, 41])
MIXES = {
    "decode_only": ([1, 1, 1, 1], [1, 8, 9, 40]),
    "single_token_prefill": ([1], [1]),
    "whole_prefill_two_tiles": ([37], [37]),
    "chunk_over_cache_block_boundary": ([8], [24]),
    "verify": ([4], [13]),
}


@pytest.mark.parametrize(
    ("dtype", "group", "head_dim"),
    [
        (torch.float32, 1, 64),
        (torch.float32, 3, 128),
        (torch.float32, 8, 64),
        (torch.float16, 1, 128),
        (torch.float16, 3, 64),
        (torch.float16, 8, 128),
        (torch.bfloat16, 3, 64),
    ],
    ids=lambda v: DTYPE_NAMES.get(v, v) if isinstance(v, torch.dtype) else None,
)
def test_paged_attention_mixed_batch(triton_kernels, dtype, group, head_dim):
    case = paged_case(*MIXED, num_kv_heads=2, group=group, head_dim=head_dim, dtype=dtype)
    check_attention(triton_kernels.paged_attention, case, dtype)


@pytest.mark.parametrize("mix", MIXES.values(), ids=MIXES.keys())
def test_paged_attention_each_phase(triton_kernels, mix):
    case = paged_case(*mix, num_kv_heads=1, group=3, head_dim=64, dtype=torch.float32, seed=1)
    check_attention(triton_kernels.paged_attention, case, torch.float32)


@pytest.mark.parametrize(
    ("dtype", "group", "head_dim", "num_splits"),
    [(torch.float32, 3, 64, 3), (torch.float16, 8, 128, 4), (torch.float32, 1, 64, 16)],
    ids=lambda v: DTYPE_NAMES.get(v, v) if isinstance(v, torch.dtype) else None,
)
def test_split_kv_decode(triton_kernels, dtype, group, head_dim, num_splits):
    """Flash-decoding: partials per KV split, then the reduce; 16 splits leave some empty."""
    case = paged_case([1, 1, 1], [1, 70, 100], num_kv_heads=2, group=group, head_dim=head_dim, dtype=dtype)

    def run(*args):
        return triton_kernels.attention.unified_attention(*args, num_kv_splits=num_splits)

    check_attention(run, case, dtype)


def test_split_kv_handles_multi_token_sequences(triton_kernels):
    case = paged_case([1, 5, 3], [40, 37, 70], num_kv_heads=1, group=3, head_dim=64, dtype=torch.float32)

    def run(*args):
        return triton_kernels.attention.unified_attention(*args, num_kv_splits=3)

    check_attention(run, case, torch.float32)


def test_split_choice(triton_kernels):
    choose = triton_kernels.attention.choose_num_kv_splits
    sms = 132
    # Decode, 8 sequences x 3 KV heads, long context: far fewer programs than SMs, so split.
    assert 1 < choose(8, 8, 3, 4096, sms) <= triton_kernels.attention.MAX_KV_SPLITS
    assert choose(9, 8, 3, 4096, sms) == 1  # a prefill or verify in the batch
    assert choose(256, 256, 8, 4096, sms) == 1  # the GPU is full already
    assert choose(8, 8, 3, 128, sms) == 1  # too short to be worth a reduce
    # Each count is a compiled variant: whatever the batch and context, only a few counts are ever chosen.
    chosen = {choose(s, s, h, ctx, sms) for s in range(1, 64) for h in (1, 2, 3, 8) for ctx in range(16, 9000, 112)}
    assert chosen == set(triton_kernels.attention.KV_SPLIT_COUNTS)


def test_store_kvcache_matches_reference(triton_kernels):
    """Key/value as strided views into a fused qkv (as the model passes them), slot -1 skipped."""
    num_kv_heads, head_dim = 3, 64
    for dtype in (torch.float32, torch.float16):
        qkv = torch.randn(6, (9 + 2 * num_kv_heads) * head_dim).to(dtype)
        _, k, v = qkv.split([9 * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        k, v = k.view(6, num_kv_heads, head_dim), v.view(6, num_kv_heads, head_dim)
        slots = torch.tensor([3, -1, 17, 8, -1, 39])
        caches = [torch.zeros(5, BLOCK_SIZE, num_kv_heads, head_dim, dtype=dtype) for _ in range(4)]
        reference.store_kvcache(k, v, caches[0], caches[1], slots)
        triton_kernels.store_kvcache(k, v, caches[2], caches[3], slots)
        assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
        assert caches[2].abs().sum() > 0


def test_dispatch_picks_triton_for_cuda_tensors(triton_kernels):
    for name in ("paged_attention", "store_kvcache", "rejection_sample"):
        assert kernels._impl(name, "cuda") is getattr(triton_kernels, name)
        assert kernels._impl(name, "cpu") is getattr(
            cpu_ops if cpu_available() and hasattr(cpu_ops, name) else reference, name
        )


def test_bench_gpu_kernels_refuses_without_cuda(capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present: the refusal does not apply")
    from workbench.cli import main

    assert main(["bench", "gpu_kernels"]) == 2
    err = capsys.readouterr().err
    assert "workbench: error: bench gpu_kernels needs a CUDA GPU (torch.cuda.is_available() is False)" in err


def test_bench_gpu_kernels_cases_and_report_on_cpu(triton_kernels):
    """The GPU bench's inputs and tables, checked here on CPU (its timings need CUDA)."""
    from workbench.bench import gpu_kernels as bench

    shape = bench.AttentionShape("tiny heads", 6, 2, 64, block_size=8)
    case = bench.paged_case([1, 4, 1], [9, 20, 1], shape, torch.float32, device="cpu")
    assert bench._rel_error(triton_kernels.paged_attention(**case), reference.paged_attention(**case)) < 1e-5
    for ngram in (False, True):
        rejection = bench.rejection_case(6, 3, 40, ngram, device="cpu")
        assert torch.equal(triton_kernels.rejection_sample(**rejection), reference.rejection_sample(**rejection))
    check = {"kernel": "store_kvcache", "case": "c", "error": 0.0, "bound": 0.0, "ok": True}
    timing = {
        "kernel": "decode attention",
        "workload": "w",
        "ms": 1.5,
        "achieved": "3000 GB/s",
        "of_copy": 0.75,
        "torch_ms": 4.0,
    }
    throughput = {
        "model": "m",
        "num_requests": 4,
        "hf_batch_size": 32,
        "engine_tok_s": 900.0,
        "hf_tok_s": 300.0,
        "ratio": 3.0,
    }
    result = {
        "gpu": "Fake GPU",
        "checks": [check],
        "timings": [timing],
        "copy_gbs": 4000.0,
        "throughput": throughput,
        "settings": {},
    }
    text = bench.format_text(result)
    assert "GPU: Fake GPU" in text and "75%" in text and "ratio 3.00x" in text
    markdown = bench.format_markdown(result, "workbench bench gpu_kernels")
    assert markdown.startswith("## Kernels on Fake GPU") and "| decode attention | w | 1.500 |" in markdown
    failed = {**result, "checks": [{**check, "ok": False}], "timings": None, "throughput": None}
    assert "timings skipped" in bench.format_text(failed)
