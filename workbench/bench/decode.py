"""Single-stream decode, as a CPU user meets it: one prompt, N greedy tokens, tok/s of the engine in each weight
format against transformers `generate` on the same weights in the same process (float32; bfloat16 where the
engine stores bfloat16 weights), and against llama.cpp (llama-cpp-python) on GGUF files of the same weights where
it is installed and `--llamacpp-gguf` names them. Sides alternate round by round; each number is a median.

The floor of a token is its weights over the read bandwidth (`bench roofline`); this benchmark says how far each
system is from the others, and its load-average line says how much the machine was shared meanwhile.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoTokenizer

from engine import LLM, SamplingParams, resolve_model
from workbench.bench.args import add_common_args, run_with_flags
from workbench.bench.report import Line, Part, Table, described, formatters, run_settings
from workbench.bench.timing import LoadAverage, alternate, load_line

HELP = "single-stream decode tok/s: the engine in each weight format vs transformers (and llama.cpp if installed)"
IN_ALL: tuple[int, list[str]] = (10, [])  # `workbench bench all` runs it: (place, flags)
PROMPT = "The history of the printing press begins"
WEIGHT_FORMATS = {"float32": {}, "bfloat16": {"dtype": "bfloat16"}, "int8": {"quantization": "int8"}}
TRANSFORMERS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # transformers has no int8 on CPU


@dataclass
class Side:
    """One system in one weight format: a callable that decodes the prompt and returns the tokens it made."""

    system: str
    weights: str
    decode: Callable[[], list[int]]
    tok_s: list[float]


def engine_side(
    model: str, weights: str, prompt_ids: list[int], max_tokens: int, seed: int, engine_kwargs: dict[str, Any]
) -> Side:
    llm = LLM(model=model, seed=seed, **{**engine_kwargs, **WEIGHT_FORMATS[weights]})
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Side("engine", weights, lambda: llm.generate([prompt_ids], params, use_tqdm=False)[0].token_ids, [])


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

    return Side("transformers generate", weights, decode, [])


def llamacpp_side(label: str, gguf: str, prompt_ids: list[int], max_tokens: int) -> Side:
    try:
        from llama_cpp import Llama
    except ImportError as exc:
        raise SystemExit("bench decode: --llamacpp-gguf needs llama-cpp-python (pip install llama-cpp-python)") from exc
    llama = Llama(
        model_path=gguf, n_ctx=len(prompt_ids) + max_tokens + 8, n_threads=torch.get_num_threads(), verbose=False
    )

    def decode() -> list[int]:
        llama.reset()
        tokens = []
        for token in llama.generate(prompt_ids, temp=0.0, top_k=1):
            tokens.append(token)
            if len(tokens) == max_tokens:
                return tokens
        return tokens

    return Side("llama.cpp (llama-cpp-python)", label, decode, [])


def parse_gguf(specs: Sequence[str]) -> dict[str, str]:
    """`FORMAT=PATH` pairs (e.g. `q8_0=/models/smollm2-q8_0.gguf`), each path an existing file."""
    named = {}
    for spec in specs:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            raise SystemExit(f"bench decode: --llamacpp-gguf: expected FORMAT=PATH, got {spec!r}")
        if not os.path.isfile(path):
            raise SystemExit(f"bench decode: --llamacpp-gguf: no such file {path!r}")
        named[label] = path
    return named


def run_decode(
    model: str = "smollm2-135m",
    weight_formats: Sequence[str] = tuple(WEIGHT_FORMATS),
    max_tokens: int = 128,
    runs: int = 3,
    seed: int = 0,
    baseline: bool = True,
    llamacpp_gguf: dict[str, str] | None = None,
    engine_kwargs: dict[str, Any] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Build every side, check each makes its tokens, then `runs` rounds in which every side decodes once (the
    same order each round, so a burst of load falls on all); the median tok/s per side, and which sides made the
    same tokens as the engine in float32."""
    engine_kwargs = dict(engine_kwargs or {})
    sides: list[Side] = []
    path = str(resolve_model(model))
    prompt_ids = AutoTokenizer.from_pretrained(path).encode(PROMPT)  # no model loaded for it
    for weights in weight_formats:
        sides.append(engine_side(model, weights, prompt_ids, max_tokens, seed, engine_kwargs))
        if baseline and weights in TRANSFORMERS_DTYPES:
            sides.append(transformers_side(path, weights, prompt_ids, max_tokens))
    for label, gguf in (llamacpp_gguf or {}).items():
        sides.append(llamacpp_side(label, gguf, prompt_ids, max_tokens))
    tokens = {(s.system, s.weights): s.decode() for s in sides}  # warm-up, and what each made
    reference = tokens.get(("engine", "float32"))
    load = LoadAverage()
    for turn in alternate({i: side.decode for i, side in enumerate(sides)}, runs):
        sides[turn.side].tok_s.append(len(turn.value) / turn.seconds)
        if turn.side == len(sides) - 1:  # the round's last side
            done = ", ".join(f"{s.system} {s.weights} {s.tok_s[-1]:.1f}" for s in sides)
            log(f"round {turn.run + 1}/{runs}: {done}")
    rows = [
        {
            "system": s.system,
            "weights": s.weights,
            "tok_s": statistics.median(s.tok_s),
            "runs": s.tok_s,
            "same_tokens_as_engine_fp32": None if reference is None else tokens[(s.system, s.weights)] == reference,
        }
        for s in sides
    ]
    return {
        "model": model,
        "prompt": PROMPT,
        "prompt_len": len(prompt_ids),
        "threads": torch.get_num_threads(),
        "load_average": load.done(),
        "rows": rows,
        "settings": run_settings(run_decode, locals(), omit=("llamacpp_gguf",)),
    }


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser, budget=False)
    parser.add_argument(
        "--weight-formats",
        nargs="+",
        choices=tuple(WEIGHT_FORMATS),
        default=list(WEIGHT_FORMATS),
        help="how the engine stores its weights, a side each (default: all)",
    )
    parser.add_argument("--max-tokens", type=int, default=128, help="greedy tokens per decode (default: 128)")
    parser.add_argument("--no-baseline", action="store_true", help="leave out transformers generate")
    parser.add_argument(
        "--llamacpp-gguf",
        nargs="+",
        default=[],
        metavar="FORMAT=PATH",
        help="GGUF files of the same weights for llama.cpp (needs llama-cpp-python)",
    )


def main(args: argparse.Namespace) -> dict[str, Any]:
    """`workbench bench decode`: run_decode with the command line's settings."""
    if args.max_tokens < 1:
        raise SystemExit(f"bench decode: --max-tokens: must be >= 1, got {args.max_tokens}")
    return run_with_flags(run_decode, args, baseline=not args.no_baseline, llamacpp_gguf=parse_gguf(args.llamacpp_gguf))


_HEADERS = ("system", "weights", "tok/s (median)", "runs", "vs transformers fp32", "same tokens as engine fp32")


def _rows(result: dict[str, Any]) -> list[list[object]]:
    base = next(
        (r["tok_s"] for r in result["rows"] if r["system"] == "transformers generate" and r["weights"] == "float32"),
        None,
    )
    return [
        [
            r["system"],
            r["weights"],
            r["tok_s"],
            " ".join(f"{x:.1f}" for x in r["runs"]),
            "-" if base is None else f"{r['tok_s'] / base:.2f}x",
            {True: "yes", False: "no", None: "-"}[r["same_tokens_as_engine_fp32"]],
        ]
        for r in result["rows"]
    ]


_TEXT = (
    "{model}: a {prompt_len}-token prompt, {max_tokens} greedy tokens, {threads} threads, median of {runs} "
    "alternating rounds"
)
_DOCS = _TEXT + (
    ". The engine's bfloat16 and int8 store the weights so and compute in float32 (checked against "
    "Hugging Face in tests/model/test_fast_dtypes.py); transformers bfloat16 computes in bfloat16."
    "{note}"
)


def _parts(result: dict[str, Any]) -> list[Part]:
    return [described(result, _TEXT, _DOCS), Table(_HEADERS, _rows(result)), Line(load_line(result))]


format_text, format_markdown = formatters("Single-stream decode: the engine in each weight format", _parts)
