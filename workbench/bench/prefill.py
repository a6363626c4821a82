"""Prefill, as a long prompt meets it: the engine's prompt tokens per second in each weight format against llama.cpp's
`llama-bench` pp on GGUF files of the same weights (`make llamacpp-ref`). Two workloads: a `prompt_len`-token prompt
in one step (pp512), and a `long_prompt_len`-token prompt under each token budget of `budgets`, split into chunks of
the budget (llama.cpp: the same prompt with its batch and micro-batch the budget, pp2048 -b 512 -ub 512). The engine
side is one request's whole prefill, its first token sampled (as llama.cpp computes the last position's logits),
prefix caching off so that every run computes every token. Sides alternate round by round; each number is a
median, with the load average and the CPU's vector units beside it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import AutoTokenizer

from engine import LLM, SamplingParams, resolve_model
from kernels.cpu.cpuinfo import cpu_info
from workbench.bench.args import add_common_args, positive_int, run_with_flags
from workbench.bench.datasets import random_requests, token_id_range
from workbench.bench.decode import (
    WEIGHT_FORMATS,
    Side,
    add_weight_formats_arg,
    llamacpp_side,
    measure_sides,
    peer_parts,
    side_row,
    vs_llamacpp,
)
from workbench.bench.llamacpp import LlamaBench, add_llamacpp_args, llamacpp_from_args
from workbench.bench.report import Part, Table, formatters, run_settings
from workbench.bench.timing import LoadAverage

HELP = "prefill tok/s: a prompt in one step and a long one in budget-sized chunks, the engine vs llama.cpp"
IN_ALL: tuple[int, list[str]] = (11, [])  # `workbench bench all` runs it: (place, flags)


def workloads(prompt_len: int, long_prompt_len: int, budgets: Sequence[int]) -> list[tuple[int, int]]:
    """(prompt tokens, token budget) of each measured prefill: the short prompt in one step, the long one under
    each budget; one entry each."""
    return list(dict.fromkeys([(prompt_len, prompt_len), *((long_prompt_len, b) for b in budgets)]))


def engine_prefill_side(llm: LLM, weights: str, prompt_ids: list[int], workload: str) -> Side:
    """The engine's prefill of `prompt_ids` in as many steps as its budget takes: its first token is sampled and
    the request ends; the rate is the prompt's tokens over the call's wall seconds."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def prefill() -> list[int]:
        return llm.generate([prompt_ids], params, use_tqdm=False)[0].token_ids

    return Side("engine", weights, prefill, lambda _tokens, seconds: len(prompt_ids) / seconds, workload=workload)


def run_prefill(
    model: str = "smollm2-135m",
    weight_formats: Sequence[str] = tuple(WEIGHT_FORMATS),
    prompt_len: int = 512,
    long_prompt_len: int = 2048,
    budgets: Sequence[int] = (512, 2048),
    runs: int = 3,
    seed: int = 0,
    llama_bench: LlamaBench | None = None,
    llamacpp_gguf: dict[str, str] | None = None,
    engine_kwargs: dict[str, Any] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """An engine per weight format and budget (prefix caching off, a KV cache just large enough unless
    `engine_kwargs` sizes it), and llama-bench where given, over every workload (`workloads`), measured in
    alternating rounds; the median tok/s of each, and each engine row against llama.cpp's."""
    engine_kwargs = dict(engine_kwargs or {})
    engine_kwargs.setdefault("num_kv_blocks", -(-(long_prompt_len + 1) // 16) + 2)  # the default 16-token blocks
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(model))  # no model loaded for it
    (request,) = random_requests(1, (long_prompt_len,) * 2, (1, 1), token_id_range(tokenizer), seed)
    ids = list(request.prompt_token_ids)
    cases = workloads(prompt_len, long_prompt_len, budgets)
    sides: list[Side] = []
    labels: list[tuple[int, int]] = []  # each side's (prompt tokens, budget)
    for weights in weight_formats:
        engines = {
            budget: LLM(
                model=model,
                seed=seed,
                max_num_batched_tokens=budget,
                enable_prefix_caching=False,
                **{**engine_kwargs, **WEIGHT_FORMATS[weights]},
            )
            for budget in dict.fromkeys(b for _, b in cases)
        }
        for length, budget in cases:
            workload = f" {length}/{budget}"  # prompt tokens / budget, in the progress lines
            sides.append(engine_prefill_side(engines[budget], weights, ids[:length], workload))
            labels.append((length, budget))
            if llama_bench is not None and weights in (llamacpp_gguf or {}):
                test = {"n_prompt": length, "n_gen": 0, "batch": budget, "ubatch": budget}
                sides.append(llamacpp_side(llama_bench, weights, (llamacpp_gguf or {})[weights], workload, **test))
                labels.append((length, budget))
    cpu = cpu_info()
    load = LoadAverage()
    measure_sides(sides, runs, log)
    rows = [{**side_row(s), "prompt_len": n, "budget": b} for s, (n, b) in zip(sides, labels, strict=True)]
    return {
        "model": model,
        "threads": torch.get_num_threads(),
        "cpu": cpu.model,
        "vector_units": " ".join(cpu.vector_units) or "none",
        "llama_bench": None if llama_bench is None else llama_bench.binary,
        "load_average": load.done(),
        "rows": rows,
        "settings": run_settings(run_prefill, locals(), omit=("llama_bench", "llamacpp_gguf")),
    }


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser, budget=False)
    add_weight_formats_arg(parser)
    parser.add_argument(
        "--prompt-len", type=positive_int, default=512, help="the prompt prefilled in one step (default: 512)"
    )
    parser.add_argument(
        "--long-prompt-len",
        type=positive_int,
        default=2048,
        help="the prompt prefilled under each of --budgets (default: 2048)",
    )
    parser.add_argument(
        "--budgets",
        nargs="+",
        type=positive_int,
        default=[512, 2048],
        help="token budgets (max_num_batched_tokens) the long prompt is prefilled under, its chunk size each; "
        "llama.cpp's -b and -ub (default: 512 2048)",
    )
    add_llamacpp_args(parser)


def main(args: argparse.Namespace) -> dict[str, Any]:
    """`workbench bench prefill`: run_prefill with the command line's settings."""
    if args.long_prompt_len < args.prompt_len:
        raise SystemExit(
            f"bench prefill: --long-prompt-len: must be >= --prompt-len ({args.prompt_len}), got {args.long_prompt_len}"
        )
    bench, ggufs = llamacpp_from_args(args, "bench prefill", args.weight_formats)
    return run_with_flags(run_prefill, args, llama_bench=bench, llamacpp_gguf=ggufs)


_HEADERS = ("workload", "system", "weights", "tok/s (median)", "runs", "engine / llama.cpp")


def _workload(row: dict[str, Any]) -> str:
    n, budget = row["prompt_len"], row["budget"]
    return f"{n} tokens in one step" if budget >= n else f"{n} tokens in chunks of {budget}"


def _rows(result: dict[str, Any]) -> list[list[object]]:
    rows = result["rows"]
    return [
        [
            _workload(r),
            r["system"],
            r.get("gguf", r["weights"]),
            r["tok_s"],
            " ".join(f"{x:.1f}" for x in r["runs"]),
            vs_llamacpp(rows, r, lambda row: (row["weights"], row["prompt_len"], row["budget"])),
        ]
        for r in rows
    ]


_TEXT = (
    "{model}: one request's prefill, {threads} threads, median of {runs} alternating rounds, on {cpu} "
    "(vector units: {vector_units})"
)
_DOCS = _TEXT + (
    ". The engine: prefix caching off, the first token sampled; a prompt longer than the budget is prefilled in "
    "chunks of the budget, each step attending to the chunks before. llama.cpp: `llama-bench -p N -n 0 -b B -ub B` "
    "on F32, BF16 and Q8_0 GGUFs of the same weights (`make llamacpp-ref`), its own tok/s.{note}"
)


def _parts(result: dict[str, Any]) -> list[Part]:
    return peer_parts(result, _TEXT, _DOCS, Table(_HEADERS, _rows(result)))


format_text, format_markdown = formatters("Prefill: the engine in each weight format against llama.cpp", _parts)
