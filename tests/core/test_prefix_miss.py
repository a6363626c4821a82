"""Where a prefix lookup stopped and why (engine/core/prefix_miss.py), and why a cached block was evicted: each
reason from a constructed case, exact (block indices, token positions, block ids, steps, requests)."""

from engine.events import KVEvicted, PrefixSkipped
from engine.reasons import (
    CappedAtLastToken,
    Evicted,
    Eviction,
    NotCached,
    OtherSalt,
    PartialBlock,
    PromptLogprobs,
    TokenDiffers,
)
from tests.core.helpers import make_request
from tests.core.test_prefix_caching import COMMON, events_of, make_kv, prefill


def lookup_miss(kv, request):
    """Look the request up; returns (hit block ids, the reason the hit stopped)."""
    kv.get_computed_blocks(request)
    lookup = events_of(kv, "prefix.lookup")[-1]
    assert lookup.request_id == request.request_id
    return list(lookup.hit_block_ids), lookup.miss


def test_nothing_cached_continues_the_prefix():
    kv = make_kv()
    assert lookup_miss(kv, make_request("first", COMMON + [21])) == ([], NotCached(block_index=0))
    prefill(kv, make_request("short", COMMON[:4] + [5]))  # caches one block: nothing after it
    assert lookup_miss(kv, make_request("r", COMMON + [21])) == ([1], NotCached(block_index=1))


def test_what_is_left_is_shorter_than_one_block():
    kv = make_kv()
    assert lookup_miss(kv, make_request("tiny", [1, 2, 3])) == ([], PartialBlock(num_tokens=3, block_size=4))
    prefill(kv, make_request("r0", COMMON + [21]))
    assert lookup_miss(kv, make_request("r1", COMMON + [22, 23])) == (
        [1, 2, 3],
        PartialBlock(num_tokens=2, block_size=4),
    )


def test_the_hit_is_capped_one_token_short_of_the_whole_prompt():
    kv = make_kv()
    prefill(kv, make_request("r0", COMMON))
    assert lookup_miss(kv, make_request("r1", COMMON)) == ([1, 2], CappedAtLastToken(num_tokens=12, block_index=2))


def test_a_token_differs_from_the_nearest_cached_chain():
    kv = make_kv()
    prefill(kv, make_request("r0", COMMON + [21]))  # blocks 1 2 3 cached
    prefill(kv, make_request("r1", COMMON[:4] + [12, 88, 88, 88, 13]))  # block 5: [12 88 88 88], after block 1
    changed = COMMON[:6] + [99] + COMMON[7:] + [21]  # block 1 is [12 12 99 12]: r0's block 2 is nearer than r1's
    assert lookup_miss(kv, make_request("r2", changed)) == (
        [1],
        TokenDiffers(block_index=1, position=6, token_id=99, cached_token_id=12, cached_block_id=2),
    )


def test_the_same_tokens_are_cached_under_another_salt():
    kv = make_kv()
    prefill(kv, make_request("salted", COMMON + [21], cache_salt="tenant-a"))
    assert lookup_miss(kv, make_request("plain", COMMON + [21])) == (
        [],
        OtherSalt(block_index=0, cache_salt=None, cached_salt="tenant-a", cached_block_id=1),
    )
    assert lookup_miss(kv, make_request("other", COMMON + [21], cache_salt="tenant-b")) == (
        [],
        OtherSalt(block_index=0, cache_salt="tenant-b", cached_salt="tenant-a", cached_block_id=1),
    )


def test_a_block_evicted_names_the_step_and_the_request_it_was_taken_for():
    kv = make_kv(num_blocks=5)
    r0 = make_request("r0", COMMON + [21])
    prefill(kv, r0)
    kv.free(r0)  # free queue: 4 (uncached) 3 2 1
    kv.events.begin(2)
    prefill(kv, make_request("r1", list(range(5000, 5008))))  # takes 4, then 3 (evicted)
    (evicted,) = events_of(kv, "kv.evicted")
    assert evicted == KVEvicted(
        step=2,
        block_id=3,
        block_hash=evicted.block_hash,
        reason=Eviction(cause="reused", for_request="r1", last_used_step=1, last_used_by="r0"),
    )
    kv.events.begin(3)
    assert lookup_miss(kv, make_request("r2", COMMON + [30])) == (
        [1, 2],
        Evicted(block_index=2, block_id=3, step=2, cause="reused", for_request="r1"),
    )


def test_blocks_never_computed_and_a_reset_are_evictions_too():
    kv = make_kv()
    r = make_request("r", COMMON + [21])
    hits, num_hit = kv.get_computed_blocks(r)
    kv.allocate_slots(r, r.num_tokens - num_hit, num_hit, hits)  # cached as allocated, never computed
    kv.free(r)  # preempted in the step that allocated: their hashes go
    uncomputed = Eviction(cause="uncomputed", for_request=None, last_used_step=1, last_used_by="r")
    assert [(e.block_id, e.reason) for e in events_of(kv, "kv.evicted")] == [(b, uncomputed) for b in (1, 2, 3)]
    s = make_request("s", COMMON + [21])
    prefill(kv, s)
    cached = kv.get_block_ids("s")[:3]
    kv.free(s)
    kv.events.begin(2)
    assert kv.reset_prefix_cache()
    reset = Eviction(cause="reset", for_request=None, last_used_step=1, last_used_by="s")
    assert sorted((e.block_id, e.reason) for e in events_of(kv, "kv.evicted") if e.step == 2) == [
        (b, reset) for b in sorted(cached)
    ]


def test_a_request_that_wants_prompt_logprobs_skips_the_cache():
    kv = make_kv()
    prefill(kv, make_request("r0", COMMON + [21]))
    queries = kv.stats.queries
    hits, num_hit = kv.get_computed_blocks(make_request("r", COMMON + [21], prompt_logprobs=1))
    assert (hits, num_hit) == ([], 0)
    assert events_of(kv, "prefix.skipped") == [PrefixSkipped(step=1, request_id="r", reason=PromptLogprobs())]
    assert kv.stats.queries == queries  # as vLLM: no query counted
