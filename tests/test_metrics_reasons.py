"""Why, in Prometheus (engine/metrics.py): waiting requests by reason (vLLM's `vllm:num_requests_waiting_by_reason`,
capacity / deferred, and `workbench:num_requests_waiting_by_reason` by this engine's codes), preemptions by the
victim's rule and per request, and vLLM's KV block residency histograms, exact on constructed runs."""

from dataclasses import replace

from prometheus_client.parser import text_string_to_metric_families

from engine import LLMEngine, SamplingParams, StepRecord
from engine.events import KVUsage, RequestDeferred
from engine.metrics import PrometheusStatLogger
from engine.reasons import MaxNumSeqs, WaitingForGrammar


def _logged(engine: LLMEngine) -> tuple[PrometheusStatLogger, list[StepRecord]]:
    """A logger following `engine`, its gauges read from the last record (the engine as of its last step)."""
    records: list[StepRecord] = []

    def stats() -> dict:
        last = records[-1]
        return {"num_running": last.num_running, "num_waiting": last.num_waiting, "kv": last.kv}

    logger = PrometheusStatLogger("m", stats)
    engine.subscribe(logger)
    engine.subscribe(records.append)
    return logger, records


def _samples(logger: PrometheusStatLogger) -> dict[tuple[str, str], float]:
    """{(sample name, its reason / le label): value} for every sample, labels but those two dropped."""
    out = {}
    for family in text_string_to_metric_families(logger.render().decode()):
        for s in family.samples:
            out[s.name, s.labels.get("reason", s.labels.get("le", ""))] = s.value
    return out


def _by_reason(samples: dict[tuple[str, str], float], name: str) -> dict[str, int]:
    return {label: int(v) for (n, label), v in samples.items() if n == name and v}


def test_waiting_and_preemptions_by_reason_step_by_step():
    # three requests of 6 prompt + 8 output tokens (4 blocks each at the end) in 6 blocks, 2 running at most: r2
    # waits for a seat, then r1 and r2 both wait under memory pressure, then r2 is preempted in its turn
    engine = LLMEngine(
        executor="scripted",
        token_script=lambda request: 7,
        num_kv_blocks=6,
        block_size=4,
        max_num_seqs=2,
        max_num_batched_tokens=64,
    )
    logger, records = _logged(engine)
    for i in range(3):
        prompt = list(range(100 + 10 * i, 106 + 10 * i))
        engine.add_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True), request_id=f"r{i}")
    seen = []
    while engine.has_unfinished_requests():
        engine.step()
        samples = _samples(logger)
        ours = _by_reason(samples, "workbench:num_requests_waiting_by_reason")
        vllm = _by_reason(samples, "vllm:num_requests_waiting_by_reason")
        assert sum(ours.values()) == records[-1].num_waiting == vllm.get("capacity", 0)  # nothing deferred by status
        seen.append(ours)
    seats, held, hol = {"max_num_seqs": 1}, {"preempted": 1, "memory_pressure": 1}, {"kv_blocks": 1, "head_of_line": 1}
    assert seen == [seats] * 3 + [held] + [hol] * 4 + [{}] * 3 + [{"preempted": 1}, {"kv_blocks": 1}] + [{}] * 5
    samples = _samples(logger)
    assert samples["vllm:num_preemptions_total", ""] == 2
    assert _by_reason(samples, "workbench:num_preemptions_by_reason_total") == {"last_running": 2}
    # r0 never preempted, r1 and r2 once each: vLLM's per-request histogram
    assert samples["vllm:request_num_preemptions_count", ""] == 3
    assert samples["vllm:request_num_preemptions_sum", ""] == 2
    assert samples["vllm:request_num_preemptions_bucket", "1.0"] == 3


def test_deferred_is_vllms_transient_status_and_capacity_the_rest():
    engine = LLMEngine(executor="scripted", token_script=lambda request: 7, num_kv_blocks=6, block_size=4)
    logger, records = _logged(engine)
    engine.add_request([100, 101], SamplingParams(max_tokens=1), request_id="r")
    engine.step()
    # a step as a grammar-heavy engine makes it: two requests compiling, one without a seat, four waiting in all
    # (the fourth arrived after the step: capacity, as in vLLM, where only skipped requests are deferred)
    events = [
        RequestDeferred(step=2, request_ids=("g1", "g2"), reason=WaitingForGrammar()),
        RequestDeferred(step=2, request_ids=("s",), reason=MaxNumSeqs(max_num_seqs=1)),
    ]
    step = replace(records[-1], step=2, events=events, num_waiting=4, num_running=0, kv=KVUsage(6, 0, 0, 6))
    logger(step)
    records.append(step)
    samples = _samples(logger)
    assert _by_reason(samples, "vllm:num_requests_waiting_by_reason") == {"deferred": 2, "capacity": 2}
    assert _by_reason(samples, "workbench:num_requests_waiting_by_reason") == {"grammar": 2, "max_num_seqs": 1}


def test_kv_block_residency_histograms_are_every_ended_life():
    # test_block_life's run: blocks 1 and 2 cached by r0, hit by r1 and r2, evicted for r3; block 3 reused each time
    engine = LLMEngine(
        executor="scripted", token_script=lambda request: 7, num_kv_blocks=8, block_size=4, enable_prefix_caching=True
    )
    logger, _ = _logged(engine)
    prefix = list(range(100, 108))
    for rid, prompt in (
        ("r0", prefix + [40]),
        ("r1", prefix + [50]),
        ("r2", prefix + [60]),
        ("r3", list(range(500, 527))),
    ):
        engine.add_request(prompt, SamplingParams(max_tokens=1), request_id=rid)
        engine.run()
    ended = [life for b in range(1, 8) for life in engine.block_life(b) if life.ended_step is not None]
    gaps = [gap for life in ended for gap in life.reuse_gaps_s]
    assert len(ended) == 5 and len(gaps) == 2
    samples = _samples(logger)
    for name, values in (
        ("vllm:kv_block_lifetime_seconds", [life.lifetime_s for life in ended]),
        ("vllm:kv_block_idle_before_evict_seconds", [life.idle_s for life in ended]),
        ("vllm:kv_block_reuse_gap_seconds", gaps),
    ):
        assert samples[f"{name}_count", ""] == len(values)
        assert abs(samples[f"{name}_sum", ""] - sum(values)) < 1e-9  # the text format's float rounding
        assert samples[f"{name}_bucket", "1800.0"] == len(values)
