"""A request's journey (engine/journey.py, LLMEngine.explain): each step with its state, tokens and reason, the
lookups and preemptions, and TTFT and latency split into parts that add up to the latencies the engine measured;
the same from a trace read back."""

import pytest

from engine import LLM, LLMEngine, SamplingParams
from engine.events import RequestPreempted
from engine.journey import Explainer, Journey, JourneyRecorder, waiting_by_reason
from engine.reasons import BudgetLeft, NotEnoughBlocks, PartialBlock, Preemption, TokenBudgetSpent
from workbench.fidelity.command import GOLDEN_DIR, RECORDED_GROUPS, load_golden
from workbench.fidelity.engine_side import make_engine, trace_steps
from workbench.trace import read_trace, trace_header, write_trace

A = list(range(100, 120))  # 20 tokens: five blocks of 4
B = A[:12] + [5, 6, 7]  # A's first three blocks, then three tokens of its own


def scripted(**kw) -> LLMEngine:
    """A model-free engine on the simulated clock: 7 blocks of 4 tokens, 16 tokens a step, prefix caching."""
    settings = dict(
        executor="scripted",
        token_script=lambda request: 7,
        num_kv_blocks=8,
        block_size=4,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
    )
    return LLMEngine(**{**settings, **kw})


def run_a_and_b() -> tuple[LLMEngine, list]:
    """a's prompt takes two steps; b waits for the budget, shares a's first three blocks, is preempted when a
    needs a block, waits for blocks, then recomputes one token on its cached prefix."""
    engine = scripted()
    engine.add_request(A, SamplingParams(max_tokens=4, ignore_eos=True), request_id="a")
    engine.add_request(B, SamplingParams(max_tokens=6, ignore_eos=True), request_id="b")
    return engine, engine.run()


def spans(journey) -> list[tuple]:
    return [(s.first_step, s.last_step, s.state, s.phase, s.num_tokens, s.reason, s.part) for s in journey.spans]


def test_each_step_with_its_state_tokens_and_reason():
    engine, _ = run_a_and_b()
    assert spans(engine.explain("a")) == [
        (1, 1, "running", "chunk", 16, BudgetLeft(num_wanted=20, budget_left=16), "prefill"),
        (2, 2, "running", "chunk", 4, None, "prefill"),
        (3, 5, "running", "decode", 1, None, "decode"),
    ]
    b = engine.explain("b")
    preemption = Preemption(
        rule="last_running",
        needed_by="b",
        num_blocks_needed=1,
        num_free_blocks=0,
        kept_block_ids=(1, 2, 3, 6),
        num_kept_tokens=16,
    )
    short = NotEnoughBlocks(num_blocks_needed=2, num_free_blocks=1, num_cached_free_blocks=1, whole_sequence=True)
    assert spans(b) == [
        (1, 1, "waiting", None, 0, TokenBudgetSpent(budget=16), "wait:budget_spent"),
        (2, 2, "running", "prefill", 3, None, "prefill"),
        (3, 3, "running", "decode", 1, None, "decode"),
        (4, 4, "preempted", None, 0, preemption, "preempted"),
        (5, 5, "waiting", None, 0, short, "wait:kv_blocks"),
        (6, 6, "running", "prefill", 1, None, "recompute"),
        (7, 9, "running", "decode", 1, None, "decode"),
    ]
    assert b.at(8).phase == "decode" and [step for step, _ in b.steps()] == list(range(1, 10))
    assert [(e.step, e.num_hit_tokens, e.miss) for e in b.lookups] == [
        (2, 12, PartialBlock(num_tokens=3, block_size=4)),
        (5, 16, PartialBlock(num_tokens=1, block_size=4)),
        (6, 16, PartialBlock(num_tokens=1, block_size=4)),
    ]
    assert b.preemptions == [
        RequestPreempted(step=4, request_id="b", num_computed_tokens=16, num_freed_blocks=4, reason=preemption)
    ]
    totals = (b.num_prefill_chunks, b.num_recomputed_tokens, b.num_lost_tokens, b.num_prefix_hit_tokens)
    assert totals == (1, 1, 16, 44) and b.num_decode_steps == 4
    assert b.ttft is not None and b.ttft.parts_steps == {"wait:budget_spent": 1, "prefill": 1}
    assert b.latency.parts_steps == {
        "wait:budget_spent": 1,
        "prefill": 1,
        "decode": 4,
        "preempted": 1,
        "wait:kv_blocks": 1,
        "recompute": 1,
    }
    assert "preempted at step 4, 16 computed tokens lost: the last running request" in b.describe()


def assert_parts_add_up(journey: Journey) -> None:
    """The parts add up to TTFT and latency as the steps' ends measure them, and count every step it lived once."""
    assert journey.ttft is not None and journey.arrival_ns is not None and journey.finished_ns is not None
    assert journey.ttft.total_ns == journey.first_token_ns - journey.arrival_ns
    assert journey.latency.total_ns == journey.finished_ns - journey.arrival_ns
    assert sum(span.ns for span in journey.spans) == journey.latency.total_ns
    first, last = journey.spans[0].first_step, journey.spans[-1].last_step
    assert sum(journey.latency.parts_steps.values()) == last - first + 1


def test_the_parts_add_up_to_the_ttft_and_latency_the_engine_measured():
    engine, _ = run_a_and_b()
    for rid in ("a", "b"):
        journey, metrics = engine.explain(rid), engine.get_output(rid).metrics
        assert_parts_add_up(journey)
        assert journey.ttft is not None  # the engine's metrics, on the simulated clock: the same to the ns
        assert abs(journey.ttft.total_ns - (metrics.first_token_time - metrics.arrival_time) * 1e9) <= 1
        assert abs(journey.latency.total_ns - (metrics.finished_time - metrics.arrival_time) * 1e9) <= 1


def test_over_vllms_workloads_every_journey_adds_up_and_a_trace_explains_the_same(tmp_path):
    for group in RECORDED_GROUPS:
        for case in load_golden(GOLDEN_DIR, group)["cases"][:4]:
            engine = make_engine(case["workload"])
            header = trace_header(engine)
            records = []
            engine.subscribe(records.append)
            for _ in trace_steps(case["workload"], engine):
                pass
            path = tmp_path / f"{case['workload']['name']}.jsonl"
            write_trace(path, header, records)
            replayed = read_trace(path).explainer()
            for spec in case["workload"]["requests"]:
                rid = spec["request_id"]
                if engine.explain(rid).finish_reason not in (None, "abort", "error"):  # error: maybe no token
                    assert_parts_add_up(engine.explain(rid))
                assert replayed.explain(rid) == engine.explain(rid)
            for block_id in range(engine.num_kv_blocks):
                assert replayed.block_life(block_id) == engine.block_life(block_id)


def test_a_journey_outlives_pop_output_and_unknown_ids_are_refused():
    llm = LLM(executor="scripted", token_script=lambda request: 7, num_kv_blocks=8, block_size=4)
    (out,) = llm.generate([[3, 4, 5, 6, 7, 8]], SamplingParams(max_tokens=2, ignore_eos=True))
    journey = llm.engine.explain(out.request_id)
    assert journey.finish_reason == "length" and [s.phase for s in journey.spans] == ["prefill", "decode"]
    with pytest.raises(KeyError, match="no journey"):
        llm.engine.explain("never-added")
    rid = llm.engine.add_request([3, 4, 5], SamplingParams(n=2, max_tokens=1))
    with pytest.raises(ValueError, match="explain one of"):
        llm.engine.explain(rid)


def test_a_trace_that_begins_mid_run_explains_from_its_first_step():
    engine, records = run_a_and_b()
    journey = Explainer.from_records(records[3:], block_size=4).explain("b")
    assert journey.arrival_ns is None and journey.spans[0].first_step == 4
    assert journey.latency.total_ns == records[-1].end_ns - records[3].start_ns


def test_one_request_alone_is_folded_as_the_whole_fold_folds_it():
    # a dashboard folds a trace for the request it opens (JourneyRecorder(only=...)): the same journey, nobody else's
    engine, records = run_a_and_b()
    for rid in ("a", "b"):
        alone = JourneyRecorder(only=rid)
        for record in records:
            alone.observe(record)
        assert alone.journey(rid) == engine.explain(rid)
        with pytest.raises(KeyError):
            alone.journey("b" if rid == "a" else "a")


def test_waiting_by_reason_adds_up_to_the_queue_every_step():
    engine, records = run_a_and_b()
    running: set[str] = set()
    counts = []
    for record in records:
        by_reason = waiting_by_reason(record, running.__contains__)
        assert sum(by_reason.values()) == record.num_waiting
        counts.append(by_reason)
        running |= set(record.scheduled)
        running -= {e.request_id for e in record.of_type(RequestPreempted)}
    assert counts[0] == {"budget_spent": 1}  # b, behind a's first chunk
    assert {"preempted": 1} in counts and {"kv_blocks": 1} in counts
