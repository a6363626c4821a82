"""Engine throughput against Hugging Face transformers `generate` in static batches, on one seeded workload of
mixed prompt and output lengths.

The engine gets every request at once and batches continuously; transformers runs batches of `batch_size` in
arrival order, left-padded, each generating its longest request's output length. Only the tokens each request
asked for count as useful output: the padding and the tokens a short request makes while it waits for the long
ones in its batch are the waste continuous batching removes.
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from engine import LLM, SamplingParams
from engine.model import resolve_model
from workbench.bench.args import add_common_args, add_positive_ints, positive_int, run_with_flags
from workbench.bench.datasets import BenchRequest, random_requests, token_id_range
from workbench.bench.report import Part, Table, bold, described, formatters

HELP = "engine vs transformers generate on a mixed workload"
IN_ALL = (1, [])  # `workbench bench all` runs it: (place, flags)


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
            self._generate(requests[i:i + self.batch_size])
        return RunStats(time.perf_counter() - t0, *_token_counts(requests))

    @torch.inference_mode()
    def _generate(self, batch: Sequence[BenchRequest]) -> None:
        width = max(len(r.prompt_token_ids) for r in batch)
        input_ids = torch.tensor([[self.pad_token_id] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids
                                  for r in batch])
        mask = torch.tensor([[0] * (width - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids)
                             for r in batch])
        n = max(r.output_len for r in batch)
        # min_new_tokens = max_new_tokens: EOS cannot end a batch early, as ignore_eos on the engine side
        out = self.model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, pad_token_id=self.pad_token_id)
        if out.shape[1] != width + n:
            raise RuntimeError(f"transformers: generated {out.shape[1] - width} tokens, expected {n}")


def _summary(runs: list[RunStats]) -> dict[str, Any]:
    elapsed = statistics.median(r.elapsed_s for r in runs)
    stats = RunStats(elapsed, runs[0].num_prompt_tokens, runs[0].num_output_tokens)
    return {"elapsed_s": elapsed, "output_tok_s": stats.output_tok_s, "total_tok_s": stats.total_tok_s,
            "runs_s": [r.elapsed_s for r in runs]}


def run_throughput(model: str = "smollm2-135m", num_requests: int = 32, input_len_range: tuple[int, int] = (32, 512),
                   output_len_range: tuple[int, int] = (16, 128), runs: int = 3, seed: int = 0,
                   baseline: bool = True, max_num_batched_tokens: int = 2048, batch_size: int = 8,
                   engine_kwargs: dict[str, Any] | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Time the engine (and transformers unless `baseline` is False) on one seeded workload, alternating,
    `runs` times each; medians. `engine_kwargs`: more EngineConfig fields. Returns settings, token counts,
    per-side summaries and the engine/HF ratio."""
    engine_kwargs = dict(engine_kwargs or {})
    llm = LLM(model=model, max_num_batched_tokens=max_num_batched_tokens, seed=seed, **engine_kwargs)
    requests = random_requests(num_requests, input_len_range, output_len_range, token_id_range(llm.tokenizer), seed)
    hf = HFBaseline(resolve_model(model), batch_size) if baseline else None
    warmup = [BenchRequest(r.prompt_token_ids[:16], 4) for r in requests[:2]]
    run_engine(llm, warmup)  # first calls pay for allocator and kernel warm-up; keep them out of the timings
    if hf is not None:
        hf.run(warmup)
    ours: list[RunStats] = []
    theirs: list[RunStats] = []
    for i in range(runs):
        ours.append(run_engine(llm, requests))
        log(f"run {i + 1}/{runs}: engine {ours[-1].elapsed_s:.2f} s")
        if hf is not None:
            theirs.append(hf.run(requests))
            log(f"run {i + 1}/{runs}: transformers {theirs[-1].elapsed_s:.2f} s")
    num_prompt, num_output = _token_counts(requests)
    result = {
        "model": model,
        "settings": {"num_requests": num_requests, "input_len_range": list(input_len_range),
                     "output_len_range": list(output_len_range), "runs": runs, "seed": seed,
                     "max_num_batched_tokens": max_num_batched_tokens, "hf_batch_size": batch_size,
                     "engine_kwargs": engine_kwargs},
        "num_prompt_tokens": num_prompt,
        "num_output_tokens": num_output,
        "engine": _summary(ours),
        "baseline": _summary(theirs) if theirs else None,
    }
    result["ratio"] = (result["engine"]["output_tok_s"] / result["baseline"]["output_tok_s"]) if theirs else None
    return result


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser)
    add_positive_ints(parser, num_requests=32)
    parser.add_argument("--input-len-range", type=positive_int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"))
    parser.add_argument("--output-len-range", type=positive_int, nargs=2, default=[16, 128], metavar=("MIN", "MAX"))
    parser.add_argument("--hf-batch-size", type=positive_int, default=8, help="transformers static batch size")
    parser.add_argument("--no-baseline", action="store_true", help="time the engine only")


def main(args: argparse.Namespace) -> dict[str, Any]:
    """`workbench bench throughput`: run_throughput with the command line's settings."""
    return run_with_flags(run_throughput, args, input_len_range=tuple(args.input_len_range),
                          output_len_range=tuple(args.output_len_range), baseline=not args.no_baseline,
                          batch_size=args.hf_batch_size)


def _rows(result: dict[str, Any]) -> list[list[object]]:
    rows = [["engine (continuous batching)", result["engine"]["elapsed_s"], result["engine"]["output_tok_s"],
             result["engine"]["total_tok_s"]]]
    if result["baseline"]:
        b = result["baseline"]
        rows.append([f"transformers generate (static batches of {result['settings']['hf_batch_size']})",
                     b["elapsed_s"], b["output_tok_s"], b["total_tok_s"]])
    return rows


_HEADERS = ("", "median s", "output tok/s", "total tok/s")


def ratio_line(result: dict[str, Any]) -> str:
    if result["ratio"] is None:
        return "ratio: no baseline run (--no-baseline)"
    return f"ratio engine / transformers (output tok/s): {result['ratio']:.2f}x"


_HEAD = ("{model}: {num_requests} requests, prompts {input_len_range}, outputs {output_len_range} ({num_prompt_tokens} "
         "prompt + {num_output_tokens} output tokens), median of {runs}")
_DOCS = ("Model {model}, fp32; {num_requests} requests, seed {seed}, prompt lengths {input_len_range[0]}.."
         "{input_len_range[1]}, output lengths {output_len_range[0]}..{output_len_range[1]} (greedy, EOS ignored): "
         "{num_prompt_tokens} prompt and {num_output_tokens} output tokens. Engine: all requests at once, "
         "max_num_batched_tokens={max_num_batched_tokens}. transformers: `generate` in arrival-order batches of "
         "{hf_batch_size}, left-padded, min_new_tokens = max_new_tokens = the batch's longest output; only requested "
         "tokens count. Median of {runs} alternating runs.{note}")


def _parts(result: dict[str, Any]) -> list[Part]:
    return [described(result, _HEAD, _DOCS), Table(_HEADERS, _rows(result)), bold(ratio_line(result))]


format_text, format_markdown = formatters("Throughput: engine vs transformers", _parts)
