"""Smoke test of `workbench bench spec` on the tiny model (no timed assertions)."""
from __future__ import annotations

from workbench.bench.spec import format_markdown, run_spec


def test_spec_bench_reports_every_configuration() -> None:
    result = run_spec(model="tiny-llama", k=3, batch_sizes=(1, 4), num_requests=4, output_len=12, runs=1,
                      log=lambda line: None)
    keys = {(r["workload"], r["batch"], r["method"]) for r in result["rows"]}
    assert keys == {(w, b, m) for w in ("editing", "chat") for b in (1, 4) for m in ("none", "ngram", "draft_model")}
    for r in result["rows"]:
        assert r["output_tokens"] > 0 and r["seconds"] > 0
        if r["method"] == "draft_model":  # the target drafting for itself: every greedy draft stands
            assert r["acceptance_rate"] == 1.0
        if r["method"] == "none":
            assert r["speedup"] == 1.0
    assert "## Speculative decoding" in format_markdown(result, "workbench bench spec")
