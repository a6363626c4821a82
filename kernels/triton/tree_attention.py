"""Tree attention in Triton: paged attention in which each query row carries a mask of the 64 keys just before it
(a draft tree verified in one pass), against ``kernels.reference.tree_attention``.

A program owns one query token and one KV head: the ``group`` query heads sharing that head are one ``[GROUP, D]``
tile. It walks the keys up to the token's own slot position in tiles of ``TILE_SIZE`` through the block table, with
an online softmax; a key ``off`` slots behind the row is dropped when ``off < 64`` and bit ``off`` of the row's mask
is clear. Verification batches are small (a few tokens per request), so one program per token is enough here;
``paged_attention``'s query blocks and KV splits are what a long prefill would want.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE_SIZE = 32
MASK_BITS = tl.constexpr(64)  # a global a kernel reads must be a constexpr
LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _tree_attention_kernel(
    out_ptr,  # [T, Hq, D]
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    v_cache_ptr,
    block_tables_ptr,  # [S, max_blocks] int32
    seq_lens_ptr,  # [S]
    query_start_loc_ptr,  # [S + 1]
    tree_mask_ptr,  # [T] int64
    qk_scale,  # softmax scale * log2(e)
    num_seqs,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_k_b,
    stride_k_s,
    stride_k_h,
    stride_bt,
    GROUP: tl.constexpr,
    GROUP_PADDED: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
):
    t = tl.program_id(0)
    kv_head = tl.program_id(1)
    # the token's sequence: the last s with query_start_loc[s] <= t
    left: tl.int32 = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        if tl.load(query_start_loc_ptr + mid) <= t:
            left = mid + 1
        else:
            right = mid
    seq = left - 1
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    pos = tl.load(seq_lens_ptr + seq) - q_len + (t - q_start)  # the row's own slot position
    mask_bits = tl.load(tree_mask_ptr + t)

    g = tl.arange(0, GROUP_PADDED)
    d = tl.arange(0, HEAD_SIZE_PADDED)
    g_ok = g < GROUP
    d_ok = d < HEAD_SIZE
    heads = kv_head * GROUP + g
    q = tl.load(
        q_ptr + t * stride_q_t + heads[:, None] * stride_q_h + d[None, :], mask=g_ok[:, None] & d_ok[None, :]
    ).to(tl.float32)

    m = tl.full([GROUP_PADDED], float("-inf"), tl.float32)
    denom = tl.zeros([GROUP_PADDED], tl.float32)
    acc = tl.zeros([GROUP_PADDED, HEAD_SIZE_PADDED], tl.float32)
    for start in range(0, pos + 1, TILE):
        j = start + tl.arange(0, TILE)
        off = pos - j
        near = ((mask_bits >> tl.minimum(tl.maximum(off, 0), MASK_BITS - 1).to(tl.int64)) & 1) == 1
        seen = (off >= 0) & ((off >= MASK_BITS) | near)
        block = tl.load(block_tables_ptr + seq * stride_bt + j // BLOCK_SIZE, mask=off >= 0, other=0).to(tl.int64)
        kv_off = block * stride_k_b + (j % BLOCK_SIZE) * stride_k_s + kv_head * stride_k_h
        kv_mask = seen[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * qk_scale  # [GROUP_PADDED, TILE], log2 units
        s = tl.where(seen[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile with nothing seen yet: no NaN
        p = tl.exp2(s - m_safe[:, None])
        corr = tl.exp2(m - m_safe)
        denom = denom * corr + tl.sum(p, axis=1)
        acc = acc * corr[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(
        out_ptr + t * stride_o_t + heads[:, None] * stride_o_h + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=g_ok[:, None] & d_ok[None, :],
    )


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    tree_mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    num_tokens, num_heads, head_size = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    q = q.contiguous()
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    _tree_attention_kernel[(num_tokens, num_kv_heads)](
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        tree_mask.to(torch.int64),
        scale * LOG2E,
        seq_lens.shape[0],
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        GROUP_PADDED=max(triton.next_power_of_2(group), 1),
        HEAD_SIZE=head_size,
        HEAD_SIZE_PADDED=triton.next_power_of_2(head_size),
        BLOCK_SIZE=block_size,
        TILE=TILE_SIZE,
    )
    return out
