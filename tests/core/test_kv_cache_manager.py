"""KVCacheManager without prefix caching: exact block ids, shortage, free order, usage figures."""

import pytest

from engine.core.kv_cache_manager import KVCacheManager
from engine.events import EventLog
from tests.core.helpers import check_usage, free_ids, make_request

BLOCK_SIZE = 4


@pytest.fixture
def kv() -> KVCacheManager:
    events = EventLog()
    events.begin(1)
    return KVCacheManager(10, BLOCK_SIZE, False, "builtin", events)


def test_allocate_slots_gives_exact_block_ids_in_free_order(kv):
    r0, r1 = make_request("r0", 10), make_request("r1", 4)
    assert [b.block_id for b in kv.allocate_slots(r0, 10)] == [1, 2, 3]
    assert [b.block_id for b in kv.allocate_slots(r1, 4)] == [4]
    assert kv.get_block_ids("r0") == [1, 2, 3]
    assert free_ids(kv) == [5, 6, 7, 8, 9]
    check_usage(kv)


def test_allocate_slots_adds_a_block_only_when_a_block_boundary_is_crossed(kv):
    r0 = make_request("r0", 10)
    kv.allocate_slots(r0, 10)
    r0.num_computed_tokens = 10
    r0.append_output_token_ids(7)
    assert kv.allocate_slots(r0, 1) == []  # slot 10 lies in block 3 (slots 8..11)
    r0.num_computed_tokens = 12
    assert [b.block_id for b in kv.allocate_slots(r0, 1)] == [4]
    assert kv.get_block_ids("r0") == [1, 2, 3, 4]


def test_allocate_slots_reserves_lookahead_slots(kv):
    r0 = make_request("r0", 8)
    assert [b.block_id for b in kv.allocate_slots(r0, 8, num_lookahead_tokens=3)] == [1, 2, 3]


def test_lookahead_slots_stop_at_max_model_len():
    # a prompt one token short of max_model_len: its drafts can never be verified, so no block is taken for them
    # (it took a 4th block here, past the runner's block table, and failed every request in the step)
    events = EventLog()
    events.begin(1)
    kv = KVCacheManager(10, BLOCK_SIZE, False, "builtin", events, max_model_len=12)
    r0 = make_request("r0", 11)
    assert [b.block_id for b in kv.allocate_slots(r0, 11, num_lookahead_tokens=3)] == [1, 2, 3]


def test_allocate_slots_returns_none_when_short_and_changes_nothing(kv):
    r0, r1 = make_request("r0", 28), make_request("r1", 12)
    kv.allocate_slots(r0, 28)  # 7 of the 9 usable blocks
    before = (free_ids(kv), kv.usage(), kv.get_block_ids("r0"))
    assert kv.allocate_slots(r1, 12) is None
    assert (free_ids(kv), kv.usage(), kv.get_block_ids("r0")) == before
    assert kv.get_block_ids("r1") == []
    assert [e.kind for e in kv.events.events] == ["kv.allocated"]  # r0 only
    assert [b.block_id for b in kv.allocate_slots(r1, 8)] == [8, 9]


def test_freed_uncached_blocks_go_tail_first_to_the_head_of_the_queue_and_are_reused_first(kv):
    # vLLM 0.33: without prefix caching no block holds a hash, and a freed one goes to the head of the free queue
    # (LIFO): the blocks freed last are reused first
    r0, r1, r2 = make_request("r0", 12), make_request("r1", 8), make_request("r2", 4)
    kv.allocate_slots(r0, 12)  # 1 2 3
    kv.allocate_slots(r1, 8)  # 4 5
    kv.allocate_slots(r2, 4)  # 6
    kv.free(r0)
    assert free_ids(kv) == [3, 2, 1, 7, 8, 9]
    kv.free(r2)
    assert free_ids(kv) == [6, 3, 2, 1, 7, 8, 9]
    # the next allocation takes from the head: the blocks freed last go first
    r3 = make_request("r3", 16)
    assert [b.block_id for b in kv.allocate_slots(r3, 16)] == [6, 3, 2, 1]
    assert free_ids(kv) == [7, 8, 9]
    assert kv.get_block_ids("r0") == []
    freed = [e for e in kv.events.events if e.kind == "kv.freed"]
    assert [(e.request_id, e.block_ids) for e in freed] == [("r0", (1, 2, 3)), ("r2", (6,))]


def test_usage_adds_up_at_every_point(kv):
    requests = [make_request(f"r{i}", 3 + 2 * i) for i in range(4)]
    assert (kv.usage().total, kv.usage().used, kv.usage().free) == (9, 0, 9)
    for request in requests:
        kv.allocate_slots(request, request.num_tokens)
        check_usage(kv)
    assert kv.usage().used == 1 + 2 + 2 + 3
    for request in requests:
        kv.free(request)
        check_usage(kv)
    assert (kv.usage().used, kv.usage().cached_free, kv.usage().free) == (0, 0, 9)


def test_without_caching_no_hits_and_no_hashes(kv):
    r0 = make_request("r0", 12)
    kv.allocate_slots(r0, 12)
    kv.free(r0)
    r1 = make_request("r1", 12)
    assert kv.get_computed_blocks(r1) == ([], 0)
    assert kv.block_pool.cached_block_hash_to_block == {}
    assert r0.block_hashes == [] and r1.block_hashes == []
