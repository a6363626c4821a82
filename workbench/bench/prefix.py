"""Prefix caching: time to first token and throughput with `enable_prefix_caching` on and off, on requests that
share a few long prefixes (system prompts, few-shot examples) and differ in their suffixes.

Every request arrives at t=0, so TTFT includes queueing behind the others' prefills: that is where the skipped
prefix work shows.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from engine import LLM
from workbench.bench.args import add_common_args, add_positive_ints, run_with_flags
from workbench.bench.datasets import BenchRequest, shared_prefix_requests, token_id_range
from workbench.bench.report import Part, Table, bold, described, formatters, percentile, run_settings
from workbench.bench.throughput import cold_start, greedy_params
from workbench.bench.timing import alternate, medians

HELP = "TTFT and throughput with prefix caching on vs off"
IN_ALL: tuple[int, list[str]] = (2, [])  # `workbench bench all` runs it: (place, flags)

MODES = {"on": True, "off": False}


@dataclass(frozen=True)
class PrefixRun:
    """One pass of the workload on one engine: per-request TTFTs, totals and the prefix-cache counters."""

    ttft_s: list[float]
    elapsed_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    hit_rate: float
    num_cached_tokens: int
    num_preemptions: int
    peak_kv_blocks: int

    def summary(self) -> dict[str, float]:
        ms = [t * 1e3 for t in self.ttft_s]
        return {
            "ttft_mean_ms": statistics.fmean(ms),
            "ttft_median_ms": statistics.median(ms),
            "ttft_p90_ms": percentile(ms, 90),
            "elapsed_s": self.elapsed_s,
            "output_tok_s": self.num_output_tokens / self.elapsed_s,
            "total_tok_s": (self.num_prompt_tokens + self.num_output_tokens) / self.elapsed_s,
            "hit_rate": self.hit_rate,
            "num_cached_tokens": self.num_cached_tokens,
            "num_preemptions": self.num_preemptions,
            "peak_kv_blocks": self.peak_kv_blocks,
        }


def run_prefix_once(llm: LLM, requests: Sequence[BenchRequest]) -> PrefixRun:
    """Add every request with one arrival time, step the engine until all finish, collect the metrics."""
    cold_start(llm)  # the hits measured are those within the run
    eng = llm.engine
    stats = eng.kv_cache_manager.stats
    queries0, hits0 = stats.queries, stats.hits
    t0 = time.monotonic()
    ids = [eng.add_request(r.prompt_token_ids, p, arrival_time=t0) for r, p in zip(requests, greedy_params(requests))]
    preemptions = peak = 0
    while eng.has_unfinished_requests():
        record = eng.step()
        preemptions += len(record.of_kind("request.preempted"))
        peak = max(peak, record.kv.used)
    elapsed = time.monotonic() - t0
    outs = [eng.pop_output(rid) for rid in ids]
    queries = stats.queries - queries0
    return PrefixRun(
        ttft_s=[o.metrics.first_token_time - o.metrics.arrival_time for o in outs],
        elapsed_s=elapsed,
        num_prompt_tokens=sum(len(r.prompt_token_ids) for r in requests),
        num_output_tokens=sum(len(o.token_ids) for o in outs),
        hit_rate=(stats.hits - hits0) / queries if queries else 0.0,
        num_cached_tokens=sum(o.num_cached_tokens for o in outs),
        num_preemptions=preemptions,
        peak_kv_blocks=peak,
    )


def run_prefix(
    model: str = "smollm2-135m",
    num_prefixes: int = 5,
    prefix_len: int = 512,
    suffix_len: int = 128,
    num_requests: int = 64,
    output_len: int = 16,
    runs: int = 3,
    seed: int = 0,
    max_num_batched_tokens: int = 2048,
    block_size: int = 16,
    engine_kwargs: dict[str, Any] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The shared-prefix workload on two engines (prefix caching on, off), alternating, `runs` times each;
    per-metric medians. `engine_kwargs`: more EngineConfig fields. Returns settings and one summary per mode,
    plus on/off speedups."""
    engine_kwargs = dict(engine_kwargs or {})
    engines = {
        mode: LLM(
            model=model,
            enable_prefix_caching=on,
            max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size,
            seed=seed,
            **engine_kwargs,
        )
        for mode, on in MODES.items()
    }
    requests = shared_prefix_requests(
        num_prefixes, prefix_len, suffix_len, num_requests, output_len, token_id_range(engines["on"].tokenizer), seed
    )
    warmup = [BenchRequest(r.prompt_token_ids[:16], 2) for r in requests[:2]]
    for llm in engines.values():
        run_prefix_once(llm, warmup)
    summaries: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    # each PrefixRun times its own run, from the requests' common arrival to the last one's end
    for turn in alternate({mode: partial(run_prefix_once, llm, requests) for mode, llm in engines.items()}, runs):
        summaries[turn.side].append(turn.value.summary())
        log(f"run {turn.run + 1}/{runs}: caching {turn.side}: {turn.value.elapsed_s:.2f} s")
    on, off = medians(summaries["on"]), medians(summaries["off"])
    return {
        "model": model,
        "settings": run_settings(run_prefix, locals()),
        "on": on,
        "off": off,
        "ttft_mean_speedup": off["ttft_mean_ms"] / on["ttft_mean_ms"],
        "throughput_speedup": on["total_tok_s"] / off["total_tok_s"],
    }


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser, engine=["block_size"])
    add_positive_ints(parser, num_prefixes=5, prefix_len=512, suffix_len=128, num_requests=64, output_len=16)


def main(args: argparse.Namespace) -> dict[str, Any]:
    """`workbench bench prefix`: run_prefix with the command line's settings."""
    return run_with_flags(run_prefix, args)


_HEADERS = (
    "prefix caching",
    "TTFT mean ms",
    "TTFT median ms",
    "TTFT p90 ms",
    "output tok/s",
    "total tok/s",
    "hit rate",
    "preemptions",
    "peak KV blocks",
)


def _rows(result: dict[str, Any]) -> list[list[object]]:
    return [
        [
            mode,
            s["ttft_mean_ms"],
            s["ttft_median_ms"],
            s["ttft_p90_ms"],
            s["output_tok_s"],
            s["total_tok_s"],
            f"{s['hit_rate']:.1%}",
            int(s["num_preemptions"]),
            int(s["peak_kv_blocks"]),
        ]
        for mode, s in ((m, result[m]) for m in MODES)
    ]


def speedup_line(result: dict[str, Any]) -> str:
    on, off = result["on"], result["off"]
    return (
        f"caching on vs off: mean TTFT {on['ttft_mean_ms']:.0f} vs {off['ttft_mean_ms']:.0f} ms "
        f"({result['ttft_mean_speedup']:.2f}x faster), total throughput {result['throughput_speedup']:.2f}x"
    )


_WORKLOAD = (
    "{model}: {num_requests} requests = one of {num_prefixes} shared {prefix_len}-token prefixes + a "
    "{suffix_len}-token random suffix, {output_len} output tokens each, all arriving at t=0; median of {runs} "
    "alternating runs"
)
_DOCS = _WORKLOAD + (
    ". Greedy, EOS ignored; block_size={block_size}, max_num_batched_tokens="
    "{max_num_batched_tokens}, seed {seed}. TTFT = first token time - arrival time. Hit rate = "
    "prefix-cache hit tokens / queried prompt tokens.{note}"
)


def _parts(result: dict[str, Any]) -> list[Part]:
    return [described(result, _WORKLOAD, _DOCS), Table(_HEADERS, _rows(result)), bold(speedup_line(result))]


format_text, format_markdown = formatters("Prefix caching: on vs off", _parts)
