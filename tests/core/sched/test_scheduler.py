"""The scheduler on fake model outputs: budget splits, chunked prefill, running first, preemption (FCFS and
priority), stop conditions, aborts in every state, and no leaked block after a random workload."""

import random

import pytest

from engine.request import RequestStatus
from tests.core.helpers import EOS, TOKEN, SchedulerHarness, check_usage, free_ids, make_config, make_request


def chunk_positions(h: SchedulerHarness) -> dict[str, tuple[str, int, int]]:
    """{request id: (phase, chunk index, number of chunks)} from the last step's request.scheduled events."""
    return {e.request_id: (e.phase, e.chunk_index, e.num_chunks) for e in h.of_kind("request.scheduled")}


# ---- budget and chunking ------------------------------------------------------------------------


def test_long_prefill_threshold_splits_the_budget_400_400_224():
    h = SchedulerHarness(num_blocks=512, block_size=16, max_num_batched_tokens=1024, long_prefill_token_threshold=400)
    h.add(make_request("a", 1000), make_request("b", 1100), make_request("c", 1200))
    out = h.step()
    assert out.num_scheduled_tokens == {"a": 400, "b": 400, "c": 224}
    assert list(h.last_phases.values()) == ["chunk"] * 3
    assert h.sampled == []
    out = h.step()  # running first, in admission order, under the same caps
    assert out.num_scheduled_tokens == {"a": 400, "b": 400, "c": 224}
    out = h.step()
    assert out.num_scheduled_tokens == {"a": 200, "b": 300, "c": 400}


def test_long_prefill_threshold_is_not_applied_to_a_lone_request():
    # vLLM 0.33: the threshold keeps a long prompt from starving the others; with one request running or waiting
    # there is nobody to starve, and only the budget cuts it. It applies again as soon as a second one arrives.
    h = SchedulerHarness(num_blocks=512, block_size=16, max_num_batched_tokens=1024, long_prefill_token_threshold=400)
    h.add(make_request("a", 1000, max_tokens=3))
    assert h.step().num_scheduled_tokens == {"a": 1000}
    assert h.last_phases == {"a": "prefill"}
    h.add(make_request("b", 1000))
    assert h.step().num_scheduled_tokens == {"a": 1, "b": 400}
    assert h.step().num_scheduled_tokens == {"a": 1, "b": 400}  # a finishes with its third token
    assert h.step().num_scheduled_tokens == {"b": 200}  # alone again: the rest at once
    lone = SchedulerHarness(num_blocks=512, block_size=16, max_num_batched_tokens=600, long_prefill_token_threshold=400)
    lone.add(make_request("a", 1000))
    assert lone.step().num_scheduled_tokens == {"a": 600}  # the budget still cuts


def test_chunked_prefill_takes_three_steps_and_samples_only_in_the_last():
    h = SchedulerHarness(max_num_batched_tokens=100)
    request = make_request("r", 250, max_tokens=2)
    h.add(request)
    seen = []
    for _ in range(3):
        (s,) = h.step().scheduled
        seen.append(
            (s.num_computed_tokens, s.num_new_tokens, h.last_phases["r"], h.sampled == ["r"], request.num_output_tokens)
        )
        assert chunk_positions(h)["r"][1:] == (len(seen), 3)
    assert seen == [(0, 100, "chunk", False, 0), (100, 100, "chunk", False, 0), (200, 50, "chunk", True, 1)]
    (s,) = h.step().scheduled
    assert (s.num_computed_tokens, s.num_new_tokens, h.last_phases["r"], h.sampled) == (250, 1, "decode", ["r"])
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_a_prompt_that_fits_is_one_prefill_then_decodes():
    h = SchedulerHarness(max_num_batched_tokens=100)
    h.add(make_request("r", 30, max_tokens=3))
    h.step()
    assert chunk_positions(h) == {"r": ("prefill", 1, 1)}
    assert h.sampled == ["r"]
    for _ in range(2):
        assert [(h.last_phases[s.request_id], s.num_new_tokens) for s in h.step().scheduled] == [("decode", 1)]
    assert not h.scheduler.has_unfinished_requests()


def test_running_decodes_are_scheduled_before_waiting_prompts():
    h = SchedulerHarness(max_num_batched_tokens=20)
    h.add(make_request("old", 10, max_tokens=5))
    h.step()
    h.add(make_request("new", 50))
    out = h.step()
    assert [(s.request_id, s.num_new_tokens, h.last_phases[s.request_id]) for s in out.scheduled] == [
        ("old", 1, "decode"),
        ("new", 19, "chunk"),
    ]
    out = h.step()
    assert out.num_scheduled_tokens == {"old": 1, "new": 19}


def test_max_num_seqs_caps_the_running_requests():
    h = SchedulerHarness(max_num_seqs=2)
    h.add(make_request("a", 5, max_tokens=1), make_request("b", 5, max_tokens=3), make_request("c", 5))
    out = h.step()
    assert list(out.num_scheduled_tokens) == ["a", "b"]
    assert (h.scheduler.num_running, h.scheduler.num_waiting) == (1, 1)  # a finished with its first token
    out = h.step()
    assert out.num_scheduled_tokens == {"b": 1, "c": 5}
    assert h.scheduler.num_running == 2


def test_without_chunked_prefill_a_prompt_waits_until_it_fits_whole():
    h = SchedulerHarness(max_num_batched_tokens=100, enable_chunked_prefill=False)
    h.add(make_request("a", 60), make_request("b", 50))
    out = h.step()
    assert out.num_scheduled_tokens == {"a": 60}
    assert [r.request_id for r in h.scheduler.waiting] == ["b"]
    out = h.step()
    assert out.num_scheduled_tokens == {"a": 1, "b": 50}
    assert chunk_positions(h)["b"] == ("prefill", 1, 1)


def test_without_chunked_prefill_a_lone_request_is_not_cut_by_the_long_prefill_threshold():
    h = SchedulerHarness(max_num_batched_tokens=64, enable_chunked_prefill=False, long_prefill_token_threshold=8)
    h.add(make_request("r", 20, max_tokens=1))
    assert h.step().num_scheduled_tokens == {"r": 20}


def test_without_chunked_prefill_the_long_prefill_threshold_still_cuts_two_requests():
    # vLLM 0.33 applies the threshold before it looks at chunking: with two requests, each prompt goes in chunks of
    # the threshold even with enable_chunked_prefill=False (only a prompt over the budget waits whole)
    h = SchedulerHarness(max_num_batched_tokens=64, enable_chunked_prefill=False, long_prefill_token_threshold=8)
    h.add(make_request("a", 20, max_tokens=1), make_request("b", 20, max_tokens=1))
    assert h.step().num_scheduled_tokens == {"a": 8, "b": 8}
    assert h.last_phases == {"a": "chunk", "b": "chunk"} and h.sampled == []
    assert h.step().num_scheduled_tokens == {"a": 8, "b": 8}
    assert h.step().num_scheduled_tokens == {"a": 4, "b": 4}
    assert h.sampled == ["a", "b"]


def test_without_chunked_prefill_the_budget_must_hold_a_whole_request():
    # a preempted request is recomputed whole (prompt + outputs): without chunking it must fit one step,
    # or it could never be scheduled again. vLLM's rule: max_num_batched_tokens >= max_model_len.
    config = make_config(max_num_batched_tokens=8, enable_chunked_prefill=False, max_model_len=None)
    with pytest.raises(ValueError, match="max_num_batched_tokens: 8 must be >= max_model_len"):
        config.set_max_model_len(2048)
    fits = make_config(max_num_batched_tokens=2048, enable_chunked_prefill=False, max_model_len=None)
    fits.set_max_model_len(2048)
    assert fits.max_model_len == 2048


# ---- preemption -----------------------------------------------------------------------------------


def fcfs_preemption_harness(**config) -> SchedulerHarness:
    """Four usable blocks of 4 slots; after two steps "a" (9 tokens) holds blocks 1 3 and "b" (8) 2 4."""
    h = SchedulerHarness(num_blocks=5, max_num_batched_tokens=16, long_prefill_token_threshold=4, **config)
    h.add(make_request("a", 8, max_tokens=3), make_request("b", 7, max_tokens=3))
    assert h.step().num_scheduled_tokens == {"a": 4, "b": 4}
    assert h.step().num_scheduled_tokens == {"a": 4, "b": 3}
    assert (h.kv.get_block_ids("a"), h.kv.get_block_ids("b"), free_ids(h.kv)) == ([1, 3], [2, 4], [])
    return h


def test_fcfs_preempts_the_last_running_request_and_puts_it_at_the_head_of_waiting():
    h = fcfs_preemption_harness()
    a, b = h.scheduler.requests["a"], h.scheduler.requests["b"]
    h.add(make_request("c", 1))
    out = h.step()  # "a" needs a third block; none is free
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.preempted_req_ids == ["b"]
    assert (b.status, b.num_computed_tokens, b.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert [r.request_id for r in h.scheduler.waiting] == ["b", "c"]
    assert h.scheduler.running == [a]
    # b's blocks went back tail first; a took the head
    assert (h.kv.get_block_ids("a"), h.kv.get_block_ids("b"), free_ids(h.kv)) == ([1, 3, 4], [], [2])
    (event,) = h.of_kind("request.preempted")
    assert (event.request_id, event.num_computed_tokens, event.num_freed_blocks) == ("b", 7, 2)
    check_usage(h.kv)


def test_no_request_is_admitted_in_a_step_that_preempted():
    # scheduler_reserve_full_isl=False: with vLLM 0.33's default the full-sequence gate would also keep b out
    # (its 8 tokens need two blocks, one is free) and hide this rule; with the old first-chunk check it shows
    h = fcfs_preemption_harness(scheduler_reserve_full_isl=False)
    out = h.step()
    # b's first chunk (4 tokens, one block) would fit in the freed block 2, but it waits a step
    assert out.num_scheduled_tokens == {"a": 1}
    out = h.step()
    assert out.num_scheduled_tokens == {"a": 1, "b": 4}
    assert h.kv.get_block_ids("b") == [2]


def test_a_waiting_request_is_admitted_only_when_its_whole_sequence_fits():
    # vLLM 0.33's admission gate (scheduler_reserve_full_isl, default True): b, preempted with 7 prompt tokens and
    # 1 output, needs two blocks for its whole sequence; one first chunk would fit the free block 2, but b waits
    # until a finishes and frees its blocks, so that admitting it cannot force another preemption mid-prefill
    h = fcfs_preemption_harness()
    assert h.step().preempted_req_ids == ["b"]
    assert (h.step().num_scheduled_tokens, free_ids(h.kv)) == ({"a": 1}, [4, 3, 1, 2])  # a finished
    # b is alone now: the long-prefill threshold (4) does not apply, and its 8 tokens go at once into a's blocks,
    # freed tail first to the head of the free queue (LIFO)
    assert h.step().num_scheduled_tokens == {"b": 8}
    assert h.kv.get_block_ids("b") == [4, 3]


def test_without_the_full_sequence_gate_a_waiting_request_is_admitted_on_its_first_chunk():
    h = SchedulerHarness(
        num_blocks=5, max_num_batched_tokens=16, long_prefill_token_threshold=4, scheduler_reserve_full_isl=False
    )
    h.add(make_request("a", 8, max_tokens=20))
    assert h.step().num_scheduled_tokens == {"a": 8}  # alone: no threshold; blocks 1 2
    h.add(make_request("b", 12))
    # a's 9th token takes block 3, leaving block 4 free; b's 12 tokens need three blocks, but its first chunk
    # (4 tokens: the threshold applies with two requests) needs one, and that is enough here
    assert h.step().num_scheduled_tokens == {"a": 1, "b": 4}
    assert (h.kv.get_block_ids("a"), h.kv.get_block_ids("b")) == ([1, 2, 3], [4])
    gated = SchedulerHarness(num_blocks=5, max_num_batched_tokens=16, long_prefill_token_threshold=4)
    gated.add(make_request("a", 8, max_tokens=20))
    gated.step()
    gated.add(make_request("b", 12))
    assert gated.step().num_scheduled_tokens == {"a": 1}  # the gate: three blocks do not fit in the one free
    assert [r.request_id for r in gated.scheduler.waiting] == ["b"]


def test_a_preempted_request_resumes_and_finishes_with_all_its_tokens():
    h = fcfs_preemption_harness()
    b = h.scheduler.requests["b"]
    h.run(max_steps=50)
    assert b.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert b.num_output_tokens == 3 and b.num_preemptions == 1
    assert h.kv.usage().used == 0


def test_priority_waiting_order_is_priority_then_arrival():
    h = SchedulerHarness(scheduling_policy="priority")
    h.add(
        make_request("a", 4, priority=2, arrival_time=0.0),
        make_request("b", 4, priority=0, arrival_time=1.0),
        make_request("c", 4, priority=1, arrival_time=2.0),
        make_request("d", 4, priority=0, arrival_time=0.5),
    )
    assert [r.request_id for r in h.scheduler.waiting] == ["d", "b", "c", "a"]
    assert list(h.step().num_scheduled_tokens) == ["d", "b", "c", "a"]


def test_priority_preempts_the_lowest_priority_even_if_already_scheduled_this_step():
    # scheduler_reserve_full_isl=False: mid's 20 tokens need five blocks, more than the pool's four, so vLLM 0.33's
    # full-sequence gate would never admit it; the first-chunk check lets it in to show the victim choice
    h = SchedulerHarness(
        num_blocks=5, max_num_batched_tokens=4, scheduling_policy="priority", scheduler_reserve_full_isl=False
    )
    low = make_request("low", 3, max_tokens=50, priority=5, arrival_time=0.0)
    high = make_request("high", 3, max_tokens=50, priority=0, arrival_time=1.0)
    mid = make_request("mid", 20, priority=1, arrival_time=2.0)
    h.add(low)
    h.step()
    h.add(high)
    assert h.step().num_scheduled_tokens == {"low": 1, "high": 3}
    h.add(mid)
    assert h.step().num_scheduled_tokens == {"low": 1, "high": 1, "mid": 2}
    assert [r.request_id for r in h.scheduler.running] == ["low", "high", "mid"]
    assert free_ids(h.kv) == []
    out = h.step()  # low decodes first; then high needs a block: low is the victim, its token returns to the budget
    assert out.num_scheduled_tokens == {"high": 1, "mid": 3}
    assert out.preempted_req_ids == ["low"]
    assert (low.status, low.num_computed_tokens) == (RequestStatus.PREEMPTED, 0)
    assert [r.request_id for r in h.scheduler.running] == ["high", "mid"]
    assert h.kv.get_block_ids("high") == [2, 3]
    assert h.kv.get_block_ids("mid") == [4, 1]
    assert [e.request_id for e in h.of_kind("request.preempted")] == ["low"]


def test_priority_victim_among_equal_priorities_is_the_latest_arrival():
    h = SchedulerHarness(num_blocks=4, scheduling_policy="priority")
    late = make_request("late", 4, max_tokens=50, priority=1, arrival_time=1.0)
    early = make_request("early", 3, max_tokens=50, priority=1, arrival_time=0.0)
    h.add(late)
    h.step()
    h.add(early)  # arrived earlier but admitted later: running is [late, early]
    h.step()
    h.step()
    assert free_ids(h.kv) == []
    out = h.step()  # early needs a block; FCFS would preempt early itself (the last running)
    assert out.num_scheduled_tokens == {"early": 1}
    assert out.preempted_req_ids == ["late"]
    assert h.scheduler.running == [early]


def test_priority_a_request_that_preempts_itself_lets_the_higher_priority_ones_after_it_go_on():
    # vLLM 0.33: "low" (admitted first, so first in the running list) needs a block and is itself the worst
    # priority: it preempts itself, and "high", after it in the list, is still scheduled in the same step
    h = SchedulerHarness(num_blocks=5, scheduling_policy="priority")
    h.add(make_request("low", 7, max_tokens=50, priority=5, arrival_time=0.0))
    assert h.step().num_scheduled_tokens == {"low": 7}  # blocks 1 2
    h.add(make_request("high", 7, max_tokens=50, priority=0, arrival_time=1.0))
    assert h.step().num_scheduled_tokens == {"low": 1, "high": 7}  # high: blocks 3 4; none free
    out = h.step()  # low's 9th token needs a third block
    assert out.preempted_req_ids == ["low"]
    assert out.num_scheduled_tokens == {"high": 1} and h.sampled == ["high"]
    assert (h.kv.get_block_ids("high"), free_ids(h.kv)) == ([3, 4], [2, 1])  # low's blocks, tail first, at the head


def test_a_running_request_is_never_scheduled_past_max_model_len_minus_one():
    # vLLM 0.33 caps a running request's new tokens (drafts included) at max_model_len - 1 - num_computed_tokens:
    # the token sampled at position max_model_len - 1 is the last one the model can hold
    h = SchedulerHarness(max_model_len=8)
    request = make_request("r", 5, max_tokens=10)
    h.add(request)
    assert h.step().num_scheduled_tokens == {"r": 5}
    request.spec_token_ids = [TOKEN] * 3  # 6 tokens + 3 drafts would reach position 8
    out = h.scheduler.schedule()
    assert [(s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled] == [(5, 2)]


def test_a_victim_preempted_in_the_step_it_was_scheduled_leaves_no_uncomputed_block_cached():
    h = SchedulerHarness(
        num_blocks=8,
        max_num_batched_tokens=12,
        long_prefill_token_threshold=8,
        scheduling_policy="priority",
        enable_prefix_caching=True,
    )
    victim = make_request("victim", 24, max_tokens=1, priority=5, arrival_time=0.0)
    h.add(victim)
    # alone, the victim is not cut by the threshold (vLLM 0.33), only by the budget of 12
    assert h.step().num_scheduled_tokens == {"victim": 12}  # tokens 0-11 computed, blocks 1-3
    h.add(make_request("high", 4, max_tokens=2, priority=0, arrival_time=1.0))
    assert h.step().num_scheduled_tokens == {"victim": 8, "high": 4}  # victim tokens 12-19; high prefilled
    out = h.step()  # victim is given tokens 20-23 (the last free block, full), then preempted for high's decode
    assert out.preempted_req_ids == ["victim"]
    _, num_hit = h.kv.get_computed_blocks(make_request("probe", 25))
    assert num_hit == 20  # only what was computed
    h.run(max_steps=20)  # the victim resumes on its prefix hit; the fake model checks the KV it reads


# ---- stop conditions ------------------------------------------------------------------------------


def run_one(max_steps: int = 100, tokens: list[int] | None = None, **request_kwargs):
    """Run one 4-token request to its end, feeding `tokens` in order (then TOKEN); returns it."""
    h = SchedulerHarness(**request_kwargs.pop("config", {}))
    request = make_request("r", 4, **request_kwargs)
    h.add(request)
    feed = iter(tokens or [])
    h.run(max_steps, sampler=lambda r: next(feed, TOKEN))
    return request, h


def test_max_tokens_finishes_with_length():
    request, h = run_one(max_tokens=3)
    assert request.output_token_ids == [TOKEN] * 3
    assert request.status.finish_reason == "length"
    (event,) = h.of_kind("request.finished")
    assert (event.request_id, event.reason, event.num_output_tokens) == ("r", "length", 3)


def test_eos_finishes_with_stop_unless_ignore_eos():
    request, _ = run_one(max_tokens=10, tokens=[TOKEN, EOS, TOKEN])
    assert (request.output_token_ids, request.status.finish_reason) == ([TOKEN, EOS], "stop")
    assert request.stop_reason is None
    request, _ = run_one(max_tokens=4, tokens=[TOKEN, EOS, TOKEN], ignore_eos=True)
    assert (request.output_token_ids, request.status.finish_reason) == ([TOKEN, EOS, TOKEN, TOKEN], "length")


def test_eos_sampled_as_the_max_tokens_th_token_finishes_with_stop():
    # vLLM 0.33's check_stop order: EOS, then stop token ids, then length
    request, _ = run_one(max_tokens=3, tokens=[TOKEN, TOKEN, EOS])
    assert (request.output_token_ids, request.status.finish_reason) == ([TOKEN, TOKEN, EOS], "stop")
    request, _ = run_one(max_tokens=3, stop_token_ids=[9], tokens=[TOKEN, TOKEN, 9])
    assert (request.status.finish_reason, request.stop_reason) == ("stop", 9)
    request, _ = run_one(max_tokens=3, tokens=[TOKEN, TOKEN, TOKEN])
    assert request.status.finish_reason == "length"


def test_min_tokens_is_the_samplers_rule_not_the_schedulers():
    # vLLM 0.33: the sampler bans EOS and the stop token ids while fewer than min_tokens are out
    # (tests/sample/test_logits_processors.py); the scheduler checks every sampled token as it comes, so a
    # stop token that reaches it ends the request whatever min_tokens says
    request, _ = run_one(max_tokens=10, min_tokens=3, stop_token_ids=[9], tokens=[EOS, 9, EOS])
    assert (request.output_token_ids, request.status.finish_reason) == ([EOS], "stop")
    request, _ = run_one(max_tokens=10, min_tokens=3, stop_token_ids=[9], tokens=[9, EOS, TOKEN, 9])
    assert (request.output_token_ids, request.stop_reason) == ([9], 9)


def test_stop_token_id_finishes_with_the_token_as_stop_reason():
    request, _ = run_one(max_tokens=10, stop_token_ids=[9, 11], tokens=[TOKEN, 11, 9])
    assert (request.output_token_ids, request.status.finish_reason, request.stop_reason) == ([TOKEN, 11], "stop", 11)


def test_max_model_len_finishes_with_length():
    request, _ = run_one(max_tokens=100, config={"max_model_len": 7})
    assert (request.num_tokens, request.num_output_tokens, request.status.finish_reason) == (7, 3, "length")


# ---- abort in every state -------------------------------------------------------------------------


def abort(h: SchedulerHarness, rid: str) -> None:
    """Abort `rid` between steps and check it is gone everywhere, with a finished event."""
    request = h.scheduler.requests[rid]
    h.events.begin(h.step_count + 1)
    h.scheduler.finish_request(request, RequestStatus.FINISHED_ABORTED)
    assert request.status.finish_reason == "abort"
    assert rid not in h.scheduler.requests
    assert request not in h.scheduler.running and request not in list(h.scheduler.waiting)
    assert h.kv.get_block_ids(rid) == []
    finished = [e for e in h.events.events if e.kind == "request.finished"]
    assert [(e.request_id, e.reason) for e in finished] == [(rid, "abort")]
    assert rid in h.step().finished_req_ids
    check_usage(h.kv)


def test_abort_a_waiting_request():
    h = SchedulerHarness()
    h.add(make_request("a", 4), make_request("b", 4))
    abort(h, "a")
    assert h.kv.usage().used == 1  # b, scheduled by the step after the abort


def test_abort_a_running_request_mid_prefill():
    h = SchedulerHarness(max_num_batched_tokens=8)
    h.add(make_request("a", 20))
    h.step()
    assert h.kv.get_block_ids("a") == [1, 2]
    abort(h, "a")
    # uncached blocks go back tail first to the head of the free queue (vLLM 0.33's LIFO)
    assert h.kv.usage().used == 0 and free_ids(h.kv)[:2] == [2, 1]


def test_abort_a_running_decode():
    h = SchedulerHarness()
    h.add(make_request("a", 4), make_request("b", 4))
    h.step()
    h.step()
    abort(h, "a")
    assert h.kv.usage().used == 2 and h.scheduler.running == [h.scheduler.requests["b"]]


def test_abort_a_preempted_request():
    h = fcfs_preemption_harness()
    h.step()
    assert h.scheduler.requests["b"].status == RequestStatus.PREEMPTED
    assert h.kv.get_block_ids("a") == [1, 3, 4]
    abort(h, "b")  # the step after it finishes "a"
    assert h.scheduler.requests == {} and h.kv.usage().used == 0


# ---- a random workload ------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("caching", [False, True])
def test_random_workload_with_preemption_leaks_no_block(policy, caching):
    rng = random.Random(1234)
    # 16 usable blocks of 4 slots; the longest request (41 prompt + 19 output tokens) fits alone
    h = SchedulerHarness(
        num_blocks=17,
        max_num_batched_tokens=24,
        long_prefill_token_threshold=12,
        scheduling_policy=policy,
        enable_prefix_caching=caching,
    )
    shared = [rng.randrange(100, 200) for _ in range(12)]
    arrivals = sorted(rng.randrange(0, 30) for _ in range(20))
    requests = []
    for i, at in enumerate(arrivals):
        prompt = shared[: rng.choice([0, 4, 8, 12])] + [rng.randrange(100, 200) for _ in range(rng.randrange(1, 30))]
        requests.append(
            (
                at,
                make_request(
                    f"r{i}", prompt, max_tokens=rng.randrange(1, 20), priority=rng.randrange(3), arrival_time=float(i)
                ),
            )
        )

    def sampler(_request):
        return EOS if rng.random() < 0.03 else rng.randrange(100, 200)

    for step in range(500):
        for _, request in [x for x in requests if x[0] == step]:
            h.add(request)
        h.step(sampler)
        check_usage(h.kv)
        if step >= arrivals[-1] and not h.scheduler.has_unfinished_requests():
            break
    assert all(r.is_finished for _, r in requests)
    assert sum(r.num_preemptions for _, r in requests) > 0
    assert all(r.num_output_tokens <= r.sampling_params.max_tokens for _, r in requests)
    assert h.kv.usage().used == 0
    assert sorted(free_ids(h.kv)) == list(range(1, 17))
    assert h.kv.req_to_blocks == {}
