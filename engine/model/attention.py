"""Per-step attention metadata, shared by every layer of the model, and the paged KV cache tensors it
addresses."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


def allocate_kv_caches(model, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (K, V) pair per layer, each [num_blocks, block_size, kv heads, head dim]."""
    shape = (num_blocks, block_size, model.shape.num_kv_heads, model.shape.head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(model.shape.num_layers)]
