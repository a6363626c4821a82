"""Benchmarks of the engine: `throughput` (against transformers), `prefix` (prefix caching on/off), `profile`
(where a step's time goes), `serve` (online serving metrics), `sweep` (the token budget), `guided` (the cost of
grammar masks), `roofline` (against the machine's limits), `spec` (speculative decoding), `pd` (disaggregated
prefill/decode), `parallel` (tensor parallelism), `dp_routing` (data parallelism: routing by load vs by
cached prefix), `gpu_kernels` (Triton, CUDA only) and `gains` (a table from the
others' kept results).

Each module owns its command line, as vLLM's `vllm/benchmarks/serve.py` does, and has what `BenchmarkModule`
declares: `add_cli_args(parser)` adds its flags (the shared ones from `args.add_common_args`), `main(args)` runs
`run_<name>(...)` with them and returns its result, and `format_text(result)` / `format_markdown(result, command)`
(from `report.formatters`) report it; `HELP` is its help and `IN_ALL = (place, flags)` puts it in
`workbench bench all`. Its runs are timed with `timing` (warm-up, runs, medians, sides taking turns, the load
average). `workbench.cli` finds such modules by reading their source, so adding a benchmark is adding its module;
the submodules are imported on use, so the CLI starts without torch."""

from __future__ import annotations

import argparse
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class BenchmarkModule(Protocol):
    """What `workbench bench NAME` asks of the module workbench/bench/NAME.py (tests/workbench/bench/test_interface.py
    checks every benchmark the CLI finds). Two module constants are optional: `IN_ALL = (place, [flags])`, its place
    and extra flags in `workbench bench all` (none: `bench all` leaves it out), and `KEEPS_RESULT = False` where
    --write-docs keeps no result of it beside the docs (gains, made from the others' kept results)."""

    HELP: str  # one line, its help in `workbench bench --help`

    def add_cli_args(self, parser: argparse.ArgumentParser) -> None:
        """Add its flags to `parser`: the shared ones, the docs flags among them, then its own."""

    def main(self, args: argparse.Namespace) -> dict[str, Any]:
        """Run it with the command line's settings; its result (JSON-serialisable: --write-docs keeps it)."""

    def format_text(self, result: dict[str, Any]) -> str:
        """What it prints for `result`."""

    def format_markdown(self, result: dict[str, Any], command: str) -> str:
        """Its docs section for `result`, which `command` produced."""
