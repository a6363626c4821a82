"""Smoke tests of the benchmarks and the `workbench` CLI on the tiny model: they run, report what they should,
and write only their own docs section. Never timed assertions."""

import pytest

from workbench.bench.datasets import random_requests, shared_prefix_requests
from workbench.bench.report import write_section
from workbench.cli import main

TINY = {"model": "tiny-llama", "engine_kwargs": {"num_kv_blocks": 256}}  # a small cache builds in no time
TOKENS = (17, 49152)


def test_random_requests_are_deterministic_and_in_range():
    a = random_requests(6, (4, 20), (2, 9), TOKENS, seed=3)
    assert a == random_requests(6, (4, 20), (2, 9), TOKENS, seed=3)
    assert a != random_requests(6, (4, 20), (2, 9), TOKENS, seed=4)
    assert all(4 <= len(r.prompt_token_ids) <= 20 and 2 <= r.output_len <= 9 for r in a)
    assert all(TOKENS[0] <= t < TOKENS[1] for r in a for t in r.prompt_token_ids)
    with pytest.raises(ValueError, match="input_len_range"):
        random_requests(1, (5, 4), (1, 1), TOKENS)


def test_shared_prefix_requests_share_their_prefix_round_robin():
    reqs = shared_prefix_requests(2, 8, 3, 5, 4, TOKENS, seed=0)
    assert reqs == shared_prefix_requests(2, 8, 3, 5, 4, TOKENS, seed=0)
    assert [len(r.prompt_token_ids) for r in reqs] == [11] * 5 and {r.output_len for r in reqs} == {4}
    prefix = [r.prompt_token_ids[:8] for r in reqs]
    assert prefix[0] == prefix[2] == prefix[4] and prefix[1] == prefix[3] and prefix[0] != prefix[1]
    assert reqs[0].prompt_token_ids[8:] != reqs[2].prompt_token_ids[8:]


def test_write_section_rewrites_only_its_own_section(tmp_path):
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("# Benchmarks\n\nheader text\n")
    write_section(doc, "throughput", "first")
    write_section(doc, "prefix", "prefix body")
    write_section(doc, "throughput", "second")
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nheader text\n")
    assert "second" in text and "first" not in text and "prefix body" in text
    assert text.index("bench:throughput:start") < text.index("bench:prefix:start")
    assert text.count("<!-- bench:throughput:start -->") == 1


def test_throughput_cli_prints_the_ratio_and_writes_docs(tmp_path, capsys):
    doc = tmp_path / "BENCHMARKS.md"
    argv = [
        "bench",
        "throughput",
        "--model",
        "tiny-llama",
        "--num-requests",
        "4",
        "--runs",
        "1",
        "--input-len-range",
        "8",
        "24",
        "--output-len-range",
        "2",
        "6",
        "--num-kv-blocks",
        "256",
        "--write-docs",
        "--docs-path",
        str(doc),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "ratio engine / transformers (output tok/s):" in out
    assert "transformers generate" in out
    text = doc.read_text()
    assert "<!-- bench:throughput:start -->" in text and "workbench bench throughput --model tiny-llama" in text


def test_cli_reports_bad_settings_without_a_traceback(capsys):
    argv = ["bench", "throughput", "--model", "no-such-model", "--runs", "1", "--no-baseline"]
    assert main(argv) == 2
    assert "model" in capsys.readouterr().err


def test_throughput_result_has_the_expected_keys():
    from workbench.bench.throughput import run_throughput

    result = run_throughput(
        num_requests=3,
        input_len_range=(8, 16),
        output_len_range=(2, 5),
        runs=1,
        baseline=False,
        cb_baseline=False,
        log=lambda _: None,
        **TINY,
    )
    assert set(result) == {
        "model",
        "settings",
        "num_prompt_tokens",
        "num_output_tokens",
        "engine",
        "baseline",
        "ratio",
        "baseline_cb",
        "ratio_cb",
        "floor",
        "load_average",
    }
    assert set(result["engine"]) == {"elapsed_s", "output_tok_s", "total_tok_s", "runs_s"}
    assert result["baseline"] is None and result["ratio"] is None
    assert result["baseline_cb"] is None and result["ratio_cb"] is None
    assert 6 <= result["num_output_tokens"] <= 15 and result["engine"]["output_tok_s"] > 0
    # the floor is a lower bound on time: no side can be faster than it
    assert 0 < result["floor"]["elapsed_s"] and len(result["load_average"]["before"]) == 3


def test_transformers_continuous_batching_baseline_generates_what_was_asked(tiny_model_path):
    """generate_batch's machinery, kept running: all at once, then at arrival times; every request gets exactly its
    output length (EOS ignored), its token times are after its arrival and in order."""
    from workbench.bench.hf_continuous import HFContinuousBaseline

    requests = random_requests(4, (8, 24), (2, 6), TOKENS, seed=1)
    with HFContinuousBaseline(tiny_model_path, requests, max_batch_tokens=64) as cb:
        assert cb.run(requests) > 0
        timelines, duration = cb.serve(requests, [0.0, 0.0, 0.05, 0.1])
    assert [t.output_len for t in timelines] == [r.output_len for r in requests]
    assert all(t.times[0] > 0 and t.times == sorted(t.times) for t in timelines)
    assert duration >= max(t.times[-1] for t in timelines)


def test_prefix_bench_hits_with_caching_on_only():
    from workbench.bench.prefix import run_prefix

    result = run_prefix(
        num_prefixes=2, prefix_len=32, suffix_len=8, num_requests=6, output_len=2, runs=1, log=lambda _: None, **TINY
    )
    on, off = result["on"], result["off"]
    assert on["hit_rate"] > 0 and on["num_cached_tokens"] > 0
    assert off["hit_rate"] == 0 and off["num_cached_tokens"] == 0
    # 4 of the 6 requests reuse a 32-token prefix (two full blocks of 16)
    assert on["num_cached_tokens"] == 4 * 32
    assert on["ttft_p90_ms"] >= on["ttft_median_ms"] > 0


def test_profile_splits_the_step_and_names_the_largest_overhead():
    from workbench.bench.profile import MODEL_ROWS, run_profile

    result = run_profile(num_requests=4, prompt_len=16, steps=1, warmup=0, top_ops=3, log=lambda _: None, **TINY)
    assert sum(ms for _, ms in result["stages"]) == pytest.approx(result["profiled_step_ms"])
    assert result["largest_non_model"] not in MODEL_ROWS
    assert result["events_per_step"] >= 4  # one request.scheduled per request, at least
    assert 0 < result["events_ms_replayed"] and 0 < result["events_share_profiled"] < 1
    assert len(result["torch_ops"]) == 3
