"""`workbench tune`: the engine's knobs searched for the most goodput under latency SLOs, on one workload.

The workload is `bench serve`'s (a dataset, a number of prompts, an arrival rate and shape, seeded) or the arrivals
of a recorded step trace (`--trace`: each request's arrival, prompt length and output length, with seeded random
prompt tokens). SLOs are percentile bounds in ms (`--slo ttft_p99:1000 itl_p99:200`): a configuration is feasible
when every one holds. Goodput is vLLM's: requests per second that meet per-request bounds (`--goodput ttft:MS
tpot:MS e2el:MS`; by default the `--slo` bounds of ttft, tpot and e2el, applied to each request).

The search, under a budget of measured runs (`--max-runs`): start from the engine's defaults, then one knob at a
time (`max_num_batched_tokens`, `max_num_seqs`, `long_prefill_token_threshold`, `enable_prefix_caching`,
`num_speculative_tokens`, `block_size`), each candidate value with the other knobs at the best configuration so
far, passes repeated while one finds something better, then, with runs left, the configurations that change
several knobs at once, nearest the best first, until the budget is spent. As vLLM's `auto_tune.sh` narrows its
search when latency fails, a failed SLO prunes what cannot win: a larger token budget or more sequences per step
only make steps longer, so an ITL or TPOT failure prunes the larger values of that knob (the others equal); a smaller
budget or fewer sequences only delay first tokens, so a TTFT failure prunes the smaller ones. Pruned configurations
cost no run and are listed with the failure that pruned them.

The best configuration is the feasible one with the most goodput (ties: the lower first SLO statistic); none
feasible: the one closest to its SLOs is named. The Pareto front is goodput against the first SLO's statistic over
every measured configuration. The reproducing command re-runs exactly the winner on the same workload.

With `--executor simulated --hardware ... --tensor-parallel-size N` (bench serve's flags) every run is the engine's
scheduler and KV cache over the simulated executor's cost model: a deployment no laptop holds is tuned in seconds,
every latency is simulated time, and the same flags give the same table."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import shlex
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.bench.args import (
    EXECUTOR_FLAGS,
    add_common_args,
    add_executor_args,
    executor_text,
    non_negative_int,
    positive_int,
    run_with_flags,
)
from workbench.bench.report import Line, Part, Table, bold, described, docs_only, formatters, percentile, run_settings
from workbench.bench.timing import LoadAverage, load_line

HELP = "search the engine's knobs for the most goodput under latency SLOs (vLLM's auto_tune)"

METRICS = ("ttft", "tpot", "itl", "e2el")
PER_REQUEST = ("ttft", "tpot", "e2el")  # metrics a single request has (vLLM's goodput); ITL is per token gap
_SLO_KEY = re.compile(r"^(ttft|tpot|itl|e2el)_(mean|median|p(\d{1,2}(?:\.\d+)?|100))$")


@dataclass(frozen=True)
class Knob:
    """One engine setting the search varies: its EngineConfig name, its flag, its candidates by default, whether
    its values are ordered by step size (so a failed SLO prunes one side of it) and how a value is parsed."""

    name: str
    default: tuple[Any, ...]
    ordered: bool
    parse: Callable[[str], Any]
    help: str


def _on_off(text: str) -> bool:
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return text == "on"


def _power_of_two(text: str) -> int:
    value = positive_int(text)
    if value & (value - 1):
        raise argparse.ArgumentTypeError(f"must be a power of two, got {value}")
    return value


KNOBS = (
    Knob("max_num_batched_tokens", (256, 512, 1024, 2048), True, positive_int, "token budget per step"),
    Knob("max_num_seqs", (16, 64, 256), True, positive_int, "sequences per step at most"),
    Knob("long_prefill_token_threshold", (0,), False, non_negative_int, "prefill chunk cap per request; 0: none"),
    Knob("enable_prefix_caching", (True,), False, _on_off, "on / off"),
    Knob("num_speculative_tokens", (0,), False, non_negative_int, "n-gram draft tokens per step; 0: none"),
    Knob("block_size", (16,), False, _power_of_two, "tokens per KV block"),
)
KNOB_NAMES = tuple(k.name for k in KNOBS)
# which way along an ordered knob a failed metric gets worse: +1 larger values are worse, -1 smaller ones are
_WORSE = {"itl": +1, "tpot": +1, "ttft": -1}


# ---- SLOs ------------------------------------------------------------------------------------------------------
def parse_slo(items: Sequence[str]) -> dict[str, float]:
    """`--slo ttft_p99:1000 itl_p99:200` -> {key: ms}. A key is METRIC_STAT: METRIC one of ttft, tpot, itl, e2el,
    STAT mean, median or pNN; refused with a ValueError naming the key and what was expected."""
    slos: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep:
            raise ValueError(f"--slo: {item!r}: expected KEY:MS, e.g. ttft_p99:1000")
        if not _SLO_KEY.match(key):
            raise ValueError(
                f"--slo: unknown key {key!r}: expected METRIC_STAT with METRIC one of "
                f"{', '.join(METRICS)} and STAT mean, median or pNN (e.g. ttft_p99, itl_median)"
            )
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--slo: {key}: {value!r} is not a number of milliseconds") from None
        if not ms > 0 or math.isinf(ms):
            raise ValueError(f"--slo: {key}: the bound must be a finite number of ms > 0, got {value}")
        if key in slos:
            raise ValueError(f"--slo: {key} given twice")
        slos[key] = ms
    return slos


def slo_statistic(samples_ms: Sequence[float], stat: str) -> float:
    """mean, median or pNN of `samples_ms` (0 with no sample, as vLLM reports an empty metric)."""
    if not samples_ms:
        return 0.0
    if stat == "mean":
        return statistics.fmean(samples_ms)
    return percentile(samples_ms, 50.0 if stat == "median" else float(stat[1:]))


def _samples_ms(results: Sequence[Any]) -> dict[str, list[float]]:
    ok = [r for r in results if r.success]
    return {
        "ttft": [r.ttft * 1e3 for r in ok],
        "tpot": [r.tpot * 1e3 for r in ok if r.output_len > 1],
        "itl": [g * 1e3 for r in ok for g in r.itl],
        "e2el": [r.e2el * 1e3 for r in ok],
    }


def slo_values(results: Sequence[Any], keys: Sequence[str]) -> dict[str, float]:
    """Each SLO key's statistic over a run's per-request results (ms)."""
    samples = _samples_ms(results)
    return {key: slo_statistic(samples[key.split("_")[0]], key.split("_", 1)[1]) for key in keys}


def goodput_bounds(slos: dict[str, float], goodput: dict[str, float] | None) -> dict[str, float]:
    """The per-request bounds goodput counts against: `goodput` where given, else each per-request metric's
    tightest `--slo` bound (ttft_p99:1000 -> a request is good when its TTFT <= 1000 ms)."""
    if goodput:
        return dict(goodput)
    bounds: dict[str, float] = {}
    for key, ms in slos.items():
        metric = key.split("_")[0]
        if metric in PER_REQUEST:
            bounds[metric] = min(ms, bounds.get(metric, math.inf))
    return bounds


# ---- the search ------------------------------------------------------------------------------------------------
def config_key(config: dict[str, Any]) -> tuple:
    return tuple(config[name] for name in KNOB_NAMES)


def engine_settings(config: dict[str, Any], speculative_method: str = "ngram") -> dict[str, Any]:
    """The EngineConfig fields of one configuration of the knobs."""
    kwargs = {k: v for k, v in config.items() if k != "num_speculative_tokens"}
    if config["num_speculative_tokens"]:
        kwargs["speculative_config"] = {
            "method": speculative_method,
            "num_speculative_tokens": config["num_speculative_tokens"],
        }
    return kwargs


def start_config(space: dict[str, Sequence[Any]]) -> dict[str, Any]:
    """Where the search starts: each knob at the engine's default if it is a candidate, else its first candidate."""
    from engine import EngineConfig

    defaults = {name: getattr(EngineConfig, name, None) for name in KNOB_NAMES}
    defaults["num_speculative_tokens"] = 0
    return {name: defaults[name] if defaults[name] in values else values[0] for name, values in space.items()}


@dataclass(frozen=True)
class PruneRule:
    """What one failed SLO rules out: along ordered knob `knob`, every value beyond `value` in direction
    `direction` (+1: larger), the other knobs as in `others`."""

    knob: str
    value: Any
    direction: int
    others: tuple
    reason: str

    def prunes(self, config: dict[str, Any]) -> bool:
        rest = tuple(v for name, v in config.items() if name != self.knob)
        return rest == self.others and (config[self.knob] - self.value) * self.direction > 0


def prune_rules(
    config: dict[str, Any], failed: dict[str, float], slos: dict[str, float], space: dict[str, Sequence[Any]]
) -> list[PruneRule]:
    """The rules a configuration's failed SLOs (key -> measured ms) give, one per ordered knob and direction."""
    rules = []
    for key, measured in failed.items():
        direction = _WORSE.get(key.split("_")[0])
        if direction is None:  # E2E latency moves both ways along these knobs: nothing is ruled out
            continue
        for knob in KNOBS:
            if not knob.ordered or len(space[knob.name]) < 2:
                continue
            others = tuple(v for name, v in config.items() if name != knob.name)
            side = "larger" if direction > 0 else "smaller"
            reason = (
                f"{knob.name}={config[knob.name]} failed {key} ({measured:.0f} ms > {slos[key]:g} ms); "
                f"a {side} value only makes it worse"
            )
            rules.append(PruneRule(knob.name, config[knob.name], direction, others, reason))
    return rules


def violation(values: dict[str, float], slos: dict[str, float]) -> float:
    """How far a run is from its SLOs: the largest measured / bound ratio (<= 1: every SLO met)."""
    return max((values[k] / ms for k, ms in slos.items()), default=0.0)


def _rank(point: dict[str, Any], primary: str) -> tuple:
    """Larger is better: feasible first; then goodput (feasible) or closeness to the SLOs (infeasible); then the
    lower first SLO statistic."""
    if point["feasible"]:
        return (1, point["goodput"], -point["values"][primary])
    return (0, -point["violation"], point["goodput"])


def pareto_front(points: Sequence[dict[str, Any]], primary: str) -> list[dict[str, Any]]:
    """The measured points no other point dominates on (higher goodput, lower `primary` statistic), by latency."""

    def dominated(p: dict[str, Any]) -> bool:
        return any(
            q["goodput"] >= p["goodput"]
            and q["values"][primary] <= p["values"][primary]
            and (q["goodput"] > p["goodput"] or q["values"][primary] < p["values"][primary])
            for q in points
        )

    return sorted((p for p in points if not dominated(p)), key=lambda p: p["values"][primary])


def search_order(space: dict[str, Sequence[Any]], incumbent: dict[str, Any]) -> list[dict[str, Any]]:
    """One pass: for each knob in turn, every candidate value with the other knobs at `incumbent`."""
    return [
        {**incumbent, knob: value} for knob, values in space.items() for value in values if value != incumbent[knob]
    ]


def tune(
    space: dict[str, Sequence[Any]],
    measure: Callable[[dict[str, Any]], dict[str, Any]],
    slos: dict[str, float],
    max_runs: int,
    primary: str,
    progress: Callable[[dict[str, Any]], None] = lambda _: None,
) -> dict[str, Any]:
    """The search itself, on any `measure(config) -> {"goodput", "values": {slo key: ms}, ...}` (a ValueError: the
    engine refused the configuration; no run spent). Returns the measured points in order, the pruned and refused
    configurations, and the best point."""
    incumbent = start_config(space)
    points: list[dict[str, Any]] = []
    seen: set[tuple] = set()
    rules: list[PruneRule] = []
    pruned: list[dict[str, Any]] = []
    refused: list[dict[str, Any]] = []

    def try_config(config: dict[str, Any]) -> dict[str, Any] | None:
        seen.add(config_key(config))
        rule = next((r for r in rules if r.prunes(config)), None)
        if rule is not None:
            pruned.append({"config": config, "reason": rule.reason})
            return None
        try:
            measured = measure(config)
        except ValueError as exc:  # the engine refuses a combination (e.g. a budget below the block size)
            refused.append({"config": config, "reason": str(exc)})
            return None
        values = measured["values"]
        failed = {k: values[k] for k, ms in slos.items() if values[k] > ms}
        point = {
            **measured,
            "config": config,
            "feasible": not failed,
            "failed": sorted(failed),
            "violation": violation(values, slos),
            "run": len(points) + 1,
        }
        points.append(point)
        rules.extend(prune_rules(config, failed, slos, space))
        progress(point)
        return point

    best = try_config(incumbent)
    improved = True
    while improved and len(points) < max_runs:
        improved = False
        for config in search_order(space, best["config"] if best else incumbent):
            if len(points) >= max_runs:
                break
            if config_key(config) in seen:
                continue
            point = try_config(config)
            if point is not None and (best is None or _rank(point, primary) > _rank(best, primary)):
                best, improved = point, True
                break  # a new incumbent: the next pass varies the knobs around it
        if not improved and len(points) < max_runs:
            # one knob at a time found nothing better: spend what is left on the configurations that change several
            # knobs, nearest the best first (the rules prune along one knob only, so these may still win)
            centre = best["config"] if best else incumbent
            rest = [dict(zip(space, values)) for values in itertools.product(*space.values()) if values not in seen]
            for config in sorted(rest, key=lambda c: sum(c[k] != centre[k] for k in space)):
                if len(points) >= max_runs:
                    break
                point = try_config(config)
                if point is not None and (best is None or _rank(point, primary) > _rank(best, primary)):
                    best, improved = point, True
                    break
    untried = sum(1 for c in itertools.product(*space.values()) if c not in seen)
    return {"points": points, "pruned": pruned, "refused": refused, "best": best, "untried": untried}


# ---- the workload ----------------------------------------------------------------------------------------------
def trace_workload(path: str, tokenizer: Any, seed: int = 0) -> tuple[list[Any], list[float]]:
    """The requests of a recorded step trace: each `request.added`'s arrival (s after the first), prompt length
    and output length (what it generated, or its max_tokens if it never finished), with seeded random prompt
    tokens; generated to exactly that length."""
    import random

    from engine.events import RequestAdded, RequestFinished
    from workbench.bench.datasets import BenchRequest, token_id_range
    from workbench.trace import read_trace

    added: dict[str, RequestAdded] = {}
    finished: dict[str, int] = {}  # request id -> the tokens it generated
    for record in read_trace(path).records:
        for event in record.events:
            if isinstance(event, RequestAdded):
                added[event.request_id] = event
            elif isinstance(event, RequestFinished):
                finished[event.request_id] = event.num_output_tokens
    if not added:
        raise ValueError(f"--trace: {path} has no request.added event to take arrivals from")
    order = sorted(added.values(), key=lambda e: e.arrival_ns)
    rng = random.Random(seed)
    low, high = token_id_range(tokenizer)
    requests = [
        BenchRequest(
            [rng.randrange(low, high) for _ in range(e.num_prompt_tokens)],
            max(1, finished.get(e.request_id, e.max_tokens)),
        )
        for e in order
    ]
    return requests, [(e.arrival_ns - order[0].arrival_ns) / 1e9 for e in order]


def workload_tokenizer(model: str, engine_kwargs: dict[str, Any]) -> Any:
    """The tokenizer the workload is sampled with: the model's, or a simulated model's (a byte tokenizer where its
    config ships none), without building an engine."""
    if engine_kwargs.get("executor") == "simulated":
        from engine.executor.sim.model_spec import load_model_spec
        from engine.executor.sim.tokenizer import spec_tokenizer

        return spec_tokenizer(load_model_spec(model, engine_kwargs.get("revision")))
    from transformers import AutoTokenizer

    from engine.model import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(model))


def measure_config(
    model: str,
    config: dict[str, Any],
    requests: Sequence[Any],
    arrivals: Sequence[float],
    slos: dict[str, float],
    goodput: dict[str, float],
    seed: int,
    max_concurrency: int | None,
    engine_kwargs: dict[str, Any],
    speculative_method: str = "ngram",
) -> dict[str, Any]:
    """One run: an engine with `config`, warmed up on two requests, serves the workload once; its goodput, SLO
    statistics and vLLM's serving metrics."""
    from engine import LLM
    from workbench.bench.serve import compute_metrics, run_serve_once

    llm = LLM(model=model, seed=seed, **engine_settings(config, speculative_method), **engine_kwargs)
    run_serve_once(llm, requests[:2], [0.0, 0.0], progress=False)
    results, duration = run_serve_once(llm, requests, arrivals, max_concurrency, progress=False)
    metrics = compute_metrics(results, duration, goodput or None)
    rate = metrics["request_goodput"] if goodput else metrics["request_throughput"]
    keys = list(dict.fromkeys([*slos, "ttft_p99", "itl_p99"]))
    return {
        "goodput": rate,
        "values": slo_values(results, keys),
        "output_throughput": metrics["output_throughput"],
        "completed": metrics["completed"],
        "duration": duration,
    }


def run_tune(
    model: str = "smollm2-135m",
    dataset: str = "random",
    num_requests: int = 32,
    dataset_args: dict[str, Any] | None = None,
    request_rate: float = 4.0,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    trace: str | None = None,
    slos: dict[str, float] | None = None,
    goodput: dict[str, float] | None = None,
    space: dict[str, Sequence[Any]] | None = None,
    max_runs: int = 8,
    seed: int = 0,
    speculative_method: str = "ngram",
    engine_kwargs: dict[str, Any] | None = None,
    workload_argv: Sequence[str] = (),
    log: Callable[[str], None] = print,
    progress: bool = True,
) -> dict[str, Any]:
    """Tune the knobs in `space` (default: KNOBS' defaults) on one workload under `slos` (key -> ms), spending at
    most `max_runs` runs; returns the settings, every measured point, the pruned and refused configurations, the
    best point (or the closest, flagged infeasible), the Pareto front and the commands that reproduce the winner.
    `workload_argv`: the workload and SLO flags, repeated in the reproducing command."""
    from tqdm.auto import tqdm

    from workbench.bench.datasets import DATASET_DEFAULTS, sample_dataset
    from workbench.bench.serve import request_arrivals

    load = LoadAverage()
    slos = dict(slos or {})
    space = {k.name: list(k.default) for k in KNOBS} | {k: list(v) for k, v in (space or {}).items()}
    unknown = sorted(set(space) - set(KNOB_NAMES))
    if unknown:
        raise ValueError(f"space: unknown knob {unknown[0]} (knobs: {', '.join(KNOB_NAMES)})")
    engine_kwargs = dict(engine_kwargs or {})
    bounds = goodput_bounds(slos, goodput)
    primary = next(iter(slos), "ttft_p99")
    tokenizer = workload_tokenizer(model, engine_kwargs)
    if trace is not None:
        requests, arrivals = trace_workload(trace, tokenizer, seed)
    else:
        requests = sample_dataset(dataset, tokenizer, num_requests, seed, **(dataset_args or {}))
        arrivals = request_arrivals(num_requests, request_rate, burstiness, seed)

    def measure(config: dict[str, Any]) -> dict[str, Any]:
        return measure_config(
            model, config, requests, arrivals, slos, bounds, seed, max_concurrency, engine_kwargs, speculative_method
        )

    with tqdm(total=max_runs, desc="tune", unit="run", disable=not progress) as bar:

        def report(point: dict[str, Any]) -> None:
            bar.update(1)
            bar.set_postfix_str(f"goodput {point['goodput']:.2f} req/s, {primary} {point['values'][primary]:.0f} ms")
            log(
                f"run {point['run']}: {_describe(point['config'])}: goodput {point['goodput']:.2f} req/s, "
                + ", ".join(f"{k} {v:.0f} ms" for k, v in point["values"].items() if k in slos or k == primary)
                + ("" if point["feasible"] else f" (fails {', '.join(point['failed'])})")
            )

        search = tune(space, measure, slos, max_runs, primary, report)
    best = search["best"]
    result = {
        "model": model,
        "settings": run_settings(
            run_tune,
            locals(),
            omit=("workload_argv",),
            dataset=dataset if trace is None else "trace",
            num_requests=len(requests),
            dataset_args={**DATASET_DEFAULTS[dataset], **(dataset_args or {})} if trace is None else {},
            goodput=bounds,
            primary=primary,
        ),
        **search,
        "front": pareto_front(search["points"], primary),
        "command": reproduce_command(best["config"], workload_argv) if best else None,
        "serve_command": serve_command(model, best["config"], engine_kwargs) if best else None,
        "load_average": load.done(),
    }
    return result


def _describe(config: dict[str, Any]) -> str:
    return ", ".join(f"{k}={'on' if v is True else 'off' if v is False else v}" for k, v in config.items())


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _value(value: Any) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def reproduce_command(config: dict[str, Any], workload_argv: Sequence[str]) -> str:
    """`workbench tune` with the same workload and SLO flags, each knob pinned to the winner's value and one run:
    it measures exactly that configuration again on the same seeded workload."""
    pinned = [item for name, value in config.items() for item in (_flag(name), _value(value))]
    return "workbench " + shlex.join(["tune", *workload_argv, *pinned, "--max-runs", "1"])


# the flags that define the workload, the SLOs and the engine outside the search space, as `workload_argv` repeats them
_WORKLOAD_FLAGS = (
    "model",
    *EXECUTOR_FLAGS,
    "seed",
    "num_kv_blocks",
    "dataset_name",
    "num_prompts",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "random_input_len",
    "random_output_len",
    "random_range_ratio",
    "prefix_repetition_prefix_len",
    "prefix_repetition_suffix_len",
    "prefix_repetition_num_prefixes",
    "prefix_repetition_output_len",
    "json_output_len",
    "trace",
    "slo",
    "goodput",
    "speculative_method",
)


def workload_argv(args: argparse.Namespace) -> list[str]:
    """The workload, SLO and fixed engine flags of `args`, every one that has a value, spelled out."""
    argv: list[str] = []
    for name in _WORKLOAD_FLAGS:
        value = getattr(args, name, None)
        if value is None or value == []:
            continue
        argv += [_flag(name), *(map(str, value) if isinstance(value, list) else [str(value)])]
    return argv


def serve_command(model: str, config: dict[str, Any], engine_kwargs: dict[str, Any] | None = None) -> str:
    """The deployment the winner stands for: `workbench serve` with its settings (its speculative setting, which
    `workbench serve` has no flag for, is in the Python settings beside); after a simulated tune, `vllm serve` of
    the model on the simulated GPUs (tensor parallel size and memory share as vLLM's flags; the simulated executor
    refuses speculation), where such a model is deployed."""
    knobs = ("max_num_batched_tokens", "max_num_seqs", "long_prefill_token_threshold", "block_size")
    argv = [item for name in knobs for item in (_flag(name), str(config[name]))]
    kw = engine_kwargs or {}
    if kw.get("executor") != "simulated":
        return "workbench " + shlex.join(
            ["serve", model, *argv] + ([] if config["enable_prefix_caching"] else ["--no-prefix-caching"])
        )
    from engine.executor.sim.model_spec import builtin_models

    hub_id = builtin_models().get(model.lower(), {}).get("_name_or_path", model)
    argv += [
        item
        for name in ("tensor_parallel_size", "gpu_memory_utilization")
        if kw.get(name) is not None
        for item in (_flag(name), str(kw[name]))
    ]
    argv += [] if config["enable_prefix_caching"] else ["--no-enable-prefix-caching"]
    return shlex.join(["vllm", "serve", hub_id, *argv])


# ---- the command line ------------------------------------------------------------------------------------------
def add_cli_args(parser: argparse.ArgumentParser) -> None:
    from workbench.bench.serve import add_workload_args

    add_common_args(parser, runs=False, budget=False)
    add_executor_args(parser)
    add_workload_args(parser)
    parser.set_defaults(num_prompts=32, request_rate=4.0)
    parser.add_argument(
        "--trace",
        default=None,
        help="a JSONL step trace: its requests' arrivals and lengths are the workload (instead of --dataset-name)",
    )
    parser.add_argument(
        "--slo",
        nargs="+",
        default=[],
        metavar="KEY:MS",
        help="latency SLOs, METRIC_STAT:MS with METRIC ttft, tpot, itl or e2el and STAT mean, median "
        "or pNN (e.g. ttft_p99:1000 itl_p99:200)",
    )
    parser.add_argument(
        "--goodput",
        nargs="+",
        default=[],
        metavar="METRIC:MS",
        help="per-request bounds goodput counts (vLLM's, e.g. ttft:1000 tpot:100; default: the "
        "--slo bounds of ttft, tpot and e2el)",
    )
    parser.add_argument("--max-runs", type=positive_int, default=8, help="measured runs at most (default: 8)")
    parser.add_argument("--speculative-method", default="ngram", help="proposer when num_speculative_tokens > 0")
    knobs = parser.add_argument_group("search space: each knob's candidates (default: shown)")
    for knob in KNOBS:
        shown = " ".join(_value(v) for v in knob.default)
        knobs.add_argument(
            _flag(knob.name),
            type=knob.parse,
            nargs="+",
            default=None,
            metavar="V",
            help=f"{knob.help} (default: {shown})",
        )
    parser.add_argument("--output-json", default=None, metavar="PATH", help="write the result as JSON here")
    parser.add_argument(
        "--plot",
        default=None,
        help="PNG of the Pareto front and the sweep, where /usr/bin/chromium "
        "renders it (default with --write-docs: img/tune.png beside the docs)",
    )


def plot_png(result: dict[str, Any], path: str | Path) -> str | None:
    """The Pareto front and the sweep (workbench/bench/tune_figures.py, as the notebook shows them) as a PNG at
    `path`; None with nothing measured, or without Chromium to render them."""
    from workbench.bench.tune_figures import save_png, tune_figures

    return save_png(tune_figures(result), path) if result["points"] else None


def main(args: argparse.Namespace) -> dict[str, Any]:
    """`workbench tune`: run_tune with the command line's settings; the result written to --output-json."""
    from workbench.bench.serve import dataset_args, parse_goodput

    space = {k.name: list(dict.fromkeys(getattr(args, k.name))) for k in KNOBS if getattr(args, k.name)}
    result = run_with_flags(
        run_tune,
        args,
        dataset=args.dataset_name,
        num_requests=args.num_prompts,
        dataset_args=dataset_args(args),
        slos=parse_slo(args.slo),
        goodput=parse_goodput(args.goodput),
        space=space,
        workload_argv=workload_argv(args),
    )
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")
    plot = args.plot or (str(Path(args.docs_path).parent / "img" / "tune.png") if args.write_docs else None)
    result["plot"] = plot_png(result, plot) if plot else None
    return result


# ---- the report ------------------------------------------------------------------------------------------------
def _slo_text(result: dict[str, Any]) -> str:
    s = result["settings"]
    slos = ", ".join(f"{k} <= {v:g} ms" for k, v in s["slos"].items()) or "none"
    good = ", ".join(f"{k} <= {v:g} ms" for k, v in s["goodput"].items())
    return f"SLOs {slos}; goodput: requests/s with {good}" if good else f"SLOs {slos}; goodput: completed requests/s"


def _workload_text(result: dict[str, Any]) -> str:
    s = result["settings"]
    if s["trace"]:
        return f"{result['model']}: the {s['num_requests']} requests of trace {s['trace']} at their recorded arrivals"
    rate = "all at once" if math.isinf(s["request_rate"]) else f"{s['request_rate']:g} req/s"
    given = ", ".join(f"{k}={v}" for k, v in s["dataset_args"].items())
    return (
        f"{result['model']}: {s['num_requests']} requests of the {s['dataset']} dataset ({given}) at {rate} "
        f"(seed {s['seed']})"
    )


def _simulated_text(result: dict[str, Any]) -> str:
    simulated = executor_text(result["settings"]["engine_kwargs"])
    return f". {simulated} (latencies are simulated time, not this machine's)" if simulated else ""


_HEADERS = (
    "run",
    "max_num_batched_tokens",
    "max_num_seqs",
    "long_prefill",
    "prefix caching",
    "spec tokens",
    "block",
    "goodput req/s",
    "output tok/s",
    "SLOs",
    "Pareto",
)


def _rows(result: dict[str, Any]) -> list[list[object]]:
    primary = result["settings"]["primary"]
    on_front = {p["run"] for p in result["front"]}
    rows = []
    for p in result["points"]:
        c = p["config"]
        slo = (
            ", ".join(f"{k} {v:.0f}" for k, v in p["values"].items() if k in result["settings"]["slos"])
            or f"{primary} {p['values'][primary]:.0f}"
        )
        rows.append(
            [
                p["run"],
                c["max_num_batched_tokens"],
                c["max_num_seqs"],
                c["long_prefill_token_threshold"],
                _value(c["enable_prefix_caching"]),
                c["num_speculative_tokens"],
                c["block_size"],
                p["goodput"],
                p["output_throughput"],
                slo + (" ok" if p["feasible"] else " FAIL"),
                "yes" if p["run"] in on_front else "",
            ]
        )
    return rows


def verdict(result: dict[str, Any]) -> str:
    """The best configuration, or that none met the SLOs and which came closest."""
    best = result["best"]
    if best is None:
        return "no configuration could be measured (every one was refused by the engine)"
    if not best["feasible"]:
        slos = result["settings"]["slos"]
        misses = ", ".join(f"{k} {best['values'][k]:.0f} ms > {slos[k]:g} ms" for k in best["failed"])
        return (
            f"no configuration meets {', '.join(f'{k} <= {v:g} ms' for k, v in slos.items())}; the closest, "
            f"run {best['run']} ({_describe(best['config'])}), misses by {best['violation']:.2f}x: {misses}"
        )
    return f"best: run {best['run']}, {_describe(best['config'])}: goodput {best['goodput']:.2f} req/s, " + ", ".join(
        f"{k} {v:.0f} ms" for k, v in best["values"].items() if k in result["settings"]["slos"]
    )


def _pruned_text(result: dict[str, Any]) -> str:
    lines = [f"pruned without a run: {_describe(p['config'])} ({p['reason']})" for p in result["pruned"]]
    lines += [f"refused by the engine: {_describe(p['config'])} ({p['reason']})" for p in result["refused"]]
    lines.append(
        f"{len(result['points'])} run(s) of at most {result['settings']['max_runs']}; "
        f"{result['untried']} configuration(s) of the space neither run nor pruned"
    )
    return "\n".join(lines)


def _parts(result: dict[str, Any]) -> list[Part]:
    plot = (
        f"![the Pareto front of goodput against {result['settings']['primary']}, and the sweep run by run]"
        f"(img/{Path(result['plot']).name})"
        if result.get("plot")
        else ""
    )
    command = (
        [
            Line(
                f"reproduce: {result['command']}\ndeploy: {result['serve_command']}",
                f"Reproduce the winner: `{result['command']}`; deploy it: `{result['serve_command']}`",
            )
        ]
        if result["command"]
        else []
    )
    simulated = _simulated_text(result)
    load = [] if simulated else [Line(load_line(result))]  # simulated time does not move with the machine's load
    return [
        described(
            result,
            "{workload}; {slo}{simulated}",
            _DOCS,
            workload=_workload_text(result),
            slo=_slo_text(result),
            simulated=simulated,
        ),
        Table(_HEADERS, _rows(result)),
        bold(verdict(result)),
        *command,
        Line(_pruned_text(result)),
        *load,
        docs_only(plot),
    ]


_DOCS = (
    "{workload}; {slo}{simulated}. One engine per configuration, warmed up on two requests, serves the workload "
    "once; the search starts at the engine's defaults and varies one knob at a time around the best so far, then, "
    "with runs left, configurations that change several knobs, nearest first; a "
    "failed ITL/TPOT SLO prunes larger budgets and sequence caps, a failed TTFT SLO smaller ones. Pareto: no "
    "other run has both more goodput and a lower {primary}.{note}"
)

format_text, format_markdown = formatters("Tuning: the most goodput under latency SLOs (`workbench tune`)", _parts)
