"""Benchmark reporting: the machine description, plain-text and Markdown tables, the reports a benchmark states
once as parts (lines and tables) and gets both in the terminal and as its docs section, and docs sections that each
benchmark rewrites on its own (delimited by HTML comment markers)."""

from __future__ import annotations

import datetime
import importlib.metadata
import inspect
import json
import os
import platform
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_DOCS_PATH = Path("docs") / "BENCHMARKS.md"
DEFAULT_RESULTS_DIR = Path("docs") / "bench"  # one committed JSON per benchmark: the numbers behind its section


def machine_info() -> dict[str, str]:
    """What a timing depends on: platform, CPU and its vector units, which of the C++ kernels run, cores and
    threads, library versions, the date. torch and the CPU's reader (the kernels package imports torch) are imported
    on use: the CLI imports this module as it starts."""
    import torch

    from kernels.cpu.build import isa
    from kernels.cpu.cpuinfo import cpu_info

    cpu = cpu_info()
    return {
        "platform": platform.platform(),
        "cpu": cpu.model,
        "vector units": " ".join(cpu.vector_units) or "none",
        "CPU kernels": _kernels_line(isa()),
        "cores": str(os.cpu_count()),
        "torch threads": str(torch.get_num_threads()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": importlib.metadata.version("transformers"),
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
    }


def _kernels_line(name: str) -> str:
    """Which C++ CPU kernels a run used: an AVX2 run on an AVX-512 CPU says so (its vector units do not)."""
    if os.environ.get("WORKBENCH_CPU_OPS", "1") == "0":
        return "none: the torch references (WORKBENCH_CPU_OPS=0)"
    return "the AVX2 build, forced (WORKBENCH_CPU_ISA=avx2)" if name == "avx2" else "built for this CPU (native)"


def _cells(rows: Sequence[Sequence[object]]) -> list[list[str]]:
    return [[f"{v:.2f}" if isinstance(v, float) else str(v) for v in row] for row in rows]


def text_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A fixed-width table for the terminal; floats with two decimals, numbers right-aligned."""
    cells = [list(headers), *_cells(rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(_is_number(r[i]) for r in cells[1:]) for i in range(len(headers))]
    lines = []
    for row in cells:
        lines.append("  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric)))
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-flavoured Markdown table; floats with two decimals."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in _cells(rows)]
    return "\n".join(lines)


def _is_number(text: str) -> bool:
    try:
        float(text.rstrip("%x"))
    except ValueError:
        return False
    return True


def machine_markdown(info: dict[str, str]) -> str:
    return "\n".join(f"- {k}: {v}" for k, v in info.items())


@dataclass(frozen=True)
class Line:
    """A paragraph of a report: `text` in the terminal, `docs` in the docs section (None: the same text). An empty
    one is left out of that output."""

    text: str
    docs: str | None = None

    def as_text(self) -> str:
        return self.text

    def as_markdown(self) -> str:
        return self.text if self.docs is None else self.docs


@dataclass(frozen=True)
class Table:
    """A table of a report: fixed-width in the terminal, Markdown in the docs."""

    headers: Sequence[str]
    rows: Sequence[Sequence[object]]

    def as_text(self) -> str:
        return text_table(self.headers, self.rows)

    def as_markdown(self) -> str:
        return markdown_table(self.headers, self.rows)


Part = Line | Table


def text_only(text: str) -> Line:
    """A paragraph of the terminal output only."""
    return Line(text, "")


def docs_only(docs: str) -> Line:
    """A paragraph of the docs section only."""
    return Line("", docs)


def bold(text: str) -> Line:
    """A summary line: plain in the terminal, bold in the docs."""
    return Line(text, f"**{text}**")


def text_report(parts: Iterable[Part]) -> str:
    """What a benchmark prints: its parts' terminal text, one a line."""
    return "\n".join(text for text in (p.as_text() for p in parts) if text)


def markdown_report(title: str, command: str, parts: Iterable[Part], machine: dict[str, str] | None = None) -> str:
    """A benchmark's docs section: `## title`, the command that produced it, its parts, and the machine it ran on
    (`machine`, by default machine_info(); `{}`: none), one paragraph each."""
    machine = machine_info() if machine is None else machine
    paragraphs = [f"## {title}", f"`{command}`", *(p.as_markdown() for p in parts), machine_markdown(machine)]
    return "\n\n".join(p for p in paragraphs if p)


def run_settings(
    run: Callable[..., Any], values: Mapping[str, Any], omit: Iterable[str] = (), **changed: Any
) -> dict[str, Any]:
    """What a benchmark's result keeps as its `settings` (what `describe` reads): the value in `values` (the run
    function's locals()) of each parameter of `run`, in their order, less `model` (the result's own entry), `log`,
    `progress` and `omit`; a tuple as a list, as the JSON kept beside the docs holds it, so that a fresh result
    reads as a kept one; `changed` replaces or adds entries."""
    skip = {"model", "log", "progress", *omit}
    settings = {name: values[name] for name in inspect.signature(run).parameters if name not in skip}
    return {**{k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()}, **changed}


def describe(template: str, result: dict[str, Any], **values: Any) -> str:
    """`template` (str.format) filled in from a benchmark's result: `{name}` is the setting of that name, else the
    result's own entry (`{model}`, `{seed}`, `{input_len_range[0]}`, `{request_rate:g}`); `{note}` is the
    engine_settings_note of its engine_kwargs; `values` add or override names."""
    settings = result.get("settings") or {}
    note = engine_settings_note(settings.get("engine_kwargs") or {})
    return template.format(**{**result, **settings, "note": note, **values})


def described(result: dict[str, Any], text: str, docs: str, **values: Any) -> Line:
    """A paragraph from two `describe` templates: `text` in the terminal, `docs` in the docs section."""
    return Line(describe(text, result, **values), describe(docs, result, **values))


def formatters(
    title: str, parts: Callable[[dict[str, Any]], list[Part]]
) -> tuple[Callable[[dict[str, Any]], str], Callable[[dict[str, Any], str], str]]:
    """A benchmark's `format_text(result)` (what it prints) and `format_markdown(result, command)` (its docs
    section, under `## title`), both from the one list of parts it states for a result."""

    def format_text(result: dict[str, Any]) -> str:
        return text_report(parts(result))

    def format_markdown(result: dict[str, Any], command: str) -> str:
        return markdown_report(title, command, parts(result))

    return format_text, format_markdown


def engine_settings_note(engine_kwargs: dict[str, object]) -> str:
    """ " Other engine settings: k=v, ..." for the EngineConfig fields a benchmark was given beyond its own."""
    if not engine_kwargs:
        return ""
    return " Other engine settings: " + ", ".join(f"{k}={v}" for k, v in engine_kwargs.items()) + "."


def write_section(path: str | os.PathLike, name: str, body: str) -> None:
    """Replace the text between `<!-- bench:NAME:start -->` and `<!-- bench:NAME:end -->` in `path` by `body`,
    leaving every other section alone; append the section (with its markers) if it is not there yet."""
    path = Path(path)
    start, end = f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"
    block = f"{start}\n{body.strip()}\n{end}"
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text, count=1)
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + block + "\n"
    path.write_text(text, encoding="utf-8")


def write_result(results_dir: str | os.PathLike, name: str, result: dict[str, Any], command: str) -> Path:
    """Keep a benchmark's result as `results_dir/NAME.json` (with the command and the machine), so that other
    sections (the gains table) can be built from it without re-running anything."""
    path = Path(results_dir) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"name": name, "command": command, "machine": machine_info(), "result": result}
    path.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return path


def read_result(results_dir: str | os.PathLike, name: str) -> dict[str, Any]:
    """The record `write_result` kept for benchmark `name`: name, command, machine, result."""
    path = Path(results_dir) / f"{name}.json"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no result of the {name} benchmark kept there")
    return json.loads(path.read_text(encoding="utf-8"))


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100] (numpy's default method)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
