"""The torch reference kernels against a naive per-sequence loop over contiguous K/V."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import reference

HEAD_DIM = 16
BLOCK_SIZE = 4
NUM_BLOCKS = 64


def naive_attention(q, keys, values, q_lens, seq_lens, scale, offset=0):
    """Explicit softmax per sequence; ``offset`` shifts the causal rule (0 = correct)."""
    outs, start = [], 0
    for k, v, q_len, seq_len in zip(keys, values, q_lens, seq_lens):
        qs = q[start : start + q_len].float()
        start += q_len
        group = qs.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, 1).float()
        v = v.repeat_interleave(group, 1).float()
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        q_pos = torch.arange(q_len)[:, None] + seq_len - q_len
        allowed = torch.arange(seq_len)[None, :] < q_pos + 1 + offset
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outs)


def build_case(q_lens, seq_lens, num_kv_heads, group, seed=0):
    """Random contiguous K/V per sequence, scattered into a cache with scrambled blocks."""
    gen = torch.Generator().manual_seed(seed)
    num_heads = num_kv_heads * group
    k_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    perm = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    max_blocks = max(-(-n // BLOCK_SIZE) for n in seq_lens) + 1
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    keys, values = [], []
    for s, seq_len in enumerate(seq_lens):
        n_blocks = -(-seq_len // BLOCK_SIZE)
        ids = [perm.pop() for _ in range(n_blocks)]
        block_tables[s, :n_blocks] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(seq_len, num_kv_heads, HEAD_DIM, generator=gen)
        v = torch.randn(seq_len, num_kv_heads, HEAD_DIM, generator=gen)
        slots = torch.tensor([ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(seq_len)])
        reference.store_kvcache(k, v, k_cache, v_cache, slots)
        keys.append(k)
        values.append(v)
    q = torch.randn(sum(q_lens), num_heads, HEAD_DIM, generator=gen)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    return q, k_cache, v_cache, block_tables, seq_lens_t, qsl, keys, values


MIXES = {
    "decode_only_equal": ([1, 1, 1], [9, 9, 9]),
    "decode_only_ragged": ([1, 1, 1, 1], [1, 4, 5, 17]),
    "whole_prefill": ([7], [7]),
    "prefill_block_multiple": ([8], [8]),
    "chunk_over_cache": ([5], [13]),
    "chunk_at_block_boundary": ([4], [12]),
    "verify": ([3], [10]),
    "mixed": ([1, 6, 1, 3, 9, 1], [20, 6, 4, 11, 17, 1]),
}


@pytest.mark.parametrize("mix", MIXES.values(), ids=MIXES.keys())
@pytest.mark.parametrize("group", [1, 3])
def test_paged_attention_matches_naive(mix, group):
    q_lens, seq_lens = mix
    q, kc, vc, bt, sl, qsl, keys, values = build_case(q_lens, seq_lens, 2, group)
    scale = HEAD_DIM**-0.5
    out = reference.paged_attention(q, kc, vc, bt, sl, qsl, scale)
    expected = naive_attention(q, keys, values, q_lens, seq_lens, scale)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("mix", "offset"), [("verify", -1), ("verify", 1), ("chunk_over_cache", 1), ("whole_prefill", 1)]
)
def test_wrong_causal_offset_is_detected(mix, offset):
    q_lens, seq_lens = MIXES[mix]
    q, kc, vc, bt, sl, qsl, keys, values = build_case(q_lens, seq_lens, 2, 3)
    scale = HEAD_DIM**-0.5
    out = reference.paged_attention(q, kc, vc, bt, sl, qsl, scale)
    wrong = naive_attention(q, keys, values, q_lens, seq_lens, scale, offset=offset)
    assert not torch.allclose(out, wrong, atol=1e-3)


def test_store_kvcache_writes_slots_and_skips_minus_one():
    kc = torch.zeros(4, BLOCK_SIZE, 2, HEAD_DIM)
    vc = torch.zeros_like(kc)
    key = torch.randn(3, 2, HEAD_DIM)
    value = torch.randn(3, 2, HEAD_DIM)
    reference.store_kvcache(key, value, kc, vc, torch.tensor([13, -1, 2]))
    torch.testing.assert_close(kc[3, 1], key[0])
    torch.testing.assert_close(vc[3, 1], value[0])
    torch.testing.assert_close(kc[0, 2], key[2])
    torch.testing.assert_close(vc[0, 2], value[2])
    written = torch.zeros(4 * BLOCK_SIZE, dtype=torch.bool)
    written[[13, 2]] = True
    assert kc.view(-1, 2, HEAD_DIM)[~written].abs().sum() == 0
    assert vc.view(-1, 2, HEAD_DIM)[~written].abs().sum() == 0


def test_dispatch_on_cpu_uses_the_cpu_ops_or_the_reference():
    from kernels.cpu import ops
    from kernels.cpu.build import available

    q, kc, vc, bt, sl, qsl, _, _ = build_case([1, 3], [5, 3], 1, 2)
    torch.testing.assert_close(
        kernels.paged_attention(q, kc, vc, bt, sl, qsl, 0.25),
        reference.paged_attention(q, kc, vc, bt, sl, qsl, 0.25),
    )
    for name in ("paged_attention", "store_kvcache"):
        expected = getattr(ops, name) if available() else getattr(reference, name)
        assert kernels._impl(name, "cpu") is expected, name
    assert kernels._impl("rejection_sample", "cpu") is reference.rejection_sample  # no C++ op: the reference runs
