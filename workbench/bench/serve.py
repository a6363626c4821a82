"""Online serving, measured as vLLM's `benchmark_serving` measures a server, but in-process: requests arrive on a
seeded Poisson (or Gamma, with burstiness) schedule while the engine steps, each added with its scheduled arrival
time; TTFT, TPOT, ITL and end-to-end latency (mean, median, std, p90, p99), request and token throughput, and
goodput under SLOs, with vLLM's key names. ITL comes from per-token times: a subscriber records, per request, the
end of every step that gave it tokens.

`--baseline` replays the same schedule through transformers `generate` in static batches, arrival order (a batch
starts when its last request has arrived and the previous batch is done); a streamer times each of its steps, so
its TTFT, ITL and latencies are defined the same way. JSON-schema requests run there under xgrammar's own
transformers logits processor, with the schema compiled as the engine compiles it (no free whitespace).

`--cb-baseline` replays it through transformers' own continuous batching (the machinery of `generate_batch`,
workbench/bench/hf_continuous.py): each request added at its arrival while the earlier ones run, each token stamped
by transformers as it is sampled, so TTFT, ITL and latencies are defined the same way again.

`--base-url URL` sends the same seeded arrivals over HTTP instead, streaming, to any OpenAI-compatible server (ours,
`workbench serve`, or a real vLLM): TTFT, ITL and latency measured at the client as `benchmark_serving` does (ITL
= gaps between chunks that carried text), output lengths from the server's usage (workbench/bench/http_serve.py).
`--chaos-disconnect SHARE` / `--chaos-malformed SHARE` add a bad client to that burst (over HTTP: to --base-url, or
to this engine served in-process): requests cut mid-stream, malformed ones among them; the table then says what was
refused and what was lost.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine import LLM, RequestOutput, SamplingParams, StepRecord, StructuredOutputsParams
from engine.events import RequestTokens
from engine.model import resolve_model
from workbench.bench.args import (
    add_common_args,
    add_executor_args,
    executor_text,
    positive_float,
    positive_int,
    run_with_flags,
)
from workbench.bench.datasets import DATASET_DEFAULTS, DATASETS, BenchRequest, sample_dataset
from workbench.bench.report import (
    Line,
    Part,
    Table,
    bold,
    described,
    formatters,
    machine_info,
    percentile,
    run_settings,
)
from workbench.bench.throughput import HFBaseline, cold_start
from workbench.bench.timing import LoadAverage, load_line
from workbench.perfetto import SPAN_OF_PHASE

if TYPE_CHECKING:
    from workbench.bench.http_serve import Streamed

HELP = "online serving: requests at a rate; TTFT, TPOT, ITL, E2E, goodput (vLLM keys)"
# `workbench bench all` runs it: (place, flags)
IN_ALL: tuple[int, list[str]] = (
    4,
    ["--request-rate", "1", "--baseline", "--cb-baseline", "--goodput", "ttft:1000", "tpot:100"],
)

METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (90, 99)  # the median is reported as median_*_ms, as vLLM does
SLO_METRICS = ("ttft", "tpot", "e2el")


def request_arrivals(num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Arrival offsets (s) as vLLM's benchmark draws them: the first at 0, then Gamma(shape=burstiness,
    scale=1/(rate*burstiness)) gaps (burstiness 1: Poisson; below 1 burstier, above 1 more regular).
    An infinite rate sends every request at 0."""
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError(f"request_rate and burstiness: must be > 0, got {request_rate}, {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (request_rate * burstiness), size=num_requests)
    return [0.0, *np.cumsum(gaps[:-1]).tolist()][:num_requests]


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """vLLM's `--goodput ttft:MS tpot:MS e2el:MS` -> {metric: ms}."""
    slos = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"goodput: expected METRIC:MS with METRIC one of {', '.join(SLO_METRICS)}, got {item!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"goodput: {item!r}: {value!r} is not a number of milliseconds") from None
        if slos[name] < 0:
            raise ValueError(f"goodput: {item!r}: the SLO must be >= 0 ms")
    return slos


@dataclass
class RequestResult:
    """One request as a client sees it: its lengths, whether it succeeded, TTFT, latency and its inter-token
    gaps (seconds)."""

    prompt_len: int
    output_len: int
    ttft: float
    e2el: float
    itl: list[float]
    success: bool = True

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first; 0 for a single token (vLLM's convention)."""
        return (self.e2el - self.ttft) / (self.output_len - 1) if self.output_len > 1 else 0.0


@dataclass(frozen=True)
class StepMix:
    """What one engine step ran: prompt tokens (whole prefills and chunks), the requests it decoded (or verified),
    and how long it took."""

    prompt_tokens: int
    decodes: int
    seconds: float


class TokenTimes:
    """A step subscriber that owns, per request id, the end time (epoch ns) of every step that gave the request
    tokens, and each step's StepMix by its end time."""

    def __init__(self) -> None:
        self.end_ns: dict[str, list[int]] = defaultdict(list)
        self.steps: dict[int, StepMix] = {}

    def __call__(self, record: StepRecord) -> None:
        for event in record.of_type(RequestTokens):
            self.end_ns[event.request_id].append(record.end_ns)
        prompt = [r for r, phase in record.phases.items() if SPAN_OF_PHASE[phase] == "prefill"]
        self.steps[record.end_ns] = StepMix(
            sum(record.scheduled[r] for r in prompt),
            len(record.scheduled) - len(prompt),
            (record.end_ns - record.start_ns) / 1e9,
        )

    def step_mix(self) -> dict[str, Any]:
        """Why the requests' TPOT is what it is: the steps with prompt tokens beside the decodes against those with
        decodes alone (how many, their median ms, prompt tokens and decodes), and the share of every gap between
        two tokens of a request that ended on a step with prompt tokens (a step's tokens come at its end)."""
        kinds: dict[str, list[StepMix]] = {"with_prompt": [], "decode_only": []}
        for mix in self.steps.values():
            if mix.prompt_tokens or mix.decodes:
                kinds["with_prompt" if mix.prompt_tokens else "decode_only"].append(mix)
        gaps = {"with_prompt": 0, "decode_only": 0}
        for stamps in self.end_ns.values():
            for a, b in zip(stamps, stamps[1:]):
                gaps["with_prompt" if self.steps[b].prompt_tokens else "decode_only"] += b - a
        result: dict[str, Any] = {}
        for kind, steps in kinds.items():
            result[kind] = {
                "steps": len(steps),
                "ms_median": statistics.median(m.seconds for m in steps) * 1e3 if steps else 0.0,
                "prompt_tokens_median": statistics.median(m.prompt_tokens for m in steps) if steps else 0,
                "decodes_median": statistics.median(m.decodes for m in steps) if steps else 0,
            }
        total = sum(gaps.values())
        result["gap_share_with_prompt"] = gaps["with_prompt"] / total if total else 0.0
        return result

    def times(self, request_id: str) -> list[float]:
        """The request's token times in epoch seconds."""
        return [ns / 1e9 for ns in self.end_ns[request_id]]

    def gaps(self, request_id: str) -> list[float]:
        """The request's inter-token gaps (s), subtracted in integer ns: epoch seconds as floats are only good to a
        quarter of a microsecond, which would make the same simulated run's ITL differ in the sixth digit."""
        stamps = self.end_ns[request_id]
        return [(b - a) / 1e9 for a, b in zip(stamps, stamps[1:])]


def request_params(request: BenchRequest, temperature: float = 0.0) -> SamplingParams:
    """A benchmark request's sampling: `output_len` tokens (exactly, or at most), guided by its schema if any."""
    guided = StructuredOutputsParams(json=request.json_schema) if request.json_schema is not None else None
    return SamplingParams(
        temperature=temperature, max_tokens=request.output_len, ignore_eos=request.ignore_eos, structured_outputs=guided
    )


@dataclass
class _Admission:
    """The serve loop's client side: the requests not sent yet, the in-flight count and the concurrency cap."""

    pending: deque
    max_concurrency: int | None
    in_flight: int = 0
    slot_freed: float = 0.0  # when a request last finished while every slot was taken

    @property
    def full(self) -> bool:
        return self.max_concurrency is not None and self.in_flight >= self.max_concurrency


def run_serve_once(
    llm: LLM,
    requests: Sequence[BenchRequest],
    arrivals: Sequence[float],
    max_concurrency: int | None = None,
    progress: bool = True,
    temperature: float = 0.0,
    recorder: TokenTimes | None = None,
) -> tuple[list[RequestResult], float]:
    """Serve `requests` arriving at `arrivals` (s after the start): before each step, add every request whose time
    has come (with that time as its arrival, or the moment a slot freed if `max_concurrency` held it back), then
    step. Returns one result per request, in order, and the duration (start to last finish, s). `recorder`: a
    fresh TokenTimes to record the run into, kept by the caller (its step mix), else one of its own."""
    from tqdm.auto import tqdm

    if len(arrivals) != len(requests) or any(b < a for a, b in zip(arrivals, arrivals[1:])):
        raise ValueError("arrivals: expected one non-decreasing time per request")
    cold_start(llm)
    eng = llm.engine
    clock = eng.clock  # simulated time for a simulated engine: arrivals and idle waits are on its clock
    params = [request_params(r, temperature) for r in requests]
    recorder = eng.subscribe(recorder if recorder is not None else TokenTimes())
    start = clock.monotonic()
    adm = _Admission(deque(range(len(requests))), max_concurrency, slot_freed=start)
    ids: dict[int, str] = {}
    try:
        with tqdm(total=len(requests), desc="serve", unit="req", disable=not progress) as bar:
            while adm.pending or adm.in_flight:
                now = clock.monotonic()
                while adm.pending and start + arrivals[adm.pending[0]] <= now and not adm.full:
                    i = adm.pending.popleft()
                    arrival = max(start + arrivals[i], adm.slot_freed)
                    ids[i] = eng.add_request(requests[i].prompt_token_ids, params[i], arrival_time=arrival)
                    adm.in_flight += 1
                if not adm.in_flight:  # idle until the next arrival
                    clock.sleep_until(start + arrivals[adm.pending[0]])
                    continue
                was_full = adm.full
                done = len(eng.step().of_kind("request.finished"))
                adm.in_flight -= done
                bar.update(done)
                if was_full and done:
                    adm.slot_freed = clock.monotonic()
    finally:
        eng.unsubscribe(recorder)
    duration = clock.monotonic() - start
    return [_engine_result(eng.pop_output(ids[i]), recorder.gaps(ids[i])) for i in range(len(requests))], duration


def http_results(streamed: Sequence[Streamed]) -> list[RequestResult]:
    """Requests over HTTP (http_serve.run_http_serve_once) as the benchmark counts them: only one that ended with
    [DONE] succeeded; times at the client, from when it was sent."""
    return [
        RequestResult(s.prompt_len, s.output_len, s.times[0], s.times[-1], np.diff(s.times).tolist())
        if s.outcome == "done" and s.times
        else RequestResult(s.prompt_len, 0, 0.0, 0.0, [], success=False)
        for s in streamed
    ]


def _engine_result(out: RequestOutput, itl: list[float]) -> RequestResult:
    m = out.metrics
    assert m is not None  # the engine gives every output its request's metrics
    first, last = m.first_token_time, m.last_token_time  # both set with the first token
    if out.finish_reason not in ("length", "stop") or first is None or last is None:
        return RequestResult(len(out.prompt_token_ids), len(out.token_ids), 0.0, 0.0, [], success=False)
    return RequestResult(
        len(out.prompt_token_ids),
        len(out.token_ids),
        first - m.arrival_time,
        last - m.arrival_time,
        itl,
    )


class _StepTimes:
    """A transformers streamer that owns the time and the tokens of every generate step (the prompt skipped)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.tokens: list[list[int]] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate() first streams the prompt
            self._prompt_seen = True
            return
        self.times.append(time.monotonic())
        self.tokens.append(value.reshape(-1).tolist())

    def end(self) -> None:
        pass


class HFGrammars:
    """Owns xgrammar's tokenizer info and compiler for the transformers baseline, and the JSON schemas compiled
    so far (a schema is compiled once, as the engine's compile cache does)."""

    def __init__(self, model_path: str | Path, vocab_size: int) -> None:
        import xgrammar as xgr
        from transformers import AutoTokenizer

        info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(model_path), vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(info)
        self._compiled: dict[str, Any] = {}

    def logits_processor(self, batch: Sequence[BenchRequest]):
        """xgrammar's transformers LogitsProcessor for a batch of JSON-schema requests (one per generate call)."""
        import xgrammar as xgr

        grammars = []
        for r in batch:
            spec = json.dumps(r.json_schema)  # key order kept: the grammar emits the properties in it
            if spec not in self._compiled:
                self._compiled[spec] = self.compiler.compile_json_schema(spec, any_whitespace=False)
            grammars.append(self._compiled[spec])
        return xgr.contrib.hf.LogitsProcessor(grammars)


def run_hf_serve_once(
    hf: HFBaseline,
    requests: Sequence[BenchRequest],
    arrivals: Sequence[float],
    eos_token_id: int | None,
    grammars: HFGrammars | None = None,
) -> tuple[list[RequestResult], float]:
    """The same schedule through transformers `generate` in static batches of `hf.batch_size`, arrival order.
    A fixed-length request counts its first `output_len` tokens; one that may stop counts up to its first EOS.
    JSON-schema requests need `grammars`; a workload is all guided or all free (a batch shares one processor)."""
    guided = {r.json_schema is not None for r in requests}
    if len(guided) > 1:
        raise ValueError("baseline: a workload with and without JSON schemas cannot share generate batches")
    if True in guided and grammars is None:
        raise ValueError("grammars: JSON-schema requests need an HFGrammars for the transformers baseline")
    order = sorted(range(len(requests)), key=lambda i: arrivals[i])
    results: dict[int, RequestResult] = {}
    start = time.monotonic()
    for k in range(0, len(order), hf.batch_size):
        batch = order[k : k + hf.batch_size]
        time.sleep(max(0.0, start + arrivals[batch[-1]] - time.monotonic()))
        steps = _hf_generate(hf, [requests[i] for i in batch], grammars)
        for row, i in enumerate(batch):
            n = _hf_output_len(requests[i], [s[row] for s in steps.tokens], eos_token_id)
            times = [t - (start + arrivals[i]) for t in steps.times[:n]]
            results[i] = RequestResult(
                len(requests[i].prompt_token_ids), n, times[0], times[-1], np.diff(times).tolist()
            )
    return [results[i] for i in range(len(requests))], time.monotonic() - start


@torch.inference_mode()
def _hf_generate(hf: HFBaseline, batch: Sequence[BenchRequest], grammars: HFGrammars | None) -> _StepTimes:
    width = max(len(r.prompt_token_ids) for r in batch)
    pads = [width - len(r.prompt_token_ids) for r in batch]
    input_ids = torch.tensor([[hf.pad_token_id] * p + r.prompt_token_ids for p, r in zip(pads, batch)])
    mask = torch.tensor([[0] * p + [1] * len(r.prompt_token_ids) for p, r in zip(pads, batch)])
    n = max(r.output_len for r in batch)
    fixed = all(r.ignore_eos for r in batch)
    streamer = _StepTimes()
    processors = None
    if batch[0].json_schema is not None:
        assert grammars is not None  # run_hf_serve_once refuses a guided workload without them
        processors = [grammars.logits_processor(batch)]
    hf.model.generate(
        input_ids=input_ids,
        attention_mask=mask,
        max_new_tokens=n,
        min_new_tokens=n if fixed else 0,
        do_sample=False,
        pad_token_id=hf.pad_token_id,
        streamer=streamer,
        logits_processor=processors,
    )
    return streamer


def _hf_output_len(request: BenchRequest, tokens: list[int], eos_token_id: int | None) -> int:
    n = min(request.output_len, len(tokens))
    if not request.ignore_eos and eos_token_id in tokens[:n]:
        n = tokens.index(eos_token_id) + 1
    return n


def _stats(name: str, seconds: Sequence[float]) -> dict[str, float]:
    ms = [s * 1e3 for s in seconds] or [0.0]  # vLLM reports 0 for a metric with no samples
    stats = {
        f"mean_{name}_ms": statistics.fmean(ms),
        f"median_{name}_ms": statistics.median(ms),
        f"std_{name}_ms": statistics.pstdev(ms),
    }
    stats.update({f"p{p}_{name}_ms": percentile(ms, p) for p in PERCENTILES})
    return stats


def is_good(result: RequestResult, slos: dict[str, float]) -> bool:
    """Whether a successful request meets every SLO given (ms; a bound equal to the value counts as met)."""
    values = {"ttft": result.ttft, "tpot": result.tpot, "e2el": result.e2el}
    return result.success and all(values[k] * 1e3 <= ms for k, ms in slos.items())


def compute_metrics(
    results: Sequence[RequestResult], duration: float, slos: dict[str, float] | None = None
) -> dict[str, Any]:
    """vLLM's serving metrics over the successful requests: counts, throughputs (per second of `duration`),
    goodput (requests meeting every SLO, per second) when SLOs are given, and the latency statistics."""
    ok = [r for r in results if r.success]
    num_in, num_out = sum(r.prompt_len for r in ok), sum(r.output_len for r in ok)
    metrics: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": num_in,
        "total_output_tokens": num_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": num_out / duration,
        "total_token_throughput": (num_in + num_out) / duration,
    }
    if slos:
        metrics["request_goodput"] = sum(is_good(r, slos) for r in ok) / duration
    metrics.update(_stats("ttft", [r.ttft for r in ok]))
    metrics.update(_stats("tpot", [r.tpot for r in ok if r.output_len > 1]))
    metrics.update(_stats("itl", [gap for r in ok for gap in r.itl]))
    metrics.update(_stats("e2el", [r.e2el for r in ok]))
    return metrics


def per_request(results: Sequence[RequestResult]) -> dict[str, list]:
    """The per-request lists vLLM's result file carries."""
    return {
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_len for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "errors": ["" if r.success else "failed" for r in results],
    }


def run_serve(
    model: str = "smollm2-135m",
    dataset: str = "random",
    num_requests: int = 64,
    dataset_args: dict[str, Any] | None = None,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    goodput: dict[str, float] | None = None,
    baseline: bool = False,
    hf_batch_size: int = 8,
    result_file: str | None = None,
    seed: int = 0,
    max_num_batched_tokens: int = 2048,
    engine_kwargs: dict[str, Any] | None = None,
    log: Callable[[str], None] = print,
    progress: bool = True,
    base_url: str | None = None,
    served_model_name: str | None = None,
    cb_baseline: bool = False,
    chaos_disconnect: float = 0.0,
    chaos_malformed: float = 0.0,
) -> dict[str, Any]:
    """Serve one seeded workload on the engine (and on transformers `generate` if `baseline`, on transformers'
    continuous batching if `cb_baseline`); returns the settings and vLLM-style metrics per side (plus the engine's
    ratios to each); writes them as JSON to `result_file`.
    With `base_url`, the engine side is the server there, over HTTP (its model named `served_model_name`, default
    `model`); `model` gives the tokenizer of the dataset. With a chaos share, a bad client joins the burst
    (http_serve.py), over HTTP to `base_url` or to this engine served in-process; `result["http"]` says what
    became of every request."""
    from workbench.bench.http_serve import Chaos, run_http_serve_once, served_in_process

    load = LoadAverage()
    engine_kwargs = dict(engine_kwargs or {})
    arrivals = request_arrivals(num_requests, request_rate, burstiness, seed)
    chaos = Chaos(chaos_disconnect, chaos_malformed, seed)
    if (base_url is not None or chaos.active) and (baseline or cb_baseline):
        raise ValueError("--baseline, --cb-baseline: run in-process; not with --base-url or --chaos-*")
    if base_url is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(resolve_model(model))
        llm = None
    else:
        llm = LLM(model=model, max_num_batched_tokens=max_num_batched_tokens, seed=seed, **engine_kwargs)
        tokenizer = llm.tokenizer
    requests = sample_dataset(dataset, tokenizer, num_requests, seed, **(dataset_args or {}))
    dataset_args = {**DATASET_DEFAULTS[dataset], **(dataset_args or {})}
    http, step_mix = None, None
    if llm is None or chaos.active:
        name = served_model_name or model
        with served_in_process(llm, name) if llm is not None else nullcontext(base_url) as url:
            assert url is not None  # base_url, where there is no engine here
            run_http_serve_once(url, name, requests[:2], [0.0, 0.0])  # warm-up, as in-process
            streamed, duration, http = run_http_serve_once(url, name, requests, arrivals, max_concurrency, chaos)
        results = http_results(streamed)
        log(f"server at {base_url or 'this engine, served in-process'}: {duration:.2f} s")
    else:
        run_serve_once(llm, requests[:2], [0.0, 0.0], progress=False)  # warm-up: first calls pay for allocation
        times = TokenTimes()
        results, duration = run_serve_once(llm, requests, arrivals, max_concurrency, progress, recorder=times)
        step_mix = times.step_mix()
        log(f"engine: {duration:.2f} s")
    result: dict[str, Any] = {
        "model": model,
        "date": machine_info()["date"],
        "settings": run_settings(
            run_serve,
            locals(),
            omit=("baseline", "cb_baseline", "result_file", "served_model_name"),
            goodput=goodput or {},
            hf_batch_size=hf_batch_size if baseline else None,
        ),
        "engine": compute_metrics(results, duration, goodput),
        "engine_steps": step_mix,
        "baseline": None,
        "baseline_cb": None,
        "http": http.to_dict() if http is not None else None,
    }
    files = {"engine": per_request(results)}
    if baseline:
        assert llm is not None  # --baseline runs in-process: refused above with --base-url
        hf = HFBaseline(resolve_model(model), hf_batch_size)
        grammars = None
        if any(r.json_schema is not None for r in requests):
            grammars = HFGrammars(resolve_model(model), hf.model.config.vocab_size)
        run_hf_serve_once(hf, requests[:2], [0.0, 0.0], llm.engine.eos_token_id, grammars)
        hf_results, hf_duration = run_hf_serve_once(hf, requests, arrivals, llm.engine.eos_token_id, grammars)
        log(f"transformers: {hf_duration:.2f} s")
        result["baseline"] = compute_metrics(hf_results, hf_duration, goodput)
        files["baseline"] = per_request(hf_results)
    if cb_baseline:
        cb_results, cb_duration = run_hf_continuous_serve(model, requests, arrivals, max_num_batched_tokens)
        log(f"transformers generate_batch: {cb_duration:.2f} s")
        result["baseline_cb"] = compute_metrics(cb_results, cb_duration, goodput)
        files["baseline_cb"] = per_request(cb_results)
    result["ratio"] = _ratios(result["engine"], result["baseline"])
    result["ratio_cb"] = _ratios(result["engine"], result["baseline_cb"])
    result["load_average"] = load.done()
    if result_file:
        write_result_file(result_file, result, files)
    return result


def run_hf_continuous_serve(
    model: str, requests: Sequence[BenchRequest], arrivals: Sequence[float], max_batch_tokens: int
) -> tuple[list[RequestResult], float]:
    """The schedule through transformers' continuous batching (warmed up on two requests first, as the engine is);
    one result per request, in order, and the duration (s)."""
    from workbench.bench.hf_continuous import HFContinuousBaseline

    with HFContinuousBaseline(resolve_model(model), requests, max_batch_tokens) as cb:
        cb.serve(requests[:2], [0.0, 0.0])
        timelines, duration = cb.serve(requests, arrivals)
    results = [
        RequestResult(t.prompt_len, t.output_len, t.times[0], t.times[-1], np.diff(t.times).tolist())
        if t.times
        else RequestResult(t.prompt_len, 0, 0.0, 0.0, [], success=False)
        for t in timelines
    ]
    return results, duration


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser, runs=False)
    add_executor_args(parser)
    add_workload_args(parser)
    parser.add_argument("--goodput", nargs="+", default=[], metavar="METRIC:MS", help="SLOs, e.g. ttft:1000 tpot:100")
    parser.add_argument("--result-file", default=None, help="write the results as JSON here")
    parser.add_argument("--baseline", action="store_true", help="also serve the schedule with transformers generate")
    parser.add_argument(
        "--cb-baseline",
        action="store_true",
        help="also serve it with transformers' continuous batching (generate_batch's machinery)",
    )
    parser.add_argument("--hf-batch-size", type=positive_int, default=8, help="transformers static batch size")
    parser.add_argument(
        "--base-url",
        default=None,
        help="an OpenAI-compatible server (e.g. http://127.0.0.1:8000/v1) "
        "to send the requests to over HTTP, instead of the in-process engine",
    )
    parser.add_argument(
        "--served-model-name", default=None, help="the model name that server expects (default: --model)"
    )
    parser.add_argument(
        "--chaos-disconnect",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="a bad client: this share of the requests is cut mid-stream (over HTTP; without "
        "--base-url the engine is served in-process)",
    )
    parser.add_argument(
        "--chaos-malformed",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="malformed requests sent among them, this share of their number",
    )


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The workload's flags, vLLM's names: dataset, number of prompts, arrival rate and shape, concurrency cap and
    each dataset's lengths (`workbench tune` takes the same)."""
    parser.add_argument("--dataset-name", choices=DATASETS, default="random")
    parser.add_argument("--num-prompts", type=positive_int, default=64)
    parser.add_argument("--request-rate", type=positive_float, default=float("inf"), help="req/s; inf: all at once")
    parser.add_argument("--burstiness", type=positive_float, default=1.0, help="Gamma shape; 1: Poisson (default)")
    parser.add_argument("--max-concurrency", type=positive_int, default=None)
    for flag in (
        "--random-input-len",
        "--random-output-len",
        "--prefix-repetition-prefix-len",
        "--prefix-repetition-suffix-len",
        "--prefix-repetition-num-prefixes",
        "--prefix-repetition-output-len",
        "--json-output-len",
    ):
        parser.add_argument(flag, type=positive_int, default=None, help="(default: the dataset's)")
    parser.add_argument("--random-range-ratio", type=float, default=None, help="in [0, 1) (default: 0)")


_DATASET_FLAGS = {
    "random": {"input_len": "random_input_len", "output_len": "random_output_len", "range_ratio": "random_range_ratio"},
    "prefix_repetition": {
        "prefix_len": "prefix_repetition_prefix_len",
        "suffix_len": "prefix_repetition_suffix_len",
        "num_prefixes": "prefix_repetition_num_prefixes",
        "output_len": "prefix_repetition_output_len",
    },
    "json_schema": {"output_len": "json_output_len"},
    "editing": {},
}


def dataset_args(args: argparse.Namespace) -> dict[str, Any]:
    """The flags of the chosen dataset that were given, under its generator's argument names."""
    given = {arg: getattr(args, flag) for arg, flag in _DATASET_FLAGS[args.dataset_name].items()}
    return {k: v for k, v in given.items() if v is not None}


def main(args: argparse.Namespace) -> dict[str, Any]:
    """`workbench bench serve`: run_serve with the command line's settings (vLLM's flag names)."""
    return run_with_flags(
        run_serve,
        args,
        dataset=args.dataset_name,
        num_requests=args.num_prompts,
        dataset_args=dataset_args(args),
        goodput=parse_goodput(args.goodput),
    )


def _ratios(ours: dict[str, Any], theirs: dict[str, Any] | None) -> dict[str, float] | None:
    if theirs is None:
        return None
    return {
        "output_throughput": ours["output_throughput"] / theirs["output_throughput"],
        "mean_ttft_ms": theirs["mean_ttft_ms"] / max(ours["mean_ttft_ms"], 1e-9),
        "mean_e2el_ms": theirs["mean_e2el_ms"] / max(ours["mean_e2el_ms"], 1e-9),
    }


def write_result_file(path: str | Path, result: dict[str, Any], per_side: dict[str, dict[str, list]]) -> None:
    """vLLM's flat layout for the engine (settings, metrics, per-request lists at the top level); the baseline's
    metrics and lists under "baseline" (transformers' continuous batching's under "baseline_cb")."""
    s = result["settings"]
    flat = {
        "date": result["date"],
        "backend": "workbench",
        "model_id": result["model"],
        "num_prompts": s["num_requests"],
        **s,
        **result["engine"],
        **per_side["engine"],
    }
    if result["baseline"] is not None:
        flat["baseline"] = {**result["baseline"], **per_side["baseline"]}
        flat["ratio"] = result["ratio"]
    if result.get("baseline_cb") is not None:
        flat["baseline_cb"] = {**result["baseline_cb"], **per_side["baseline_cb"]}
        flat["ratio_cb"] = result["ratio_cb"]
    Path(path).write_text(json.dumps(flat, indent=2) + "\n", encoding="utf-8")


_ROWS = (
    ("completed", "completed"),
    ("duration s", "duration"),
    ("request throughput (req/s)", "request_throughput"),
    ("request goodput (req/s)", "request_goodput"),
    ("output throughput (tok/s)", "output_throughput"),
    ("total token throughput (tok/s)", "total_token_throughput"),
)


def _sides(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [result["engine"], *(result[k] for k in ("baseline", "baseline_cb") if result.get(k))]


def _rows(result: dict[str, Any]) -> list[list[object]]:
    sides = _sides(result)
    rows = [[label, *(s[key] for s in sides)] for label, key in _ROWS if key in result["engine"]]
    for m in METRICS:
        for stat in ("mean", "median", *(f"p{p}" for p in PERCENTILES)):
            rows.append([f"{m.upper()} {stat} ms", *(s[f"{stat}_{m}_ms"] for s in sides)])
    return rows


def _headers(result: dict[str, Any]) -> list[str]:
    headers = ["metric", "engine"]
    if result["baseline"] is not None:
        headers.append(f"transformers (static batches of {result['settings']['hf_batch_size']})")
    if result.get("baseline_cb") is not None:
        headers.append("transformers generate_batch (continuous batching)")
    return headers


_WORKLOAD = (
    "{model}: {num_requests} requests of the {dataset} dataset{args}, arriving at {rate} ({shape}, seed "
    "{seed}){cap}{slo}; greedy{via}"
)
_DOCS = _WORKLOAD + (
    ". {where} (max_num_batched_tokens="
    "{max_num_batched_tokens}); TTFT and E2E latency from each request's arrival, TPOT = (E2E - TTFT) "
    "/ (output tokens - 1), ITL = gaps between the steps that gave a request tokens. Keys and "
    "definitions as vLLM's `benchmark_serving`.{baseline_note}{note}"
)
_BASELINE_NOTE = (
    " transformers: the same arrivals through `generate` in static batches, arrival order (a batch "
    "starts when its last request has arrived and the previous one is done), each step timed by a "
    "streamer."
)
_CB_NOTE = (
    " transformers generate_batch: the same arrivals through transformers' continuous batching (paged cache, "
    "its own scheduler), each request added at its arrival, each token stamped by transformers as it is "
    "sampled; its cache holds the whole workload and its token budget is max_num_batched_tokens. Each side "
    "served the schedule once, one after the other, in this process."
)


def _workload_values(result: dict[str, Any]) -> dict[str, str]:
    """The workload's phrases that depend on its settings: rate and its shape, dataset arguments, cap, SLOs."""
    s = result["settings"]
    given = ", ".join(f"{k}={v}" for k, v in s["dataset_args"].items())
    slos = ", ".join(f"{k} <= {v:g} ms" for k, v in s["goodput"].items())
    return {
        "rate": "all at once" if math.isinf(s["request_rate"]) else f"{s['request_rate']:g} req/s",
        "shape": "Poisson" if s["burstiness"] == 1 else f"Gamma, burstiness {s['burstiness']:g}",
        "args": f" ({given})" if given else "",
        "slo": f", goodput SLOs {slos}" if slos else "",
        "cap": f", max concurrency {s['max_concurrency']}" if s["max_concurrency"] else "",
        "baseline_note": (_BASELINE_NOTE if result["baseline"] else "")
        + (_CB_NOTE if result.get("baseline_cb") else ""),
        "where": _where(s),
        "via": _via(s),
    }


def _via(s: dict[str, Any]) -> str:
    chaos = s.get("chaos_disconnect") or s.get("chaos_malformed")
    if not s.get("base_url") and not chaos:
        return ""
    where = s["base_url"] or "this engine, served in-process"
    bad = (
        f"; a bad client in the burst: {s['chaos_disconnect']:.0%} of the requests cut mid-stream, malformed ones "
        f"{s['chaos_malformed']:.0%} of their number"
        if chaos
        else ""
    )
    return f"; over HTTP, streamed, to {where} (times at the client){bad}"


def _where(s: dict[str, Any]) -> str:
    if s.get("base_url") or s.get("chaos_disconnect") or s.get("chaos_malformed"):
        return "Requests go over HTTP to the server, which steps while they arrive"
    return executor_text(s.get("engine_kwargs") or {}) or "Requests arrive in-process while the engine steps"


def ratio_line(result: dict[str, Any]) -> str:
    lines = []
    for key, name in (("ratio", "transformers"), ("ratio_cb", "transformers generate_batch")):
        r = result.get(key)
        if r is not None:
            lines.append(
                f"engine / {name}: output throughput {r['output_throughput']:.2f}x, mean TTFT "
                f"{r['mean_ttft_ms']:.2f}x lower, mean E2E latency {r['mean_e2el_ms']:.2f}x lower"
            )
    if not lines:
        return (
            "no baseline run (--baseline runs transformers generate on the same schedule, --cb-baseline "
            "transformers' continuous batching)"
        )
    return "; ".join(lines)


def step_mix_line(mix: dict[str, Any]) -> str:
    """The engine's steps with prompt tokens against those with decodes alone, and where its TPOT went."""
    w, d = mix["with_prompt"], mix["decode_only"]
    return (
        f"Engine steps: {w['steps']} with prompt tokens (median {w['ms_median']:.0f} ms: "
        f"{w['prompt_tokens_median']:g} prompt tokens beside {w['decodes_median']:g} decodes), {d['steps']} with "
        f"decodes alone (median {d['ms_median']:.0f} ms, {d['decodes_median']:g} decodes); "
        f"{mix['gap_share_with_prompt']:.0%} of the time between two tokens of a request went to steps that also "
        "ran prompt tokens"
    )


def chaos_rows(http: dict[str, Any]) -> list[list[object]]:
    """What became of every request over HTTP: finished, cut, refused (by status), lost; the malformed ones'
    statuses; /health's answers during the burst; what the server held once idle."""
    requests, malformed, left = http["requests"], http["malformed"], http["left"]
    refused = ", ".join(f"{k.split()[1]}: {n}" for k, n in sorted(requests.items()) if k.startswith("refused"))
    return [
        ["finished with data: [DONE]", requests.get("done", 0)],
        ["cut mid-stream by the client", requests.get("cut", 0)],
        ["refused (status: count)", refused or 0],
        ["malformed sent (status: count)", ", ".join(f"{k}: {n}" for k, n in sorted(malformed.items())) or 0],
        ["lost (no [DONE], no refusal; malformed without a 4xx)", http["lost"]],
        ["/health answered during the burst", f"{http['health_ok']} of {http['health_ok'] + http['health_failed']}"],
        [
            "left on the server once idle: running, waiting, KV usage",
            f"{left['running']:g}, {left['waiting']:g}, {left['kv_cache_usage_perc']:.1%}",
        ],
    ]


def _parts(result: dict[str, Any]) -> list[Part]:
    parts: list[Part] = [
        described(result, _WORKLOAD, _DOCS, **_workload_values(result)),
        Table(_headers(result), _rows(result)),
        bold(ratio_line(result)),
        Line(load_line(result)),
    ]
    if result.get("engine_steps"):
        parts.insert(3, Line(step_mix_line(result["engine_steps"])))
    if result.get("http") and (result["settings"].get("chaos_disconnect") or result["settings"].get("chaos_malformed")):
        parts.insert(
            2, Table(["what became of the requests (a bad client in the burst)", "count"], chaos_rows(result["http"]))
        )
    return parts


format_text, format_markdown = formatters("Serving: latency and throughput under a request rate", _parts)
