"""The flags every benchmark shares and the command line's argument types. Each benchmark module's `add_cli_args`
starts with `add_common_args`, and its `main` calls its run function through `run_with_flags`. Imports nothing
heavy: the CLI builds its parser with it before any benchmark is imported."""

from __future__ import annotations

import argparse
import inspect
import sys
from collections.abc import Callable
from typing import Any

from workbench.bench.report import DEFAULT_DOCS_PATH

DEFAULT_MODEL = "smollm2-135m"


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an int >= `low`."""

    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = "int"  # argparse names the type in its error messages
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def positive_float(text: str) -> float:
    """An argparse type: a float > 0 (inf allowed)."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def add_docs_args(
    parser: argparse.ArgumentParser,
    write_help: str = "rewrite this benchmark's section of the docs",
    path_help: str = "the docs file (default: %(default)s)",
) -> None:
    """--write-docs, --docs-path and --docs-section."""
    parser.add_argument("--write-docs", action="store_true", help=write_help)
    parser.add_argument("--docs-path", default=str(DEFAULT_DOCS_PATH), help=path_help)
    parser.add_argument(
        "--docs-section",
        default=None,
        metavar="NAME",
        help="the docs section (and kept result) to write, default the benchmark's name: one "
        "benchmark keeps several settings side by side (serve at 1 req/s and at saturation, say)",
    )


def add_common_args(parser: argparse.ArgumentParser, runs: bool = True, budget: bool = True) -> None:
    """The flags of every benchmark that runs a model: --model, --seed, --runs (where it repeats its timings),
    --max-num-batched-tokens (where one engine budget applies), --num-kv-blocks and the docs flags."""
    parser.add_argument("--model", default=DEFAULT_MODEL, help="registry name or HF folder (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default: %(default)s)")
    if runs:
        parser.add_argument("--runs", type=positive_int, default=3, help="timed runs per side; medians (default: 3)")
    if budget:
        parser.add_argument(
            "--max-num-batched-tokens",
            type=positive_int,
            default=2048,
            help="the engine's token budget per step (default: %(default)s)",
        )
    parser.add_argument(
        "--num-kv-blocks",
        type=positive_int,
        default=None,
        help="KV cache size in blocks (default: sized from the engine's kv_cache_memory)",
    )
    add_docs_args(parser)


def add_executor_args(parser: argparse.ArgumentParser) -> None:
    """--executor, --hardware, --tensor-parallel-size, --gpu-memory-utilization: the simulated executor's settings
    (vLLM's names), passed to the engine through engine_kwargs when given."""
    parser.add_argument(
        "--executor",
        choices=("uniproc", "simulated"),
        default=None,
        help="uniproc (default): the model in this process; simulated: the scheduler and KV cache "
        "over a cost model, in simulated time",
    )
    parser.add_argument("--hardware", default=None, help="simulated executor: h100-sxm, h200, a100-80gb, l4 or cpu")
    parser.add_argument("--tensor-parallel-size", type=positive_int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=positive_float, default=None)


EXECUTOR_FLAGS = ("executor", "hardware", "tensor_parallel_size", "gpu_memory_utilization")


def executor_text(engine_kwargs: dict[str, Any]) -> str | None:
    """What a report says of a simulated run (every time in it is simulated), or None for a real one."""
    if engine_kwargs.get("executor") != "simulated":
        return None
    return (
        f"Simulated: the engine's scheduler and KV cache over the cost model of {engine_kwargs.get('hardware')} "
        f"(tensor_parallel_size={engine_kwargs.get('tensor_parallel_size', 1)}), every time on the simulated clock"
    )


def engine_kwargs_from(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig settings the shared flags gave: --num-kv-blocks and the executor's flags, where set."""
    kwargs = {"num_kv_blocks": args.num_kv_blocks}
    kwargs.update({name: getattr(args, name, None) for name in EXECUTOR_FLAGS})
    return {k: v for k, v in kwargs.items() if v is not None}


def add_positive_ints(parser: argparse.ArgumentParser, **defaults: int) -> None:
    """A `--name` flag (underscores as dashes) of a positive int for each keyword, with its default and no help."""
    for name, default in defaults.items():
        parser.add_argument("--" + name.replace("_", "-"), type=positive_int, default=default)


def _log(line: str) -> None:
    print(line, file=sys.stderr)


def run_with_flags(run: Callable[..., dict[str, Any]], args: argparse.Namespace, **renamed: Any) -> dict[str, Any]:
    """`run(...)` with the command line's settings: each flag whose name is one of its parameters (--model, --seed,
    --runs, --num-requests ...), --num-kv-blocks and the executor's flags as engine_kwargs, progress lines to
    stderr, and `renamed`: the values of flags spelled, or typed, otherwise than its parameters (they win over a
    flag of the same name)."""
    params = inspect.signature(run).parameters
    kwargs = {name: value for name, value in vars(args).items() if name in params}
    kwargs["engine_kwargs"] = engine_kwargs_from(args)
    return run(**{**kwargs, "log": _log, **renamed})
