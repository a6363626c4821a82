"""Every benchmark the CLI finds has what `workbench bench` asks of it (workbench.bench.BenchmarkModule), and no
module of workbench/bench/ that means to be one is left unfound."""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect

import pytest

from workbench.bench import BenchmarkModule
from workbench.cli import BENCH_DIR, discover_benchmarks

BENCHMARKS = discover_benchmarks()
# each function's parameters, as run_bench calls it
CALLED_WITH = {"add_cli_args": 1, "main": 1, "format_text": 1, "format_markdown": 2}


def test_the_cli_finds_every_module_that_declares_a_help() -> None:
    """A module with a HELP but without `add_cli_args` or `main` would be no command, silently."""
    declaring = set()
    for path in BENCH_DIR.glob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        targets = [t for node in tree.body if isinstance(node, ast.Assign) for t in node.targets]
        if any(isinstance(t, ast.Name) and t.id == "HELP" for t in targets):
            declaring.add(path.stem)
    assert declaring == {b.name for b in BENCHMARKS}


@pytest.mark.parametrize("name", [b.name for b in BENCHMARKS])
def test_a_benchmark_module_has_the_declared_interface(name: str) -> None:
    module = importlib.import_module(f"workbench.bench.{name}")
    assert isinstance(module, BenchmarkModule), f"{name}: missing one of HELP, add_cli_args, main, format_*"
    assert isinstance(module.HELP, str) and module.HELP and "\n" not in module.HELP
    for function, count in CALLED_WITH.items():
        params = [p for p in inspect.signature(getattr(module, function)).parameters.values() if p.default is p.empty]
        assert len(params) == count, f"{name}.{function} takes {len(params)} required arguments, not {count}"
    in_all = getattr(module, "IN_ALL", None)
    assert in_all is None or (
        isinstance(in_all[0], int) and isinstance(in_all[1], list) and all(isinstance(f, str) for f in in_all[1])
    )
    assert isinstance(getattr(module, "KEEPS_RESULT", True), bool)
    parser = argparse.ArgumentParser()
    module.add_cli_args(parser)
    args = parser.parse_args([])  # every flag has a default, and the docs flags run_bench reads are there
    assert {"write_docs", "docs_path", "docs_section"} <= set(vars(args))


def test_each_benchmark_in_bench_all_has_a_place_of_its_own() -> None:
    places = [b.in_all[0] for b in BENCHMARKS if b.in_all is not None]
    assert len(places) == len(set(places))
