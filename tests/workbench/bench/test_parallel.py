"""Smoke test of `workbench bench parallel` through the CLI on tiny-llama (no timed assertions): TP 1, TP 2 and DP 2
run and give the same greedy tokens, TP 1 runs again at a TP 2 rank's threads where those differ (labelled), TP 3
(4 query heads) is reported as not run, and the bytes all-reduced per token are exactly the model's arithmetic."""

from __future__ import annotations

import json

import pytest

from workbench.cli import main


@pytest.mark.slow
def test_parallel_bench_through_the_cli(tmp_path, capsys) -> None:
    doc = tmp_path / "BENCHMARKS.md"
    assert (
        main(
            [
                "bench",
                "parallel",
                "--model",
                "tiny-llama",
                "--sizes",
                "1",
                "2",
                "3",
                "--runs",
                "1",
                "--data-parallel-sizes",
                "2",
                "--num-requests",
                "2",
                "--input-len",
                "8",
                "--output-len",
                "3",
                "--write-docs",
                "--docs-path",
                str(doc),
            ]
        )
        == 0
    )
    result = json.loads((tmp_path / "bench" / "parallel.json").read_text())["result"]  # kept beside the docs
    tp1, tp2, *fair, dp2 = result["rows"]
    assert [(r["tp"], r["dp"]) for r in (tp1, tp2, *fair, dp2)] == [(1, 1), (2, 1)] + [(1, 1)] * len(fair) + [(1, 2)]
    assert all(r["same_tokens"] and r["output_tok_s"] > 0 for r in result["rows"])
    # TP 1 on all threads, and again at a rank's threads when a rank has fewer: each row says which it is
    assert [r["threads_per_rank"] for r in fair] == (
        [tp2["threads_per_rank"]] if tp1["threads_per_rank"] != tp2["threads_per_rank"] else []
    )
    assert tp1["label"].startswith("TP 1, all") and all(r["label"].startswith("TP 1 at") for r in fair)
    rows = {(r["tp"], r["dp"]): r for r in (tp1, tp2, dp2)}
    assert rows[1, 2]["comm_ms"] == 0 and rows[1, 2]["all_reduce_bytes_per_token"] == 0  # replicas exchange nothing
    rows = {tp: rows[tp, 1] for tp in (1, 2)}
    assert "num_attention_heads (4)" in result["skipped"]["3"]
    # tiny-llama: 4 layers, hidden 64: the embedding's all-reduce and two per layer, fp32, on every token
    assert result["expected_all_reduce_bytes_per_token"] == (1 + 2 * 4) * 64 * 4
    assert rows[2]["all_reduce_bytes_per_token"] == result["expected_all_reduce_bytes_per_token"]
    assert rows[1]["all_reduce_bytes_per_token"] == 0 and rows[1]["comm_ms"] == 0 and rows[2]["comm_ms"] > 0
    assert rows[1]["threads_per_rank"] >= rows[2]["threads_per_rank"] >= 1
    text = doc.read_text()
    assert "<!-- bench:parallel:start -->" in text and "## Tensor parallelism" in text
    assert "cores cannot show what tensor parallelism is for" in text and "TP 3 not run" in text
    assert "tokens = first size" in capsys.readouterr().out
