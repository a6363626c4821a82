"""The gains table from kept benchmark results (fixture JSON; nothing runs a model), and the kept results."""

import json

import pytest

from workbench.bench import gains
from workbench.bench.report import DEFAULT_RESULTS_DIR, read_result, write_result

PREFIX = {
    "settings": {"num_requests": 4, "num_prefixes": 2, "prefix_len": 64, "suffix_len": 8, "output_len": 2},
    "on": {"ttft_mean_ms": 100.0, "total_tok_s": 300.0},
    "off": {"ttft_mean_ms": 250.0, "total_tok_s": 100.0},
}
GUIDED = {"rows": [{"batch": 8, "steps": 3, "fill_ms": 1.0, "apply_ms": 3.0, "forward_ms": 90.0, "step_ms": 100.0}]}
SPEC = {
    "k": 3,
    "draft_model": "tiny-llama",
    "rows": [
        {"workload": "editing", "batch": 1, "method": "none", "tok_s": 10.0, "speedup": 1.0},
        {"workload": "editing", "batch": 1, "method": "ngram", "tok_s": 15.0, "speedup": 1.5, "acceptance_rate": 0.5},
        {
            "workload": "editing",
            "batch": 1,
            "method": "draft_model",
            "tok_s": 8.0,
            "speedup": 0.8,
            "acceptance_rate": 1.0,
        },
    ],
}


@pytest.fixture
def results_dir(tmp_path):
    for name, result in (("prefix", PREFIX), ("guided", GUIDED), ("spec", SPEC)):
        write_result(tmp_path / "bench", name, result, f"workbench bench {name} --write-docs")
    return tmp_path / "bench"


def test_rows_set_each_feature_against_its_absence(results_dir) -> None:
    rows = gains.gain_rows(gains.load_records(results_dir))
    got = [
        (r.feature.split(",")[0].split(" (")[0], r.metric.split(" (")[0], r.without, r.with_, round(r.gain, 3))
        for r in rows
    ]
    assert got == [
        ("prefix caching", "TTFT mean ms", 250.0, 100.0, 2.5),  # a time: without / with
        ("prefix caching", "total tok/s", 100.0, 300.0, 3.0),  # a rate: with / without
        ("guided decoding", "step ms", 96.0, 100.0, 0.96),  # a cost: below 1
        ("speculative decoding", "output tok/s", 10.0, 15.0, 1.5),
        ("speculative decoding", "output tok/s", 10.0, 8.0, 0.8),
    ]
    assert rows[0].command == "workbench bench prefix --write-docs"
    assert "draft_model (tiny-llama), k=3" in rows[4].feature and "acceptance 100%" in rows[4].metric


def test_bench_gains_rewrites_the_gains_section_only(results_dir) -> None:
    from workbench.cli import build_parser, run_gains

    doc = results_dir.parent / "BENCHMARKS.md"  # results are read from bench/ beside the docs
    doc.write_text("# Benchmarks\n\n<!-- bench:prefix:start -->\nprefix body\n<!-- bench:prefix:end -->\n")
    lines = []
    args = build_parser().parse_args(["bench", "gains", "--write-docs", "--docs-path", str(doc)])
    run_gains(args, "workbench bench gains --write-docs", lines.append)
    text = doc.read_text()
    assert "prefix body" in text and "<!-- bench:gains:start -->" in text
    assert (
        "| prefix caching | 4 requests, 2 shared 64-token prefixes + 8-token suffixes, 2 output tokens | "
        "TTFT mean ms | 250.00 | 100.00 | 2.50x | `workbench bench prefix --write-docs` |" in text
    )
    assert "speculative decoding" in lines[0]


def test_a_missing_result_names_its_file(results_dir) -> None:
    (results_dir / "spec.json").unlink()
    with pytest.raises(FileNotFoundError, match="spec.json"):
        gains.load_records(results_dir)
    with pytest.raises(ValueError, match="records: no result for spec"):
        gains.gain_rows({"prefix": read_result(results_dir, "prefix"), "guided": read_result(results_dir, "guided")})


def test_kept_result_round_trips_with_command_and_machine(tmp_path) -> None:
    path = write_result(tmp_path, "x", {"stages": [("a", 1.5)]}, "workbench bench x")
    record = read_result(tmp_path, "x")
    assert record["command"] == "workbench bench x" and "cpu" in record["machine"]
    assert record["result"] == {"stages": [["a", 1.5]]} and json.loads(path.read_text()) == record


def test_the_committed_results_build_the_table() -> None:
    rows = gains.gain_rows(gains.load_records(DEFAULT_RESULTS_DIR))
    assert {r.feature.split(",")[0] for r in rows} == {
        "prefix caching",
        "guided decoding (JSON schema)",
        "speculative decoding",
    }
