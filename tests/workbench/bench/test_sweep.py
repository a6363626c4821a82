"""The token-budget sweep: its workload (a long prompt among short ones), its per-point metrics, and a reduced
run on tiny-llama through the CLI. No timed assertions."""

import importlib.util

import pytest
from transformers import AutoTokenizer

from workbench.bench import sweep
from workbench.bench.serve import RequestResult
from workbench.cli import main


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


def test_long_prompt_arrives_in_the_middle_of_the_short_ones(tokenizer):
    short, short_arrivals, none = sweep.sweep_workload(tokenizer, 6, 10, 4, 50, 5.0, with_long=False, seed=3)
    reqs, arrivals, i = sweep.sweep_workload(tokenizer, 6, 10, 4, 50, 5.0, with_long=True, seed=3)
    assert none == -1 and i == 3 and len(reqs) == 7
    assert reqs[:3] + reqs[4:] == short and arrivals[:3] + arrivals[4:] == short_arrivals
    assert len(reqs[i].prompt_token_ids) == 50 and reqs[i].output_len == 4
    assert arrivals[i] == arrivals[i - 1] and arrivals == sorted(arrivals)


def test_point_metrics_separate_the_long_prompt_from_the_short_ones():
    results = [
        RequestResult(10, 3, 0.1, 0.3, [0.1, 0.1]),
        RequestResult(100, 3, 0.9, 1.2, [0.2, 0.1]),
        RequestResult(10, 3, 0.3, 0.5, [0.4, 0.1]),
    ]
    m = sweep.point_metrics(results, duration=3.0, long_index=1)
    assert m["ttft_mean_ms"] == pytest.approx(200.0) and m["long_ttft_ms"] == pytest.approx(900.0)
    assert m["itl_max_ms"] == pytest.approx(400.0) and m["itl_mean_ms"] == pytest.approx(1000 / 6)
    assert m["output_throughput"] == pytest.approx(3.0) and m["total_token_throughput"] == pytest.approx(129 / 3)
    assert sweep.point_metrics(results, 3.0, -1)["ttft_mean_ms"] == pytest.approx(1300 / 3)


def test_reduced_sweep_through_the_cli(tmp_path, capsys):
    doc = tmp_path / "BENCHMARKS.md"
    argv = [
        "bench",
        "sweep",
        "--model",
        "tiny-llama",
        "--num-kv-blocks",
        "256",
        "--budgets",
        "16",
        "128",
        "--num-requests",
        "4",
        "--input-len",
        "12",
        "--output-len",
        "4",
        "--long-prompt-len",
        "100",
        "--request-rate",
        "50",
        "--runs",
        "1",
        "--write-docs",
        "--docs-path",
        str(doc),
    ]
    assert main(argv) == 0
    table = [line for line in capsys.readouterr().out.splitlines() if line.lstrip()[:3] in ("16 ", "128")]
    assert len(table) == 4 and sum("with long prompt" in line for line in table) == 2
    text = doc.read_text()
    assert "<!-- bench:sweep:start -->" in text and "| 128 | with long prompt |" in text
    assert ("![token-budget sweep](img/sweep.png)" in text) == (importlib.util.find_spec("matplotlib") is not None)
    assert (tmp_path / "img" / "sweep.png").exists() == (importlib.util.find_spec("matplotlib") is not None)
