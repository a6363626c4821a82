"""`workbench bench pd`: its workload, its metrics and TTFT breakdown on hand-made records, and a reduced run on
tiny-llama through the CLI (one engine with and without chunking, and 1 prefill + 1 decode process). No timed
assertions."""

import json

import pytest
from transformers import AutoTokenizer

from engine.events import (
    KVTransferLoad,
    KVTransferSave,
    KVUsage,
    RequestAdded,
    RequestFinished,
    RequestTokens,
    StepRecord,
)
from workbench import cli
from workbench.bench import pd
from workbench.cli import main

S = 1_000_000_000  # ns per second


def _record(step: int, start_s: float, end_s: float, events: list, scheduled: dict | None = None) -> StepRecord:
    return StepRecord(
        step, int(start_s * S), int(end_s * S), scheduled or {}, {}, 0, 0, KVUsage(64, 0, 0, 64), {}, events
    )


def _transfer(cls, rid: str, ms: float, **extra):
    return cls(
        step=1,
        request_id=rid,
        instance="x",
        connector="c",
        key="k",
        num_blocks=1,
        num_tokens=16,
        num_bytes=1000,
        ms=ms,
        mb_per_s=1.0,
        **extra,
    )


def test_workload_puts_the_short_requests_first_and_spaces_the_long_ones(tiny_model_path):
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    w = pd.pd_workload(tok, 3, 10, 5, 2, 40, 2, 0.5, seed=1)
    assert [(a.at, a.long) for a in w] == [(0.0, False)] * 3 + [(0.5, True), (1.0, True)]
    assert [len(a.request.prompt_token_ids) for a in w] == [10, 10, 10, 40, 40]
    assert [a.request.output_len for a in w] == [5, 5, 5, 2, 2] and all(a.request.ignore_eos for a in w)
    assert pd.pd_workload(tok, 3, 10, 5, 2, 40, 2, 0.5, seed=1) == w != pd.pd_workload(tok, 3, 10, 5, 2, 40, 2, 0.5)
    with pytest.raises(ValueError, match="long_interval"):
        pd.pd_workload(tok, 1, 10, 5, 1, 40, 2, -1.0)


def test_setup_metrics_take_itl_from_the_short_requests_and_ttft_from_the_long():
    timelines = [
        pd.Timeline("a", False, 0.0, [0.05, 0.15, 0.35]),
        pd.Timeline("b", False, 0.0, [0.1, 0.3]),
        pd.Timeline("c", True, 1.0, [1.5]),
        pd.Timeline("d", True, 2.0, [2.25, 2.3]),
    ]
    m = pd.setup_metrics(timelines)
    assert m["itl_mean_ms"] == pytest.approx(500 / 3) and m["itl_median_ms"] == pytest.approx(200)
    assert m["itl_max_ms"] == pytest.approx(200) and m["itl_p90_ms"] == pytest.approx(200)
    assert m["long_ttft_mean_ms"] == pytest.approx(375) and m["long_ttft_max_ms"] == pytest.approx(500)


def test_ttft_breakdown_adds_up_and_puts_each_transfer_where_it_happened():
    rid = "pd-1"
    finished = RequestFinished(step=1, request_id=rid, reason="length", num_output_tokens=1)
    added = RequestAdded(
        step=8, request_id=rid, num_prompt_tokens=100, max_tokens=4, priority=0, arrival_ns=int(100.058 * S)
    )
    tokens = RequestTokens(step=8, request_id=rid, token_ids=(5,), text="x", text_offset=0, num_output_tokens=1)
    prefill = [_record(1, 100.010, 100.050, [_transfer(KVTransferSave, rid, 5.0), finished], {rid: 100})]
    first = _record(8, 100.060, 100.080, [added, _transfer(KVTransferLoad, rid, 3.0), tokens], {rid: 1})
    timeline = pd.Timeline(rid, True, 100.0, [100.080, 100.1])
    parts = pd.ttft_breakdown({"prefill-0": prefill, "decode-0": [_record(7, 100.04, 100.045, []), first]}, timeline)
    assert parts == pytest.approx(
        {"prefill": 45, "transfer": 8, "router to decode": 8, "decode queue": 2, "first decode step": 17, "ttft": 80},
        abs=1e-3,
    )
    # a load finished before the first scheduled step (an asynchronous one) is taken from the decode queue
    early = _record(8, 100.058, 100.059, [added, _transfer(KVTransferLoad, rid, 1.0)])
    later = _record(9, 100.060, 100.080, [tokens], {rid: 1})
    parts = pd.ttft_breakdown({"prefill-0": prefill, "decode-0": [early, later]}, timeline)
    assert parts["decode queue"] == pytest.approx(1, abs=1e-3) and parts["first decode step"] == pytest.approx(20)
    assert sum(parts[k] for k in pd.PARTS) == pytest.approx(parts["ttft"])


def test_reduced_pd_bench_through_the_cli(tmp_path, capsys):
    doc, out = tmp_path / "BENCHMARKS.md", tmp_path / "pd.json"
    argv = [
        "bench",
        "pd",
        "--model",
        "tiny-llama",
        "--num-kv-blocks",
        "128",
        "--runs",
        "1",
        "--num-short",
        "2",
        "--short-len",
        "16",
        "--output-len",
        "6",
        "--num-long",
        "2",
        "--long-len",
        "100",
        "--long-output-len",
        "2",
        "--long-interval",
        "0.05",
        "--chunk-budget",
        "32",
        "--max-num-batched-tokens",
        "256",
        "--json",
        str(out),
        "--write-docs",
        "--docs-path",
        str(doc),
    ]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert set(result["setups"]) == {"engine", "chunked", "pd", "pd_async"}
    for m in result["setups"].values():  # gaps between real step ends: positive, and ordered as statistics are
        assert 0 < m["itl_median_ms"] <= m["itl_p90_ms"] <= m["itl_p99_ms"] <= m["itl_max_ms"]
        assert 0 < m["long_ttft_mean_ms"] <= m["long_ttft_max_ms"]
    parts = result["breakdown"]
    assert all(parts[k] >= 0 for k in pd.PARTS) and parts["transfer"] > 0
    assert sum(parts[k] for k in pd.PARTS) == pytest.approx(parts["ttft"], rel=1e-6)
    rows = {r["instance"]: r for r in result["transfers"]}
    assert rows["prefill-0"]["saves"] == rows["decode-0"]["loads"] == 2 + 4  # warm-up, then the run
    assert [r["connector"] for r in result["connectors"]][0] == "shared_storage"
    assert all(r["save MB/s"] > 0 and r["load MB/s"] > 0 for r in result["connectors"])
    text = doc.read_text()
    assert "<!-- bench:pd:start -->" in text and "| 1 prefill + 1 decode process (shared_storage) |" in text
    assert "1 torch thread(s) each" in text and "`workbench bench pd --model tiny-llama" in text
    assert "**short requests' ITL p99: " in text
    assert "1 prefill + 1 decode process" in capsys.readouterr().out
    assert "pd" in cli.ALL_BENCHES
    argv[argv.index("--long-len") + 1] = "300"
    assert main(argv) == 2  # 300 + 2 tokens do not fit a 256-token step: refused before any model loads
