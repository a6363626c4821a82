"""`workbench fidelity run | record | check`.

- run: fresh seeded workloads of each coverage group through vLLM 0.33.0 (the reference venv, a child process)
  and through this engine; prints how many made the same decisions at every step, and the first divergences.
  `--write-docs` puts the counts in docs/FIDELITY.md.
- record: vLLM's traces of a fixed set of workloads, written to tests/fidelity/golden/GROUP.json with vLLM's version
  and the command that made them (`make test` checks this engine against them, without vLLM).
- check: this engine against the recorded traces; exits 1 on any divergence.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from workbench.bench.args import non_negative_int, positive_int
from workbench.fidelity.workload import GROUPS

ROOT = Path(__file__).resolve().parents[2]
GOLDEN_DIR = ROOT / "tests" / "fidelity" / "golden"
DOCS = ROOT / "docs" / "FIDELITY.md"
DEFAULT_VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
BATCH = 250  # workloads per vLLM child process: a crash loses little, and memory stays flat


RECORDED_GROUPS = (*GROUPS, "lessons")  # the random groups and the hand-made lessons


def golden_workloads(group: str, count: int) -> list[dict[str, Any]]:
    """The recorded workloads of `group`: seeds 0 .. count - 1, or every lesson."""
    from workbench.fidelity.lessons import LESSON_NAMES, make_lesson
    from workbench.fidelity.workload import make_workload

    if group == "lessons":
        return [make_lesson(i) for i in range(len(LESSON_NAMES))]
    return [make_workload(group, seed) for seed in range(count)]


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="fidelity_command", required=True, metavar="{run,record,check}")
    for name, what in (
        ("run", "compare with live vLLM on fresh seeded workloads"),
        ("record", "write vLLM's traces of the golden workloads to tests/fidelity/golden"),
        ("check", "compare with the recorded traces (no vLLM needed)"),
    ):
        p = sub.add_parser(name, help=what)
        groups = GROUPS if name == "run" else RECORDED_GROUPS
        p.add_argument("--groups", nargs="+", choices=groups, default=list(groups), help="coverage groups")
        if name != "check":
            p.add_argument(
                "--vllm-python",
                default=str(DEFAULT_VLLM_PYTHON),
                help="the reference venv's python (`make vllm-ref`; default: %(default)s)",
            )
        if name == "run":
            p.add_argument("--workloads", type=positive_int, default=1000, help="per group (default: %(default)s)")
            p.add_argument(
                "--start",
                type=non_negative_int,
                default=1000,
                help="first seed (default: %(default)s; the golden workloads use seeds from 0)",
            )
            p.add_argument("--write-docs", action="store_true", help="put the counts in docs/FIDELITY.md")
        if name == "record":
            p.add_argument(
                "--workloads",
                type=positive_int,
                default=10,
                help="per random group (default: %(default)s; the lessons are all recorded)",
            )
        if name != "run":
            p.add_argument("--golden-dir", default=str(GOLDEN_DIR), help="default: %(default)s")


def main(args: argparse.Namespace, command: str, out: Callable[[str], None] = print) -> int:
    return {"run": run, "record": record, "check": check}[args.fidelity_command](args, command, out)


def _pipelined(batches: list[list[dict[str, Any]]], vllm_python: str) -> Iterator[tuple[list, list]]:
    """Each batch of workloads with vLLM's traces of it. vLLM's child process runs the next batch while the caller
    compares this one in this process: the two sides on two cores, not one after the other."""
    from workbench.fidelity.compare import run_vllm

    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(run_vllm, batches[0], vllm_python) if batches else None
        for i, batch in enumerate(batches):
            assert pending is not None  # submitted for every batch before it is taken
            traces = pending.result()
            if i + 1 < len(batches):
                pending = pool.submit(run_vllm, batches[i + 1], vllm_python)
            yield batch, traces


def run(args: argparse.Namespace, command: str, out: Callable[[str], None] = print) -> int:
    from workbench.fidelity.compare import compare, vllm_version
    from workbench.fidelity.workload import make_workload

    starts = range(args.start, args.start + args.workloads, BATCH)
    results = _pipelined(
        [
            [make_workload(group, seed) for seed in range(start, min(start + BATCH, args.start + args.workloads))]
            for group in args.groups
            for start in starts
        ],
        args.vllm_python,
    )
    rows, divergences = [], []
    for group in args.groups:
        t0, found = time.monotonic(), []
        for _ in starts:
            found += compare(*next(results))
        rows.append((group, args.workloads, args.workloads - len(found), len(found), time.monotonic() - t0))
        divergences += found
        out(
            f"{group}: {args.workloads - len(found)} of {args.workloads} workloads identical "
            f"(seeds {args.start}-{args.start + args.workloads - 1}, {rows[-1][-1]:.0f} s)"
        )
    for d in divergences[:10]:
        out(f"  {d}")
    if args.write_docs:
        from workbench.bench.report import write_section

        write_section(DOCS, "fidelity-run", format_markdown(rows, vllm_version(args.vllm_python), command))
        out(f"wrote the fidelity-run section of {DOCS}")
    return 1 if divergences else 0


def format_markdown(rows: list[tuple], version: str, command: str) -> str:
    from workbench.bench.report import machine_info

    lines = [
        f"`{command}`, vLLM {version}, {time.strftime('%Y-%m-%d')}, {machine_info().get('cpu', '')}",
        "",
        "| group | workloads | identical at every step | divergent | seconds |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {g} | {n} | {same} | {diff} | {s:.0f} |" for g, n, same, diff, s in rows]
    return "\n".join(lines)


def _golden_path(golden_dir: str, group: str) -> Path:
    return Path(golden_dir) / f"{group}.json"


def record(args: argparse.Namespace, command: str, out: Callable[[str], None] = print) -> int:
    from workbench.fidelity.compare import run_vllm, vllm_version

    version = vllm_version(args.vllm_python)
    for group in args.groups:
        workloads = golden_workloads(group, args.workloads)
        traces = run_vllm(workloads, args.vllm_python)
        path = _golden_path(args.golden_dir, group)
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "vllm_version": version,
            "command": command,
            "group": group,
            "cases": [{"workload": w, "trace": t} for w, t in zip(workloads, traces)],
        }
        path.write_text(json.dumps(doc, separators=(",", ":")) + "\n", encoding="utf-8")
        out(f"wrote {len(workloads)} traces of vLLM {version} to {path}")
    return 0


def load_golden(golden_dir: str | Path, group: str) -> dict[str, Any]:
    """A recorded file: {"vllm_version", "command", "group", "cases": [{"workload", "trace"}]}."""
    return json.loads(_golden_path(str(golden_dir), group).read_text(encoding="utf-8"))


def check(args: argparse.Namespace, command: str, out: Callable[[str], None] = print) -> int:
    from workbench.fidelity.compare import compare

    failed = 0
    for group in args.groups:
        doc = load_golden(args.golden_dir, group)
        cases = doc["cases"]
        found = compare([c["workload"] for c in cases], [c["trace"] for c in cases])
        failed += len(found)
        out(
            f"{group}: {len(cases) - len(found)} of {len(cases)} recorded vLLM {doc['vllm_version']} traces "
            "matched at every step"
        )
        for d in found[:10]:
            out(f"  {d}")
    return 1 if failed else 0


if __name__ == "__main__":  # python -m workbench.fidelity.command ... (the same as `workbench fidelity ...`)
    parser = argparse.ArgumentParser(prog="workbench fidelity")
    add_cli_args(parser)
    sys.exit(main(parser.parse_args(), "workbench fidelity " + shlex.join(sys.argv[1:])))
