"""Why a prefix lookup stopped where it did: the reason (engine/reasons.py) a `prefix.lookup` event carries.

The hit is the longest chain of cached blocks that starts the request. Where it stops, one of: what is left is
shorter than one block; the next full block holds the last token (the hit is capped at num_tokens - 1); that
block's hash was cached and evicted (the block pool remembers when, why and for whom); the same tokens are
cached under another salt; the nearest cached continuation of the hit differs at some token; or nothing cached
continues it. Computed only at a lookup, from what the block pool keeps for it (each cached block's tokens and
salt, cached blocks by parent hash, recent evictions by hash).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice

from engine.core.block_hash import BlockHash
from engine.core.block_pool import BlockPool, KVCacheBlock
from engine.reasons import (
    CappedAtLastToken,
    Evicted,
    NotCached,
    OtherSalt,
    PartialBlock,
    Reason,
    TokenDiffers,
)
from engine.request import Request

# Siblings compared at a miss, most recently cached first: a bound on the lookup's cost, whatever the cache holds.
MAX_SIBLINGS_COMPARED = 32


def why_missed(
    pool: BlockPool, request: Request, hashes: Sequence[BlockHash], num_hits: int, block_size: int
) -> Reason:
    """The reason the request's hit stops after `num_hits` blocks (`hashes`: its full blocks' hashes)."""
    num_tokens = request.num_tokens
    left = num_tokens - num_hits * block_size
    if left < block_size:
        return PartialBlock(num_tokens=left, block_size=block_size)
    if num_hits == (num_tokens - 1) // block_size:  # exactly one full block is left, and it holds the last token
        return CappedAtLastToken(num_tokens=num_tokens, block_index=num_hits)
    evicted = pool.evictions.get(hashes[num_hits])
    if evicted is not None:
        block_id, step, cause, for_request = evicted
        return Evicted(block_index=num_hits, block_id=block_id, step=step, cause=cause, for_request=for_request)
    return _nearest_sibling(pool, request, hashes, num_hits, block_size)


def _nearest_sibling(
    pool: BlockPool, request: Request, hashes: Sequence[BlockHash], index: int, block_size: int
) -> Reason:
    """Compare block `index` with the cached blocks after the same prefix (the same parent hash; for the first
    block, every cached first block): the one sharing the most leading tokens is the nearest chain."""
    parent = hashes[index - 1] if index else None
    siblings = list(islice(reversed(pool.children.get(parent, {}).values()), MAX_SIBLINGS_COMPARED))
    tokens = request.all_token_ids[index * block_size : (index + 1) * block_size]
    best: KVCacheBlock | None = None
    best_common = -1
    for block in siblings:
        if not block.token_ids:  # cached without its tokens (the block pool used alone): nothing to compare
            continue
        common = _common_prefix(tokens, block.token_ids)
        if common > best_common:
            best, best_common = block, common
    if best is None:
        return NotCached(block_index=index)
    if best_common == len(tokens):  # the same tokens, another hash: only a salt (first block's extra keys) differs
        return OtherSalt(
            block_index=index, cache_salt=request.cache_salt, cached_salt=best.cache_salt, cached_block_id=best.block_id
        )
    return TokenDiffers(
        block_index=index,
        position=index * block_size + best_common,
        token_id=tokens[best_common],
        cached_token_id=best.token_ids[best_common],
        cached_block_id=best.block_id,
    )


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))
