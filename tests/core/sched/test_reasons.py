"""The reason on every scheduler decision (engine/reasons.py), each from a constructed case, exact: which request,
which step, which numbers. A request that gets no tokens is in a request.deferred event; one given fewer tokens
than it wants carries a limit; a preemption names its rule, its beneficiary, the blocks and what stays cached.
Over vLLM's recorded workloads (four of each group), every live request has exactly one decision in every step."""

from collections import Counter

import pytest

from engine import LLMEngine, SamplingParams
from engine.events import RequestDeferred, RequestPreempted
from engine.reasons import (
    BudgetLeft,
    HeadOfLine,
    LongPrefillThreshold,
    LowerPriority,
    MaxModelLen,
    MaxNumSeqs,
    MemoryPressure,
    NotEnoughBlocks,
    OutputsInFlight,
    Preemption,
    PromptExceedsBudget,
    TokenBudgetSpent,
    WaitingForGrammar,
    WaitingForRemoteKV,
)
from engine.request import RequestStatus
from engine.sampling_params import StructuredOutputsParams
from tests.core.helpers import TOKEN, SchedulerHarness, make_request
from workbench.fidelity.command import GOLDEN_DIR, RECORDED_GROUPS, load_golden
from workbench.fidelity.engine_side import make_engine, trace_steps


def deferred(h: SchedulerHarness) -> list[RequestDeferred]:
    return h.of_kind("request.deferred")


def limits(h: SchedulerHarness) -> dict:
    return {e.request_id: e.limit for e in h.of_kind("request.scheduled")}


def short_of_blocks(
    step: int, rid: str, needed: int, free: int, cached_free: int, whole: bool = True
) -> RequestDeferred:
    """The request.deferred of one request whose allocate_slots was refused."""
    reason = NotEnoughBlocks(
        num_blocks_needed=needed, num_free_blocks=free, num_cached_free_blocks=cached_free, whole_sequence=whole
    )
    return RequestDeferred(step=step, request_ids=(rid,), reason=reason)


# ---- a waiting request not admitted ------------------------------------------------------------------------------


def test_the_budget_spent_before_its_turn_and_the_chunk_it_cut():
    h = SchedulerHarness(max_num_batched_tokens=10)
    h.add(make_request("a", 25), make_request("b", 5))
    h.step()
    assert limits(h) == {"a": BudgetLeft(num_wanted=25, budget_left=10)}
    assert deferred(h) == [RequestDeferred(step=1, request_ids=("b",), reason=TokenBudgetSpent(budget=10))]
    h.step()
    assert limits(h) == {"a": BudgetLeft(num_wanted=15, budget_left=10)}
    assert deferred(h) == [RequestDeferred(step=2, request_ids=("b",), reason=TokenBudgetSpent(budget=10))]
    h.step()  # a's last 5 tokens, then b is admitted with the 5 left: all it wants
    assert limits(h) == {"a": None, "b": None}
    assert deferred(h) == []


def test_a_running_request_the_budget_did_not_reach_and_the_drafts_cut():
    h = SchedulerHarness(max_num_batched_tokens=12)
    h.add(make_request("a", 3), make_request("b", 3), make_request("c", 3))
    h.step()
    h.scheduler.requests["a"].spec_token_ids = [TOKEN] * 12  # a proposer's drafts: a wants 13 tokens
    h.events.begin(2)
    out = h.scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 12}
    assert out.scheduled[0].limit == BudgetLeft(num_wanted=13, num_drafts_cut=1, budget_left=12)
    assert [e for e in h.events.events if e.kind == "request.deferred"] == [
        RequestDeferred(step=2, request_ids=("b", "c"), reason=TokenBudgetSpent(budget=12))
    ]


def test_an_unchunked_prompt_waits_for_the_whole_budget_and_blocks_the_line():
    h = SchedulerHarness(max_num_batched_tokens=10, max_model_len=10, enable_chunked_prefill=False)
    h.add(make_request("a", 8), make_request("b", 5), make_request("c", 1))
    h.step()
    assert deferred(h) == [
        RequestDeferred(step=1, request_ids=("b",), reason=PromptExceedsBudget(num_new_tokens=5, budget_left=2)),
        RequestDeferred(step=1, request_ids=("c",), reason=HeadOfLine(blocked_by="b")),
    ]


def test_max_num_seqs_reached():
    h = SchedulerHarness(max_num_seqs=1)
    h.add(make_request("a", 4), make_request("b", 4), make_request("c", 4))
    h.step()
    assert deferred(h) == [RequestDeferred(step=1, request_ids=("b", "c"), reason=MaxNumSeqs(max_num_seqs=1))]


def test_not_enough_free_blocks_counts_the_cached_free_ones_and_holds_the_line():
    h = SchedulerHarness(num_blocks=8, enable_prefix_caching=True)
    h.add(make_request("r0", 9, max_tokens=1))
    h.step()  # r0 finishes: its two full blocks (1, 2) stay cached-free at the tail, block 3 at the head
    h.add(make_request("x", list(range(2000, 2016))), make_request("y", list(range(3000, 3016))))
    h.add(make_request("z", 2))
    h.step()
    assert h.scheduler.kv.get_block_ids("x") == [3, 4, 5, 6]
    assert deferred(h) == [
        short_of_blocks(2, "y", needed=4, free=3, cached_free=2),
        RequestDeferred(step=2, request_ids=("z",), reason=HeadOfLine(blocked_by="y")),
    ]


def test_without_the_whole_sequence_gate_only_the_chunk_must_fit():
    h = SchedulerHarness(num_blocks=5, max_num_batched_tokens=8, scheduler_reserve_full_isl=False)
    h.add(make_request("a", 8), make_request("b", 20))
    h.step()  # a takes 2 blocks and the whole budget
    h.step()  # a decodes into a third block; b's first chunk of 7 needs 2, only 1 free
    assert limits(h) == {"a": None}
    assert deferred(h) == [short_of_blocks(2, "b", needed=2, free=1, cached_free=0, whole=False)]


def test_under_priority_the_others_wait_behind_a_higher_ranked_request():
    h = SchedulerHarness(num_blocks=5, scheduling_policy="priority")
    h.add(make_request("a", 12, priority=0, arrival_time=0.0))
    h.step()  # a holds 3 of the 4 blocks
    h.add(make_request("hi", 8, priority=0, arrival_time=1.0), make_request("lo", 2, priority=1, arrival_time=2.0))
    h.step()  # a's decode takes the last block
    assert deferred(h) == [
        short_of_blocks(2, "hi", needed=2, free=0, cached_free=0),
        RequestDeferred(step=2, request_ids=("lo",), reason=LowerPriority(blocked_by="hi", blocker_priority=0)),
    ]


class CompilingForever:
    """A structured output manager whose grammars never finish compiling."""

    def add_request(self, request):
        request.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR

    def check_ready(self, request):
        return False

    def error(self, request_id):
        return None

    def is_guided(self, request_id):
        return False


def test_a_request_waits_for_its_grammar_while_the_others_go_on():
    h = SchedulerHarness()
    h.scheduler.structured = CompilingForever()
    h.add(make_request("g", 4, structured_outputs=StructuredOutputsParams(regex="a+")), make_request("p", 4))
    h.step()
    assert h.last_phases == {"p": "prefill"}
    assert deferred(h) == [RequestDeferred(step=1, request_ids=("g",), reason=WaitingForGrammar())]


class RemoteKV:
    """A connector whose producer stores the request's KV after `not_stored` lookups; then it loads
    asynchronously."""

    def __init__(self, not_stored: int, num_external: int) -> None:
        self.not_stored, self.num_external = not_stored, num_external

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if self.not_stored:
            self.not_stored -= 1
            return None, False
        return self.num_external, True

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return None


def test_a_request_waits_for_remote_kv_not_stored_then_loading():
    h = SchedulerHarness()
    h.scheduler.connector = RemoteKV(not_stored=1, num_external=8)
    h.add(make_request("r", 9))
    reasons = []
    for _ in range(3):
        h.step()
        reasons.append(deferred(h))
    assert reasons == [
        [RequestDeferred(step=1, request_ids=("r",), reason=WaitingForRemoteKV(stored=False))],
        [RequestDeferred(step=2, request_ids=("r",), reason=WaitingForRemoteKV(stored=True))],  # parked
        [RequestDeferred(step=3, request_ids=("r",), reason=WaitingForRemoteKV(stored=True))],
    ]
    assert h.scheduler.requests["r"].status == RequestStatus.WAITING_FOR_REMOTE_KVS


def test_asynchronously_a_request_whose_outputs_in_flight_end_it_gets_no_more_tokens():
    engine = LLMEngine(
        executor="scripted", token_script={"r": [5, 6, 7]}, num_kv_blocks=16, block_size=4, async_scheduling=True
    )
    engine.add_request([10, 11, 12, 13], SamplingParams(max_tokens=3), request_id="r")
    records = engine.run()
    assert [r.scheduled for r in records] == [{"r": 4}, {"r": 1}, {"r": 1}, {}]
    assert [e for r in records for e in r.of_type(RequestDeferred)] == [
        RequestDeferred(step=4, request_ids=("r",), reason=OutputsInFlight(num_tokens=1))
    ]


# ---- a request given fewer tokens than it wants ------------------------------------------------------------------


def test_the_long_prefill_threshold_and_the_budget_left_cut_the_chunks():
    h = SchedulerHarness(num_blocks=512, block_size=16, max_num_batched_tokens=1024, long_prefill_token_threshold=400)
    h.add(make_request("a", 1000), make_request("b", 1100), make_request("c", 1200))
    h.step()
    assert limits(h) == {
        "a": LongPrefillThreshold(num_wanted=1000, threshold=400),
        "b": LongPrefillThreshold(num_wanted=1100, threshold=400),
        "c": BudgetLeft(num_wanted=1200, budget_left=224),
    }
    h.step()
    assert limits(h) == {
        "a": LongPrefillThreshold(num_wanted=600, threshold=400),
        "b": LongPrefillThreshold(num_wanted=700, threshold=400),
        "c": BudgetLeft(num_wanted=976, budget_left=224),
    }


def test_max_model_len_cuts_a_verification_and_its_drafts():
    h = SchedulerHarness(max_model_len=20)
    h.add(make_request("r", 16))
    h.step()  # 17 tokens now, 16 computed
    h.scheduler.requests["r"].spec_token_ids = [TOKEN] * 5
    h.events.begin(2)
    (s,) = h.scheduler.schedule().scheduled
    assert (s.num_new_tokens, s.limit) == (3, MaxModelLen(num_wanted=6, num_drafts_cut=3, max_model_len=20))


# ---- a preemption ------------------------------------------------------------------------------------------------


def test_fcfs_preempts_the_last_running_request_which_keeps_its_cached_blocks_for_its_resume():
    h = SchedulerHarness(num_blocks=6, enable_prefix_caching=True)
    h.add(make_request("a", 8), make_request("b", list(range(2000, 2008))))
    h.step()  # a holds 1 2, b holds 3 4, block 5 is free
    h.add(make_request("c", 4))
    h.step()  # a's decode takes block 5; b's needs one more, none is free: b goes, its two blocks stay cached
    (preempted,) = h.of_kind("request.preempted")
    assert preempted == RequestPreempted(
        step=2,
        request_id="b",
        num_computed_tokens=8,
        num_freed_blocks=2,
        reason=Preemption(
            rule="last_running",
            needed_by="b",
            num_blocks_needed=1,
            num_free_blocks=0,
            kept_block_ids=(3, 4),
            num_kept_tokens=8,
        ),
    )
    assert deferred(h) == [RequestDeferred(step=2, request_ids=("c",), reason=MemoryPressure(preempted=("b",)))]
    h.step()  # b's resume hits its two blocks, but its whole sequence needs a third
    (lookup,) = h.of_kind("prefix.lookup")
    assert (lookup.request_id, lookup.hit_block_ids) == ("b", (3, 4))
    assert deferred(h) == [
        short_of_blocks(3, "b", needed=3, free=2, cached_free=2),
        RequestDeferred(step=3, request_ids=("c",), reason=HeadOfLine(blocked_by="b")),
    ]


@pytest.mark.parametrize(("later", "needed_by", "num_computed"), [(False, "low", 8), (True, "high", 9)])
def test_priority_preempts_the_lowest_priority_for_the_request_that_needed_the_blocks(later, needed_by, num_computed):
    """Added together, high is admitted first and low's decode finds no block: low goes, for itself. Added after
    low, high runs last and its decode finds none: low goes, for high."""
    h = SchedulerHarness(num_blocks=6, scheduling_policy="priority")
    h.add(make_request("low", 8, priority=1, arrival_time=0.0))
    if later:
        h.step()
    h.add(make_request("high", 8, priority=0, arrival_time=1.0))
    h.step()  # both prefill: four of the five blocks
    h.step()  # the first decode takes the fifth; the second finds none
    (preempted,) = h.of_kind("request.preempted")
    assert (preempted.request_id, preempted.num_computed_tokens, preempted.reason) == (
        "low",
        num_computed,
        Preemption(
            rule="lowest_priority",
            needed_by=needed_by,
            num_blocks_needed=1,
            num_free_blocks=0,
            kept_block_ids=(),
            num_kept_tokens=0,
        ),
    )


# ---- every decision has its reason -------------------------------------------------------------------------------


def test_every_live_request_has_one_decision_in_every_step_of_vllms_workloads():
    codes = Counter()
    for group in RECORDED_GROUPS:
        for case in load_golden(GOLDEN_DIR, group)["cases"][:4]:  # four per group: every kind of decision, in time
            engine = make_engine(case["workload"])
            records = []
            engine.subscribe(records.append)
            for _ in trace_steps(case["workload"], engine):
                pass
            live: set[str] = set()
            for record in records:
                decisions = Counter()
                for e in record.events:
                    if e.kind == "request.added":
                        live.add(e.request_id)
                    elif e.kind in ("request.scheduled", "request.preempted"):
                        decisions[e.request_id] += 1
                        codes[e.kind] += 1
                    elif e.kind == "request.deferred":
                        decisions.update(e.request_ids)
                        codes[e.reason.code] += 1
                finished = {e.request_id for e in record.events if e.kind == "request.finished"}
                for rid in live:
                    assert decisions[rid] == 1 or (rid in finished and decisions[rid] == 0), (record.step, rid)
                live -= finished
    assert {"budget_spent", "max_num_seqs", "kv_blocks", "head_of_line", "lower_priority", "memory_pressure"} <= set(
        codes
    )
