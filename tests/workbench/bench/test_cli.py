"""`workbench bench NAME` comes from the benchmark modules themselves: every module of workbench/bench/ with
`add_cli_args` and `main` is a subcommand with exactly its flags and a working --help, found from its source without
importing anything heavy; `bench all` keeps its benchmarks and their order. No model runs here."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import subprocess
import sys

import pytest

import workbench.bench
from workbench import cli
from workbench.bench.args import add_common_args, run_with_flags
from workbench.bench.report import Line, Table, bold, docs_only, markdown_report, text_only, text_report


def _bench_modules() -> dict[str, object]:
    """The benchmark modules, found by importing every module of the package (independently of the CLI's search)."""
    found = {}
    for info in pkgutil.iter_modules(workbench.bench.__path__):
        module = importlib.import_module(f"workbench.bench.{info.name}")
        if callable(getattr(module, "add_cli_args", None)) and callable(getattr(module, "main", None)):
            found[info.name] = module
    return found


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    commands = next(a for a in cli.build_parser()._subparsers._group_actions if a.dest == "command")
    return next(a for a in commands.choices["bench"]._subparsers._group_actions if a.dest == "bench_name").choices


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    return [flag for action in parser._actions for flag in action.option_strings if flag not in ("-h", "--help")]


def test_every_benchmark_module_is_a_subcommand_with_its_own_flags() -> None:
    modules, subcommands = _bench_modules(), _subcommands()
    assert set(subcommands) == {*modules, "all"}
    assert {
        "throughput",
        "prefix",
        "profile",
        "serve",
        "sweep",
        "guided",
        "roofline",
        "spec",
        "pd",
        "gpu_kernels",
        "gains",
    } <= set(modules)
    for name, module in modules.items():
        own = argparse.ArgumentParser()
        module.add_cli_args(own)
        sub = subcommands[name]
        sub.format_help()  # the subcommand adds its module's flags on first use
        assert _flags(sub) == _flags(own), name
        help_ = getattr(module, "HELP", None) or module.__doc__.strip().splitlines()[0]
        assert next(b for b in cli.BENCHMARKS if b.name == name).help == help_


@pytest.mark.parametrize("name", [*sorted(_bench_modules()), "all"])
def test_help_of_each_bench_subcommand(name, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", name, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: workbench bench {name} ") and "--write-docs" in out and "--docs-path" in out


def test_bench_all_runs_the_cpu_benchmarks_in_their_order() -> None:
    assert cli.ALL_BENCHES == {
        "throughput": [],
        "prefix": [],
        "profile": [],
        "serve": ["--request-rate", "1", "--baseline", "--cb-baseline", "--goodput", "ttft:1000", "tpot:100"],
        "sweep": [],
        "guided": [],
        "roofline": [],
        "spec": ["--runs", "2"],
        "pd": [],
        "decode": [],
        "prefill": [],
    }
    listed = [b.name for b in cli.BENCHMARKS]
    assert listed[: len(cli.ALL_BENCHES)] == list(cli.ALL_BENCHES) and "gpu_kernels" in listed[len(cli.ALL_BENCHES) :]


def test_a_module_is_a_benchmark_by_its_source_alone(tmp_path) -> None:
    """What adding a benchmark takes: one module. Its help is HELP, else its docstring's first line."""
    (tmp_path / "zeta.py").write_text(
        '"""Zeta: the last one.\n\nMore."""\nimport nothing_that_exists\n\n\n'
        "def add_cli_args(parser):\n    pass\n\n\ndef main(args):\n    return {}\n"
    )
    (tmp_path / "alpha.py").write_text(
        'HELP = ("first, " "in all")\nIN_ALL = (1, ["--runs", "2"])\n\n\n'
        "def add_cli_args(parser):\n    pass\n\n\ndef main(args):\n    return {}\n"
    )
    (tmp_path / "helper.py").write_text("def add_cli_args(parser):\n    pass\n")  # no main: not a benchmark
    found = cli.discover_benchmarks(tmp_path)
    assert found == [
        cli.Benchmark("alpha", "first, in all", (1, ["--runs", "2"])),
        cli.Benchmark("zeta", "Zeta: the last one."),
    ]


def test_the_cli_imports_a_benchmark_only_when_its_subcommand_is_parsed() -> None:
    code = (
        "import sys; from workbench import cli; parser = cli.build_parser(); "
        "assert not [m for m in sys.modules if m.startswith('workbench.bench.') and m not in "
        "('workbench.bench.args', 'workbench.bench.report')], 'a benchmark imported at start'; "
        "args = parser.parse_args(['bench', 'gains', '--write-docs']); "
        "assert 'workbench.bench.gains' in sys.modules and 'workbench.bench.throughput' not in sys.modules; "
        "assert args.write_docs and args.bench == 'gains' and 'torch' not in sys.modules"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_docs_section_keeps_a_second_setting_beside_the_first(tmp_path, monkeypatch) -> None:
    """--docs-section NAME writes that section and keeps the result under that name; the benchmark's own section
    (written before, by default) stays as it was."""
    import json
    import types

    fake = types.ModuleType("workbench.bench.fakebench")
    fake.main = lambda args: {"rate": args.rate}
    fake.format_text = lambda result: f"rate {result['rate']}"
    fake.format_markdown = lambda result, command: f"rate {result['rate']} ({command})"
    monkeypatch.setitem(sys.modules, "workbench.bench.fakebench", fake)
    docs = tmp_path / "BENCHMARKS.md"
    for rate, section in (("1", None), ("inf", "fakebench-saturated")):
        args = argparse.Namespace(
            bench="fakebench", rate=rate, write_docs=True, docs_path=str(docs), docs_section=section
        )
        cli.run_bench(args, f"workbench bench fakebench --rate {rate}", out=lambda _: None)
    text = docs.read_text()
    assert (
        "<!-- bench:fakebench:start -->\nrate 1 (workbench bench fakebench --rate 1)\n<!-- bench:fakebench:end -->"
        in text
    )
    assert (
        "<!-- bench:fakebench-saturated:start -->\nrate inf (workbench bench fakebench --rate inf)\n"
        "<!-- bench:fakebench-saturated:end -->"
    ) in text
    kept = {p.name: json.loads(p.read_text())["result"] for p in (tmp_path / "bench").iterdir()}
    assert kept == {"fakebench.json": {"rate": "1"}, "fakebench-saturated.json": {"rate": "inf"}}


def test_run_with_flags_passes_flags_named_as_parameters() -> None:
    def run_x(model: str, seed: int, num_requests: int, batch_size: int, engine_kwargs: dict, log) -> dict:
        return {
            "model": model,
            "seed": seed,
            "num_requests": num_requests,
            "batch_size": batch_size,
            "engine_kwargs": engine_kwargs,
            "log": log,
        }

    parser = argparse.ArgumentParser()
    add_common_args(parser)
    parser.add_argument("--num-requests", type=int, default=3)
    parser.add_argument("--hf-batch-size", type=int, default=8)
    args = parser.parse_args(["--model", "tiny-llama", "--num-kv-blocks", "7", "--num-requests", "5"])
    got = run_with_flags(run_x, args, batch_size=args.hf_batch_size, seed=9)
    assert got["log"] is not print and callable(got["log"])
    assert {k: v for k, v in got.items() if k != "log"} == {
        "model": "tiny-llama",
        "seed": 9,
        "num_requests": 5,
        "batch_size": 8,
        "engine_kwargs": {"num_kv_blocks": 7},
    }


def test_one_list_of_parts_gives_the_terminal_text_and_the_docs_section() -> None:
    parts = [
        Line("workload", "workload, and more for the docs"),
        Table(("a", "b"), [["x", 1.5]]),
        bold("summary"),
        docs_only("docs only"),
        text_only("terminal only"),
    ]
    assert text_report(parts) == "workload\na     b\n-  ----\nx  1.50\nsummary\nterminal only"
    assert markdown_report("Title", "workbench bench x", parts, machine={"cpu": "C"}) == (
        "## Title\n\n`workbench bench x`\n\nworkload, and more for the docs\n\n| a | b |\n|---|---|\n| x | 1.50 |"
        "\n\n**summary**\n\ndocs only\n\n- cpu: C"
    )
    assert markdown_report("T", "c", [docs_only("d")], machine={}) == "## T\n\n`c`\n\nd"
