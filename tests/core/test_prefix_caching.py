"""Prefix caching, ported from vLLM's behaviours: hits and misses, ref counts, the exact free order, LRU
eviction, salts, hash algorithms, reset, and the events each decision emits."""

import hashlib
import os
import pickle
import subprocess
import sys
from pathlib import Path

import cbor2
import pytest

from engine.core.block_hash import HASH_FUNCTIONS, extra_keys_for_block, hash_hex, sha256_hash
from engine.core.kv_cache_manager import KVCacheManager
from engine.events import EventLog
from engine.request import Request
from tests.core.helpers import SchedulerHarness, check_usage, free_ids, make_request

BLOCK_SIZE = 4
ROOT = Path(__file__).resolve().parents[2]
# Three full blocks shared by several requests, then tokens unique to each.
COMMON = [11, 11, 11, 11, 12, 12, 12, 12, 13, 13, 13, 13]


def make_kv(num_blocks: int = 10, algo: str = "builtin") -> KVCacheManager:
    events = EventLog()
    events.begin(1)
    return KVCacheManager(num_blocks, BLOCK_SIZE, True, algo, events)


def prefill(kv: KVCacheManager, request: Request) -> tuple[list[int], int]:
    """Look up, allocate the whole prompt, and mark it computed (the model's part). Returns (hit ids, hit tokens)."""
    hits, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit, num_hit, hits) is not None
    request.num_computed_tokens = request.num_tokens
    return [b.block_id for b in hits], num_hit


def decode(kv: KVCacheManager, request: Request, token: int) -> None:
    """Append a sampled token and compute it, as one decode step does."""
    request.append_output_token_ids(token)
    assert kv.allocate_slots(request, 1) is not None
    request.num_computed_tokens += 1


def ref_counts(kv: KVCacheManager, block_ids: list[int]) -> list[int]:
    return [kv.block_pool.blocks[i].ref_cnt for i in block_ids]


def events_of(kv: KVCacheManager, kind: str) -> list:
    return [e for e in kv.events.events if e.kind == kind]


@pytest.fixture(params=["builtin", "sha256", "sha256_cbor"])
def algo(request) -> str:
    return request.param


def test_prefill_miss_then_hit_with_ref_counts_and_free_order(algo):
    kv = make_kv(algo=algo)
    r0 = make_request("r0", COMMON + [21, 22, 23])
    assert prefill(kv, r0) == ([], 0)
    assert kv.get_block_ids("r0") == [1, 2, 3, 4]
    # the three full blocks are cached under their chained hashes; the partial one is not
    hash_fn = HASH_FUNCTIONS[algo]
    parent = None
    for i, block_id in enumerate([1, 2, 3]):
        parent = hash_fn(parent, COMMON[i * 4 : (i + 1) * 4], None)
        assert r0.block_hashes[i] == parent
        assert kv.block_pool.blocks[block_id].block_hash == parent
        assert kv.block_pool.get_cached_block(parent) is kv.block_pool.blocks[block_id]
    assert kv.block_pool.blocks[4].block_hash is None

    r1 = make_request("r1", COMMON + [31, 32])
    assert prefill(kv, r1) == ([1, 2, 3], 12)
    assert kv.get_block_ids("r1") == [1, 2, 3, 5]
    assert ref_counts(kv, [1, 2, 3, 4, 5]) == [2, 2, 2, 1, 1]
    assert free_ids(kv) == [6, 7, 8, 9]

    # vLLM 0.33: a freed block without a hash (r0's partial block 4) goes to the head of the free queue, to be
    # reused first (LIFO); the shared blocks are still held by r1
    kv.free(r0)
    assert free_ids(kv) == [4, 6, 7, 8, 9]
    # r1's blocks go back tail first: its partial block 5 to the head, its cached blocks to the tail (LRU)
    kv.free(r1)
    assert free_ids(kv) == [5, 4, 6, 7, 8, 9, 3, 2, 1]
    usage = kv.usage()
    assert (usage.used, usage.cached_free, usage.free) == (0, 3, 6)

    # a third request takes its hits out of the end of the free queue and its new block from the head: the
    # uncached block freed last
    r2 = make_request("r2", COMMON + [41, 42, 43])
    assert prefill(kv, r2) == ([1, 2, 3], 12)
    assert kv.get_block_ids("r2") == [1, 2, 3, 5]
    assert free_ids(kv) == [4, 6, 7, 8, 9]
    check_usage(kv)


def test_hit_is_capped_so_the_last_prompt_token_is_computed(algo):
    kv = make_kv(algo=algo)
    r0 = make_request("r0", list(COMMON))
    prefill(kv, r0)
    kv.free(r0)
    assert free_ids(kv) == [4, 5, 6, 7, 8, 9, 3, 2, 1]
    kv.events.begin(2)
    r1 = make_request("r1", list(COMMON))  # exactly three full blocks: only two may hit
    assert prefill(kv, r1) == ([1, 2], 8)
    (lookup,) = events_of(kv, "prefix.lookup")
    assert (lookup.request_id, lookup.num_queried_blocks, lookup.num_hit_blocks, lookup.num_hit_tokens) == (
        "r1",
        2,
        2,
        8,
    )
    # its third block is recomputed into a new block; block 3 keeps the cache entry and stays free
    assert kv.get_block_ids("r1") == [1, 2, 4]
    assert kv.block_pool.get_cached_block(r1.block_hashes[2]).block_id == 3
    assert free_ids(kv) == [5, 6, 7, 8, 9, 3]
    check_usage(kv)


def test_blocks_filled_by_decode_become_cached(algo):
    kv = make_kv(algo=algo)
    r0 = make_request("r0", [11, 11, 11, 11, 12, 12])
    prefill(kv, r0)
    assert len(r0.block_hashes) == 1
    decode(kv, r0, 50)
    assert len(r0.block_hashes) == 1 and kv.block_pool.blocks[2].block_hash is None
    decode(kv, r0, 51)  # block 2 now holds 12 12 50 51
    assert len(r0.block_hashes) == 2
    expected = HASH_FUNCTIONS[algo](r0.block_hashes[0], [12, 12, 50, 51], None)
    assert r0.block_hashes[1] == expected
    assert kv.block_pool.blocks[2].block_hash == expected
    kv.free(r0)

    r1 = make_request("r1", [11, 11, 11, 11, 12, 12, 50, 51, 60])
    assert prefill(kv, r1) == ([1, 2], 8)


def test_eviction_takes_the_least_recently_freed_first_and_a_request_tail_before_its_prefix():
    kv = make_kv()
    r0 = make_request("r0", 20)  # blocks 1-5, all full
    r1 = make_request("r1", list(range(3000, 3012)))  # blocks 6-8
    prefill(kv, r0)
    prefill(kv, r1)
    kv.free(r0)
    kv.free(r1)
    assert free_ids(kv) == [9, 5, 4, 3, 2, 1, 8, 7, 6]
    assert kv.usage().cached_free == 8

    kv.events.begin(2)
    r2 = make_request("r2", list(range(4000, 4016)))
    prefill(kv, r2)
    assert kv.get_block_ids("r2") == [9, 5, 4, 3]
    assert [e.block_id for e in events_of(kv, "kv.evicted")] == [5, 4, 3]
    assert free_ids(kv) == [2, 1, 8, 7, 6]
    # the evicted blocks' old hashes are gone from the map; the survivors' are kept
    for i in (2, 3, 4):
        assert kv.block_pool.get_cached_block(r0.block_hashes[i]) is None
    assert [kv.block_pool.get_cached_block(h).block_id for h in r0.block_hashes[:2]] == [1, 2]
    assert [kv.block_pool.get_cached_block(h).block_id for h in r1.block_hashes] == [6, 7, 8]
    # the reused blocks now hold r2's hashes
    assert [kv.block_pool.blocks[i].block_hash for i in (9, 5, 4, 3)] == r2.block_hashes

    hits, num_hit = kv.get_computed_blocks(make_request("r3", 21))  # r0's prompt and one more token
    assert ([b.block_id for b in hits], num_hit) == ([1, 2], 8)
    check_usage(kv)


def test_blocks_in_use_are_never_evicted():
    kv = make_kv(num_blocks=7)  # 6 usable
    holder = make_request("holder", 12)  # blocks 1-3, cached and held
    freed = make_request("freed", list(range(3000, 3008)))  # blocks 4-5, cached, then freed
    prefill(kv, holder)
    prefill(kv, freed)
    kv.free(freed)
    assert free_ids(kv) == [6, 5, 4]
    greedy = make_request("greedy", list(range(4000, 4016)))
    assert kv.allocate_slots(greedy, 16) is None  # 4 blocks, but only 3 can be freed up
    assert free_ids(kv) == [6, 5, 4]
    assert kv.allocate_slots(greedy, 12) is not None
    assert kv.get_block_ids("greedy") == [6, 5, 4]
    assert ref_counts(kv, [1, 2, 3]) == [1, 1, 1]
    assert [kv.block_pool.get_cached_block(h).block_id for h in holder.block_hashes] == [1, 2, 3]


def test_cache_salt_isolates_requests(algo):
    kv = make_kv(num_blocks=20, algo=algo)
    prompt = COMMON + [99]
    salted = make_request("a0", prompt, cache_salt="alice")
    prefill(kv, salted)
    kv.free(salted)
    assert prefill(kv, make_request("b", prompt, cache_salt="bob")) == ([], 0)
    assert prefill(kv, make_request("none", prompt)) == ([], 0)
    assert prefill(kv, make_request("a1", prompt, cache_salt="alice")) == ([1, 2, 3], 12)
    # the salt changes the first block's hash, and so the whole chain
    unsalted = make_request("u", prompt)
    kv.get_computed_blocks(unsalted)
    assert all(x != y for x, y in zip(salted.block_hashes, unsalted.block_hashes))


def test_cached_free_hits_count_against_the_free_blocks():
    kv = make_kv(num_blocks=5)  # 4 usable
    r0 = make_request("r0", COMMON + [21])
    prefill(kv, r0)
    kv.free(r0)
    assert free_ids(kv) == [4, 3, 2, 1]
    assert kv.usage().cached_free == 3

    r1 = make_request("r1", COMMON + [31] * 8)  # 3 hits + 2 new = 5 > 4 free
    hits, num_hit = kv.get_computed_blocks(r1)
    assert [b.block_id for b in hits] == [1, 2, 3]
    assert kv.allocate_slots(r1, r1.num_tokens - num_hit, num_hit, hits) is None
    assert free_ids(kv) == [4, 3, 2, 1]
    assert ref_counts(kv, [1, 2, 3]) == [0, 0, 0]
    assert kv.usage().cached_free == 3

    r2 = make_request("r2", COMMON + [41] * 4)  # 3 hits + 1 new = 4
    assert prefill(kv, r2) == ([1, 2, 3], 12)
    assert kv.get_block_ids("r2") == [1, 2, 3, 4]
    assert kv.usage().used == 4


def test_hits_held_by_a_running_request_do_not_use_free_blocks():
    kv = make_kv(num_blocks=6)  # 5 usable
    r0 = make_request("r0", COMMON + [21])
    prefill(kv, r0)  # holds 1-4
    r1 = make_request("r1", COMMON + [31])  # 3 shared hits + 1 new block: fits the 1 free block
    assert prefill(kv, r1) == ([1, 2, 3], 12)
    assert kv.get_block_ids("r1") == [1, 2, 3, 5]
    assert kv.usage().free == 0


def test_reset_prefix_cache_is_refused_while_a_block_is_in_use(algo):
    kv = make_kv(algo=algo)
    r0 = make_request("r0", COMMON + [21])
    prefill(kv, r0)
    assert kv.reset_prefix_cache() is False
    assert len(kv.block_pool.cached_block_hash_to_block) == 3
    kv.free(r0)
    assert kv.usage().cached_free == 3
    assert kv.reset_prefix_cache() is True
    assert kv.block_pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in kv.block_pool.blocks)
    usage = kv.usage()
    assert (usage.used, usage.cached_free, usage.free) == (0, 0, 9)
    assert prefill(kv, make_request("r1", COMMON + [21])) == ([], 0)


def test_block_hashes_are_vllms_from_none_hash_with_the_salt_as_an_extra_key():
    # vLLM 0.33's hash_block_tokens: hash((parent or NONE_HASH, tokens, extra keys)), sha256 over the pickled
    # tuple (its default) or over canonical CBOR; NONE_HASH is the algorithm applied to $PYTHONHASHSEED, or to
    # "vllm-none-hash" when it is unset; a cache salt enters the first block only, as (("cache_salt", salt),)
    seed = os.environ.get("PYTHONHASHSEED", "vllm-none-hash")
    by_pickle = lambda obj: hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    by_cbor = lambda obj: hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()
    for algo, digest in (("sha256", by_pickle), ("sha256_cbor", by_cbor)):
        kv = make_kv(algo=algo)
        request = make_request("r", COMMON + [21], cache_salt="alice")
        kv.get_computed_blocks(request)
        first = digest((digest(seed), tuple(COMMON[:4]), (("cache_salt", "alice"),)))
        second = digest((first, tuple(COMMON[4:8]), None))
        assert request.block_hashes[:2] == [first, second], algo
    assert extra_keys_for_block(make_request("s", 8, cache_salt="alice"), 0) == (("cache_salt", "alice"),)
    assert extra_keys_for_block(make_request("s", 8, cache_salt="alice"), 1) is None
    assert extra_keys_for_block(make_request("e", 8, cache_salt=""), 0) is None  # an empty salt is no salt


def test_two_requests_computing_the_same_prefix_at_once_both_cache_it():
    # vLLM 0.33 keeps both copies (no de-duplication, so block tables stay append-only); a lookup takes the
    # copy cached first, and the second copy still answers once the first is evicted
    kv = make_kv(num_blocks=9)  # 8 usable
    r0, r1 = make_request("r0", COMMON + [21]), make_request("r1", COMMON + [31])
    assert kv.get_computed_blocks(r0) == ([], 0) and kv.get_computed_blocks(r1) == ([], 0)  # both miss
    for request in (r0, r1):
        kv.allocate_slots(request, request.num_tokens)
        request.num_computed_tokens = request.num_tokens  # the model's part
    assert (kv.get_block_ids("r0"), kv.get_block_ids("r1")) == ([1, 2, 3, 4], [5, 6, 7, 8])
    assert kv.block_pool.blocks[5].block_hash == kv.block_pool.blocks[1].block_hash
    assert [b.block_id for b in kv.get_computed_blocks(make_request("r2", COMMON + [41]))[0]] == [1, 2, 3]
    kv.free(r0)  # 4 to the head; 3 2 1 to the tail
    assert free_ids(kv) == [4, 3, 2, 1]
    kv.allocate_slots(make_request("other", list(range(5000, 5008))), 8)  # takes 4, evicts 3
    assert [b.block_id for b in kv.get_computed_blocks(make_request("r3", COMMON + [41]))[0]] == [1, 2, 7]
    check_usage(kv)


def test_sha256_chain_is_the_same_in_another_process():
    tokens = [list(range(i * 16, (i + 1) * 16)) for i in range(3)]
    script = (
        # an empty `engine` package skips engine/__init__ (it loads transformers: seconds);
        # block_hash needs only engine.request
        "import sys, types\n"
        "sys.modules['engine'] = types.ModuleType('engine')\n"
        "sys.modules['engine'].__path__ = ['engine']\n"
        "from engine.core.block_hash import sha256_hash\n"
        "parent = None\n"
        f"for block in {tokens!r}:\n"
        "    parent = sha256_hash(parent, block, ('salt', None) if parent is None else None)\n"
        "    print(parent.hex())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    parent, here = None, []
    for block in tokens:
        parent = sha256_hash(parent, block, ("salt", None) if parent is None else None)
        here.append(parent.hex())
    assert result.stdout.split() == here
    assert len(set(here)) == 3 and all(len(h) == 64 for h in here)


def test_kv_cached_events_chain_parent_hashes():
    kv = make_kv()
    r0 = make_request("r0", COMMON + [21])
    prefill(kv, r0)
    cached = events_of(kv, "kv.cached")
    assert [e.block_id for e in cached] == [1, 2, 3]
    assert [e.block_hash for e in cached] == [hash_hex(h) for h in r0.block_hashes]
    assert [e.parent_hash for e in cached] == [None] + [e.block_hash for e in cached[:-1]]
    assert all(e.step == 1 for e in cached)
    (lookup,) = events_of(kv, "prefix.lookup")
    assert (lookup.num_queried_blocks, lookup.num_hit_blocks, lookup.num_hit_tokens) == (3, 0, 0)


def test_kv_evicted_event_names_the_reused_block_and_its_old_hash():
    kv = make_kv(num_blocks=5)
    r0 = make_request("r0", COMMON + [21])
    prefill(kv, r0)
    kv.free(r0)  # free queue: 4 3 2 1
    kv.events.begin(2)
    r1 = make_request("r1", list(range(5000, 5008)))
    prefill(kv, r1)  # takes 4 (never cached) and 3 (cached: evicted)
    assert kv.get_block_ids("r1") == [4, 3]
    evicted = events_of(kv, "kv.evicted")
    assert [(e.block_id, e.block_hash) for e in evicted] == [(3, hash_hex(r0.block_hashes[2]))]
    assert [e.kind for e in kv.events.events] == [
        "prefix.lookup",
        "kv.evicted",
        "kv.allocated",
        "kv.cached",
        "kv.cached",
    ]


def test_each_lookup_emits_one_prefix_lookup_event():
    kv = make_kv()
    prefill(kv, make_request("r0", COMMON + [21]))
    kv.events.begin(2)
    for rid in ("a", "b"):
        kv.get_computed_blocks(make_request(rid, COMMON[:8] + [77] * 6))
    lookups = events_of(kv, "prefix.lookup")
    assert [(e.request_id, e.num_queried_blocks, e.num_hit_blocks, e.num_hit_tokens) for e in lookups] == [
        ("a", 3, 2, 8),
        ("b", 3, 2, 8),
    ]


def test_scheduled_request_sharing_three_blocks_of_16_gets_48_cached_tokens():
    h = SchedulerHarness(num_blocks=32, block_size=16, enable_prefix_caching=True)
    common = list(range(100, 148))
    h.add(make_request("first", common + [1] * 5, max_tokens=1))
    h.run()
    h.add(make_request("second", common + [3] * 7, max_tokens=1))
    out = h.step()
    (lookup,) = h.of_kind("prefix.lookup")
    assert (lookup.request_id, lookup.num_hit_blocks, lookup.num_hit_tokens) == ("second", 3, 48)
    (scheduled,) = out.scheduled
    assert scheduled.request.num_cached_tokens == 48
    assert (scheduled.num_computed_tokens, scheduled.num_new_tokens, h.last_phases["second"]) == (48, 7, "prefill")
    assert scheduled.block_ids[:3] == [1, 2, 3]
