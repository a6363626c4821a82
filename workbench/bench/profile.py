"""Where a decode step's time goes: scheduler, model forward (attention, linear layers, the rest), LM head,
sampler, output processing, and what the events and the StepRecord cost.

A steady workload (every request mid-decode) is stepped three ways: plainly (the step times and the events each
step made), under cProfile (the split by stage, read by code object so that no name is ambiguous), and under
torch.profiler (the heaviest aten ops). The events' cost is measured twice: cProfile's cumulative time of
`EventLog.emit` and `StepRecord` construction (inflated by the profiler's per-call overhead, which falls hardest on
small Python calls), and by replaying each plain step's events into a fresh `EventLog` and rebuilding its
StepRecord without any profiler (a lower bound: building the payloads at the call sites is not replayed). The
reasons' fold (each request's journey and each block's life, `LLMEngine.explain`) is a row of the split, and is
replayed too: the plain steps folded in order into an Explainer of their own, each timed, without any profiler.
The runner's input preparation is also timed alone, without any profiler, on a captured SchedulerOutput of the
decode workload and of one chunk of a chunked prefill.

With --kv-events the engine publishes vLLM's KV cache events (ZeroMQ, a subscriber connected and draining) and the
publishing is costed as the events are: each plain step's batch is built again, encoded and sent on a PUB socket
with a subscriber, on one thread and without any profiler (the whole work, the publisher thread's part included),
against the plain step (issue #34: under 3% of a step at batch 32).
"""

from __future__ import annotations

import argparse
import cProfile
import statistics
import time
from collections.abc import Callable
from dataclasses import fields
from typing import TYPE_CHECKING, Any
from unittest import mock

from torch.profiler import ProfilerActivity, profile

import kernels
from engine import LLM, SamplingParams, StepRecord
from engine.core.sched.scheduler import Scheduler, SchedulerOutput
from engine.events import EventLog
from engine.journey import Explainer
from engine.llm_engine import LLMEngine
from engine.model.llama import LlamaForCausalLM
from engine.model.runner import ModelRunner
from engine.output_processor import IncrementalDetokenizer
from engine.sample.sampler import Sampler
from workbench.bench.args import add_common_args, add_positive_ints, non_negative_int, positive_int, run_with_flags
from workbench.bench.datasets import random_requests, token_id_range
from workbench.bench.report import Line, Part, Table, described, docs_only, formatters, run_settings
from workbench.bench.timing import timed

if TYPE_CHECKING:
    from engine.distributed.kv_events import EventBatch

HELP = "where a decode step's time goes (cProfile, torch.profiler)"
IN_ALL: tuple[int, list[str]] = (3, [])  # `workbench bench all` runs it: (place, flags)

# The functions whose cumulative time makes up the split; the rows below are built from their differences.
_FUNCS = {
    "step": LLMEngine.step,
    "schedule": Scheduler.schedule,
    "execute_model": ModelRunner.execute_model,
    "prepare_inputs": ModelRunner.prepare_inputs,
    "model": LlamaForCausalLM.forward,
    "store_kvcache": kernels.store_kvcache,
    "paged_attention": kernels.paged_attention,
    "linear": kernels.linear,  # every linear layer (the engine's own Linear, row-parallel ones, the LM head)
    "compute_logits": LlamaForCausalLM.compute_logits,
    "sampler": Sampler.__call__,
    "update": Scheduler.update_from_output,
    "detokenize": IncrementalDetokenizer.update,
    "emit": EventLog.emit,
    "begin": EventLog.begin,
    "drain": EventLog.drain,
    "step_record": StepRecord.__init__,
    "explain": Explainer.observe,  # every step's reasons folded into journeys and block lives (LLMEngine.explain)
}
PREP_REPEATS = 50  # calls timed by input_prep_ms
REASONS_ROW = "reasons: journeys and block lives (Explainer.observe)"
# Rows that are the model's own arithmetic; every other row is engine overhead around it.
MODEL_ROWS = (
    "model: attention (KV write + paged attention)",
    "model: linear layers",
    "model: other (norms, RoPE, embedding, activations)",
    "LM head (logits)",
)


def _cumulative_ms(profiler: cProfile.Profile, steps: int) -> dict[str, float]:
    """Cumulative ms per step of each function in _FUNCS (0 when it never ran)."""
    by_code = {entry.code: entry.totaltime for entry in profiler.getstats()}
    return {name: by_code.get(func.__code__, 0.0) * 1e3 / steps for name, func in _FUNCS.items()}


def stage_split(ms: dict[str, float]) -> list[tuple[str, float]]:
    """Exclusive stages of one step (ms) from the cumulative times; they add up to the step."""
    attention = ms["store_kvcache"] + ms["paged_attention"]
    linear = ms["linear"] - ms["compute_logits"]  # the LM head is a Linear too: counted in its own row
    rows = [
        ("scheduler: schedule", ms["schedule"]),
        ("runner: input preparation", ms["prepare_inputs"]),
        (
            "runner: sampling metadata, logits rows, results",
            ms["execute_model"] - ms["prepare_inputs"] - ms["model"] - ms["compute_logits"] - ms["sampler"],
        ),
        (MODEL_ROWS[0], attention),
        (MODEL_ROWS[1], linear),
        (MODEL_ROWS[2], ms["model"] - attention - linear),
        (MODEL_ROWS[3], ms["compute_logits"]),
        ("sampler", ms["sampler"]),
        ("scheduler: update_from_output", ms["update"]),
        ("output processing (detokenize, stop strings)", ms["detokenize"]),
        (REASONS_ROW, ms["explain"]),
    ]
    rows.append(("rest of step (StepRecord, StepTiming, KV usage, glue)", ms["step"] - sum(v for _, v in rows)))
    return rows


def _payloads(record: StepRecord) -> list[tuple[type, dict[str, Any]]]:
    return [(type(e), {f.name: getattr(e, f.name) for f in fields(e) if f.name != "step"}) for e in record.events]


def replay_events_ms(record: StepRecord, repeats: int = 20) -> float:
    """ms to emit this step's events into a fresh EventLog and build its StepRecord, without any profiler
    (median of `repeats`)."""
    payloads = _payloads(record)
    others = {f.name: getattr(record, f.name) for f in fields(record) if f.name != "events"}
    fresh = iter([EventLog() for _ in range(repeats)])  # made before the timings: making one is not replaying

    def replay() -> None:
        log = next(fresh)
        log.begin(record.step)
        for cls, payload in payloads:
            log.emit(cls, **payload)
        StepRecord(**others, events=log.drain())

    return timed(replay, repeats, warmup=0).median_s * 1e3


def replay_explain_ms(records: list[StepRecord], block_size: int) -> float:
    """Median ms to fold one step into the journeys and block lives (`Explainer.observe`, as LLMEngine.step does),
    each record folded once, in order, into an Explainer that has folded the ones before it, without any profiler."""
    explainer = Explainer(block_size)
    times = []
    for record in records:
        start = time.perf_counter_ns()
        explainer.observe(record)
        times.append((time.perf_counter_ns() - start) / 1e6)
    return statistics.median(times)


def capture_scheduler_output(eng: LLMEngine) -> SchedulerOutput:
    """Step `eng` once and return the SchedulerOutput its model runner was given (through the runner's step
    hooks)."""
    if eng.runner is None:
        raise RuntimeError("capture_scheduler_output: no model runner in this process (a simulated executor)")
    captured: list[SchedulerOutput] = []
    hook, hooks = captured.append, eng.runner.step_hooks
    hooks.append(hook)
    try:
        eng.step()
    finally:
        hooks.remove(hook)
    if not captured or captured[0].is_empty:
        raise RuntimeError("capture_scheduler_output: the step scheduled nothing")
    return captured[0]


def input_prep_ms(runner: ModelRunner, output: SchedulerOutput, repeats: int = PREP_REPEATS) -> float:
    """Median ms of the runner's input preparation for `output`, without any profiler."""
    return timed(lambda: runner.prepare_inputs(output), repeats, warmup=0).median_s * 1e3


def _two_chunk_prompt_len(eng: LLMEngine, budget: int) -> int:
    """Two `budget`-token chunks, or less where max_model_len or the KV cache asks; more than one chunk."""
    fits = min(eng.scheduler.max_model_len, eng.kv_cache_manager.num_usable_blocks * eng.config.block_size) - 1
    if fits <= budget:
        raise ValueError(
            f"max_num_batched_tokens: {budget} takes the longest prompt that fits ({fits} tokens: "
            "max_model_len, KV cache) in one step: no chunked prefill to measure"
        )
    return min(2 * budget, fits)


def _chunked_prefill_input_prep(llm: LLM, prompt_len: int, seed: int) -> tuple[int, int, float]:
    """Input preparation of the second chunk of a `prompt_len`-token prompt alone in the engine:
    (tokens, context, ms)."""
    eng = llm.engine
    (request,) = random_requests(1, (prompt_len, prompt_len), (1, 1), token_id_range(llm.tokenizer), seed + 1)
    rid = eng.add_request(request.prompt_token_ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    eng.step()
    output = capture_scheduler_output(eng)
    (s,) = output.scheduled
    ms = input_prep_ms(eng.runner, output)
    eng.pop_output(rid)
    return s.num_new_tokens, s.num_computed_tokens + s.num_new_tokens, ms


class _Drain:
    """A SUB socket connected to `endpoint` and a thread that reads and drops what arrives (a subscriber costs the
    publisher its sends over TCP; decoding is the subscriber's cost, not counted)."""

    def __init__(self, endpoint: str) -> None:
        import threading

        import zmq

        self._sub: zmq.Socket = zmq.Context.instance().socket(zmq.SUB)
        self._sub.connect(endpoint)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-kv-events-drain", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sub.poll(100):
                self._sub.recv_multipart(copy=False)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sub.close(linger=0)


def publish_ms_replayed(batch: EventBatch, repeats: int = 20) -> float:
    """ms to build a batch's events again, encode the batch and send it on a PUB socket with a subscriber draining
    it, as the block pool's recorder, the engine and the publisher's thread do between them (median of `repeats`,
    no profiler)."""
    import msgspec
    import zmq

    from engine.distributed.kv_events import KVEventBatch

    encoder = msgspec.msgpack.Encoder()
    pub: zmq.Socket = zmq.Context.instance().socket(zmq.PUB)
    pub.bind("tcp://127.0.0.1:0")
    drain = _Drain(pub.getsockopt_string(zmq.LAST_ENDPOINT))
    fields_of = [(type(e), {f: getattr(e, f) for f in e.__struct_fields__}) for e in batch.events]
    seq = iter(range(repeats))

    def publish() -> None:
        events = [cls(**values) for cls, values in fields_of]
        payload = encoder.encode(KVEventBatch(ts=batch.ts, events=events, data_parallel_rank=0))
        pub.send_multipart((b"", next(seq).to_bytes(8, "big"), payload))

    try:
        return timed(publish, repeats, warmup=0).median_s * 1e3
    finally:
        drain.close()
        pub.close(linger=0)


def _kv_events_costs(plain: list[StepRecord], batches: dict[int, EventBatch]) -> dict[str, Any]:
    """What publishing the plain steps' KV events costs: batches and events per step, and the replayed ms per step
    (a step that published nothing costs nothing) against the plain step."""
    per_step = [publish_ms_replayed(batches[r.step]) if r.step in batches else 0.0 for r in plain]
    ms = statistics.fmean(per_step)
    return {
        "batches_per_step": len(batches) / len(plain),
        "events_per_step": sum(len(b.events) for b in batches.values()) / len(plain),
        "ms_replayed": ms,
        "share": ms / _median_step_ms(plain),
    }


def _start_decode_workload(llm: LLM, num_requests: int, prompt_len: int, max_tokens: int, seed: int) -> list[str]:
    """Add the requests and step until every one of them is decoding."""
    eng = llm.engine
    requests = random_requests(num_requests, (prompt_len, prompt_len), (1, 1), token_id_range(llm.tokenizer), seed)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [eng.add_request(r.prompt_token_ids, params) for r in requests]
    while True:
        record = eng.step()
        if len(record.phases) == num_requests and set(record.phases.values()) == {"decode"}:
            return ids


def _torch_ops(eng: LLMEngine, steps: int, top: int) -> tuple[list[tuple[str, float, int]], float]:
    """The `top` ops by self CPU time: (name, ms per step, calls per step); and ms per step inside any op."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            eng.step()
    averages = prof.key_averages()
    ops = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    inside = sum(e.self_cpu_time_total for e in averages) / 1e3 / steps
    return [(e.key, e.self_cpu_time_total / 1e3 / steps, e.count // steps) for e in ops], inside


def _plain_steps(eng: LLMEngine, steps: int, warmup: int) -> list[StepRecord]:
    """`steps` steps without any profiler, after `warmup` untimed ones."""
    for _ in range(warmup):
        eng.step()
    return [eng.step() for _ in range(steps)]


def _plain_steps_publishing(eng: LLMEngine, steps: int, warmup: int) -> tuple[list[StepRecord], dict[int, EventBatch]]:
    """The plain steps, and each KV event batch the engine published as one of them ended, by step number."""
    publisher = eng.kv_event_publisher
    assert publisher is not None
    batches: dict[int, EventBatch] = {}
    send = publisher.publish

    def keep(batch: EventBatch) -> None:  # published as its step ends: step_count is that step's number
        batches[eng.step_count] = batch
        send(batch)

    publisher.publish = keep  # type: ignore[method-assign]
    try:
        return _plain_steps(eng, steps, warmup), batches
    finally:
        publisher.publish = send  # type: ignore[method-assign]


def _median_step_ms(records: list[StepRecord]) -> float:
    return statistics.median((r.end_ns - r.start_ns) / 1e6 for r in records)


def _cprofile_ms(eng: LLMEngine, steps: int) -> dict[str, float]:
    """`steps` steps under cProfile: cumulative ms per step of each function in _FUNCS."""
    profiler = cProfile.Profile()
    for _ in range(steps):
        profiler.enable()
        eng.step()
        profiler.disable()
    return _cumulative_ms(profiler, steps)


def _step_costs(plain: list[StepRecord], ms: dict[str, float], block_size: int) -> dict[str, Any]:
    """The plain step time, the stage split and what the events and their reasons' fold cost, from the plain steps
    and cProfile's times."""
    events_profiled = ms["emit"] + ms["begin"] + ms["drain"] + ms["step_record"]
    stages = stage_split(ms)
    overhead = [(name, v) for name, v in stages if name not in MODEL_ROWS]
    return {
        "step_ms": _median_step_ms(plain),
        "profiled_step_ms": ms["step"],
        "stages": stages,
        "largest_non_model": max(overhead, key=lambda kv: kv[1])[0],
        "events_per_step": statistics.fmean(len(r.events) for r in plain),
        "events_ms_profiled": events_profiled,
        "events_share_profiled": events_profiled / ms["step"],
        "events_ms_replayed": statistics.median(replay_events_ms(r) for r in plain),
        "explain_ms_profiled": ms["explain"],
        "explain_ms_replayed": replay_explain_ms(plain, block_size),
    }


def _input_prep(
    llm: LLM, ids: list[str], chunked_prompt_len: int, seed: int, log: Callable[[str], None]
) -> dict[str, Any]:
    """Input preparation alone: at the running decodes `ids` (then aborted), and at a chunk of a chunked prefill."""
    eng = llm.engine
    decode_output = capture_scheduler_output(eng)
    if len(decode_output.scheduled) != len(ids):
        raise RuntimeError(f"profile: {len(decode_output.scheduled)} of {len(ids)} requests still decode")
    decode_ms = input_prep_ms(eng.runner, decode_output)
    for rid in ids:
        eng.abort(rid)
        eng.pop_output(rid)
    tokens, context, prefill_ms = _chunked_prefill_input_prep(llm, chunked_prompt_len, seed)
    log(f"input preparation: {decode_ms:.3f} ms at {len(ids)} decodes, {prefill_ms:.3f} ms at a {tokens}-token chunk")
    return {
        "decode_ms": decode_ms,
        "decode_requests": len(ids),
        "prefill_ms": prefill_ms,
        "prefill_tokens": tokens,
        "prefill_context": context,
    }


def run_profile(
    model: str = "smollm2-135m",
    num_requests: int = 32,
    prompt_len: int = 256,
    steps: int = 5,
    warmup: int = 2,
    top_ops: int = 10,
    seed: int = 0,
    max_num_batched_tokens: int = 2048,
    kv_events: bool = False,
    engine_kwargs: dict[str, Any] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Profile `steps` decode steps of `num_requests` requests three ways (plain, cProfile, torch.profiler).
    `kv_events`: the engine publishes vLLM's KV cache events, to a subscriber, and their cost is measured.
    `engine_kwargs`: more EngineConfig fields. Returns the plain step time, the stage split, the events' cost
    (and the KV events') and the top ops."""
    engine_kwargs = dict(engine_kwargs or {})
    if kv_events:
        engine_kwargs["kv_events_config"] = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0"}
    llm = LLM(model=model, max_num_batched_tokens=max_num_batched_tokens, seed=seed, **engine_kwargs)
    eng = llm.engine
    publisher = eng.kv_event_publisher
    drain = _Drain(publisher.get_publisher_config().endpoint) if kv_events and publisher is not None else None
    chunked_prompt_len = _two_chunk_prompt_len(eng, max_num_batched_tokens)
    # the first requests decode while the last ones still prefill: enough tokens that none finishes before the end
    prefill_steps = -(-num_requests * prompt_len // max_num_batched_tokens) + 1
    ids = _start_decode_workload(llm, num_requests, prompt_len, prefill_steps + warmup + 3 * steps + 2, seed)
    plain, batches = _plain_steps_publishing(eng, steps, warmup) if drain else (_plain_steps(eng, steps, warmup), {})
    log(f"plain decode step: {_median_step_ms(plain):.1f} ms")
    # the split reads the layers' ops one by one: a step of a few rows would otherwise run each layer as one call
    with mock.patch.object(kernels, "FUSED_LAYERS", False):
        ms = _cprofile_ms(eng, steps)
    ops, inside_ops_ms = _torch_ops(eng, steps, top_ops) if top_ops else ([], None)
    input_prep = _input_prep(llm, ids, chunked_prompt_len, seed, log)
    if drain is not None:
        drain.close()
    return {
        "model": model,
        "settings": run_settings(run_profile, locals()),
        **_step_costs(plain, ms, eng.config.block_size),
        "torch_ops": ops,
        "inside_ops_ms": inside_ops_ms,
        "input_prep": input_prep,
        "kv_events": _kv_events_costs(plain, batches) if kv_events else None,
    }


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser, runs=False)
    add_positive_ints(parser, num_requests=32, prompt_len=256)
    parser.add_argument("--steps", type=positive_int, default=5, help="steps per method (plain, cProfile, torch)")
    parser.add_argument("--warmup", type=non_negative_int, default=2)
    parser.add_argument(
        "--top-ops", type=non_negative_int, default=10, help="aten ops to list (0: skip torch.profiler)"
    )
    parser.add_argument(
        "--kv-events",
        action="store_true",
        help="publish vLLM's KV cache events (to a subscriber) and measure what publishing costs a step",
    )


def main(args: argparse.Namespace) -> dict[str, Any]:
    """`workbench bench profile`: run_profile with the command line's settings."""
    return run_with_flags(run_profile, args)


def _stage_rows(result: dict[str, Any]) -> list[list[object]]:
    total = result["profiled_step_ms"]
    rows = [[name, ms, f"{ms / total:.1%}"] for name, ms in result["stages"]]
    return rows + [["step (under cProfile)", total, "100.0%"]]


def _op_rows(result: dict[str, Any]) -> list[list[object]]:
    return [[name, ms, calls, f"{ms / result['step_ms']:.1%}"] for name, ms, calls in result["torch_ops"]]


_STAGE_HEADERS = ("stage", "ms/step", "share")
_OP_HEADERS = ("op (torch.profiler, self CPU)", "ms/step", "calls/step", "of plain step")


def events_line(result: dict[str, Any]) -> str:
    replayed = result["events_ms_replayed"]
    return (
        f"events + StepRecord: {result['events_per_step']:.0f} events/step; {result['events_ms_profiled']:.2f} ms "
        f"= {result['events_share_profiled']:.1%} of the step under cProfile; replayed without a profiler "
        f"{replayed:.2f} ms = {replayed / result['step_ms']:.1%} of a plain {result['step_ms']:.1f} ms step"
    )


def reasons_line(result: dict[str, Any]) -> str:
    """The reasons' fold beside the events: together, what a step pays to be explained (#33: under 3% at batch 32)."""
    step, replayed = result["step_ms"], result["explain_ms_replayed"]
    both = replayed + result["events_ms_replayed"]
    return (
        f"reasons folded into journeys and block lives (Explainer.observe, every step): "
        f"{result['explain_ms_profiled']:.2f} ms = {result['explain_ms_profiled'] / result['profiled_step_ms']:.1%} "
        f"of the step under cProfile; replayed without a profiler {replayed:.3f} ms = {replayed / step:.2%} of a "
        f"plain {step:.1f} ms step; with the events and the StepRecord {both:.3f} ms = {both / step:.2%}"
    )


def kv_events_line(result: dict[str, Any]) -> str:
    kv = result["kv_events"]
    return (
        f"KV events published (vLLM's format, ZeroMQ, a subscriber connected): {kv['batches_per_step']:.2f} batches, "
        f"{kv['events_per_step']:.2f} events per step; building, encoding and sending them again without a "
        f"profiler {kv['ms_replayed']:.3f} ms per step = {kv['share']:.2%} of a plain {result['step_ms']:.1f} ms step"
    )


def largest_line(result: dict[str, Any]) -> str:
    """The two largest non-model rows: under a profiler, near-ties among small rows can swap from run to run."""
    total = result["profiled_step_ms"]
    overhead = sorted(((ms, name) for name, ms in result["stages"] if name not in MODEL_ROWS), reverse=True)
    (ms1, name1), (ms2, name2) = overhead[:2]
    return (
        f"Largest non-model cost: {name1} ({ms1:.2f} ms, {ms1 / total:.1%}); next: {name2} ({ms2:.2f} ms, "
        f"{ms2 / total:.1%})"
    )


def eager_line(result: dict[str, Any]) -> str:
    """What runs between the ops: the most that compiling the forward (or capturing it as a graph) could remove."""
    outside = result["step_ms"] - result["inside_ops_ms"]
    return (
        f"outside any torch op (Python, scheduling, dispatch between ops): {outside:.2f} ms = "
        f"{outside / result['step_ms']:.1%} of a plain step (plain step minus the ops' self CPU time per step "
        f"under torch.profiler)"
    )


def input_prep_line(result: dict[str, Any]) -> str:
    prep = result["input_prep"]
    return (
        f"input preparation alone (no profiler, median of {PREP_REPEATS} calls on a captured SchedulerOutput): "
        f"{prep['decode_ms']:.3f} ms at {prep['decode_requests']} decoding requests "
        f"({prep['decode_ms'] / result['step_ms']:.2%} of a plain step); {prep['prefill_ms']:.3f} ms for a "
        f"{prep['prefill_tokens']}-token prefill chunk (context {prep['prefill_context']})"
    )


_WORKLOAD = (
    "{model}: {num_requests} requests mid-decode ({prompt_len}-token prompts), {steps} steps per method "
    "after {warmup} warm-up steps"
)
_DOCS = _WORKLOAD + (
    ".{note} Plain step (no profiler): {step_ms:.1f} ms. Split by cProfile cumulative times (each row "
    "exclusive; the profiler adds its own overhead to Python-heavy rows):"
)


def _parts(result: dict[str, Any]) -> list[Part]:
    largest, prep, events, reasons = (
        largest_line(result),
        input_prep_line(result),
        events_line(result),
        reasons_line(result),
    )
    parts: list[Part] = [
        described(result, _WORKLOAD, _DOCS),
        Table(_STAGE_HEADERS, _stage_rows(result)),
        Line(largest, f"**{largest}.**"),
        Line(prep, prep + "."),
        Line(events, events + "."),
        Line(reasons, reasons + "."),
    ]
    if result.get("kv_events"):
        kv = kv_events_line(result)
        parts.append(Line(kv, kv + "."))
    if result["torch_ops"]:
        eager = eager_line(result)
        parts += [Line(eager, eager + "."), docs_only("Heaviest aten ops:"), Table(_OP_HEADERS, _op_rows(result))]
    return parts


format_text, format_markdown = formatters("Step profile: where a decode step's time goes", _parts)
