"""Tensor parallelism on this CPU: output throughput at tensor_parallel_size 1, 2, 3 (gloo worker processes, the
machine's torch threads split between them), each step's forward split into compute and communication (the time
inside collectives, from every rank's parallel.step), and the bytes each rank all-reduces per token.

A size that does not divide the model's heads is refused before any process starts and reported as not run
(smollm2-135m: 9 query heads, 3 KV heads, so TP 3 runs and TP 2 does not; tiny-llama's 4 and 2 take TP 2 and 4).
Greedy tokens are compared with the first size run: a fp32 sum in another order may flip a near-tie.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Callable, Sequence

from engine import LLMEngine, SamplingParams
from workbench.bench.args import add_common_args, add_positive_ints, positive_int, run_with_flags
from workbench.bench.datasets import BenchRequest, random_requests, token_id_range
from workbench.bench.report import Line, Part, Table, describe, described, formatters
from workbench.state import EngineState

HELP = "tensor parallelism: tokens/s at TP 1/2/3, step time in compute and communication, bytes all-reduced"


def _generate(engine: LLMEngine, requests: Sequence[BenchRequest]) -> tuple[list[list[int]], list]:
    params = SamplingParams(temperature=0.0, max_tokens=requests[0].output_len, ignore_eos=True)
    ids = [engine.add_request(r.prompt_token_ids, params) for r in requests]
    records = engine.run(ids)
    return [list(engine.pop_output(i).token_ids) for i in ids], records


def _split(records: list) -> dict[str, float]:
    """Mean ms per step of compute and communication (mean over ranks), and bytes per token, from the records."""
    state = EngineState()
    for record in records:
        state.apply(record)
    par, ran = state.parallel, [r for r in records if r.scheduled]
    if not par.rows:  # one process: the whole forward is compute
        compute, comm = statistics.mean(r.timing["forward"] for r in ran), 0.0
    else:
        compute = statistics.mean(statistics.mean(r.compute_ms for r in row.ranks) for row in par.rows)
        comm = statistics.mean(statistics.mean(r.comm_ms for r in row.ranks) for row in par.rows)
    tokens = sum(sum(r.scheduled.values()) for r in ran)
    return {"step_ms": statistics.mean((r.end_ns - r.start_ns) / 1e6 for r in ran), "compute_ms": compute,
            "comm_ms": comm, "all_reduce_bytes_per_token": par.bytes.get("all_reduce", 0) / tokens,
            "all_gather_bytes": par.bytes.get("all_gather", 0), "tokens": tokens}


def _measure(engine: LLMEngine, requests: list[BenchRequest], runs: int) -> tuple[float, list[list[int]], list]:
    """Median seconds of `runs` runs after a warm-up run; the last run's tokens and records."""
    _generate(engine, requests)
    times = []
    for _ in range(runs):
        engine.reset_prefix_cache()  # every run prefills its prompts
        t0 = time.perf_counter()
        tokens, records = _generate(engine, requests)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), tokens, records


def run_parallel(model: str = "smollm2-135m", sizes: Sequence[int] = (1, 2, 3), num_requests: int = 4,
                 input_len: int = 64, output_len: int = 32, runs: int = 2, seed: int = 0,
                 max_num_batched_tokens: int = 2048, engine_kwargs: dict[str, Any] | None = None,
                 log: Callable[[str], None] = print) -> dict[str, Any]:
    """One row per tensor-parallel size that divides the model's heads (the others under `skipped`, with the
    engine's reason); the 1-minute load average before the first size and after the last."""
    import torch
    from transformers import AutoConfig

    rows, skipped, reference, load = [], {}, None, [os.getloadavg()[0]]
    for size in sizes:
        try:
            engine = LLMEngine(model=model, seed=seed, tensor_parallel_size=size,
                               max_num_batched_tokens=max_num_batched_tokens, **(engine_kwargs or {}))
        except ValueError as exc:  # the heads are not divided: refused before any process starts
            skipped[size] = str(exc)
            log(f"TP {size}: not run ({exc})")
            continue
        with engine:
            requests = random_requests(num_requests, (input_len, input_len), (output_len, output_len),
                                       token_id_range(engine.tokenizer), seed)
            seconds, tokens, records = _measure(engine, requests, runs)
            threads = getattr(engine.executor, "threads_per_rank", torch.get_num_threads())
            hf = AutoConfig.from_pretrained(engine.model_path)
        reference = tokens if reference is None else reference
        out = sum(len(t) for t in tokens)
        rows.append({"tp": size, "threads_per_rank": threads, "seconds": seconds, "output_tok_s": out / seconds,
                     "same_tokens": tokens == reference, **_split(records)})
        log(f"TP {size}: {seconds:.2f} s, {out / seconds:.1f} output tok/s")
    load.append(os.getloadavg()[0])
    # per token: the embedding's all-reduce, then o_proj's and down_proj's in every layer, hidden_size fp32 each
    expected = (1 + 2 * hf.num_hidden_layers) * hf.hidden_size * 4 if rows else 0
    return {"model": model, "num_requests": num_requests, "input_len": input_len, "output_len": output_len,
            "runs": runs, "cores": os.cpu_count(), "rows": rows, "skipped": skipped, "load_average": load,
            "expected_all_reduce_bytes_per_token": expected}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser)
    parser.add_argument("--sizes", type=positive_int, nargs="+", default=[1, 2, 3],
                        help="tensor_parallel_size values (default: %(default)s)")
    add_positive_ints(parser, num_requests=4, input_len=64, output_len=32)
    parser.set_defaults(runs=2)


def main(args: argparse.Namespace) -> dict[str, Any]:
    """`workbench bench parallel`: run_parallel with the command line's settings."""
    return run_with_flags(run_parallel, args)


_HEADERS = ("TP", "threads/rank", "median s", "output tok/s", "step ms", "compute ms", "comm ms", "comm share",
            "KB all-reduced/token", "tokens = first size")


def _table_rows(result: dict[str, Any]) -> list[list[object]]:
    return [[r["tp"], r["threads_per_rank"], r["seconds"], r["output_tok_s"], r["step_ms"], r["compute_ms"],
             r["comm_ms"], f"{r['comm_ms'] / (r['compute_ms'] + r['comm_ms']):.0%}",
             r["all_reduce_bytes_per_token"] / 1e3, "yes" if r["same_tokens"] else "no"] for r in result["rows"]]


_SETUP = ("Model {model}, fp32, greedy, {num_requests} requests of {input_len} prompt tokens and {output_len} output "
          "tokens at once; median of {runs} runs after a warm-up. TP N runs N gloo worker processes on loopback, the "
          "machine's {cores} cores' torch threads split between them. Compute and comm: each step's forward on each "
          "rank, split into the time inside collectives (waiting for a slower peer included) and the rest, mean over "
          "ranks and steps. 1-minute load average before and after: {load}.{skipped}")
_VERDICT = ("{cores} cores cannot show what tensor parallelism is for: the N ranks share the same cores, each with 1/N "
            "of the threads and 1/N of each matmul, so the work per step is unchanged and the collectives come on "
            "top (a difference between rows here is thread scheduling on this machine, see the load average, not "
            "sharding). What TP costs is the communication: per token, one all-reduce of hidden_size fp32 for the "
            "embedding and two per layer (o_proj, down_proj), {expected:.1f} KB per rank for this model, plus an "
            "all-gather of the sampled rows' logits; on CPU each collective is a rendezvous of processes. On "
            "separate devices the compute would shrink by N and this communication remain.")


def _parts(result: dict[str, Any]) -> list[Part]:
    skipped = "".join(f" TP {size} not run: {why}." for size, why in result["skipped"].items())
    values = {"load": ", ".join(f"{x:.1f}" for x in result["load_average"]), "skipped": skipped,
              "expected": result["expected_all_reduce_bytes_per_token"] / 1e3}
    return [described(result, _SETUP, _SETUP, **values), Table(_HEADERS, _table_rows(result)),
            Line(describe(_VERDICT, result, **values))]


format_text, format_markdown = formatters("Tensor parallelism", _parts)
