"""The simulated executor under the real engine: vLLM's KV capacity as the block count, simulated time in every
record and metric, seeded tokens with the workload's output lengths, and, given a real run's step times, exactly
the real scheduler's decisions (StepRecords' scheduling fields and block ids)."""

from __future__ import annotations

from collections import deque

import pytest

from engine import LLM, EngineConfig, SamplingParams, StructuredOutputsParams
from engine.executor.sim.cost_model import CostModel, ReplayCostModel, ScheduledShape
from engine.executor.sim.hardware import get_hardware
from engine.executor.sim.model_spec import load_model_spec


def _sim(model: str = "llama-3.1-8b", **kwargs) -> LLM:
    return LLM(model=model, executor="simulated", **{"hardware": "h100-sxm", **kwargs})


def test_block_map_shows_vllms_block_count() -> None:
    eng = _sim("llama-3.1-70b", tensor_parallel_size=8).engine
    assert eng.num_kv_blocks == 89477 and eng.runner is None and eng.config.dtype == "bfloat16"
    eng.add_request([11] * 40, SamplingParams(max_tokens=1))
    assert eng.step().kv.total == 89476  # the null block is not counted


def test_a_narrower_kv_cache_dtype_gives_more_blocks_and_reads_fewer_bytes() -> None:
    """kv_cache_dtype in the simulator: float32 weights with a bfloat16 cache, each block half the bytes (vLLM's
    split then fits more of them), and a decode's attention reads half the cache's bytes."""
    full, half = (_sim(dtype="float32", **kw).engine for kw in ({}, {"kv_cache_dtype": "bfloat16"}))
    assert full.bytes_per_block == 2 * half.bytes_per_block
    assert half.num_kv_blocks - 1 >= 2 * (full.num_kv_blocks - 1)  # usable blocks (the null block apart)
    shapes = [ScheduledShape(num_computed=4000, num_new=1, num_logits=1)] * 32
    full_s, half_s = (e.executor.cost_model.step_cost(shapes).attention_s for e in (full, half))
    assert 1.9 < full_s / half_s <= 2  # the queries' bytes are the same in both


def test_config_refuses_what_the_executor_cannot_do() -> None:
    with pytest.raises(ValueError, match="hardware: only the simulated executor"):
        EngineConfig(hardware="h100-sxm")
    assert EngineConfig(tensor_parallel_size=2).executor == "multiproc"  # as vLLM picks mp for several ranks
    with pytest.raises(ValueError, match="hardware: the simulated executor needs one of h100-sxm"):
        EngineConfig(executor="simulated")
    with pytest.raises(ValueError, match="executor: must be"):
        EngineConfig(executor="ray")
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(executor="simulated", hardware="h100-sxm", gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="speculative_config: not supported by the simulated executor"):
        EngineConfig(
            executor="simulated",
            hardware="h100-sxm",
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )
    eng = _sim(num_kv_blocks=64).engine
    with pytest.raises(ValueError, match="structured_outputs"):
        eng.add_request([1, 2, 3], SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object"})))
    with pytest.raises(ValueError, match="logprobs"):
        eng.add_request([1, 2, 3], SamplingParams(logprobs=2))


def test_records_and_metrics_are_on_the_simulated_clock() -> None:
    """A 100-token prefill then two decodes: each record lasts exactly the cost model's step, and TTFT is the
    first step."""
    eng = _sim(num_kv_blocks=64).engine
    model = CostModel(load_model_spec("llama-3.1-8b"), get_hardware("h100-sxm"), 1, "bfloat16")
    rid = eng.add_request([5] * 100, SamplingParams(max_tokens=3, ignore_eos=True))
    records = eng.run()
    costs = [
        model.step_cost([ScheduledShape(0, 100, 1)]),
        model.step_cost([ScheduledShape(100, 1, 1)]),
        model.step_cost([ScheduledShape(101, 1, 1)]),
    ]
    assert [r.end_ns - r.start_ns for r in records] == [
        round(sum(c.total_s for c in costs[: i + 1]) * 1e9) - round(sum(c.total_s for c in costs[:i]) * 1e9)
        for i in range(3)
    ]
    for record, cost in zip(records, costs):
        assert record.timing["total"] == pytest.approx(cost.total_s * 1e3)
        assert record.timing["forward"] == pytest.approx(cost.forward_s * 1e3)
        assert record.timing["sample"] == pytest.approx(cost.sampling_s * 1e3)
    out = eng.pop_output(rid)
    assert out.metrics.first_token_time - out.metrics.arrival_time == pytest.approx(costs[0].total_s)
    assert out.metrics.last_token_time - out.metrics.arrival_time == pytest.approx(sum(c.total_s for c in costs))
    assert eng.clock.monotonic() == pytest.approx(sum(c.total_s for c in costs))  # nothing else moved it


def test_tokens_are_seeded_and_lengths_follow_the_workload() -> None:
    """Random ids from the seed, never EOS (128001) nor a stop token, so every request runs to max_tokens even
    without ignore_eos; text prompts go through the byte tokenizer of a model without one."""

    def outputs(seed: int) -> list[list[int]]:
        llm = _sim(num_kv_blocks=256, seed=seed)
        params = [SamplingParams(max_tokens=n, stop_token_ids=[7, 8]) for n in (5, 40, 17)]
        return [o.token_ids for o in llm.generate(["héllo", [3] * 30, [4] * 70], params, use_tqdm=False)]

    a, b, c = outputs(0), outputs(0), outputs(1)
    assert a == b and a != c
    assert [len(t) for t in a] == [5, 40, 17]
    assert not {128001, 7, 8} & {t for tokens in a + c for t in tokens}
    llm = _sim(num_kv_blocks=64)
    rid = llm.engine.add_request("héllo", SamplingParams(max_tokens=1))
    assert llm.engine.run()[0].scheduled == {rid: 6}  # UTF-8 bytes: é is two
    assert llm.engine.pop_output(rid).text.startswith("[")


def _serve(eng, prompts, arrivals, params, start: float) -> tuple[list, list[float]]:
    """The simulated side's serving loop: before each step, add the requests whose arrival (s after `start`) has
    come; idle until the next one when nothing runs. Returns the records and, per step, the clock at the next loop
    top."""
    clock = eng.clock
    pending, records, ends, stepped = deque(range(len(prompts))), [], [], False
    while True:
        now = clock.monotonic() - start
        if stepped:
            ends.append(now)
            stepped = False
        if not pending and not eng.has_unfinished_requests():
            return records, ends
        while pending and arrivals[pending[0]] <= now:
            i = pending.popleft()
            eng.add_request(prompts[i], params[i], request_id=str(i))
        if not eng.has_unfinished_requests():
            clock.sleep_until(start + arrivals[pending[0]])
            continue
        records.append(eng.step())
        stepped = True


def _serve_real(eng, prompts, params, rng) -> tuple[list, list[float], list[float]]:
    """The real side: the same loop, but the next request arrives (at a random moment since the last loop top) at
    a seeded third of the loop tops, and whenever nothing runs: arrivals interleave with steps however fast this
    machine steps. Returns the records, each step's next loop top and the arrivals (s after the start), which the
    simulated side is given."""
    clock, start = eng.clock, eng.clock.monotonic()
    records, ends, arrivals, previous, stepped = [], [], [], 0.0, False
    while True:
        now = clock.monotonic() - start
        if stepped:
            ends.append(now)
            stepped = False
        if len(arrivals) == len(prompts) and not eng.has_unfinished_requests():
            return records, ends, arrivals
        if len(arrivals) < len(prompts) and (not eng.has_unfinished_requests() or rng.random() < 0.35):
            i = len(arrivals)
            arrivals.append(previous + (now - previous) * (0.5 + 0.5 * rng.random()))  # in (previous, now]
            eng.add_request(prompts[i], params[i], request_id=str(i))
        previous = now
        records.append(eng.step())
        stepped = True


def _decisions(record) -> dict:
    """A record's scheduling fields, and the block ids and prefix hits of its events."""
    kinds = ("kv.allocated", "kv.freed", "prefix.lookup", "request.preempted", "request.scheduled", "request.finished")
    events = [e.to_dict() for e in record.events if e.kind in kinds]
    for e in events:
        e.pop("step")
    return {
        "scheduled": record.scheduled,
        "phases": record.phases,
        "num_waiting": record.num_waiting,
        "num_running": record.num_running,
        "kv": record.kv,
        "events": events,
    }


def test_replayed_step_times_give_the_real_schedulers_decisions() -> None:
    """A real run of the tiny model (arrivals over time, shared prefixes, chunked prefill, a cache small enough to
    preempt), then the simulator over the same config with that run's clock replayed step by step: every step
    schedules the same requests, phases, queue depths, KV usage and block ids."""
    import random

    rng = random.Random(0)
    prefixes = [[rng.randrange(3, 49152) for _ in range(48)] for _ in range(3)]
    prompts = [prefixes[i % 3] + [rng.randrange(3, 49152) for _ in range(rng.randint(4, 90))] for i in range(24)]
    params = [SamplingParams(max_tokens=rng.randint(4, 24), ignore_eos=True) for _ in prompts]
    kwargs = dict(block_size=16, num_kv_blocks=24, max_num_batched_tokens=64, max_model_len=256, seed=0)
    real = LLM(model="tiny-llama", **kwargs).engine
    real_records, ends, arrivals = _serve_real(real, prompts, params, rng)
    assert any(r.of_kind("request.preempted") for r in real_records)  # the cache ran out
    assert any(e.num_hit_blocks for r in real_records for e in r.of_kind("prefix.lookup"))
    assert "chunk" in {p for r in real_records for p in r.phases.values()}
    assert len({len(r.scheduled) for r in real_records}) > 3  # batches grew and shrank with the arrivals

    sim = LLM(model="tiny-llama", executor="simulated", hardware="cpu", **kwargs).engine
    start = sim.clock.monotonic()
    sim.executor.cost_model = ReplayCostModel(sim.clock, [start + e for e in ends])
    sim_records, _ = _serve(sim, prompts, arrivals, params, start)
    assert len(sim_records) == len(real_records)
    for real_record, sim_record in zip(real_records, sim_records):
        assert _decisions(sim_record) == _decisions(real_record), real_record.step


def test_the_engine_names_its_cost_model_and_process_facts() -> None:
    """LLMEngine.cost_model is the simulated executor's own (its price of a step is what the clock moved by);
    worker_pids / threads_per_rank are empty where no worker process runs the model."""
    eng = _sim(num_kv_blocks=64).engine
    assert eng.cost_model is eng.executor.cost_model and eng.worker_pids == [] and eng.threads_per_rank is None
    eng.add_request([5] * 100, SamplingParams(max_tokens=1))
    record = eng.step()
    assert record.end_ns - record.start_ns == round(eng.cost_model.step_cost([ScheduledShape(0, 100, 1)]).total_s * 1e9)
    real = LLM(model="tiny-llama", num_kv_blocks=32).engine
    assert real.cost_model is None and real.worker_pids == [] and real.threads_per_rank is None
