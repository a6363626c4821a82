"""The free block queue and the block pool: order, the null block, allocation and freeing."""

import pytest

from engine.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from engine.events import EventLog


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


@pytest.fixture
def queue_and_blocks() -> tuple[FreeKVCacheBlockQueue, list[KVCacheBlock]]:
    blocks = [KVCacheBlock(i) for i in range(6)]
    return FreeKVCacheBlockQueue(blocks), blocks


def test_free_queue_starts_in_id_order_and_pops_from_the_head(queue_and_blocks):
    queue, blocks = queue_and_blocks
    assert queue.num_free_blocks == 6
    assert ids(queue.get_all_free_blocks()) == [0, 1, 2, 3, 4, 5]
    assert queue.popleft() is blocks[0]
    assert queue.popleft() is blocks[1]
    assert ids(queue.get_all_free_blocks()) == [2, 3, 4, 5]
    assert queue.num_free_blocks == 4


def test_free_queue_remove_from_the_middle_then_append_at_the_tail(queue_and_blocks):
    queue, blocks = queue_and_blocks
    queue.remove(blocks[3])
    assert ids(queue.get_all_free_blocks()) == [0, 1, 2, 4, 5]
    assert blocks[3].prev_free_block is None and blocks[3].next_free_block is None
    queue.remove(blocks[0])  # the head
    queue.remove(blocks[5])  # the tail
    assert ids(queue.get_all_free_blocks()) == [1, 2, 4]
    queue.append(blocks[3])
    queue.append_n([blocks[5], blocks[0]])
    assert ids(queue.get_all_free_blocks()) == [1, 2, 4, 3, 5, 0]
    assert queue.num_free_blocks == 6
    assert ids(queue.popleft_n(4)) == [1, 2, 4, 3]


def test_free_queue_remove_of_a_block_not_in_it_raises(queue_and_blocks):
    queue, blocks = queue_and_blocks
    queue.popleft()
    with pytest.raises(RuntimeError):
        queue.remove(blocks[0])
    assert queue.num_free_blocks == 5


def test_free_queue_pop_beyond_free_raises_and_takes_nothing(queue_and_blocks):
    queue, _ = queue_and_blocks
    with pytest.raises(ValueError):
        queue.popleft_n(7)
    assert queue.num_free_blocks == 6
    queue.popleft_n(6)
    with pytest.raises(ValueError):
        queue.popleft()
    assert queue.get_all_free_blocks() == []


def test_null_block_is_block_zero_and_never_handed_out():
    pool = BlockPool(num_blocks=5, enable_caching=True, events=EventLog())
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [1, 2, 3, 4]
    taken = pool.get_new_blocks(4)
    assert ids(taken) == [1, 2, 3, 4]
    assert all(b.ref_cnt == 1 for b in taken)
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks(taken)
    assert ids(pool.get_new_blocks(4)) == [1, 2, 3, 4]
    assert pool.null_block.ref_cnt == 0


def test_pool_free_prepends_uncached_blocks_in_the_given_order_only_when_the_last_reference_goes():
    # vLLM 0.33: with caching off every freed block goes to the head of the free queue (LIFO), the first given
    # first in line
    pool = BlockPool(num_blocks=5, enable_caching=False, events=EventLog())
    a, b, c = pool.get_new_blocks(3)
    pool.touch([b])  # a second holder
    pool.free_blocks([c, b, a])
    assert b.ref_cnt == 1
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [3, 1, 4]
    pool.free_blocks([b])
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [2, 3, 1, 4]
    assert pool.usage().used == 0


def test_pool_free_sends_cached_blocks_to_the_tail_lru_and_uncached_ones_to_the_head_lifo():
    # vLLM 0.33's free_blocks: a block that holds a hash may be hit again, so it waits at the tail and is evicted
    # last (LRU); one without a hash can never be hit, so it is reused first
    pool = BlockPool(num_blocks=7, enable_caching=True, events=EventLog())
    a, b, c, d = pool.get_new_blocks(4)  # 1 2 3 4; 5 6 stay free
    pool.cache_full_blocks([a, b], [b"ha", b"hb"], 0, 2)  # a and b are full and cached; c and d are not
    pool.free_blocks([d, c, b, a])  # a request's blocks, tail first
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [4, 3, 5, 6, 2, 1]
    assert pool.usage().cached_free == 2
    # the next allocation takes the uncached blocks freed last, then the never-used ones; the cached ones last
    assert ids(pool.get_new_blocks(4)) == [4, 3, 5, 6]
    assert pool.get_cached_block(b"hb") is b and pool.get_cached_block(b"ha") is a
    assert ids(pool.get_new_blocks(1)) == [2]  # evicted only now
    assert pool.get_cached_block(b"hb") is None and pool.get_cached_block(b"ha") is a


def test_two_blocks_may_hold_the_same_hash_and_a_lookup_takes_the_first_cached():
    # vLLM 0.33 does not de-duplicate: two requests that compute the same block at once both cache it
    pool = BlockPool(num_blocks=5, enable_caching=True, events=EventLog())
    first, second = pool.get_new_blocks(2)
    pool.cache_full_blocks([first], [b"h"], 0, 1)
    pool.cache_full_blocks([second], [b"h"], 0, 1)
    assert (first.block_hash, second.block_hash) == (b"h", b"h")
    assert pool.get_cached_block(b"h") is first
    pool.free_blocks([first, second])
    assert ids(pool.get_new_blocks(2)) == [3, 4]
    assert ids(pool.get_new_blocks(1)) == [1]  # evicts the first copy: the second one still answers
    assert pool.get_cached_block(b"h") is second
    assert ids(pool.get_new_blocks(1)) == [2]
    assert pool.get_cached_block(b"h") is None
