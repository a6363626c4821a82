"""Per-step attention metadata, shared by every layer of the model, and the paged KV cache tensors it
addresses."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels
from engine.model.hugepages import zeros_on_hugepages


@dataclass
class AttentionMetadata:
    """Per-step attention inputs shared by every layer (built by the model runner).

    The step's ``T`` new tokens of ``S`` sequences are flattened back to back; sequence
    ``s`` owns rows ``query_start_loc[s]:query_start_loc[s + 1]``.
    """

    # [T] int64: flat KV slot of each new token (block_id * block_size + offset); -1 = do not write.
    slot_mapping: torch.Tensor
    # [S, max_blocks] int32: each sequence's block ids, padded with 0 (any valid block id:
    # the decode path may read padding, then masks it out).
    block_tables: torch.Tensor
    seq_lens: torch.Tensor  # [S] int32: total context per sequence, new tokens included
    query_start_loc: torch.Tensor  # [S+1] int32: cumulative new-token counts, starting at 0
    # [T] int64 where a draft tree is verified: each row's mask of the 64 keys before it (engine/spec_decode/tree.py,
    # kernels.tree_attention); None: causal attention
    tree_mask: torch.Tensor | None = None


def allocate_kv_caches(
    model, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (K, V) pair per layer, each [num_blocks, block_size, kv heads, head dim], zeroed; on a CPU all of them in
    one arena on huge pages (engine/model/hugepages.py: a decode step's attention reads faster there)."""
    shape = (num_blocks, block_size, model.shape.num_kv_heads, model.shape.head_dim)
    layers = model.shape.num_layers
    if device.type == "cpu":
        caches, _ = zeros_on_hugepages([shape] * (2 * layers), dtype)
    else:
        caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(2 * layers)]
    return [(caches[2 * i], caches[2 * i + 1]) for i in range(layers)]


def sliding_window_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttentionMetadata, scale: float, window: int
) -> torch.Tensor:
    """Paged attention in which the new token at position ``p`` sees only the keys at ``p - window < j <= p``
    (Hugging Face's and vLLM's sliding window). While every context fits the window that is plain causal attention,
    so the kernel runs; otherwise each sequence gathers just the blocks its window covers, in torch."""
    lens = attn.seq_lens.tolist()
    if max(lens) <= window:
        return kernels.paged_attention(
            q, k_cache, v_cache, attn.block_tables, attn.seq_lens, attn.query_start_loc, scale
        )
    starts = attn.query_start_loc.tolist()
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)
    for s, seq_len in enumerate(lens):
        rows = slice(starts[s], starts[s + 1])
        first = seq_len - (starts[s + 1] - starts[s])  # position of the sequence's first new token
        lo = max(0, first - window + 1)  # the earliest key any of its new tokens sees
        blocks = attn.block_tables[s, lo // block_size : -(-seq_len // block_size)].to(torch.int64)
        skip = lo % block_size
        k = k_cache[blocks].flatten(0, 1)[skip : skip + seq_len - lo]  # [keys, Hkv, D]
        v = v_cache[blocks].flatten(0, 1)[skip : skip + seq_len - lo]
        q_pos = torch.arange(first, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(lo, seq_len, device=q.device)[None, :]
        mask = (k_pos <= q_pos) & (k_pos > q_pos - window)
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, keys, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        out[rows] = torch.nn.functional.scaled_dot_product_attention(
            q[rows].transpose(0, 1), k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale
        ).transpose(0, 1)
    return out
