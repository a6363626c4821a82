"""Tensor parallelism on this CPU: output throughput at tensor_parallel_size 1, 2, 3 (gloo worker processes, the
machine's torch threads split between them), each step's forward split into compute and communication (the time
inside collectives, from every rank's parallel.step), and the bytes each rank all-reduces per token.

A size that does not divide the model's heads is refused before any process starts and reported as not run
(smollm2-135m: 9 query heads, 3 KV heads, so TP 3 runs and TP 2 does not; tiny-llama's 4 and 2 take TP 2 and 4).
Then data parallelism: `data_parallel_size` whole engines in their own processes behind the router (no collective:
each request runs on one replica), the cores' threads split between them as well. Greedy tokens are compared with
the first row's: a fp32 sum in another order may flip a near-tie.

TP 1 runs in this process on every torch thread; a TP N rank gets fewer (the cores split between N processes). So
that TP 1 is also compared at equal threads per rank, it runs again with torch's threads set to each TP N's threads
per rank (both rows labelled).
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from engine import LLM, LLMEngine, SamplingParams
from engine.model.loader import resolve_model
from workbench.bench.args import add_common_args, add_positive_ints, positive_int, run_with_flags
from workbench.bench.datasets import BenchRequest, random_requests, token_id_range
from workbench.bench.report import Line, Part, Table, describe, described, formatters
from workbench.bench.timing import LoadAverage, Timed, load_line, timed
from workbench.state import EngineState

HELP = "tensor and data parallelism: tokens/s at TP 1/2/3 and DP 2, compute vs communication, bytes all-reduced"


def _generate(engine: LLMEngine, requests: Sequence[BenchRequest]) -> tuple[list[list[int]], list]:
    """The requests through one engine (the tensor-parallel workers run inside its steps); its records."""
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
    return {
        "step_ms": statistics.mean((r.end_ns - r.start_ns) / 1e6 for r in ran),
        "compute_ms": compute,
        "comm_ms": comm,
        "all_reduce_bytes_per_token": par.bytes.get("all_reduce", 0) / tokens,
        "all_gather_bytes": par.bytes.get("all_gather", 0),
        "tokens": tokens,
    }


def _generate_dp(llm: LLM, requests: Sequence[BenchRequest]) -> tuple[list[list[int]], list]:
    """The requests through the data-parallel front end; the steps every replica ran for them."""
    params = SamplingParams(temperature=0.0, max_tokens=requests[0].output_len, ignore_eos=True)
    before = {name: len(recs) for name, recs in llm.engine.records().items()}
    outs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)
    records = [r for name, recs in llm.engine.records().items() for r in recs[before[name] :]]
    return [list(o.token_ids) for o in outs], records


def _row(
    label: str,
    tp: int,
    dp: int,
    threads: int,
    measured: Timed[tuple[list[list[int]], list]],
    reference: list[list[int]],
) -> dict[str, Any]:
    """One row: the median of `measured` (the last run's tokens against the first row's, its records split)."""
    seconds, (tokens, records) = measured.median_s, measured.last
    out = sum(len(t) for t in tokens)
    return {
        "label": label,
        "tp": tp,
        "dp": dp,
        "threads_per_rank": threads,
        "seconds": seconds,
        "output_tok_s": out / seconds,
        "same_tokens": tokens == reference,
        **_split(records),
    }


def _tp1_at(
    threads: int, kwargs: dict[str, Any], requests: Sequence[BenchRequest], runs: int, reference: list[list[int]]
) -> dict[str, Any]:
    """TP 1 with torch's threads set to `threads` (a TP rank's share), restored after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with LLMEngine(**kwargs, tensor_parallel_size=1) as engine:
            measured = timed(lambda: _generate(engine, requests), runs)
    finally:
        torch.set_num_threads(before)
    return _row(f"TP 1 at {threads} thread(s), as a TP rank", 1, 1, threads, measured, reference)


def run_parallel(
    model: str = "smollm2-135m",
    sizes: Sequence[int] = (1, 2, 3),
    data_parallel_sizes: Sequence[int] = (2,),
    num_requests: int = 4,
    input_len: int = 64,
    output_len: int = 32,
    runs: int = 2,
    seed: int = 0,
    max_num_batched_tokens: int = 2048,
    engine_kwargs: dict[str, Any] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """One row per tensor-parallel size that divides the model's heads (the others under `skipped`, with the
    engine's reason), then one per data-parallel size above 1 (whole engines behind the router); the load average
    before the first row and after the last. Prefix caching is off: every run computes every prompt."""
    import torch
    from transformers import AutoConfig, AutoTokenizer

    kwargs = dict(
        model=model,
        seed=seed,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=False,
        **(engine_kwargs or {}),
    )
    rows, skipped, load = [], {}, LoadAverage()
    hf = AutoConfig.from_pretrained(resolve_model(model))
    requests = random_requests(
        num_requests,
        (input_len, input_len),
        (output_len, output_len),
        token_id_range(AutoTokenizer.from_pretrained(resolve_model(model))),
        seed,
    )
    reference = None  # the first row's tokens
    for size in sizes:
        try:
            engine = LLMEngine(**kwargs, tensor_parallel_size=size)
        except ValueError as exc:  # the heads are not divided: refused before any process starts
            skipped[size] = str(exc)
            log(f"TP {size}: not run ({exc})")
            continue
        with engine:
            measured = timed(partial(_generate, engine, requests), runs)
            reference = reference or measured.last[0]
            threads = engine.threads_per_rank or torch.get_num_threads()  # None: the model runs in this process
            label = f"TP {size}" if size > 1 else f"TP 1, all {threads} thread(s) in one process"
            rows.append(_row(label, size, 1, threads, measured, reference))
        log(f"{label}: {rows[-1]['seconds']:.2f} s, {rows[-1]['output_tok_s']:.1f} output tok/s")
    tp1 = {r["threads_per_rank"] for r in rows if r["tp"] == 1}
    if tp1:  # TP 1 again at each TP N's threads per rank: the fair comparison of one rank's work
        assert reference is not None  # the first row's tokens, and there is a row
        for threads in sorted({r["threads_per_rank"] for r in rows if r["tp"] > 1} - tp1):
            rows.append(_tp1_at(threads, kwargs, requests, runs, reference))
            log(f"{rows[-1]['label']}: {rows[-1]['seconds']:.2f} s, {rows[-1]['output_tok_s']:.1f} output tok/s")
    for size in (n for n in data_parallel_sizes if n > 1):
        with LLM(**kwargs, data_parallel_size=size) as llm:
            measured = timed(lambda: _generate_dp(llm, requests), runs)
            reference = reference or measured.last[0]
            rows.append(_row(f"DP {size}", 1, size, llm.engine.torch_threads, measured, reference))
        log(f"DP {size}: {rows[-1]['seconds']:.2f} s, {rows[-1]['output_tok_s']:.1f} output tok/s")
    # per token: the embedding's all-reduce, then o_proj's and down_proj's in every layer, hidden_size fp32 each
    expected = (1 + 2 * hf.num_hidden_layers) * hf.hidden_size * 4
    return {
        "model": model,
        "num_requests": num_requests,
        "input_len": input_len,
        "output_len": output_len,
        "runs": runs,
        "cores": os.cpu_count(),
        "rows": rows,
        "skipped": skipped,
        "load_average": load.done(),
        "expected_all_reduce_bytes_per_token": expected,
    }


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser)
    parser.add_argument(
        "--sizes",
        type=positive_int,
        nargs="+",
        default=[1, 2, 3],
        help="tensor_parallel_size values (default: %(default)s)",
    )
    parser.add_argument(
        "--data-parallel-sizes",
        type=positive_int,
        nargs="+",
        default=[2],
        help="data_parallel_size values above 1, each a row of whole engine replicas (default: %(default)s)",
    )
    add_positive_ints(parser, num_requests=4, input_len=64, output_len=32)
    parser.set_defaults(runs=2)


def main(args: argparse.Namespace) -> dict[str, Any]:
    """`workbench bench parallel`: run_parallel with the command line's settings."""
    return run_with_flags(run_parallel, args)


_HEADERS = (
    "run",
    "TP",
    "DP",
    "threads/process",
    "median s",
    "output tok/s",
    "step ms",
    "compute ms",
    "comm ms",
    "comm share",
    "KB all-reduced/token",
    "tokens = first size",
)


def _table_rows(result: dict[str, Any]) -> list[list[object]]:
    return [
        [
            r.get("label", ""),
            r["tp"],
            r["dp"],
            r["threads_per_rank"],
            r["seconds"],
            r["output_tok_s"],
            r["step_ms"],
            r["compute_ms"],
            r["comm_ms"],
            f"{r['comm_ms'] / (r['compute_ms'] + r['comm_ms']):.0%}",
            r["all_reduce_bytes_per_token"] / 1e3,
            "yes" if r["same_tokens"] else "no",
        ]
        for r in result["rows"]
    ]


_SETUP = (
    "Model {model}, fp32, greedy, {num_requests} requests of {input_len} prompt tokens and {output_len} output "
    "tokens at once, prefix caching off; median of {runs} runs after a warm-up. TP N runs N gloo worker "
    "processes on loopback, DP N runs N whole engines behind the router, the machine's {cores} cores' torch "
    "threads split between the processes; TP 1 runs in one process on all its threads, then again at a TP "
    "rank's threads (the fair row to compare a rank with). Compute and comm: each step's forward on each rank, "
    "split into the time inside collectives (waiting for a slower peer included) and the rest, mean over "
    "ranks and steps (DP: over every replica's steps).{skipped}"
)
_VERDICT = (
    "{cores} cores cannot show what tensor parallelism is for: the N ranks share the same cores, each with 1/N "
    "of the threads and 1/N of each matmul, so the work per step is unchanged and the collectives come on "
    "top (a difference between rows here is thread scheduling on this machine, see the load average, not "
    "sharding). What TP costs is the communication: per token, one all-reduce of hidden_size fp32 for the "
    "embedding and two per layer (o_proj, down_proj), {expected:.1f} KB per rank for this model, plus an "
    "all-gather of the sampled rows' logits; on CPU each collective is a rendezvous of processes. On "
    "separate devices the compute would shrink by N and this communication remain. DP exchanges nothing "
    "between replicas; here its replicas too share the cores, so it cannot speed up either."
)


def _parts(result: dict[str, Any]) -> list[Part]:
    skipped = "".join(f" TP {size} not run: {why}." for size, why in result["skipped"].items())
    values = {
        "skipped": skipped,
        "expected": result["expected_all_reduce_bytes_per_token"] / 1e3,
    }
    return [
        described(result, _SETUP, _SETUP, **values),
        Table(_HEADERS, _table_rows(result)),
        Line(load_line(result)),
        Line(describe(_VERDICT, result, **values)),
    ]


format_text, format_markdown = formatters("Tensor parallelism", _parts)
