"""Engine throughput against two Hugging Face transformers baselines on one seeded workload of mixed prompt and
output lengths: `generate` in static batches, and transformers' own continuous batching (`generate_batch`'s
machinery, workbench/bench/hf_continuous.py).

The engine and `generate_batch` get every request at once and batch continuously; static `generate` runs batches of
`batch_size` in arrival order, left-padded, each generating its longest request's output length. Only the tokens
each request asked for count as useful output: the padding and the tokens a short request makes while it waits for
the long ones in its batch are the waste continuous batching removes. The three sides alternate in one process;
medians. The machine's floor for the workload (weights read once per step, every token's FLOPs at the matmul peak,
both measured here) says how far from the hardware all three are.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine import LLM, SamplingParams
from engine.model import resolve_model
from workbench.bench.args import add_common_args, add_positive_ints, positive_int, run_with_flags
from workbench.bench.datasets import BenchRequest, random_requests, token_id_range
from workbench.bench.report import Line, Part, Table, bold, described, formatters, run_settings
from workbench.bench.timing import LoadAverage, alternate, load_line

HELP = "engine vs transformers generate on a mixed workload"
IN_ALL: tuple[int, list[str]] = (1, [])  # `workbench bench all` runs it: (place, flags)


@dataclass(frozen=True)
class RunStats:
    """One timed pass over a workload: wall time and the useful tokens it produced."""

    elapsed_s: float
    num_prompt_tokens: int
    num_output_tokens: int

    @property
    def output_tok_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s

    @property
    def total_tok_s(self) -> float:
        return (self.num_prompt_tokens + self.num_output_tokens) / self.elapsed_s


def _token_counts(requests: Sequence[BenchRequest]) -> tuple[int, int]:
    return sum(len(r.prompt_token_ids) for r in requests), sum(r.output_len for r in requests)


def greedy_params(requests: Sequence[BenchRequest]) -> list[SamplingParams]:
    """Greedy, exactly `output_len` tokens each (EOS ignored, so every run does the same work)."""
    return [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]


def cold_start(llm: LLM) -> None:
    """Empty the prefix cache, so a repeated run cannot hit the previous run's prompt blocks."""
    if not llm.engine.reset_prefix_cache():
        raise RuntimeError("engine: prefix cache not reset: blocks are still in use by unfinished requests")


def run_engine(llm: LLM, requests: Sequence[BenchRequest]) -> RunStats:
    """All requests added at once, run to completion with continuous batching."""
    cold_start(llm)
    t0 = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in requests], greedy_params(requests), use_tqdm=False)
    elapsed = time.perf_counter() - t0
    short = [o.request_id for o, r in zip(outs, requests) if len(o.token_ids) != r.output_len]
    if short:
        raise RuntimeError(f"engine: requests {short} did not generate their requested lengths")
    return RunStats(elapsed, *_token_counts(requests))


class HFBaseline:
    """Owns a transformers model of the same weights and runs a workload through `generate` in static batches."""

    def __init__(self, model_path: str | Path, batch_size: int = 8) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging

        logging.set_verbosity_error()  # generate() warns about settings we choose on purpose
        logging.disable_progress_bar()
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        gen = self.model.generation_config
        eos = gen.eos_token_id[0] if isinstance(gen.eos_token_id, list) else gen.eos_token_id
        self.pad_token_id = gen.pad_token_id if gen.pad_token_id is not None else eos
        self.batch_size = batch_size

    def run(self, requests: Sequence[BenchRequest]) -> RunStats:
        t0 = time.perf_counter()
        for i in range(0, len(requests), self.batch_size):
            self._generate(requests[i : i + self.batch_size])
        return RunStats(time.perf_counter() - t0, *_token_counts(requests))

    @torch.inference_mode()
    def _generate(self, batch: Sequence[BenchRequest]) -> None:
        width = max(len(r.prompt_token_ids) for r in batch)
        input_ids = torch.tensor(
            [[self.pad_token_id] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids for r in batch]
        )
        mask = torch.tensor([[0] * (width - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids) for r in batch])
        n = max(r.output_len for r in batch)
        # min_new_tokens = max_new_tokens: EOS cannot end a batch early, as ignore_eos on the engine side
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=self.pad_token_id,
        )
        if out.shape[1] != width + n:
            raise RuntimeError(f"transformers: generated {out.shape[1] - width} tokens, expected {n}")


def _summary(runs: list[RunStats]) -> dict[str, Any]:
    elapsed = statistics.median(r.elapsed_s for r in runs)
    stats = RunStats(elapsed, runs[0].num_prompt_tokens, runs[0].num_output_tokens)
    return {
        "elapsed_s": elapsed,
        "output_tok_s": stats.output_tok_s,
        "total_tok_s": stats.total_tok_s,
        "runs_s": [r.elapsed_s for r in runs],
    }


def workload_floor_s(llm: LLM, requests: Sequence[BenchRequest], bandwidth: float, matmul_flops: float) -> float:
    """The least time any implementation on this machine needs for `requests`: the longest request's outputs are
    sequential steps, each reading every weight once (at `bandwidth` bytes/s), and every token, prompt or output,
    costs its linear-layer FLOPs (at `matmul_flops` FLOP/s). Attention is left out, so the true floor is higher."""
    from workbench.bench.roofline import model_cost

    shape = llm.engine.runner.model.shape
    cost = model_cost(llm.engine.runner.model, shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim)
    num_prompt, num_output = _token_counts(requests)
    memory_s = max(r.output_len for r in requests) * cost.weight_bytes / bandwidth
    compute_s = (num_prompt + num_output) * cost.linear_flops_per_token / matmul_flops
    return max(memory_s, compute_s)


def run_throughput(
    model: str = "smollm2-135m",
    num_requests: int = 32,
    input_len_range: tuple[int, int] = (32, 512),
    output_len_range: tuple[int, int] = (16, 128),
    runs: int = 3,
    seed: int = 0,
    baseline: bool = True,
    cb_baseline: bool = True,
    max_num_batched_tokens: int = 2048,
    batch_size: int = 8,
    engine_kwargs: dict[str, Any] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Time the engine, transformers `generate` (unless `baseline` is False) and transformers' continuous batching
    (unless `cb_baseline` is False) on one seeded workload, alternating, `runs` times each; medians.
    `engine_kwargs`: more EngineConfig fields. Returns settings, token counts, per-side summaries, the engine's
    ratio to each baseline, the machine's floor for the workload and the load average before and after."""
    from workbench.bench.roofline import measure_bandwidth, measure_matmul

    load = LoadAverage()
    engine_kwargs = dict(engine_kwargs or {})
    llm = LLM(model=model, max_num_batched_tokens=max_num_batched_tokens, seed=seed, **engine_kwargs)
    requests = random_requests(num_requests, input_len_range, output_len_range, token_id_range(llm.tokenizer), seed)
    hf = HFBaseline(resolve_model(model), batch_size) if baseline else None
    cb = None
    if cb_baseline:
        from workbench.bench.hf_continuous import HFContinuousBaseline

        cb = HFContinuousBaseline(resolve_model(model), requests, max_num_batched_tokens)
    warmup = [BenchRequest(r.prompt_token_ids[:16], 4) for r in requests[:2]]
    run_engine(llm, warmup)  # first calls pay for allocator and kernel warm-up; keep them out of the timings
    if hf is not None:
        hf.run(warmup)
    sides: dict[str, list[RunStats]] = {"engine": [], "baseline": [], "baseline_cb": []}
    calls: dict[str, Callable[[], RunStats]] = {"engine": lambda: run_engine(llm, requests)}
    if hf is not None:
        calls["baseline"] = lambda: hf.run(requests)
    if cb is not None:
        cb.run(warmup)
        calls["baseline_cb"] = lambda: RunStats(cb.run(requests), *_token_counts(requests))
    try:
        for turn in alternate(calls, runs):  # each side's RunStats times its own run, without the set-up
            sides[turn.side].append(turn.value)
            log(f"run {turn.run + 1}/{runs}: {_SIDE_NAMES[turn.side]} {turn.value.elapsed_s:.2f} s")
    finally:
        if cb is not None:
            cb.close()
    bandwidth = measure_bandwidth(1 << 28, runs=3)["read"]
    # the roofline benchmark gives the peak of each matmul path it times: the machine's is the best
    peak = max(measure_matmul(1024, runs=3).values())
    floor_s = workload_floor_s(llm, requests, bandwidth, peak)
    num_prompt, num_output = _token_counts(requests)
    result: dict[str, Any] = {
        "model": model,
        "settings": run_settings(
            run_throughput, locals(), omit=("baseline", "cb_baseline", "batch_size"), hf_batch_size=batch_size
        ),
        "num_prompt_tokens": num_prompt,
        "num_output_tokens": num_output,
        **{side: _summary(runs_) if runs_ else None for side, runs_ in sides.items()},
        "floor": {
            "elapsed_s": floor_s,
            "output_tok_s": num_output / floor_s,
            "read_bytes_s": bandwidth,
            "matmul_flops": peak,
        },
        "load_average": load.done(),
    }
    for side, key in (("baseline", "ratio"), ("baseline_cb", "ratio_cb")):
        result[key] = result["engine"]["output_tok_s"] / result[side]["output_tok_s"] if result[side] else None
    return result


_SIDE_NAMES = {"engine": "engine", "baseline": "transformers generate", "baseline_cb": "transformers generate_batch"}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser)
    add_positive_ints(parser, num_requests=32)
    parser.add_argument("--input-len-range", type=positive_int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"))
    parser.add_argument("--output-len-range", type=positive_int, nargs=2, default=[16, 128], metavar=("MIN", "MAX"))
    parser.add_argument("--hf-batch-size", type=positive_int, default=8, help="transformers static batch size")
    parser.add_argument("--no-baseline", action="store_true", help="leave out transformers generate")
    parser.add_argument(
        "--no-cb-baseline", action="store_true", help="leave out transformers' continuous batching (generate_batch)"
    )


def main(args: argparse.Namespace) -> dict[str, Any]:
    """`workbench bench throughput`: run_throughput with the command line's settings."""
    return run_with_flags(
        run_throughput,
        args,
        input_len_range=tuple(args.input_len_range),
        output_len_range=tuple(args.output_len_range),
        baseline=not args.no_baseline,
        cb_baseline=not args.no_cb_baseline,
        batch_size=args.hf_batch_size,
    )


def _rows(result: dict[str, Any]) -> list[list[object]]:
    rows = [
        [
            "engine (continuous batching)",
            result["engine"]["elapsed_s"],
            result["engine"]["output_tok_s"],
            result["engine"]["total_tok_s"],
        ]
    ]
    if result["baseline"]:
        b = result["baseline"]
        rows.append(
            [
                f"transformers generate (static batches of {result['settings']['hf_batch_size']})",
                b["elapsed_s"],
                b["output_tok_s"],
                b["total_tok_s"],
            ]
        )
    if result.get("baseline_cb"):
        b = result["baseline_cb"]
        rows.append(
            [
                "transformers generate_batch (its continuous batching)",
                b["elapsed_s"],
                b["output_tok_s"],
                b["total_tok_s"],
            ]
        )
    if result.get("floor"):
        f = result["floor"]
        total = (result["num_prompt_tokens"] + result["num_output_tokens"]) / f["elapsed_s"]
        rows.append(
            ["machine floor (weights once per step, linear FLOPs at peak)", f["elapsed_s"], f["output_tok_s"], total]
        )
    return rows


_HEADERS = ("", "median s", "output tok/s", "total tok/s")


def ratio_line(result: dict[str, Any]) -> str:
    parts = []
    if result["ratio"] is not None:
        parts.append(f"{result['ratio']:.2f}x transformers generate (static batches)")
    if result.get("ratio_cb") is not None:
        parts.append(f"{result['ratio_cb']:.2f}x transformers generate_batch (continuous batching)")
    if not parts:
        return "ratio: no baseline run (--no-baseline, --no-cb-baseline)"
    floor, at = result.get("floor"), ""
    if floor and floor["elapsed_s"] <= result["engine"]["elapsed_s"]:
        at = f"; the engine at {floor['elapsed_s'] / result['engine']['elapsed_s']:.0%} of the floor's speed"
    elif floor:  # a floor no run can beat: if one did, the bandwidth and peak were measured while others held cores
        at = (
            "; the floor measured here is above the engine's time: bandwidth and matmul peak were measured under "
            "other load, so it is no bound on this run"
        )
    return "ratio engine / transformers (output tok/s): " + ", ".join(parts) + at


_HEAD = (
    "{model}: {num_requests} requests, prompts {input_len_range}, outputs {output_len_range} ({num_prompt_tokens} "
    "prompt + {num_output_tokens} output tokens), median of {runs}"
)
_DOCS = (
    "Model {model}, fp32; {num_requests} requests, seed {seed}, prompt lengths {input_len_range[0]}.."
    "{input_len_range[1]}, output lengths {output_len_range[0]}..{output_len_range[1]} (greedy, EOS ignored): "
    "{num_prompt_tokens} prompt and {num_output_tokens} output tokens. Engine: all requests at once, "
    "max_num_batched_tokens={max_num_batched_tokens}. transformers: `generate` in arrival-order batches of "
    "{hf_batch_size}, left-padded, min_new_tokens = max_new_tokens = the batch's longest output; only requested "
    "tokens count. transformers generate_batch: the same requests at once through transformers' continuous "
    "batching (paged cache, its own scheduler), its cache sized to hold them all and its token budget "
    "max_batch_tokens={max_num_batched_tokens}, built and warmed up before the timings as the engine is. "
    "Median of {runs} alternating runs. Machine floor: the longest request's output steps each read every "
    "weight once at the read bandwidth measured here, or every token's linear-layer FLOPs at the fp32 matmul "
    "peak measured here, whichever is longer (attention left out: the true floor is higher).{note}"
)


def _parts(result: dict[str, Any]) -> list[Part]:
    return [
        described(result, _HEAD, _DOCS),
        Table(_HEADERS, _rows(result)),
        bold(ratio_line(result)),
        Line(load_line(result)),
    ]


format_text, format_markdown = formatters("Throughput: engine vs transformers", _parts)
