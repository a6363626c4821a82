"""The flags every benchmark shares and the command line's argument types. Each benchmark module's `add_cli_args`
starts with `add_common_args`, and its `main` calls its run function through `run_with_flags`. Engine flags come from
engine/arg_utils.py, imported when a parser is given them. Imports nothing heavy: the CLI builds its parser with it
before any benchmark (or torch) is imported."""

from __future__ import annotations

import argparse
import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from workbench.bench.report import DEFAULT_DOCS_PATH


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


def add_common_args(
    parser: argparse.ArgumentParser,
    runs: bool = True,
    budget: bool = True,
    engine: Sequence[str] = (),
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """The flags of every benchmark that runs a model: the engine's --model, --max-num-batched-tokens (where one
    engine budget applies), --num-kv-blocks and those of the fields `engine` names (engine/arg_utils.py, with
    `defaults` for this benchmark), then --seed of the workload, --runs (where it repeats its timings) and the docs
    flags."""
    from engine.arg_utils import add_engine_args

    budget_flag = ["max_num_batched_tokens"] if budget else []
    add_engine_args(parser, include=["model", *budget_flag, "num_kv_blocks", *engine], defaults=defaults)
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default: %(default)s)")
    if runs:
        parser.add_argument("--runs", type=positive_int, default=3, help="timed runs per side; medians (default: 3)")
    add_docs_args(parser)


# the simulated executor's settings (vLLM's names): passed to the engine through engine_kwargs when given
EXECUTOR_FLAGS = ("executor", "hardware", "tensor_parallel_size", "gpu_memory_utilization")


def add_executor_args(parser: argparse.ArgumentParser) -> None:
    """The engine's --executor, --hardware, --tensor-parallel-size and --gpu-memory-utilization, unset unless given:
    the engine's defaults apply, and reports and reproducing commands name only what was given."""
    from engine.arg_utils import add_engine_args

    add_engine_args(parser, include=EXECUTOR_FLAGS, defaults=dict.fromkeys(EXECUTOR_FLAGS), title="engine: executor")


def executor_text(engine_kwargs: dict[str, Any]) -> str | None:
    """What a report says of a simulated run (every time in it is simulated), or None for a real one."""
    if engine_kwargs.get("executor") != "simulated":
        return None
    return (
        f"Simulated: the engine's scheduler and KV cache over the cost model of {engine_kwargs.get('hardware')} "
        f"(tensor_parallel_size={engine_kwargs.get('tensor_parallel_size', 1)}), every time on the simulated clock"
    )


def engine_kwargs_from(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig settings a run function takes as engine_kwargs: --num-kv-blocks and the executor's flags,
    where set (the other engine flags are its own parameters)."""
    from engine.arg_utils import engine_kwargs_from_args

    given = engine_kwargs_from_args(args)
    return {name: given[name] for name in ("num_kv_blocks", *EXECUTOR_FLAGS) if name in given}


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
