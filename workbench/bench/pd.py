"""Disaggregated prefill/decode from the command line.

`workbench pd` runs prompts through a PDCluster and reports each request's output and each instance's KV transfers
(optionally streaming the tokens, and writing one step trace per instance for Perfetto).

`workbench bench pd` measures what P/D is for: a few short requests decode while long prompts keep arriving. The
same seeded workload runs on one engine without chunked prefill (a long prefill stalls every decode for a whole
step), one engine with chunked prefill (the stall is cut into budget-sized pieces), and 1 prefill + 1 decode
process (decode steps never carry a prefill; the two processes share the machine's cores), with synchronous and
with asynchronous transfers (a decode's load then runs beside its running requests' steps). Reported: the short
requests' inter-token latency, the long prompts' TTFT and, for P/D, its breakdown (prefill, transfer, router to
decode, decode queue, first decode step), and each connector's save and load rates.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from engine.events import (
    Event,
    KVTransferDone,
    KVTransferLoad,
    KVTransferSave,
    RequestAdded,
    RequestFinished,
    StepRecord,
)
from engine.sampling_params import SamplingParams
from workbench.bench.args import add_common_args, non_negative_int, positive_float, positive_int, run_with_flags
from workbench.bench.datasets import BenchRequest
from workbench.bench.report import (
    Line,
    Part,
    Table,
    described,
    docs_only,
    formatters,
    machine_info,
    run_settings,
    text_only,
)
from workbench.bench.timing import alternate, medians

HELP = "disaggregated prefill/decode: decode ITL while long prompts arrive, vs one engine"
IN_ALL: tuple[int, list[str]] = (9, [])  # `workbench bench all` runs it: (place, flags)
SAMPLE_PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "List three prime numbers:"]


def transfer_summary(records: dict[str, list[StepRecord]]) -> list[dict[str, Any]]:
    """Per instance: saves, loads and failures, bytes moved, and the bytes' rate over the time spent moving."""
    rows = []
    for instance, recs in records.items():
        events = [e for r in recs for e in r.events if e.kind.startswith("kv_transfer.")]
        moved = [e for e in events if isinstance(e, KVTransferDone)]  # the saves and loads, not the failures
        num_bytes, ms = sum(e.num_bytes for e in moved), sum(e.ms for e in moved)
        rows.append(
            {
                "instance": instance,
                "steps": len(recs),
                "saves": sum(e.kind == "kv_transfer.save" for e in events),
                "loads": sum(e.kind == "kv_transfer.load" for e in events),
                "fails": sum(e.kind == "kv_transfer.fail" for e in events),
                "MB": num_bytes / 1e6,
                "ms": ms,
                "MB/s": num_bytes / 1e3 / ms if ms else 0.0,
            }
        )
    return rows


def write_traces(trace_dir: str, model: str, records: dict[str, list[StepRecord]]) -> list[Path]:
    """One JSONL step trace per instance, its header naming the instance (the Perfetto export reads it)."""
    from workbench.trace import SCHEMA_VERSION, write_trace

    out = Path(trace_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for instance, recs in records.items():
        header = {
            "schema_version": SCHEMA_VERSION,
            "instance": instance,
            "model": {"name": model},
            "created": datetime.now(UTC).isoformat(),
        }
        paths.append(out / f"{instance}.jsonl")
        write_trace(paths[-1], header, recs)
    return paths


def run_pd_command(args: argparse.Namespace, out: Callable[[str], None] = print) -> int:
    from engine import PDCluster

    prompts = SAMPLE_PROMPTS
    if args.prompts:
        text = Path(args.prompts).read_text(encoding="utf-8")
        prompts = [line for line in text.splitlines() if line.strip()]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    engine_kwargs = {"num_kv_blocks": args.num_kv_blocks} if args.num_kv_blocks else {}
    with PDCluster(
        model=args.model, connector=args.connector, num_prefill=args.prefill, num_decode=args.decode, **engine_kwargs
    ) as cluster:
        rids = [cluster.submit(prompt, params) for prompt in prompts]
        for d in cluster.stream():
            if args.stream:
                out(f"[{d.request_id} {d.instance}] {d.text!r}" + (f" ({d.finish_reason})" if d.finished else ""))
        outs = [cluster.pop_output(rid) for rid in rids]
        records = cluster.records()
    for o in outs:
        out(f"[{o.request_id}] {o.finish_reason}: {o.text!r}")
    out(f"{'instance':<12}{'steps':>7}{'saves':>7}{'loads':>7}{'fails':>7}{'MB':>10}{'ms':>10}{'MB/s':>10}")
    for row in transfer_summary(records):
        out(
            f"{row['instance']:<12}{row['steps']:>7}{row['saves']:>7}{row['loads']:>7}{row['fails']:>7}"
            f"{row['MB']:>10.3f}{row['ms']:>10.1f}{row['MB/s']:>10.1f}"
        )
    if args.trace_dir:
        for path in write_traces(args.trace_dir, args.model, records):
            out(f"wrote {path}")
    return 0


def connector_throughput(model: str, connector: str, prompt_len: int = 512, runs: int = 3) -> dict[str, Any]:
    """Median save and load rates of one connector for a prompt's KV, in one process: a kv_both engine with
    prefix caching off saves each prompt's KV, then loads it back (a private store: a temp folder or redis)."""
    import contextlib
    import random
    import statistics
    import tempfile

    from engine import LLMEngine
    from engine.kv_transfer.redis_server import RedisServer

    with (
        tempfile.TemporaryDirectory() as tmp,
        RedisServer() if connector == "redis" else contextlib.nullcontext() as server,
    ):
        extra = {"url": server.url} if server is not None else {"shared_storage_path": tmp}  # a server for redis only
        engine = LLMEngine(
            model=model,
            enable_prefix_caching=False,
            kv_transfer_config={"kv_connector": connector, "kv_role": "kv_both", "kv_connector_extra_config": extra},
        )
        rng = random.Random(0)
        events: list[Event] = []
        for _ in range(runs):
            prompt = [rng.randrange(100, 40000) for _ in range(prompt_len)]
            saved = _complete(engine, prompt, {"do_remote_decode": True}, events)
            _complete(engine, prompt, saved, events)
    saves = [e for e in events if isinstance(e, KVTransferSave)]
    loads = [e for e in events if isinstance(e, KVTransferLoad)]
    return {
        "model": model,
        "connector": connector,
        "tokens": prompt_len,
        "MB": saves[-1].num_bytes / 1e6,
        "save ms": statistics.median(e.ms for e in saves),
        "load ms": statistics.median(e.ms for e in loads),
        "save MB/s": statistics.median(e.mb_per_s for e in saves),
        "load MB/s": statistics.median(e.mb_per_s for e in loads),
    }


def _complete(engine, prompt: list[int], kv_params: dict | None, events: list) -> dict | None:
    rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=1), kv_transfer_params=kv_params)
    while engine.has_unfinished_requests():
        events.extend(e for e in engine.step().events if e.kind.startswith("kv_transfer."))
    return engine.pop_output(rid).kv_transfer_params


# ---- `workbench bench pd` ------------------------------------------------------------------------
SETUPS = {
    "engine": "one engine, no chunked prefill",
    "chunked": "one engine, chunked prefill",
    "pd": "1 prefill + 1 decode process",
    "pd_async": "1 prefill + 1 decode, async transfers",
}
PARTS = ("prefill", "transfer", "router to decode", "decode queue", "first decode step")


@dataclass
class Arrival:
    """One request of the workload: when it arrives (s after the start), what it asks, and whether it is long."""

    at: float
    request: BenchRequest
    long: bool


@dataclass
class Timeline:
    """One request as its client saw it: its id, when it arrived, and when each step that gave it tokens ended
    (time.time() seconds: comparable across processes on one machine)."""

    request_id: str
    long: bool
    arrival: float
    token_times: list[float]


def pd_workload(
    tokenizer,
    num_short: int,
    short_len: int,
    output_len: int,
    num_long: int,
    long_len: int,
    long_output_len: int,
    long_interval: float,
    seed: int = 0,
) -> list[Arrival]:
    """`num_short` requests at t=0, then one long prompt every `long_interval` s from t=long_interval; random token
    ids, EOS ignored. The same arguments always give the same workload."""
    from workbench.bench.datasets import random_dataset, token_id_range

    if long_interval < 0:
        raise ValueError(f"long_interval: must be >= 0 s, got {long_interval}")
    tokens = token_id_range(tokenizer)
    short = random_dataset(num_short, short_len, output_len, 0.0, tokens, seed) if num_short else []
    long = random_dataset(num_long, long_len, long_output_len, 0.0, tokens, seed + 1) if num_long else []
    return [Arrival(0.0, r, False) for r in short] + [
        Arrival((i + 1) * long_interval, r, True) for i, r in enumerate(long)
    ]


def _params(request: BenchRequest) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=request.output_len, ignore_eos=request.ignore_eos)


def serve_engine(llm, workload: Sequence[Arrival]) -> list[Timeline]:
    """The workload through one engine: each request added when its time comes, the engine stepping between."""
    from workbench.bench.serve import TokenTimes
    from workbench.bench.throughput import cold_start

    cold_start(llm)
    eng = llm.engine
    recorder = eng.subscribe(TokenTimes())
    pending, start, arrived = deque(workload), time.time(), []
    try:
        while pending or eng.has_unfinished_requests():
            while pending and start + pending[0].at <= time.time():
                a, t = pending.popleft(), time.time()
                arrived.append((eng.add_request(a.request.prompt_token_ids, _params(a.request)), a, t))
            if eng.has_unfinished_requests():
                eng.step()
            else:
                time.sleep(max(0.0, start + pending[0].at - time.time()))
    finally:
        eng.unsubscribe(recorder)
    return [_timeline(rid, a, t, recorder.times(rid), eng.pop_output(rid)) for rid, a, t in arrived]


def serve_cluster(cluster, workload: Sequence[Arrival]) -> list[Timeline]:
    """The workload through a PDCluster: each request submitted when its time comes; token times are the ends of
    the decode steps that gave them, as streamed back."""
    pending, start, arrived = deque(workload), time.time(), []
    times: dict[str, list[float]] = defaultdict(list)
    while pending or cluster.has_unfinished_requests():
        while pending and start + pending[0].at <= time.time():
            a, t = pending.popleft(), time.time()
            arrived.append((cluster.submit(a.request.prompt_token_ids, _params(a.request)), a, t))
        due = start + pending[0].at if pending else None
        if not cluster.has_unfinished_requests():
            assert due is not None  # nothing running: the loop goes on for a pending request
            time.sleep(max(0.0, due - time.time()))
            continue
        for delta in cluster.stream(timeout=None if due is None else max(0.0, due - time.time())):
            if delta.token_ids:
                times[delta.request_id].append(delta.time)
            if due is not None and time.time() >= due:
                break  # the rest waits in the cluster for the next stream()
    return [_timeline(rid, a, t, times[rid], cluster.pop_output(rid)) for rid, a, t in arrived]


def _timeline(rid: str, arrival: Arrival, t: float, token_times: list[float], out) -> Timeline:
    if out.finish_reason != "length" or len(out.token_ids) != arrival.request.output_len:
        raise RuntimeError(
            f"request {rid}: {out.finish_reason!r} after {len(out.token_ids)} tokens ({out.error or 'no error'})"
        )
    return Timeline(rid, arrival.long, t, list(token_times))


def ttft_breakdown(records: dict[str, list[StepRecord]], timeline: Timeline) -> dict[str, float]:
    """A long prompt's TTFT through P/D (ms) in parts that add up to it: prefill (arrival to the end of the prefill
    step that answered, less the save), transfer (save + load), router to decode (the answer to the decode
    instance taking the request, between two of its steps), decode queue (taken to first scheduled, less a load
    done before), first decode step (less a load done in it). The save is taken from the prefill part: with
    synchronous transfers (the default, and the benchmark's) it ends inside the step that answers."""
    rid = timeline.request_id
    prefill = [r for name, recs in records.items() if name.startswith("prefill") for r in recs]
    decode = [r for name, recs in records.items() if name.startswith("decode") for r in recs]
    done_ns = next(r.end_ns for r in prefill if any(e.request_id == rid for e in r.of_type(RequestFinished)))
    save_ms = sum(e.ms for r in prefill for e in r.of_type(KVTransferSave) if e.request_id == rid)
    added_ns = next(e.arrival_ns for r in decode for e in r.of_type(RequestAdded) if e.request_id == rid)
    first = next(r for r in decode if rid in r.scheduled)
    loads = [(r is first, e.ms) for r in decode for e in r.of_type(KVTransferLoad) if e.request_id == rid]
    in_step = sum(ms for inside, ms in loads if inside)
    before = sum(ms for inside, ms in loads if not inside)
    # whole nanoseconds: a float of time.time_ns() near 1.8e18 is only good to 256 ns, and the parts must add up
    arrival_ns, token_ns = round(timeline.arrival * 1e9), round(timeline.token_times[0] * 1e9)
    return {
        "prefill": (done_ns - arrival_ns) / 1e6 - save_ms,
        "transfer": save_ms + in_step + before,
        "router to decode": (added_ns - done_ns) / 1e6,
        "decode queue": (first.start_ns - added_ns) / 1e6 - before,
        "first decode step": (token_ns - first.start_ns) / 1e6 - in_step,
        "ttft": (token_ns - arrival_ns) / 1e6,
    }


def setup_metrics(timelines: Sequence[Timeline]) -> dict[str, float]:
    """The short requests' inter-token latency (ms: mean, median, p90, p99, max; gaps between the steps that gave
    a request tokens) and the long prompts' TTFT (ms: mean, max)."""
    from workbench.bench.report import percentile

    itl: list[float] = [gap * 1e3 for t in timelines if not t.long for gap in np.diff(t.token_times)] or [0.0]
    ttft = [(t.token_times[0] - t.arrival) * 1e3 for t in timelines if t.long] or [0.0]
    return {
        "itl_mean_ms": statistics.fmean(itl),
        "itl_median_ms": statistics.median(itl),
        "itl_p90_ms": percentile(itl, 90),
        "itl_p99_ms": percentile(itl, 99),
        "itl_max_ms": max(itl),
        "long_ttft_mean_ms": statistics.fmean(ttft),
        "long_ttft_max_ms": max(ttft),
    }


def available_connectors(first: str) -> list[str]:
    """`first`, then the other connector where it can run here (redis needs redis-server and its client)."""
    import importlib.util

    from engine.kv_transfer.redis_server import RedisServer

    redis_ok = RedisServer().exe is not None and importlib.util.find_spec("redis") is not None
    return [first] + [c for c in ("shared_storage", "redis") if c != first and (c != "redis" or redis_ok)]


def _workloads(tokenizer, s: dict[str, Any]) -> tuple[list[Arrival], list[list[Arrival]]]:
    """The warm-up workload (a short and a long request at once) and each run's, from the settings; run r has its
    own seeded prompts, so no run hits an earlier one's prefix cache or store."""

    def workload(n_short: int, out_len: int, n_long: int, interval: float, seed: int) -> list[Arrival]:
        return pd_workload(
            tokenizer, n_short, s["short_len"], out_len, n_long, s["long_len"], s["long_output_len"], interval, seed
        )

    runs = [
        workload(s["num_short"], s["output_len"], s["num_long"], s["long_interval"], s["seed"] + 2 * run)
        for run in range(s["runs"])
    ]
    return workload(1, 2, 1, 0.0, s["seed"] + 2 * s["runs"]), runs


def _engine_kwargs(s: dict[str, Any]) -> dict[str, Any]:
    """What every setup's engines share: max_model_len (the budget: a whole prompt fits one step), seed, and the
    other engine settings given."""
    return {"max_model_len": s["max_num_batched_tokens"], "seed": s["seed"], **s["engine_kwargs"]}


def _engines(model: str, s: dict[str, Any]) -> dict[str, Any]:
    """The two one-engine setups, in this process: without chunked prefill, and with it under chunk_budget."""
    from engine import LLM

    return {
        "engine": LLM(
            model, enable_chunked_prefill=False, max_num_batched_tokens=s["max_num_batched_tokens"], **_engine_kwargs(s)
        ),
        "chunked": LLM(model, max_num_batched_tokens=s["chunk_budget"], **_engine_kwargs(s)),
    }


def _mean_breakdown(records: dict[str, list[StepRecord]], timelines: Sequence[Timeline]) -> dict[str, float]:
    """One run's TTFT breakdown through P/D, the mean over its long prompts ({} without any)."""
    run_parts = [ttft_breakdown(records, t) for t in timelines if t.long]
    return {k: statistics.fmean(p[k] for p in run_parts) for k in (*PARTS, "ttft")} if run_parts else {}


def _run_setups(
    serve: Mapping[str, Callable[[list[Arrival]], list[Timeline]]],
    cluster,
    workloads: list[list[Arrival]],
    log: Callable[[str], None],
) -> tuple[dict[str, list], list[dict]]:
    """Each run's workload through every setup in turn: per setup the metrics of each run, and the TTFT breakdown
    of each run through `cluster` (the synchronous P/D setup)."""
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in serve}
    parts: list[dict[str, float]] = []
    for run, workload in enumerate(workloads):
        for turn in alternate({name: partial(fn, workload) for name, fn in serve.items()}, runs=1):
            name, timelines = turn.side, turn.value
            samples[name].append(setup_metrics(timelines))
            if name == "pd":
                parts.append(_mean_breakdown(cluster.records(), timelines))
            log(
                f"run {run + 1}/{len(workloads)} {SETUPS[name]}: ITL p99 {samples[name][-1]['itl_p99_ms']:.1f} ms, "
                f"long TTFT mean {samples[name][-1]['long_ttft_mean_ms']:.1f} ms"
            )
    return samples, parts


def _measure_setups(model: str, s: dict[str, Any], log: Callable[[str], None]) -> tuple[dict[str, Any], int]:
    """Every setup serves the warm-up, then the runs' workloads: the setups' medians, P/D's TTFT breakdown and its
    transfers; and the torch threads of each P/D process."""
    from engine import PDCluster

    llms = _engines(model, s)
    warmup, workloads = _workloads(llms["engine"].tokenizer, s)
    kwargs = {
        "model": model,
        "connector": s["connector"],
        "max_num_batched_tokens": s["max_num_batched_tokens"],
        **_engine_kwargs(s),
    }
    # the same pair with asynchronous transfers: a decode's load runs beside the steps of the requests decoding
    with (
        PDCluster(**kwargs) as cluster,
        PDCluster(**kwargs, kv_connector_extra_config={"async_transfers": True}) as async_cluster,
    ):
        serve = {
            "engine": partial(serve_engine, llms["engine"]),
            "chunked": partial(serve_engine, llms["chunked"]),
            "pd": partial(serve_cluster, cluster),
            "pd_async": partial(serve_cluster, async_cluster),
        }
        for fn in serve.values():  # warm-up: the first calls pay for allocations
            fn(warmup)
        samples, parts = _run_setups(serve, cluster, workloads, log)
        return (
            {
                "setups": {name: medians(v) for name, v in samples.items()},
                "breakdown": medians(parts) if parts and parts[0] else {},
                "transfers": transfer_summary(cluster.records()),
            },
            cluster.torch_threads,
        )


def _connector_rates(
    model: str, first: str, prompt_len: int, runs: int, log: Callable[[str], None]
) -> list[dict[str, Any]]:
    """Each available connector's save and load rates for one long prompt's KV."""
    rates = []
    for name in available_connectors(first):
        rates.append(connector_throughput(model, name, prompt_len=prompt_len, runs=runs))
        log(f"{name}: save {rates[-1]['save MB/s']:.0f} MB/s, load {rates[-1]['load MB/s']:.0f} MB/s")
    return rates


def run_pd(
    model: str = "smollm2-135m",
    connector: str = "shared_storage",
    runs: int = 3,
    num_short: int = 4,
    short_len: int = 64,
    output_len: int = 128,
    num_long: int = 4,
    long_len: int = 1024,
    long_output_len: int = 4,
    long_interval: float = 3.0,
    chunk_budget: int = 256,
    json_path: str | None = None,
    seed: int = 0,
    max_num_batched_tokens: int = 2048,
    engine_kwargs: dict[str, Any] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Each setup serves the same workloads, alternating within each run (run r: its own seeded prompts, so no
    run hits an earlier one's prefix cache or store); per-metric medians over the runs. Then each connector's
    save and load rates for one long prompt. Writes the result as JSON to `json_path` when given."""
    import torch

    if long_len + long_output_len > max_num_batched_tokens:
        raise ValueError(
            f"long_len: {long_len} prompt + {long_output_len} output tokens must fit "
            f"max_num_batched_tokens ({max_num_batched_tokens}): without chunking a prompt runs whole"
        )
    settings = run_settings(run_pd, locals(), omit=("json_path",), engine_kwargs=dict(engine_kwargs or {}))
    measured, pd_threads = _measure_setups(model, settings, log)
    rates = _connector_rates(model, connector, long_len, runs, log)
    settings.update(engine_torch_threads=torch.get_num_threads(), pd_torch_threads=pd_threads)
    result = {"model": model, "settings": settings, **measured, "connectors": rates}
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser)
    parser.add_argument(
        "--connector",
        choices=("shared_storage", "redis"),
        default="shared_storage",
        help="the P/D run's store (default: %(default)s); both connectors' rates are measured",
    )
    parser.add_argument("--num-short", type=positive_int, default=4, help="short requests decoding from t=0")
    parser.add_argument("--short-len", type=positive_int, default=64, help="their prompt tokens (default: %(default)s)")
    parser.add_argument(
        "--output-len", type=positive_int, default=128, help="their output tokens (default: %(default)s)"
    )
    parser.add_argument("--num-long", type=non_negative_int, default=4, help="long prompts (default: %(default)s)")
    parser.add_argument("--long-len", type=positive_int, default=1024, help="their tokens (default: %(default)s)")
    parser.add_argument("--long-output-len", type=positive_int, default=4, help="(default: %(default)s)")
    parser.add_argument("--long-interval", type=positive_float, default=3.0, help="s between long prompts (default: 3)")
    parser.add_argument(
        "--chunk-budget",
        type=positive_int,
        default=256,
        help="max_num_batched_tokens of the chunked-prefill engine (default: %(default)s)",
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON here")


def main(args: argparse.Namespace) -> dict[str, Any]:
    """`workbench bench pd`: run_pd with the command line's settings."""
    return run_with_flags(run_pd, args, json_path=args.json)


_ITL = (
    "itl_mean_ms",
    "itl_median_ms",
    "itl_p90_ms",
    "itl_p99_ms",
    "itl_max_ms",
    "long_ttft_mean_ms",
    "long_ttft_max_ms",
)
_ITL_HEADERS = (
    "setup",
    "ITL mean ms",
    "ITL median ms",
    "ITL p90 ms",
    "ITL p99 ms",
    "ITL max ms",
    "long TTFT mean ms",
    "long TTFT max ms",
)
_PART_HEADERS = (
    "prefill ms",
    "transfer (save + load) ms",
    "router to decode ms",
    "decode queue ms",
    "first decode step ms",
    "TTFT ms",
)
_RATE_KEYS = ("connector", "MB", "save ms", "load ms", "save MB/s", "load MB/s")
_BREAKDOWN = (
    "P/D with synchronous transfers: the long prompts' TTFT in parts that add up to it (ms, mean per "
    "prompt; asynchronous transfers overlap the steps, so their parts would not add up): prefill = arrival "
    "to the end of the prefill step that answered, less the save; transfer = save + load "
    "(kv_transfer events); router to decode = the answer to the decode process taking the request "
    "(it takes requests between its steps); decode queue = taken to first scheduled; first decode "
    "step = its forward, less the load."
)


def _setups_table(result: dict[str, Any]) -> Table:
    s = result["settings"]
    budgets = {
        "engine": f" (budget {s['max_num_batched_tokens']})",
        "chunked": f" (budget {s['chunk_budget']})",
        "pd": f" ({s['connector']})",
        "pd_async": f" ({s['connector']})",
    }
    return Table(_ITL_HEADERS, [[SETUPS[n] + budgets[n], *(m[k] for k in _ITL)] for n, m in result["setups"].items()])


def _connectors_table(result: dict[str, Any]) -> Table:
    headers = (
        "connector",
        f"MB per {result['settings']['long_len']}-token prompt",
        "save ms",
        "load ms",
        "save MB/s",
        "load MB/s",
    )
    return Table(headers, [[r[k] for k in _RATE_KEYS] for r in result["connectors"]])


def summary_line(result: dict[str, Any]) -> str:
    m = result["setups"]
    return (
        f"short requests' ITL p99: {m['pd']['itl_p99_ms']:.0f} ms with P/D ({m['pd_async']['itl_p99_ms']:.0f} "
        f"ms with async transfers), {m['chunked']['itl_p99_ms']:.0f} ms with chunked prefill, "
        f"{m['engine']['itl_p99_ms']:.0f} ms without; long prompts' mean TTFT: "
        f"{m['pd']['long_ttft_mean_ms']:.0f} ({m['pd_async']['long_ttft_mean_ms']:.0f}) / "
        f"{m['chunked']['long_ttft_mean_ms']:.0f} / {m['engine']['long_ttft_mean_ms']:.0f} ms"
    )


def _transfer_line(result: dict[str, Any]) -> str:
    moved = [
        f"{r['instance']} {'saved' if r['saves'] else 'loaded'} {r['MB']:.1f} MB in {r['saves'] or r['loads']} "
        f"transfers at {r['MB/s']:.0f} MB/s"
        for r in result["transfers"]
        if r["saves"] or r["loads"]
    ]
    fails = sum(r["fails"] for r in result["transfers"])
    return (
        f"In the P/D runs ({result['settings']['connector']}, warm-up included): "
        + "; ".join(moved)
        + f"; {fails} failed transfer(s)."
    )


_WORKLOAD = (
    "{model}: {num_short} short requests ({short_len}-token prompts, {output_len} output tokens) start "
    "decoding at t=0; {num_long} long prompts ({long_len} tokens, {long_output_len} output tokens) arrive "
    "every {long_interval:g} s from t={long_interval:g} s. Random token ids (seeded, a new set per run), "
    "greedy, EOS ignored; medians over {runs} alternating run(s)"
)
_DOCS = _WORKLOAD + (
    ". ITL: gaps between the steps that gave a short request tokens, over all short requests (step "
    "ends: wall clock, read in the decode process for P/D). Long TTFT: arrival to the end of the step "
    "that gave the first token. One engine runs in this process with {engine_torch_threads} torch "
    "threads; P/D runs a prefill and a decode process with {pd_torch_threads} torch thread(s) each, "
    "on the same cores: this machine has {cores} cores, so P/D gets no extra hardware here, only the "
    "separation of prefill from decode steps.{note}"
)


def _parts(result: dict[str, Any]) -> list[Part]:
    """The setups first; in the docs the summary follows them, in the terminal it comes last."""
    summary = summary_line(result)
    parts: list[Part] = [
        described(result, _WORKLOAD, _DOCS, cores=machine_info()["cores"]),
        _setups_table(result),
        docs_only(f"**{summary}**"),
    ]
    if result["breakdown"]:
        parts += [docs_only(_BREAKDOWN), Table(_PART_HEADERS, [[result["breakdown"][k] for k in (*PARTS, "ttft")]])]
    if result["transfers"]:
        parts.append(Line(_transfer_line(result)))
    if result["connectors"]:
        parts += [
            docs_only(
                "Connectors alone (one process saves, then loads back, one long prompt's KV; median of "
                f"{result['settings']['runs']}):"
            ),
            _connectors_table(result),
        ]
    return [*parts, text_only(summary)]


format_text, format_markdown = formatters(
    "Disaggregated prefill/decode: decode latency while long prompts arrive", _parts
)
