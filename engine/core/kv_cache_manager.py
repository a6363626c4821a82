"""The KV cache manager: which blocks each request holds, prefix-cache lookups, and slot allocation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.core.block_hash import HASH_FUNCTIONS, update_block_hashes
from engine.core.block_pool import BlockPool, KVCacheBlock
from engine.core.prefix_miss import why_missed
from engine.events import EventLog, KVAllocated, KVFreed, KVUsage, PrefixLookup, PrefixSkipped
from engine.reasons import NotEnoughBlocks, PromptLogprobs
from engine.request import Request

if TYPE_CHECKING:
    from engine.distributed.kv_events import KVEvent


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    """Prefix-cache queries and hits, in tokens, and how many lookups counted them."""

    queries: int = 0
    hits: int = 0
    requests: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Owns each request's block list (`req_to_blocks`) and how many of those blocks are cached; turns
    "schedule n more tokens of this request" into blocks taken from the pool; says why the last allocate_slots
    refused (`refusal`)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        hash_algo: str,
        events: EventLog,
        max_model_len: int | None = None,
        enable_kv_cache_events: bool = False,
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.hash_fn = HASH_FUNCTIONS[hash_algo]
        self.events = events
        self.block_pool = BlockPool(num_blocks, enable_caching, events, enable_kv_cache_events)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        self.stats = PrefixCacheStats()
        self.refusal: NotEnoughBlocks | None = None  # why the last allocate_slots that returned None did

    @property
    def num_usable_blocks(self) -> int:
        return self.block_pool.num_blocks - 1

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest chain of cached blocks that starts the request, and how many tokens it covers.
        The hit is capped one token short of the whole sequence: the last token must be computed to sample."""
        if not self.enable_caching:
            return [], 0
        # As vLLM: a request that wants prompt logprobs computes its whole prompt (a hit has no logits to give).
        if request.sampling_params.prompt_logprobs is not None:
            self.events.emit(PrefixSkipped, request_id=request.request_id, reason=PromptLogprobs())
            return [], 0
        hashes = update_block_hashes(request, self.block_size, self.hash_fn)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        self.stats.requests += 1
        self.stats.queries += request.num_tokens
        self.stats.hits += num_hit_tokens
        self.events.emit(
            PrefixLookup,
            request_id=request.request_id,
            num_queried_blocks=max_hit_blocks,
            num_hit_blocks=len(hits),
            num_hit_tokens=num_hit_tokens,
            hit_block_ids=tuple(b.block_id for b in hits),
            miss=why_missed(self.block_pool, request, hashes, len(hits), self.block_size),
        )
        return hits, num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` (plus lookahead slots for draft tokens) after the request's computed
        tokens and its new prefix hits. Returns the newly allocated blocks, or None if the pool is short
        (then nothing changes). `delay_cache_blocks`: the new blocks get their KV later (an asynchronous load),
        so they enter the prefix cache only when `cache_blocks` is called. `full_sequence_must_fit` (vLLM's
        admission gate, `scheduler_reserve_full_isl`): refuse unless the request's whole sequence would fit now,
        not only this chunk, so that admitting it cannot force a preemption later in its prefill. `reserved_blocks`:
        free blocks this allocation must leave to others (vLLM's, for an asynchronous load)."""
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        if full_sequence_must_fit:
            num_tokens = (
                request.num_tokens if self.max_model_len is None else min(request.num_tokens, self.max_model_len)
            )
            if self._refuse(self._num_blocks_to_allocate(blocks, new_computed_blocks, num_tokens), whole=True):
                return None
        num_slots = num_computed + num_new_tokens + num_lookahead_tokens
        if self.max_model_len is not None:  # as vLLM: lookahead slots for drafts never reach past the last position
            num_slots = min(num_slots, self.max_model_len)
        if self._refuse(self._num_blocks_to_allocate(blocks, new_computed_blocks, num_slots) + reserved_blocks):
            return None
        num_new_blocks = max(0, cdiv(num_slots, self.block_size) - len(blocks) - len(new_computed_blocks))
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            self.num_cached_block[request.request_id] = len(blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks, request.request_id)
        blocks.extend(new_blocks)
        if new_blocks or new_computed_blocks:
            self.events.emit(
                KVAllocated,
                request_id=request.request_id,
                new_block_ids=tuple(b.block_id for b in new_blocks),
                block_ids=tuple(b.block_id for b in blocks),
                hit_block_ids=tuple(b.block_id for b in new_computed_blocks),
            )
        if not delay_cache_blocks:
            # draft tokens are not in request.num_tokens, so blocks holding them are never cached
            self.cache_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    def _refuse(self, num_needed: int, whole: bool = False) -> bool:
        """Whether the free queue is short of `num_needed` blocks; if so, `refusal` says by how much."""
        num_free = self.block_pool.get_num_free_blocks()
        if num_needed <= num_free:
            return False
        self.refusal = NotEnoughBlocks(
            num_blocks_needed=num_needed,
            num_free_blocks=num_free,
            num_cached_free_blocks=self.block_pool.num_cached_free,
            whole_sequence=whole,
        )
        return True

    def _num_blocks_to_allocate(
        self, blocks: list[KVCacheBlock], new_computed_blocks: list[KVCacheBlock], num_slots: int
    ) -> int:
        """Free blocks that `num_slots` token slots would use up: new blocks past those held and hit, plus hit
        blocks nobody holds (they sit in the free queue, so taking them uses up free blocks too)."""
        num_new_blocks = max(0, cdiv(num_slots, self.block_size) - len(blocks) - len(new_computed_blocks))
        return num_new_blocks + sum(1 for b in new_computed_blocks if b.ref_cnt == 0)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Enter the request's full blocks up to `num_tokens` into the prefix cache (a no-op without caching)."""
        if not self.enable_caching:
            return
        rid = request.request_id
        num_full = num_tokens // self.block_size
        num_cached = self.num_cached_block.get(rid, 0)
        if num_full <= num_cached:
            return
        hashes = update_block_hashes(request, self.block_size, self.hash_fn)
        self.block_pool.cache_full_blocks(
            self.req_to_blocks[rid], hashes, num_cached, num_full, request, self.block_size
        )
        self.num_cached_block[rid] = num_full

    def free(self, request: Request) -> None:
        """Release a request's blocks, tail first, so its prefix outlives its tail in the cache."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        num_cached = self.num_cached_block.pop(request.request_id, 0)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks), request.request_id)
            # Blocks are cached when allocated, before the forward computes them. A request preempted in the step
            # that allocated them leaves them uncomputed: their hashes must not outlive it. vLLM keeps them (a
            # later hit would read KV never written; docs/FIDELITY.md): they stay where vLLM's free queue puts
            # them, so every block id still matches vLLM's, and only lose their hashes.
            self.block_pool.forget_hashes(blocks[request.num_computed_tokens // self.block_size : num_cached])
            self.events.emit(KVFreed, request_id=request.request_id, block_ids=tuple(b.block_id for b in blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def take_events(self) -> list[KVEvent]:
        """The KV cache events (vLLM's format) recorded since the last call; empty unless they are on."""
        return self.block_pool.take_events()

    def usage(self) -> KVUsage:
        return self.block_pool.usage()
