"""Data-parallel routing: by load (vLLM's score, waiting x 4 + running) against by cached prefix, on requests that
share a few long prefixes, with replicas whose caches cannot hold every prefix at once.

Each rule gets its own DP front end (engine/entrypoints/dp_client.py); the workload runs in waves, each wave run to
completion with `LLM.generate` before the next, so what a replica caches carries over from one wave to the next.
Every count comes from the replicas' StepRecords and the front end's routing events: the prefix-cache hit rate (the
hit tokens of each request's first `prefix.lookup`, over all prompt tokens), preemptions, requests per replica.
They follow from the seed and the rules, not from the machine's speed (except where a replica's report reaches the
front end mid-burst: load routing reads it); the median TTFT (each replica's own arrival to first token) is a timing.
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections import Counter
from collections.abc import Callable
from typing import Any

from engine import LLM
from workbench.bench.args import add_common_args, add_positive_ints, run_with_flags
from workbench.bench.datasets import shared_prefix_requests, token_id_range
from workbench.bench.report import Line, Part, Table, bold, describe, described, formatters, run_settings
from workbench.bench.throughput import greedy_params

HELP = "data parallelism: routing by load vs by cached prefix (hit rate, preemptions, requests per replica)"

RULES = ("load", "prefix")
RULE_NAMES = {
    "load": "load (vLLM's waiting x 4 + running)",
    "prefix": "prefix (longest cached prefix, the score on ties and misses)",
}


def replica_counts(records: dict[str, list], routed: list) -> dict[str, Any]:
    """What one rule's run did, from each replica's StepRecords and the front end's `dp.routed` events: hit tokens
    of each request's first prefix.lookup (a preempted request looks again: not counted twice), preemptions, and
    requests per replica (in replica order)."""
    hit_tokens, seen, preemptions = 0, set(), 0
    for recs in records.values():
        for record in recs:
            for event in record.of_kind("prefix.lookup"):
                if event.request_id not in seen:
                    seen.add(event.request_id)
                    hit_tokens += event.num_hit_tokens
            preemptions += len(record.of_kind("request.preempted"))
    per_replica = Counter(e.replica for e in routed)
    return {
        "hit_tokens": hit_tokens,
        "num_preemptions": preemptions,
        "requests_per_replica": [per_replica.get(name, 0) for name in sorted(records)],
    }


def run_rule(
    model: str,
    rule: str,
    waves: list[list],
    data_parallel_size: int,
    engine_kwargs: dict[str, Any],
    log: Callable[[str], None],
) -> dict[str, Any]:
    """The waves on a fresh DP front end routing by `rule`: its counts and the median TTFT."""
    with LLM(
        model=model,
        data_parallel_size=data_parallel_size,
        data_parallel_routing=rule,
        enable_prefix_caching=True,
        **engine_kwargs,
    ) as llm:
        client = llm.engine
        ttft_ms: list[float] = []
        for i, wave in enumerate(waves):
            outs = llm.generate([r.prompt_token_ids for r in wave], greedy_params(wave), use_tqdm=False)
            ttft_ms += [
                (o.metrics.first_token_time - o.metrics.arrival_time) * 1e3
                for o in outs
                if o.metrics is not None and o.metrics.first_token_time is not None
            ]
            log(f"routing by {rule}: wave {i + 1}/{len(waves)} done")
        routed = [e for e in client.routing_events() if e.kind == "dp.routed"]
        counts = replica_counts(client.records(), routed)
    num_prompt_tokens = sum(len(r.prompt_token_ids) for wave in waves for r in wave)
    return {
        **counts,
        "num_prompt_tokens": num_prompt_tokens,
        "hit_rate": counts["hit_tokens"] / num_prompt_tokens if num_prompt_tokens else 0.0,
        "ttft_median_ms": statistics.median(ttft_ms) if ttft_ms else None,
    }


def run_dp_routing(
    model: str = "tiny-llama",
    data_parallel_size: int = 2,
    num_prefixes: int = 4,
    prefix_len: int = 256,
    suffix_len: int = 32,
    num_waves: int = 8,
    wave_size: int = 8,
    output_len: int = 8,
    num_kv_blocks: int | None = 56,
    block_size: int = 16,
    seed: int = 0,
    engine_kwargs: dict[str, Any] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The shared-prefix workload (`num_waves` x `wave_size` requests, each one of `num_prefixes` random
    `prefix_len`-token prefixes, each prefix equally often in a seeded random order, + a random `suffix_len`-token
    suffix) through DP
    `data_parallel_size`, once routing by load and once by prefix, each replica's cache `num_kv_blocks` blocks.
    Returns the settings and, per rule, its counts; the counts are deterministic for a seed."""
    engine_kwargs = dict(engine_kwargs or {})
    if num_kv_blocks is not None:
        engine_kwargs["num_kv_blocks"] = num_kv_blocks
    num_kv_blocks = engine_kwargs.get("num_kv_blocks")
    kwargs = {"block_size": block_size, "seed": seed, **engine_kwargs}
    from transformers import AutoTokenizer

    from engine.model.loader import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(model))
    requests = shared_prefix_requests(
        num_prefixes, prefix_len, suffix_len, num_waves * wave_size, output_len, token_id_range(tokenizer), seed
    )
    # in a seeded random order: round robin over the prefixes would line up with load routing's alternation
    # (prefixes 0, 2 on one replica, 1, 3 on the other), a best case no real arrival order gives
    random.Random(seed).shuffle(requests)
    waves = [requests[i : i + wave_size] for i in range(0, len(requests), wave_size)]
    rules = {rule: run_rule(model, rule, waves, data_parallel_size, kwargs, log) for rule in RULES}
    # the most any routing can hit: every request but the first of each prefix finds its prefix's full blocks
    full_prefix = prefix_len // block_size * block_size
    ceiling_tokens = max(0, len(requests) - num_prefixes) * full_prefix
    return {
        "model": model,
        # num_kv_blocks is a setting of its own: engine_kwargs keeps the others
        "settings": run_settings(
            run_dp_routing,
            locals(),
            engine_kwargs={k: v for k, v in engine_kwargs.items() if k != "num_kv_blocks"},
        ),
        "ceiling_hit_tokens": ceiling_tokens,
        "ceiling_hit_rate": ceiling_tokens / rules["load"]["num_prompt_tokens"],
        **rules,
    }


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_common_args(
        parser,
        runs=False,
        budget=False,
        engine=["data_parallel_size", "block_size"],
        defaults={"model": "tiny-llama", "num_kv_blocks": 56, "data_parallel_size": 2},
    )
    add_positive_ints(parser, num_prefixes=4, prefix_len=256, suffix_len=32, num_waves=8, wave_size=8, output_len=8)


def main(args: argparse.Namespace) -> dict[str, Any]:
    """`workbench bench dp_routing`: run_dp_routing with the command line's settings."""
    return run_with_flags(run_dp_routing, args)


_HEADERS = ("data_parallel_routing", "hit rate", "hit tokens", "preemptions", "requests per replica", "TTFT median ms")


def _rows(result: dict[str, Any]) -> list[list[object]]:
    rows = []
    for rule in RULES:
        r = result[rule]
        ttft = "-" if r["ttft_median_ms"] is None else f"{r['ttft_median_ms']:.0f}"
        rows.append(
            [
                RULE_NAMES[rule],
                f"{r['hit_rate']:.1%}",
                f"{r['hit_tokens']} of {r['num_prompt_tokens']}",
                r["num_preemptions"],
                " / ".join(str(n) for n in r["requests_per_replica"]),
                ttft,
            ]
        )
    return rows


def summary_line(result: dict[str, Any]) -> str:
    load, prefix = result["load"], result["prefix"]
    return (
        f"by prefix vs by load: hit rate {prefix['hit_rate']:.1%} vs {load['hit_rate']:.1%}, preemptions "
        f"{prefix['num_preemptions']} vs {load['num_preemptions']}"
    )


_WORKLOAD = (
    "{model}, DP {data_parallel_size}: {num_waves} waves of {wave_size} requests, each one of {num_prefixes} "
    "shared {prefix_len}-token prefixes (equally often, in a seeded random order) + a {suffix_len}-token "
    "random suffix, {output_len} output tokens; "
    "each replica's cache {num_kv_blocks} blocks of {block_size} tokens"
)
_DOCS = _WORKLOAD + (
    ". Greedy, EOS ignored, prefix caching on, seed {seed}; each wave runs to completion "
    "(`LLM.generate`) before the next, so replicas keep what they cached. Hit rate = hit tokens of "
    "each request's first `prefix.lookup` (a preempted request looks again) over all prompt "
    "tokens; preemptions = `request.preempted` events; both from the replicas' StepRecords, "
    "requests per replica from the front end's `dp.routed` events. These counts follow from the "
    "seed and the rules, not from the machine's speed, except where a replica's report reaches the "
    "front end in the middle of a wave's burst (routing by load reads it). TTFT median = a "
    "replica's arrival to its first token, a timing taken on a shared, loaded machine (tiny model): "
    "not a speed comparison.{note}"
)


def _parts(result: dict[str, Any]) -> list[Part]:
    ceiling = describe(_CEILING, result, ceiling=f"{result['ceiling_hit_rate']:.1%}")
    return [
        described(result, _WORKLOAD, _DOCS),
        Table(_HEADERS, _rows(result)),
        bold(summary_line(result)),
        Line(ceiling, ceiling + _READING),
    ]


_CEILING = (
    "The workload's ceiling: {ceiling} ({ceiling_hit_tokens} tokens), every request but the first of each "
    "prefix hitting its prefix's full blocks."
)
_READING = (
    " By load, every replica ends up holding every prefix in a cache too small for them, so prefixes evict "
    "each other (and requests are preempted); by prefix, each prefix lives on one replica, and the split of "
    "the requests follows the prefixes rather than the load."
)


format_text, format_markdown = formatters("Data-parallel routing: by load against by cached prefix", _parts)
