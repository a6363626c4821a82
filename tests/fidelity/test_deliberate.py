"""The deliberate differences from vLLM 0.33.0 that docs/FIDELITY.md lists, pinned."""

from engine import LLMEngine, SamplingParams
from engine.executor.scripted import ScriptedModel


def test_blocks_cached_in_a_step_that_preempts_their_request_lose_their_hashes():
    # priority: "a" (low) comes first in the running list and takes (and caches) its fourth block; "b" (high) then
    # finds no free block and preempts "a", in the same step. vLLM keeps the hash of a's fourth block, whose KV the
    # step never computes; this engine frees it to the same place (the tail, as a hashed block) and forgets the hash.
    engine = LLMEngine(
        executor="scripted",
        token_script={"a": [7] * 4, "b": [8] * 4},
        num_kv_blocks=6,
        block_size=4,
        max_num_batched_tokens=8,
        long_prefill_token_threshold=4,
        scheduling_policy="priority",
        max_model_len=32,
    )
    params = SamplingParams(max_tokens=2)
    engine.add_request(list(range(10, 26)), params, request_id="a", priority=1)
    assert engine.step().scheduled == {"a": 8}  # alone, so no threshold: blocks 1 2
    engine.add_request(list(range(30, 38)), params, request_id="b", priority=0)
    assert engine.step().scheduled == {"a": 4, "b": 4}  # a: block 3; b: block 4 (its 8 tokens fit: admitted)
    assert (engine.get_block_ids("a"), engine.get_block_ids("b")) == ([1, 2, 3], [4])
    a = engine.scheduler.requests["a"]
    record = engine.step()  # a takes block 5 and caches it; b needs one more block, none is free: a is the victim
    assert [e.request_id for e in record.events if e.kind == "request.preempted"] == ["a"]
    assert [e.block_id for e in record.events if e.kind == "kv.evicted"] == [5]
    # a's blocks went to the tail, 5 first, as vLLM frees them; b took the head: block 5
    assert engine.get_block_ids("b") == [4, 5]
    cache = engine.kv_cache_manager.block_pool.cached_block_hash_to_block
    assert a.block_hashes[3] not in cache  # nobody can hit the KV a never computed
    assert all(h in cache for h in a.block_hashes[:3])  # the blocks a did compute stay cached


def test_a_newly_admitted_one_token_decode_is_not_padded_to_k_drafts():
    # vLLM 0.33 with speculative decoding pads a request admitted with one token to compute (here a one-token
    # prompt), while the running requests decode, to 1 + K rows with K drafts of -1 that are always rejected, so the
    # batch stays a uniform decode for its CUDA graphs; and stops admitting if the budget lacks those rows. This
    # engine captures no CUDA graphs: it schedules the one token. (The harness turns the padding off on vLLM's side
    # with a dynamic speculative decoding schedule of K at every batch size, which changes nothing else.)
    engine = LLMEngine(
        executor="scripted",
        token_script=ScriptedModel({"a": [7] * 8, "b": [8] * 8}, {"a": [[], [7, 7]] + [[]] * 7}),
        speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        num_kv_blocks=16,
        block_size=4,
        max_model_len=32,
    )
    params = SamplingParams(max_tokens=8)
    engine.add_request([10, 11, 12, 13, 14], params, request_id="a")
    assert engine.step().scheduled == {"a": 5}  # the prompt; a samples, then drafts [7, 7]
    engine.add_request([20], params, request_id="b")
    record = engine.step()
    assert record.scheduled == {"a": 3, "b": 1}  # vLLM: {"a": 3, "b": 3}, b's drafts [-1, -1]
    assert [e.request_id for e in record.events if e.kind == "spec.verified"] == ["a"]
