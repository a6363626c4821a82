"""The block pool: every KV block, the free block queue, and the map from block hash to cached blocks.

As vLLM 0.33 (vllm/v1/core/block_pool.py): a freed block that holds a hash waits at the tail of the free queue as
"cached-free" (LRU: a later request with the same prefix can take it back with `touch`; it is evicted lazily, only
when it reaches the head and is popped for a new allocation); a freed block without a hash, or every freed block
when prefix caching is off, goes to the head (LIFO: it is reused first). Two blocks may hold the same hash (two
requests computed the same prefix at once): both are cached, and a lookup takes the one cached first.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from engine.core.block_hash import BlockHash, hash_hex
from engine.events import EventLog, KVCached, KVEvicted, KVUsage
from engine.reasons import Eviction
from engine.request import Request

if TYPE_CHECKING:
    from engine.distributed.kv_events import KVEvent, KVEventRecorder


class KVCacheBlock:
    """One block of KV: its id, how many requests hold it, its hash once full and cached, and its free-list links;
    for the reasons (engine/reasons.py): the tokens and salt it was cached with, and who released it last, when."""

    __slots__ = (
        "block_id",
        "ref_cnt",
        "block_hash",
        "parent_hash",
        "prev_free_block",
        "next_free_block",
        "is_null",
        "token_ids",
        "cache_salt",
        "last_used_step",
        "last_used_by",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.parent_hash: BlockHash | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False
        self.token_ids: tuple[int, ...] = ()  # while cached: a miss names the first token that differs from these
        self.cache_salt: str | None = None
        self.last_used_step: int | None = None
        self.last_used_by: str | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={hash_hex(self.block_hash)})"


class FreeKVCacheBlockQueue:
    """Free blocks as an intrusive doubly linked list: O(1) remove from the middle (a prefix hit), popleft from
    the head (the least recently freed: evicted first), append at the tail. Two sentinels spare the edge cases."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free_block, block.prev_free_block = block, prev
            prev = block
        prev.next_free_block, self._tail.prev_free_block = self._tail, prev

    def popleft(self) -> KVCacheBlock:
        if self.num_free_blocks == 0:
            raise ValueError("No free blocks available")
        block = self._head.next_free_block
        assert block is not None  # the sentinels: a block in the list always has both neighbours
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"Cannot pop {n} blocks: only {self.num_free_blocks} free")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is None or block.next_free_block is None:
            raise RuntimeError(f"remove() called on a block that is not free: {block}")
        block.prev_free_block.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = block.prev_free_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block, block.prev_free_block = block, last
        block.next_free_block, self._tail.prev_free_block = self._tail, block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        """Put blocks at the head, in the given order (the first is popped first)."""
        nxt = self._head.next_free_block
        assert nxt is not None
        for block in reversed(blocks):
            nxt.prev_free_block, block.next_free_block = block, nxt
            nxt = block
        self._head.next_free_block, nxt.prev_free_block = nxt, self._head
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        out, block = [], self._head.next_free_block
        while block is not None and block is not self._tail:
            out.append(block)
            block = block.next_free_block
        return out


class BlockPool:
    """Owns all KV blocks: allocation, ref counts, the free queue, and the hash -> cached blocks map.

    Block 0 is the null block: never allocated, it pads block tables. With `enable_kv_cache_events`, it reports
    what enters and leaves the cache to a KVEventRecorder (vLLM's events, engine/distributed/kv_events.py).
    """

    def __init__(
        self, num_blocks: int, enable_caching: bool, events: EventLog, enable_kv_cache_events: bool = False
    ) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.events = events
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # hash -> {block id: block}, in the order they were cached (vLLM's BlockHashToBlockMap)
        self.cached_block_hash_to_block: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        self.num_cached_free = 0  # blocks in the free queue that still hold a hash
        # for the reasons of a prefix miss: cached blocks by their parent's hash (None: a first block), and the
        # last eviction of each hash (block id, step, cause, for whom), the oldest forgotten past 4 per pool block
        self.children: dict[BlockHash | None, dict[int, KVCacheBlock]] = {}
        self.evictions: dict[BlockHash, tuple[int, int, str, str | None]] = {}
        self._max_evictions = 4 * num_blocks
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.kv_events: KVEventRecorder | None = None
        if enable_kv_cache_events:  # imported only then: pyzmq and msgspec are needed only by KV events
            from engine.distributed.kv_events import KVEventRecorder

            self.kv_events = KVEventRecorder()

    # ---- prefix cache -------------------------------------------------------------------------
    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        blocks = self.cached_block_hash_to_block.get(block_hash)
        return next(iter(blocks.values())) if blocks else None

    def cache_full_blocks(
        self,
        blocks: list[KVCacheBlock],
        block_hashes: list[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        request: Request | None = None,
        block_size: int = 0,
    ) -> None:
        """Give blocks[num_cached_blocks:num_full_blocks] their hashes and enter them in the map. With KV cache events
        on, they are one BlockStored, which tells the `request`'s tokens they hold, `block_size` per block."""
        cached: list[int] = []  # indices of the blocks cached now
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None or block.is_null:
                continue  # a prefix hit: cached already
            block_hash = block_hashes[i]
            block.block_hash = block_hash
            block.parent_hash = block_hashes[i - 1] if i else None
            # another request may have computed the same block first: both copies are cached (vLLM does not
            # de-duplicate, so that block tables stay append-only)
            self.cached_block_hash_to_block.setdefault(block_hash, {})[block.block_id] = block
            self.children.setdefault(block.parent_hash, {})[block.block_id] = block
            if request is not None:
                block.token_ids = tuple(request.all_token_ids[i * block_size : (i + 1) * block_size])
                block.cache_salt = request.cache_salt if i == 0 else None
            cached.append(i)
            self.events.emit(
                KVCached,
                block_id=block.block_id,
                block_hash=hash_hex(block_hash),
                parent_hash=hash_hex(block.parent_hash),
            )
        if self.kv_events is not None:
            assert request is not None and block_size > 0, "a BlockStored tells the request's tokens"
            self.kv_events.stored(request, block_size, block_hashes, cached, num_cached_blocks, num_full_blocks)

    def uncache(self, block: KVCacheBlock, cause: str = "reused", for_request: str | None = None) -> None:
        """Forget a block's hash: it leaves the map and can no longer be hit (a BlockRemoved with events on).
        `cause` and `for_request` say why (engine/reasons.py's Eviction)."""
        block_hash = self._forget(block, cause, for_request)
        if block_hash is not None and self.kv_events is not None:
            self.kv_events.removed(block_hash)

    def _forget(self, block: KVCacheBlock, cause: str, for_request: str | None = None) -> BlockHash | None:
        """Take a block's hash out of the map and the block, and remember the eviction; returns the hash (None: it
        had none)."""
        block_hash = block.block_hash
        if block_hash is None:
            return None
        blocks = self.cached_block_hash_to_block.get(block_hash, {})
        blocks.pop(block.block_id, None)
        if not blocks:
            self.cached_block_hash_to_block.pop(block_hash, None)
        siblings = self.children.get(block.parent_hash, {})
        siblings.pop(block.block_id, None)
        if not siblings:
            self.children.pop(block.parent_hash, None)
        step = self.events.step
        self.evictions.pop(block_hash, None)  # re-inserted: the dict stays oldest first
        self.evictions[block_hash] = (block.block_id, step, cause, for_request)
        if len(self.evictions) > self._max_evictions:
            del self.evictions[next(iter(self.evictions))]
        reason = Eviction(
            cause=cause, for_request=for_request, last_used_step=block.last_used_step, last_used_by=block.last_used_by
        )
        self.events.emit(KVEvicted, block_id=block.block_id, block_hash=hash_hex(block_hash), reason=reason)
        block.block_hash = block.parent_hash = None
        block.token_ids, block.cache_salt = (), None
        return block_hash

    def _maybe_evict(self, block: KVCacheBlock, cause: str, for_request: str | None = None) -> None:
        if block.block_hash is not None:
            self.uncache(block, cause, for_request)
            self.num_cached_free -= 1

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take prefix-hit blocks: a cached-free one leaves the free queue; every one gains a reference."""
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.remove(block)
                self.num_cached_free -= 1
            block.ref_cnt += 1

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is in use."""
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        for block in [b for blocks in self.cached_block_hash_to_block.values() for b in blocks.values()]:
            self._forget(block, "reset")
        self.num_cached_free = 0
        if self.kv_events is not None:
            self.kv_events.cleared()  # one event for the lot, as vLLM's
        return True

    def take_events(self) -> list[KVEvent]:
        """The KV cache events (vLLM's) recorded since the last call, oldest first; none with events off."""
        return [] if self.kv_events is None else self.kv_events.take()

    # ---- allocation -----------------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int, for_request: str | None = None) -> list[KVCacheBlock]:
        """Pop `num_blocks` from the free queue's head for request `for_request`, evicting the cached ones."""
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            self._maybe_evict(block, "reused", for_request)
            block.ref_cnt = 1
        return blocks

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock], request_id: str | None = None) -> None:
        """Drop one reference from each; those that reach 0 join the free queue in the given order (callers pass a
        request's blocks tail first): cached ones at the tail (LRU: its tail is evicted before its prefix),
        the others at the head (LIFO: reused first, as they can never be hit). Each remembers `request_id` as the
        last to use it, now."""
        reuse_first: list[KVCacheBlock] = []
        reuse_last: list[KVCacheBlock] = []
        step = self.events.step
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.last_used_step, block.last_used_by = step, request_id
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (reuse_last if block.block_hash is not None and self.enable_caching else reuse_first).append(block)
        self.free_block_queue.prepend_n(reuse_first)
        self.free_block_queue.append_n(reuse_last)
        self.num_cached_free += len(reuse_last)

    def forget_hashes(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Uncache free blocks whose KV was never computed, where they stand in the free queue."""
        for block in blocks:
            if block.ref_cnt == 0 and block.block_hash is not None:
                self._maybe_evict(block, "uncomputed")

    # ---- figures --------------------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def usage(self) -> KVUsage:
        free_all = self.get_num_free_blocks()
        total = self.num_blocks - 1
        return KVUsage(
            total=total, used=total - free_all, cached_free=self.num_cached_free, free=free_all - self.num_cached_free
        )
