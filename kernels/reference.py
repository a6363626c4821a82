"""Torch reference kernels for the paged KV cache (the CPU path, and the oracle for Triton).

KV cache layout, one pair per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
A token's flat slot is ``block_id * block_size + offset``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[T, Hkv, D]`` into their flat slots; slot -1 is skipped."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    slots = slot_mapping.to(torch.int64)
    valid = slots >= 0
    if not bool(valid.all()):
        slots, key, value = slots[valid], key[valid], value[valid]
    flat_k.index_copy_(0, slots, key.to(k_cache.dtype))
    flat_v.index_copy_(0, slots, value.to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged context.

    ``q`` ``[T, Hq, D]`` holds the new tokens of all sequences back to back
    (``query_start_loc`` ``[S+1]``); ``seq_lens`` ``[S]`` counts each sequence's whole
    context, new tokens included, which must already be in the cache. New token ``i``
    of a sequence with ``q_len`` new tokens sees the keys at positions
    ``< seq_len - q_len + i + 1``. Returns ``[T, Hq, D]``.
    """
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decodes = [s for s in range(len(lens)) if starts[s + 1] - starts[s] == 1]
    if decodes:
        _decode_batch(q, k_cache, v_cache, block_tables, lens, starts, decodes, scale, out)
    for s in range(len(lens)):
        q_len = starts[s + 1] - starts[s]
        if q_len > 1:
            rows = slice(starts[s], starts[s + 1])
            out[rows] = _prefill_one(q[rows], k_cache, v_cache, block_tables[s], lens[s], scale)
    return out


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` block ids -> ``[..., n * block_size, Hkv, D]`` contiguous K or V."""
    _, block_size, num_kv_heads, head_dim = cache.shape
    picked = cache.index_select(0, block_ids.reshape(-1).to(torch.int64))
    return picked.view(*block_ids.shape[:-1], block_ids.shape[-1] * block_size, num_kv_heads, head_dim)


def _decode_batch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lens: list[int],
    starts: list[int],
    decodes: list[int],
    scale: float,
    out: torch.Tensor,
) -> None:
    """All single-token sequences in one padded SDPA.

    The query heads sharing a KV head are folded into the query-length axis
    (``[B, Hkv, group, D]``): with one query token there is no causal structure,
    so this is exact and avoids repeating K/V per query head.
    """
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    group = q.shape[1] // num_kv_heads
    max_len = max(lens[s] for s in decodes)
    num_blocks = -(-max_len // block_size)
    seq_idx = torch.tensor(decodes, dtype=torch.int64, device=block_tables.device)
    tables = block_tables.index_select(0, seq_idx)[:, :num_blocks]
    k = _gather(k_cache, tables)[:, :max_len].transpose(1, 2)
    v = _gather(v_cache, tables)[:, :max_len].transpose(1, 2)
    tok_idx = torch.tensor([starts[s] for s in decodes], dtype=torch.int64, device=q.device)
    qd = q.index_select(0, tok_idx).view(len(decodes), num_kv_heads, group, head_dim)
    mask = None
    dec_lens = [lens[s] for s in decodes]
    if min(dec_lens) != max_len:
        lens_t = torch.tensor(dec_lens, device=q.device)
        mask = torch.arange(max_len, device=q.device)[None, :] < lens_t[:, None]
        mask = mask[:, None, None, :]
    o = F.scaled_dot_product_attention(qd, k, v, attn_mask=mask, scale=scale)
    out.index_copy_(0, tok_idx, o.reshape(len(decodes), -1, head_dim))


def _prefill_one(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
) -> torch.Tensor:
    """One sequence with several new tokens (prefill, chunk over cache, or verify)."""
    q_len = q.shape[0]
    num_blocks = -(-seq_len // k_cache.shape[1])
    k = _gather(k_cache, block_table[:num_blocks])[:seq_len]
    v = _gather(v_cache, block_table[:num_blocks])[:seq_len]
    mask = None
    if q_len != seq_len:
        # New token i sits at absolute position seq_len - q_len + i.
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
    # A leading batch axis: 4-D inputs take the fused CPU kernel (2x faster than 3-D).
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1)
