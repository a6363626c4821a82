"""What guided decoding costs per step: filling the grammar bitmask (xgrammar, one row per guided request) and
applying it to the logits, against the step's forward, at several batch sizes of JSON-schema requests.

Before each step in which every request of the batch decodes, the bitmask fill the step is about to do is timed
by calling the engine's own `StructuredOutputManager.grammar_bitmask` for the running requests (filling reads
the matchers' state and changes nothing), and the apply by masking a logits tensor of the step's shape with it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from engine import LLM
from engine.structured_output.backend_xgrammar import apply_bitmask
from workbench.bench.args import add_common_args, positive_int, run_with_flags
from workbench.bench.datasets import BenchRequest, json_schema_requests
from workbench.bench.report import Part, Table, described, formatters, run_settings
from workbench.bench.serve import request_params

HELP = "per-step cost of guided decoding (bitmask fill + apply) vs the forward"
IN_ALL: tuple[int, list[str]] = (6, [])  # `workbench bench all` runs it: (place, flags)


def _time_guidance(llm: LLM, request_ids: list[str]) -> tuple[float, float]:
    """(fill ms, apply ms) of one step's guidance for these requests, decoding (no drafts)."""
    structured = llm.engine.structured
    t0 = time.perf_counter()
    bitmask, rows = structured.grammar_bitmask([(rid, []) for rid in request_ids])
    t1 = time.perf_counter()
    logits = torch.randn(len(request_ids), structured.vocab_size)
    t2 = time.perf_counter()
    apply_bitmask(logits, bitmask, rows)
    return (t1 - t0) * 1e3, (time.perf_counter() - t2) * 1e3


def guided_step_costs(llm: LLM, prompts: Sequence[BenchRequest], steps: int, warmup: int = 1) -> dict[str, float]:
    """Run the guided requests (datasets.BenchRequest) together until `steps` steps (after `warmup`) have had every
    one of them decoding; medians of fill, apply, forward and step ms over those steps. Unfinished requests are
    aborted after."""
    eng = llm.engine
    ids = [eng.add_request(r.prompt_token_ids, request_params(r)) for r in prompts]
    # each request waits for its grammar, compiled in a thread: all of them ready first, or one compiled late starts
    # after the others and they may finish before any step has them all decoding
    eng.structured.wait_for_all(ids, timeout=120)
    batch = len(ids)
    samples: list[tuple[float, float, float, float]] = []
    seen = 0
    while eng.has_unfinished_requests() and len(samples) < steps:
        running = [r.request_id for r in eng.scheduler.running]
        guidance = _time_guidance(llm, running) if len(running) == batch else None
        record = eng.step()
        if guidance is None or len(record.scheduled) != batch or set(record.phases.values()) != {"decode"}:
            continue
        seen += 1
        if seen > warmup:
            samples.append((*guidance, record.timing["forward"], record.timing["total"]))
    for rid in ids:
        eng.abort(rid)
        eng.pop_output(rid)
    if not samples:
        raise RuntimeError(f"guided: no step had all {batch} requests decoding (outputs too short? raise output_len)")
    fill, apply, forward, total = (statistics.median(column) for column in zip(*samples))
    return {
        "batch": batch,
        "steps": len(samples),
        "fill_ms": fill,
        "apply_ms": apply,
        "forward_ms": forward,
        "step_ms": total,
    }


def run_guided(
    model: str = "smollm2-135m",
    batch_sizes: Sequence[int] = (1, 8, 32),
    steps: int = 8,
    output_len: int = 256,
    seed: int = 0,
    max_num_batched_tokens: int = 2048,
    engine_kwargs: dict[str, Any] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Guidance cost per step at each batch size, on one engine, with seeded JSON-schema requests (greedy;
    `output_len` caps each JSON). Fewer than `steps` samples where requests finish early."""
    engine_kwargs = dict(engine_kwargs or {})
    llm = LLM(model=model, max_num_batched_tokens=max_num_batched_tokens, seed=seed, **engine_kwargs)
    rows = []
    for batch in batch_sizes:
        prompts = json_schema_requests(batch, llm.tokenizer, output_len, seed=seed)
        rows.append(guided_step_costs(llm, prompts, steps))
        log(
            f"batch {batch}: fill {rows[-1]['fill_ms']:.2f} ms, apply {rows[-1]['apply_ms']:.2f} ms, "
            f"forward {rows[-1]['forward_ms']:.1f} ms"
        )
    return {
        "model": model,
        "settings": run_settings(run_guided, locals()),
        "rows": rows,
    }


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser, runs=False)
    parser.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=positive_int, default=8, help="steps measured per batch size")
    parser.add_argument("--output-len", type=positive_int, default=256, help="cap on each JSON output")


def main(args: argparse.Namespace) -> dict[str, Any]:
    """`workbench bench guided`: run_guided with the command line's settings."""
    return run_with_flags(run_guided, args)


_WORKLOAD = (
    "{model}: B JSON-schema requests (seed {seed}, greedy, at most {output_len} tokens) decoding together; "
    "medians over up to {steps} steps in which all B decode"
)
_DOCS = _WORKLOAD + (
    ". Fill: `StructuredOutputManager.grammar_bitmask` for the B requests (xgrammar "
    "`fill_next_token_bitmask` per row, plus counting the allowed tokens for the grammar.step event); "
    "apply: `apply_token_bitmask_inplace` on [B, vocab] fp32 logits. Forward: the step's model + LM "
    "head time, which includes the apply; step: the whole engine step, which includes the fill. "
    "max_num_batched_tokens={max_num_batched_tokens}.{note}"
)

_HEADERS = (
    "batch",
    "steps",
    "fill ms",
    "fill us / request",
    "apply ms",
    "guidance ms",
    "forward ms",
    "step ms",
    "guidance / forward",
)


def _rows(result: dict[str, Any]) -> list[list[object]]:
    rows = []
    for r in result["rows"]:
        guidance = r["fill_ms"] + r["apply_ms"]
        rows.append(
            [
                r["batch"],
                r["steps"],
                r["fill_ms"],
                r["fill_ms"] * 1e3 / r["batch"],
                r["apply_ms"],
                guidance,
                r["forward_ms"],
                r["step_ms"],
                f"{guidance / r['forward_ms']:.1%}",
            ]
        )
    return rows


def _parts(result: dict[str, Any]) -> list[Part]:
    return [described(result, _WORKLOAD, _DOCS), Table(_HEADERS, _rows(result))]


format_text, format_markdown = formatters("Guided decoding: what the grammar costs per step", _parts)
