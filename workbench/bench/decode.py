"""Single-stream decode, as a CPU user meets it: one prompt, N greedy tokens, tok/s of the engine in each weight
format against transformers `generate` on the same weights in the same process (float32; bfloat16 where the
engine stores bfloat16 weights), and against llama.cpp's `llama-bench` on GGUF files of the same weights (tg N after
a context as long as the prompt; `make llamacpp-ref` builds both, `workbench.bench.llamacpp` finds them). Sides
alternate round by round; each number is a median.

The floor of a token is its weights over the read bandwidth (`bench roofline`); this benchmark says how far each
system is from the others, and its load-average line says how much the machine was shared meanwhile.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AutoTokenizer

from engine import LLM, RequestOutput, SamplingParams, resolve_model
from workbench.bench.args import add_common_args, run_with_flags
from workbench.bench.llamacpp import GGUF_TYPES, LlamaBench, add_llamacpp_args, llamacpp_from_args
from workbench.bench.report import Line, Part, Table, described, formatters, run_settings
from workbench.bench.timing import LoadAverage, alternate, load_line

HELP = "single-stream decode tok/s: the engine in each weight format vs transformers and llama.cpp (llama-bench)"
IN_ALL: tuple[int, list[str]] = (10, [])  # `workbench bench all` runs it: (place, flags)
PROMPT = "The history of the printing press begins"
# how the engine stores its weights on a CPU, as its settings (the arithmetic is float32 around each format's linears)
WEIGHT_FORMATS = {"float32": {}, "bfloat16": {"dtype": "bfloat16"}, "int8": {"quantization": "int8"}}
TRANSFORMERS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # transformers has no int8 on CPU
LLAMACPP = "llama.cpp (llama-bench)"


@dataclass
class Side:
    """One system in one weight format: `run` measures once and returns what it made (the tokens of a side that
    decodes here, llama-bench's row of one that runs as a child process), `rate` the tok/s of that call from what
    it returned and its wall seconds; `tokens` is what its untimed first call made (None: a side that makes its
    tokens elsewhere, llama-bench, which warms up by itself)."""

    system: str
    weights: str
    run: Callable[[], Any]
    rate: Callable[[Any, float], float]
    # the rate of its decode steps alone, from what `run` returned: what llama-bench's tg measures (None: the side
    # cannot tell its prefill from its decode, transformers generate)
    decode_rate: Callable[[Any], float] | None = None
    tokens_of: Callable[[Any], list[int]] = lambda made: made  # the tokens in what `run` returned
    tokens: list[int] | None = None
    workload: str = ""  # what the progress lines name beside system and weights, where sides differ in it
    tok_s: list[float] = field(default_factory=list)
    decode_tok_s: list[float] = field(default_factory=list)
    last: Any = None


def token_rate(tokens: list[int], seconds: float) -> float:
    """A side that decodes in this process: the tokens it made over the call's wall seconds."""
    return len(tokens) / seconds


def engine_decode_rate(out: RequestOutput) -> float:
    """The engine's decode steps alone: the tokens after its first over the time from its first token to its last
    (the request's metrics), so its prefill step and the call around the steps are left out, as llama-bench's tg
    leaves out its context."""
    metrics = out.metrics
    assert metrics is not None and metrics.first_token_time is not None and metrics.last_token_time is not None
    return (len(out.token_ids) - 1) / (metrics.last_token_time - metrics.first_token_time)


def llama_bench_rate(row: dict[str, Any], seconds: float) -> float:
    """A llama-bench side: the rate it measured itself (its call's wall time also loads the model)."""
    return float(row["avg_ts"])


def engine_side(
    model: str, weights: str, prompt_ids: list[int], max_tokens: int, seed: int, engine_kwargs: dict[str, Any]
) -> Side:
    llm = LLM(model=model, seed=seed, **{**engine_kwargs, **WEIGHT_FORMATS[weights]})
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Side(
        "engine",
        weights,
        lambda: llm.generate([prompt_ids], params, use_tqdm=False)[0],
        lambda out, seconds: token_rate(out.token_ids, seconds),
        decode_rate=engine_decode_rate,
        tokens_of=lambda out: out.token_ids,
    )


def transformers_side(path: str, weights: str, prompt_ids: list[int], max_tokens: int) -> Side:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()  # generate() warns about settings chosen on purpose
    logging.disable_progress_bar()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=TRANSFORMERS_DTYPES[weights]).eval()
    ids = torch.tensor([prompt_ids])

    def decode() -> list[int]:
        with torch.inference_mode():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                pad_token_id=hf.generation_config.eos_token_id,
            )
        return out[0, len(prompt_ids) :].tolist()

    return Side("transformers generate", weights, decode, token_rate)


def llamacpp_side(bench: LlamaBench, weights: str, gguf: str, workload: str = "", **test: int) -> Side:
    """llama.cpp in `weights`' GGUF type: each call one llama-bench test of `gguf` (`LlamaBench.run`'s settings)."""
    return Side(
        LLAMACPP,
        weights,
        lambda: bench.run(gguf, **test),
        llama_bench_rate,
        decode_rate=(lambda row: float(row["avg_ts"])) if test.get("n_gen") else None,  # tg: decode steps alone
        workload=workload,
    )


def measure_sides(sides: Sequence[Side], runs: int, log: Callable[[str], None]) -> None:
    """Each side that decodes here once untimed (its `tokens`), then `runs` rounds in which every side runs once
    (the same order each round, so a burst of load falls on all), each call's rate appended to its side's tok_s."""
    for side in sides:
        if side.system != LLAMACPP:
            side.tokens = side.tokens_of(side.run())
    for turn in alternate({i: side.run for i, side in enumerate(sides)}, runs):
        side = sides[turn.side]
        side.tok_s.append(side.rate(turn.value, turn.seconds))
        if side.decode_rate is not None:
            side.decode_tok_s.append(side.decode_rate(turn.value))
        side.last = turn.value
        if turn.side == len(sides) - 1:  # the round's last side
            done = ", ".join(f"{s.system} {s.weights}{s.workload} {s.tok_s[-1]:.1f}" for s in sides)
            log(f"round {turn.run + 1}/{runs}: {done}")


def side_row(side: Side) -> dict[str, Any]:
    """A side's result row: its system, weights (a llama-bench row's GGUF type too), the median and every run."""
    row = {"system": side.system, "weights": side.weights, "tok_s": statistics.median(side.tok_s), "runs": side.tok_s}
    if side.decode_tok_s:
        row |= {"decode_tok_s": statistics.median(side.decode_tok_s), "decode_runs": side.decode_tok_s}
    if side.system == LLAMACPP:
        row |= {"gguf": GGUF_TYPES[side.weights], "llama_bench": side.last}
    return row


def vs_llamacpp(
    rows: Sequence[dict[str, Any]], row: dict[str, Any], key: Callable[[dict[str, Any]], Any], rate: str = "tok_s"
) -> str:
    """An engine row's median `rate` over llama.cpp's in the same weight format and `key` (its workload), as
    "0.87x"; "-" for other rows and where llama.cpp has no such row (or a kept result from before a rate)."""
    if row["system"] != "engine":
        return "-"
    peer = next((r for r in rows if r["system"] == LLAMACPP and key(r) == key(row)), None)
    return "-" if peer is None or rate not in row or rate not in peer else f"{row[rate] / peer[rate]:.2f}x"


def llamacpp_line(result: dict[str, Any]) -> str:
    """What the report says of the llama-bench it ran: the binary, its CPU and build, flash attention."""
    row = next((r["llama_bench"] for r in result["rows"] if r["system"] == LLAMACPP), None)
    if row is None:
        return "llama.cpp: not run (make llamacpp-ref builds llama-bench and the GGUFs; --llama-bench PATH names one)"
    return (
        f"llama.cpp: {result['llama_bench']} ({row['model_type']}, {row['n_threads']} threads, flash_attn "
        f"{row['flash_attn']}, build {row['build_commit']}) on {row['cpu_info']}; each round one llama-bench call "
        "(its own warm-up, then one repetition), its own tok/s"
    )


def run_decode(
    model: str = "smollm2-135m",
    weight_formats: Sequence[str] = tuple(WEIGHT_FORMATS),
    max_tokens: int = 128,
    runs: int = 3,
    seed: int = 0,
    baseline: bool = True,
    llama_bench: LlamaBench | None = None,
    llamacpp_gguf: dict[str, str] | None = None,
    engine_kwargs: dict[str, Any] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Build every side, then measure them in alternating rounds (`measure_sides`); the median tok/s per side,
    which sides made the same tokens as the engine in float32, and each engine format against llama.cpp's
    (`llama_bench` on the GGUF `llamacpp_gguf` names for that format: tg `max_tokens` after a context of the
    prompt's length)."""
    engine_kwargs = dict(engine_kwargs or {})
    sides: list[Side] = []
    path = str(resolve_model(model))
    prompt_ids = AutoTokenizer.from_pretrained(path).encode(PROMPT)  # no model loaded for it
    for weights in weight_formats:
        sides.append(engine_side(model, weights, prompt_ids, max_tokens, seed, engine_kwargs))
        if baseline and weights in TRANSFORMERS_DTYPES:
            sides.append(transformers_side(path, weights, prompt_ids, max_tokens))
        if llama_bench is not None and weights in (llamacpp_gguf or {}):
            gguf = (llamacpp_gguf or {})[weights]
            sides.append(llamacpp_side(llama_bench, weights, gguf, n_prompt=0, n_gen=max_tokens, depth=len(prompt_ids)))
    load = LoadAverage()
    measure_sides(sides, runs, log)
    reference = next((s.tokens for s in sides if (s.system, s.weights) == ("engine", "float32")), None)
    rows = [
        {
            **side_row(s),
            "same_tokens_as_engine_fp32": None if reference is None or s.tokens is None else s.tokens == reference,
        }
        for s in sides
    ]
    return {
        "model": model,
        "prompt": PROMPT,
        "prompt_len": len(prompt_ids),
        "threads": torch.get_num_threads(),
        "llama_bench": None if llama_bench is None else llama_bench.binary,
        "load_average": load.done(),
        "rows": rows,
        "settings": run_settings(run_decode, locals(), omit=("llama_bench", "llamacpp_gguf")),
    }


def add_weight_formats_arg(parser: argparse.ArgumentParser) -> None:
    """--weight-formats: the formats the engine is measured in, each its own side or set of rows."""
    parser.add_argument(
        "--weight-formats",
        nargs="+",
        choices=tuple(WEIGHT_FORMATS),
        default=list(WEIGHT_FORMATS),
        help="how the engine stores its weights, each measured apart (default: all)",
    )


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser, budget=False)
    add_weight_formats_arg(parser)
    parser.add_argument("--max-tokens", type=int, default=128, help="greedy tokens per decode (default: 128)")
    parser.add_argument("--no-baseline", action="store_true", help="leave out transformers generate")
    add_llamacpp_args(parser)


def main(args: argparse.Namespace) -> dict[str, Any]:
    """`workbench bench decode`: run_decode with the command line's settings."""
    if args.max_tokens < 1:
        raise SystemExit(f"bench decode: --max-tokens: must be >= 1, got {args.max_tokens}")
    bench, ggufs = llamacpp_from_args(args, "bench decode", args.weight_formats)
    return run_with_flags(run_decode, args, baseline=not args.no_baseline, llama_bench=bench, llamacpp_gguf=ggufs)


_HEADERS = (
    "system",
    "weights",
    "tok/s (median)",
    "runs",
    "vs transformers fp32",
    "decode tok/s (median)",
    "engine / llama.cpp (decode)",
    "same tokens as engine fp32",
)


def _rows(result: dict[str, Any]) -> list[list[object]]:
    rows = result["rows"]
    base = next(
        (r["tok_s"] for r in rows if r["system"] == "transformers generate" and r["weights"] == "float32"), None
    )
    return [
        [
            r["system"],
            r.get("gguf", r["weights"]),
            r["tok_s"],
            " ".join(f"{x:.1f}" for x in r["runs"]),
            "-" if base is None else f"{r['tok_s'] / base:.2f}x",
            r.get("decode_tok_s", "-"),
            vs_llamacpp(rows, r, lambda row: row["weights"], "decode_tok_s"),
            {True: "yes", False: "no", None: "-"}[r["same_tokens_as_engine_fp32"]],
        ]
        for r in rows
    ]


_TEXT = (
    "{model}: a {prompt_len}-token prompt, {max_tokens} greedy tokens, {threads} threads, median of {runs} "
    "alternating rounds"
)
_DOCS = _TEXT + (
    ". The engine's bfloat16 weights meet activations rounded to bfloat16, its int8 ones activations quantized "
    "in blocks of 32 (W8A8, as llama.cpp's Q8_0), sums in float32 (checked against Hugging Face in "
    "tests/model/test_fast_dtypes.py); transformers bfloat16 computes in bfloat16; llama.cpp's "
    "F32, BF16 and Q8_0 GGUFs are converted from the same weights by `make llamacpp-ref`, its tg{max_tokens} runs "
    "after a {prompt_len}-token context. tok/s is a whole call's (prefill included); decode tok/s leaves the prefill "
    "out: llama-bench's tg rate, and the engine's tokens after its first over the time from its first token to its "
    "last; engine / llama.cpp divides the decode rates."
    "{note}"
)


def peer_parts(result: dict[str, Any], text: str, docs: str, table: Table) -> list[Part]:
    """A report against llama.cpp: its settings (`text` in the terminal, `docs` in the docs), the table, which
    llama-bench ran and the load average."""
    return [described(result, text, docs), table, Line(llamacpp_line(result)), Line(load_line(result))]


def _parts(result: dict[str, Any]) -> list[Part]:
    return peer_parts(result, _TEXT, _DOCS, Table(_HEADERS, _rows(result)))


format_text, format_markdown = formatters("Single-stream decode: the engine in each weight format", _parts)
