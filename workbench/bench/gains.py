"""What prefix caching, guided decoding and speculative decoding change, in one table, built from the results
their benchmarks keep (docs/bench/NAME.json, see report.write_result); nothing is re-run.

`workbench bench gains [--write-docs]` prints the table and, with --write-docs, rewrites the `gains` section of
docs/BENCHMARKS.md; `workbench bench all --write-docs` ends with it.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.bench.args import add_docs_args
from workbench.bench.report import (
    DEFAULT_RESULTS_DIR,
    Line,
    Part,
    docs_only,
    markdown_report,
    markdown_table,
    read_result,
    text_report,
    text_table,
)

HELP = (
    "one table of prefix caching, guided and speculative decoding gains, from the results those benchmarks kept "
    "(nothing is re-run)"
)
KEEPS_RESULT = False  # built from the results others keep, it keeps none of its own
FEATURES = ("prefix", "guided", "spec")  # the benchmarks whose kept results feed the table


@dataclass(frozen=True)
class Gain:
    """One row: a metric of one workload without and with a feature; `gain` > 1 is better with it, whichever
    way the metric runs."""

    feature: str
    workload: str
    metric: str
    without: float
    with_: float
    gain: float
    command: str


def prefix_gains(record: dict[str, Any]) -> list[Gain]:
    """Mean TTFT and total throughput, caching off vs on."""
    r, s = record["result"], record["result"]["settings"]
    workload = (
        f"{s['num_requests']} requests, {s['num_prefixes']} shared {s['prefix_len']}-token prefixes + "
        f"{s['suffix_len']}-token suffixes, {s['output_len']} output tokens"
    )
    on, off = r["on"], r["off"]
    return [
        Gain(
            "prefix caching",
            workload,
            "TTFT mean ms",
            off["ttft_mean_ms"],
            on["ttft_mean_ms"],
            off["ttft_mean_ms"] / on["ttft_mean_ms"],
            record["command"],
        ),
        Gain(
            "prefix caching",
            workload,
            "total tok/s",
            off["total_tok_s"],
            on["total_tok_s"],
            on["total_tok_s"] / off["total_tok_s"],
            record["command"],
        ),
    ]


def guided_gains(record: dict[str, Any]) -> list[Gain]:
    """Step time with the grammar against the same step less its mask fill and apply: a cost, so gain < 1."""
    gains = []
    for row in record["result"]["rows"]:
        without = row["step_ms"] - row["fill_ms"] - row["apply_ms"]
        gains.append(
            Gain(
                "guided decoding (JSON schema)",
                f"batch {row['batch']}, all decoding",
                "step ms (without: less fill + apply)",
                without,
                row["step_ms"],
                without / row["step_ms"],
                record["command"],
            )
        )
    return gains


def spec_gains(record: dict[str, Any]) -> list[Gain]:
    """Output tokens/s of each drafting method against no drafts, per workload and batch size; the gain is the
    benchmark's own speedup (the same tokens in less time)."""
    r = record["result"]
    base = {(row["workload"], row["batch"]): row for row in r["rows"] if row["method"] == "none"}
    gains = []
    for row in r["rows"]:
        if row["method"] == "none":
            continue
        plain = base[(row["workload"], row["batch"])]
        method = row["method"] if row["method"] == "ngram" else f"{row['method']} ({r['draft_model']})"
        gains.append(
            Gain(
                f"speculative decoding, {method}, k={r['k']}",
                f"{row['workload']}, batch {row['batch']}",
                f"output tok/s (acceptance {row['acceptance_rate']:.0%})",
                plain["tok_s"],
                row["tok_s"],
                row["speedup"],
                record["command"],
            )
        )
    return gains


_BUILDERS: dict[str, Callable[[dict[str, Any]], list[Gain]]] = {
    "prefix": prefix_gains,
    "guided": guided_gains,
    "spec": spec_gains,
}


def gain_rows(records: dict[str, dict[str, Any]]) -> list[Gain]:
    """The table's rows from the kept records of FEATURES (by benchmark name), in that order."""
    missing = [name for name in FEATURES if name not in records]
    if missing:
        raise ValueError(f"records: no result for {', '.join(missing)}")
    return [gain for name in FEATURES for gain in _BUILDERS[name](records[name])]


def load_records(results_dir: str | os.PathLike = DEFAULT_RESULTS_DIR) -> dict[str, dict[str, Any]]:
    return {name: read_result(results_dir, name) for name in FEATURES}


_HEADERS = ("feature", "workload", "metric", "without", "with", "gain", "command")


def _cells(rows: list[Gain], code: bool) -> list[list[object]]:
    return [
        [g.feature, g.workload, g.metric, g.without, g.with_, f"{g.gain:.2f}x", f"`{g.command}`" if code else g.command]
        for g in rows
    ]


def _parts(result: dict[str, Any]) -> list[Part]:
    """The table: in the docs each row's command as code, after where the results come from."""
    rows, records = result["rows"], result["records"]
    dates = ", ".join(
        f"{name} {records[name]['machine'].get('date', 'undated')}"
        + (f" ({records[name]['source']})" if "source" in records[name] else "")
        for name in FEATURES
    )
    return [
        docs_only(
            "Built from the results each benchmark keeps under docs/bench/ (nothing re-run here); each row's "
            "command produced its numbers, on the machine its own section describes. Gain > 1 is better "
            "with the feature (for times: without / with; for rates: with / without). Guided decoding is a "
            "cost: its row sets the step against the same step less the mask fill and apply. Results "
            "from: " + dates + "."
        ),
        Line(text_table(_HEADERS, _cells(rows, code=False)), markdown_table(_HEADERS, _cells(rows, code=True))),
    ]


def format_text(result: dict[str, Any]) -> str:
    return text_report(_parts(result))


def format_markdown(result: dict[str, Any], command: str) -> str:
    """The docs section; no machine: each row's ran where its own section says."""
    return markdown_report(
        "Gains: prefix caching, guided decoding, speculative decoding", command, _parts(result), machine={}
    )


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_docs_args(
        parser,
        write_help="rewrite the gains section of the docs",
        path_help="the docs file; results are read from bench/ beside it (default: %(default)s)",
    )


def main(args: argparse.Namespace) -> dict[str, Any]:
    """`workbench bench gains`: the rows from the results kept in bench/ beside the docs, and those records."""
    records = load_records(Path(args.docs_path).parent / "bench")
    return {"rows": gain_rows(records), "records": records}
