"""`workbench bench prefill` at a tiny size: the engine's prefill of a prompt in one step and of a longer one under
each budget, against a stand-in llama-bench (test_llamacpp.py's) asked for the same workloads; bad flags name
themselves. No timed assertions."""

from __future__ import annotations

import json

import pytest

from tests.workbench.bench.test_llamacpp import SAMPLE, fake_llama_bench
from workbench.cli import main


def test_each_workload_runs_on_both_sides_and_llama_bench_gets_the_same_chunks(tmp_path, capsys):
    script, calls = fake_llama_bench(tmp_path)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    doc = tmp_path / "BENCHMARKS.md"
    status = main(
        [
            "bench",
            "prefill",
            "--model",
            "tiny-llama",
            "--weight-formats",
            "int8",
            "--prompt-len",
            "16",
            "--long-prompt-len",
            "48",
            "--budgets",
            "16",
            "48",
            "--runs",
            "2",
            "--llama-bench",
            str(script),
            "--llamacpp-gguf",
            f"int8={gguf}",
            "--write-docs",
            "--docs-path",
            str(doc),
        ]
    )
    assert status == 0 and "<!-- bench:prefill:start -->" in doc.read_text()
    result = json.loads((tmp_path / "bench" / "prefill.json").read_text())["result"]
    rows = result["rows"]
    assert [(r["system"], r["prompt_len"], r["budget"]) for r in rows] == [
        (system, n, b) for n, b in [(16, 16), (48, 16), (48, 48)] for system in ("engine", "llama.cpp (llama-bench)")
    ]
    assert all(len(r["runs"]) == 2 and r["tok_s"] > 0 for r in rows)
    made = [dict(zip(c[::2], c[1::2])) for c in map(json.loads, calls.read_text().splitlines())]
    # each round asks llama-bench for each workload, its batch and micro-batch the engine's budget
    assert [(c["-p"], c["-n"], c["-b"], c["-ub"]) for c in made] == 2 * [
        ("16", "0", "16", "16"),
        ("48", "0", "16", "16"),
        ("48", "0", "48", "48"),
    ]
    assert set(result["load_average"]) == {"before", "after"} and result["vector_units"]
    text = capsys.readouterr().out
    recorded = json.loads(SAMPLE.read_text())[0]["avg_ts"]
    assert "48 tokens in chunks of 16" in text and "16 tokens in one step" in text
    assert f"{rows[2]['tok_s'] / recorded:.2f}x" in text and f"(vector units: {result['vector_units']})" in text


def test_the_long_prompt_may_not_be_the_shorter(capsys):
    with pytest.raises(SystemExit, match="--long-prompt-len: must be >= --prompt-len"):
        main(["bench", "prefill", "--model", "tiny-llama", "--prompt-len", "64", "--long-prompt-len", "32"])
