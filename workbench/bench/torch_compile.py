"""torch.compile against eager, on the engine's own hot path: the model's forward (every layer, the paged attention
and the C++ ops in it) under `torch.compile(mode=...)` for each mode, beside the eager forward of the same model in
the same process. One engine: each side swaps the model's `forward` to its own (the compiled ones are kept, so each
compiles once), then runs; sides alternate round by round and each number is a median. Two workloads: batch-1
decode (tok/s of one greedy request) and a steady decode step of `batch` requests (the forward's ms, `bench
roofline`'s measurement). Every compiled side must make the same tokens as eager at both batch sizes: a side that
does not, or that fails to compile, is reported so, with the error.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from engine import LLM, SamplingParams
from workbench.bench.args import add_common_args, positive_int, run_with_flags
from workbench.bench.datasets import random_requests, token_id_range
from workbench.bench.decode import PROMPT, WEIGHT_FORMATS
from workbench.bench.report import Line, Part, Table, described, formatters, run_settings
from workbench.bench.roofline import decode_step_ms
from workbench.bench.timing import LoadAverage, alternate, load_line

HELP = "torch.compile of the model's forward vs eager: batch-1 decode and a batch-64 decode step, tokens checked"
EAGER = "eager"
MODES = ("default", "max-autotune-no-cudagraphs")  # CUDA graphs have no CPU side
# Dynamo compiles each decoder layer's frames once per layer object (a guard on the module): more than its default
# of 8 versions of one frame and it would silently run the rest eagerly, timing eager under the compiled name.
RECOMPILE_LIMIT = 512


class Forwards:
    """The model's eager forward and a compiled one per mode; `use(name)` makes the model call that one."""

    def __init__(self, llm: LLM, modes: Sequence[str]) -> None:
        runner = llm.engine.runner
        if runner is None:
            raise SystemExit("bench torch_compile: needs the model in this process (the uniproc executor)")
        self.model = runner.model
        eager = self.model.forward
        self.forwards: dict[str, Callable[..., torch.Tensor]] = {EAGER: eager}
        for mode in modes:
            self.forwards[mode] = torch.compile(eager, mode=mode)

    def use(self, name: str) -> None:
        # an instance attribute shadows the class's forward, which nn.Module.__call__ looks up on the instance
        self.model.forward = self.forwards[name]


def graph_breaks() -> int:
    """Graph breaks dynamo has counted in this process (each compiled side reports the ones its warm-up added)."""
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def run_torch_compile(
    model: str = "smollm2-135m",
    modes: Sequence[str] = MODES,
    weights: str = "float32",
    max_tokens: int = 128,
    batch: int = 64,
    prompt_len: int = 128,
    steps: int = 10,
    check_tokens: int = 4,
    runs: int = 3,
    seed: int = 0,
    engine_kwargs: dict[str, Any] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Eager and each mode on one engine in `weights`: first each side's untimed warm-up, which compiles (its wall
    seconds kept) and gives the tokens checked against eager's (batch-1 decode of `max_tokens`; `batch` requests of
    `prompt_len` random tokens, `check_tokens` each); then `runs` alternating rounds of batch-1 decode and of the
    median forward over `steps` decode steps of `batch` requests. A mode that raises is left out of the rounds,
    with its error."""
    import torch._dynamo.config

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    engine_kwargs = dict(engine_kwargs or {})
    llm = LLM(model=model, seed=seed, **{**engine_kwargs, **WEIGHT_FORMATS[weights]})
    forwards = Forwards(llm, modes)
    prompt_ids = llm.tokenizer.encode(PROMPT)
    decode_params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    batch_prompts = [
        r.prompt_token_ids
        for r in random_requests(batch, (prompt_len, prompt_len), (1, 1), token_id_range(llm.tokenizer), seed)
    ]
    check_params = SamplingParams(max_tokens=check_tokens, temperature=0.0, ignore_eos=True)

    def decode(name: str) -> list[int]:
        forwards.use(name)
        return llm.generate([prompt_ids], decode_params, use_tqdm=False)[0].token_ids

    def batch_tokens(name: str) -> list[list[int]]:
        forwards.use(name)
        return [out.token_ids for out in llm.generate(batch_prompts, check_params, use_tqdm=False)]

    def step_ms(name: str) -> float:
        forwards.use(name)
        return decode_step_ms(llm, batch, prompt_len, steps, seed=seed)["forward_ms"]

    sides: dict[str, dict[str, Any]] = {}
    for name in forwards.forwards:
        breaks, t0 = graph_breaks(), time.perf_counter()
        try:
            made = decode(name), batch_tokens(name)
        except Exception as exc:  # a mode that does not compile here is a result, not the end of the run
            if name == EAGER:
                raise
            sides[name] = {"mode": name, "error": f"{type(exc).__name__}: {exc}"[:500]}
            log(f"{name}: failed: {sides[name]['error']}")
            continue
        sides[name] = {
            "mode": name,
            "warmup_s": time.perf_counter() - t0,
            "graph_breaks": graph_breaks() - breaks,
            "tokens": made,
            "decode_tok_s": [],
            "step_ms": [],
        }
        log(f"{name}: warm-up (compile) {sides[name]['warmup_s']:.1f} s")
    working = [name for name, side in sides.items() if "error" not in side]
    load = LoadAverage()
    for turn in alternate({name: functools.partial(decode, name) for name in working}, runs):
        sides[turn.side]["decode_tok_s"].append(len(turn.value) / turn.seconds)
        log(f"round {turn.run + 1}/{runs}: {turn.side} batch-1 decode {sides[turn.side]['decode_tok_s'][-1]:.1f} tok/s")
    for step in alternate({name: functools.partial(step_ms, name) for name in working}, runs):
        sides[step.side]["step_ms"].append(step.value)
        log(f"round {step.run + 1}/{runs}: {step.side} batch {batch} step {step.value:.1f} ms")
    forwards.use(EAGER)
    reference = sides[EAGER]["tokens"]
    rows = []
    for side in sides.values():
        if "error" in side:
            rows.append(side)
            continue
        decode_tokens, batch_made = side.pop("tokens")
        rows.append(
            {
                **side,
                "decode_tok_s_median": statistics.median(side["decode_tok_s"]),
                "step_ms_median": statistics.median(side["step_ms"]),
                "same_tokens_as_eager": (decode_tokens, batch_made) == reference,
            }
        )
    return {
        "model": model,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "load_average": load.done(),
        "rows": rows,
        "settings": run_settings(run_torch_compile, locals()),
    }


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser)
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=MODES,
        default=list(MODES),
        help="torch.compile modes, a side each beside eager (default: all)",
    )
    parser.add_argument(
        "--weights", choices=tuple(WEIGHT_FORMATS), default="float32", help="how the engine stores its weights"
    )
    parser.add_argument("--max-tokens", type=positive_int, default=128, help="batch-1 decode tokens (default: 128)")
    parser.add_argument("--batch", type=positive_int, default=64, help="requests of the timed step (default: 64)")
    parser.add_argument("--prompt-len", type=positive_int, default=128, help="their prompts' tokens (default: 128)")
    parser.add_argument("--steps", type=positive_int, default=10, help="decode steps per timing (default: 10)")
    parser.add_argument(
        "--check-tokens", type=positive_int, default=4, help="tokens each of the batch makes for the check (default: 4)"
    )


def main(args: argparse.Namespace) -> dict[str, Any]:
    """`workbench bench torch_compile`: run_torch_compile with the command line's settings."""
    return run_with_flags(run_torch_compile, args)


_HEADERS = (
    "forward",
    "batch-1 decode tok/s",
    "vs eager",
    "batch step ms",
    "vs eager",
    "same tokens",
    "warm-up s",
    "graph breaks",
)


def _rows(result: dict[str, Any]) -> list[list[object]]:
    eager = next(r for r in result["rows"] if r["mode"] == EAGER)
    rows: list[list[object]] = []
    for r in result["rows"]:
        if "error" in r:
            rows.append([r["mode"], "failed (below)", "-", "-", "-", "-", "-", "-"])
            continue
        rows.append(
            [
                r["mode"],
                r["decode_tok_s_median"],
                f"{r['decode_tok_s_median'] / eager['decode_tok_s_median']:.2f}x",
                r["step_ms_median"],
                f"{eager['step_ms_median'] / r['step_ms_median']:.2f}x",
                "yes" if r["same_tokens_as_eager"] else "no",
                r["warmup_s"],
                r["graph_breaks"],
            ]
        )
    return rows


_TEXT = (
    "{model} in {weights}: batch-1 decode of {max_tokens} tokens and the forward of a decode step of {batch} "
    "requests ({prompt_len}-token prompts, median of {steps} steps), {threads} threads, torch {torch}, median of "
    "{runs} alternating rounds"
)
_DOCS = _TEXT + (
    '. One engine, its model\'s forward swapped per side; "vs eager" above 1 is faster. The warm-up is the first '
    "calls (the compile); same tokens: batch-1 decode and {check_tokens} tokens of each of the {batch} requests, "
    "as eager made them.{note}"
)


def _parts(result: dict[str, Any]) -> list[Part]:
    failed = [Line(f"{r['mode']} failed: {' '.join(r['error'].split())}") for r in result["rows"] if "error" in r]
    return [described(result, _TEXT, _DOCS), Table(_HEADERS, _rows(result)), *failed, Line(load_line(result))]


format_text, format_markdown = formatters("torch.compile against eager", _parts)
