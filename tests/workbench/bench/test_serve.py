"""`workbench bench serve` and its datasets: arrivals, SLO goodput, vLLM's metric keys, on tiny-llama. No timed
assertions: only counts, orderings and identities that hold however fast the machine is."""

import json
from collections import Counter

import numpy as np
import pytest
from transformers import AutoTokenizer

from workbench.bench import serve
from workbench.bench.datasets import (
    editing_requests,
    json_schema_requests,
    len_range,
    prefix_repetition_requests,
    random_dataset,
    sample_dataset,
)
from workbench.bench.serve import RequestResult, compute_metrics, parse_goodput, request_arrivals
from workbench.cli import main

TOKENS = (17, 49152)
TINY = {"model": "tiny-llama", "engine_kwargs": {"num_kv_blocks": 256}, "progress": False}
VLLM_KEYS = [
    "duration",
    "completed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    *(f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "std", "p90", "p99")),
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


# ---- arrivals -------------------------------------------------------------------------------------------------
def _gaps(arrivals):
    return np.diff(arrivals)


def test_poisson_arrivals_are_seeded_with_mean_gap_one_over_rate():
    a = request_arrivals(4000, 4.0, seed=0)
    assert a[0] == 0.0 and a == request_arrivals(4000, 4.0, seed=0) and a != request_arrivals(4000, 4.0, seed=1)
    gaps = _gaps(a)
    assert (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.25, rel=0.08)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.1)  # exponential gaps: CV 1


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_keeps_the_rate_and_sets_the_spread(burstiness):
    gaps = _gaps(request_arrivals(4000, 2.0, burstiness, seed=0))
    assert gaps.mean() == pytest.approx(0.5, rel=0.1)
    # Gamma(shape k): coefficient of variation 1 / sqrt(k): burstier below 1, more regular above
    assert gaps.std() / gaps.mean() == pytest.approx(burstiness**-0.5, rel=0.15)


def test_infinite_rate_sends_everything_at_once_and_bad_rates_are_refused():
    assert request_arrivals(5, float("inf")) == [0.0] * 5
    with pytest.raises(ValueError, match="request_rate"):
        request_arrivals(5, 0.0)
    with pytest.raises(ValueError, match="burstiness"):
        request_arrivals(5, 1.0, burstiness=-1)


# ---- goodput and metrics --------------------------------------------------------------------------------------
def test_parse_goodput_reads_vllm_slos_and_names_bad_ones():
    assert parse_goodput(["ttft:200", "tpot:50.5", "e2el:1000"]) == {"ttft": 200.0, "tpot": 50.5, "e2el": 1000.0}
    for bad in ("itl:5", "ttft", "ttft:fast", "e2el:-1"):
        with pytest.raises(ValueError, match="goodput"):
            parse_goodput([bad])


def _result(ttft_ms, e2el_ms, output_len, success=True):
    return RequestResult(10, output_len, ttft_ms / 1e3, e2el_ms / 1e3, [], success)


def test_goodput_counts_exactly_the_requests_inside_every_slo():
    results = [
        _result(100, 1000, 10),  # tpot 100: good
        _result(100, 1090, 10),  # tpot 110: misses tpot
        _result(250, 1150, 10),  # ttft 250: misses ttft
        _result(200, 200, 1),  # on the ttft bound, single token (tpot 0): good
        _result(50, 500, 10, success=False),  # failed: never good
    ]
    metrics = compute_metrics(results, duration=2.0, slos={"ttft": 200, "tpot": 100})
    assert metrics["request_goodput"] == pytest.approx(2 / 2.0)
    assert metrics["completed"] == 4 and metrics["failed"] == 1
    assert compute_metrics(results, 2.0, {"e2el": 1100})["request_goodput"] == pytest.approx(3 / 2.0)
    assert "request_goodput" not in compute_metrics(results, 2.0)


def test_metrics_follow_vllm_definitions():
    results = [RequestResult(5, 3, 0.1, 0.5, [0.3, 0.1]), RequestResult(7, 1, 0.2, 0.2, [])]
    m = compute_metrics(results, duration=2.0)
    assert m["total_input_tokens"] == 12 and m["total_output_tokens"] == 4
    assert m["output_throughput"] == pytest.approx(2.0) and m["total_token_throughput"] == pytest.approx(8.0)
    assert m["mean_ttft_ms"] == pytest.approx(150.0) and m["mean_e2el_ms"] == pytest.approx(350.0)
    assert m["mean_tpot_ms"] == pytest.approx(200.0)  # (500 - 100) / 2; the 1-token request has no TPOT
    assert m["mean_itl_ms"] == pytest.approx(200.0) and m["p99_itl_ms"] == pytest.approx(298.0)


# ---- datasets -------------------------------------------------------------------------------------------------
def test_random_dataset_spreads_lengths_by_the_range_ratio():
    assert len_range(100, 0.0) == (100, 100) and len_range(100, 0.25) == (75, 125)
    reqs = random_dataset(50, 100, 20, 0.25, TOKENS, seed=1)
    assert reqs == random_dataset(50, 100, 20, 0.25, TOKENS, seed=1)
    assert all(75 <= len(r.prompt_token_ids) <= 125 and 15 <= r.output_len <= 25 and r.ignore_eos for r in reqs)
    assert len({len(r.prompt_token_ids) for r in reqs}) > 1
    with pytest.raises(ValueError, match="range_ratio"):
        random_dataset(1, 10, 10, 1.0, TOKENS)


def test_prefix_repetition_shares_prefixes_evenly_and_shuffles():
    reqs = prefix_repetition_requests(10, 8, 4, 3, 5, TOKENS, seed=2)
    assert reqs == prefix_repetition_requests(10, 8, 4, 3, 5, TOKENS, seed=2)
    assert len(reqs) == 10 and all(len(r.prompt_token_ids) == 12 and r.output_len == 5 for r in reqs)
    assert sorted(Counter(tuple(r.prompt_token_ids[:8]) for r in reqs).values()) == [3, 3, 4]
    assert len({tuple(r.prompt_token_ids[8:]) for r in reqs}) == 10
    with pytest.raises(ValueError, match="num_prefixes"):
        prefix_repetition_requests(2, 8, 4, 3, 5, TOKENS)


def test_json_schema_requests_carry_schemas_that_repeat(tokenizer):
    reqs = json_schema_requests(20, tokenizer, output_len=40, num_schemas=3, seed=0)
    assert reqs == json_schema_requests(20, tokenizer, output_len=40, num_schemas=3, seed=0)
    schemas = {json.dumps(r.json_schema) for r in reqs}
    assert 1 < len(schemas) <= 3 and all(not r.ignore_eos and r.output_len == 40 for r in reqs)
    for r in reqs:
        required = r.json_schema["required"]
        assert set(required) == set(r.json_schema["properties"]) and len(required) >= 2
        assert json.dumps(r.json_schema) in tokenizer.decode(r.prompt_token_ids)


def test_editing_prompts_ask_to_repeat_their_passage(tokenizer):
    reqs = editing_requests(4, tokenizer, seed=5)
    assert reqs == editing_requests(4, tokenizer, seed=5) and reqs != editing_requests(4, tokenizer, seed=6)
    for r in reqs:
        text = tokenizer.decode(r.prompt_token_ids)
        code = text.split("```python\n")[1].split("```")[0]
        assert code.count("def ") >= 2 and "renaming" in text and not r.ignore_eos
        assert r.output_len > len(tokenizer.encode(code, add_special_tokens=False))


def test_unknown_dataset_or_argument_is_named(tokenizer):
    with pytest.raises(ValueError, match="dataset"):
        sample_dataset("sharegpt", tokenizer, 2)
    with pytest.raises(ValueError, match="unknown argument input_len"):
        sample_dataset("editing", tokenizer, 2, input_len=5)


# ---- serving on tiny-llama ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve") / "result.json"
    result = serve.run_serve(
        num_requests=6,
        dataset_args={"input_len": 24, "output_len": 5, "range_ratio": 0.5},
        request_rate=40.0,
        goodput={"ttft": 60_000},
        baseline=True,
        hf_batch_size=4,
        cb_baseline=True,
        result_file=str(path),
        log=lambda _: None,
        **TINY,
    )
    return result, json.loads(path.read_text())


def test_serve_reports_every_vllm_key_with_ordered_percentiles(served):
    result, _ = served
    for side in ("engine", "baseline", "baseline_cb"):
        m = result[side]
        assert set(VLLM_KEYS) <= set(m)
        assert m["completed"] == 6 and m["failed"] == 0
        for metric in ("ttft", "tpot", "itl", "e2el"):
            assert 0 <= m[f"median_{metric}_ms"] <= m[f"p90_{metric}_ms"] <= m[f"p99_{metric}_ms"]
        assert m["request_goodput"] == pytest.approx(m["request_throughput"])  # a one-minute TTFT SLO: all good
    assert (
        result["engine"]["total_output_tokens"]
        == result["baseline"]["total_output_tokens"]
        == result["baseline_cb"]["total_output_tokens"]
    )
    assert set(result["ratio"]) == set(result["ratio_cb"]) == {"output_throughput", "mean_ttft_ms", "mean_e2el_ms"}
    assert "engine / transformers generate_batch: output throughput" in serve.format_text(result)


def test_result_file_has_vllm_layout_and_one_gap_per_token_after_the_first(served):
    _, data = served
    assert set(VLLM_KEYS) <= set(data) and data["num_prompts"] == 6 and data["backend"] == "workbench"
    for per_request in (data, data["baseline"], data["baseline_cb"]):
        assert len(per_request["ttfts"]) == 6
        # no speculation: every step gives a request one token
        assert [len(gaps) for gaps in per_request["itls"]] == [n - 1 for n in per_request["output_lens"]]
    assert data["total_output_tokens"] == sum(data["output_lens"])


def test_max_concurrency_caps_the_requests_in_the_engine():
    from engine import LLM
    from workbench.bench.datasets import random_requests

    llm = LLM(model="tiny-llama", num_kv_blocks=256)
    in_engine = []
    llm.engine.subscribe(lambda record: in_engine.append(record.num_running + record.num_waiting))
    reqs = random_requests(5, (8, 16), (3, 6), TOKENS, seed=0)
    results, _ = serve.run_serve_once(llm, reqs, [0.0] * 5, max_concurrency=2, progress=False)
    assert max(in_engine) == 2 and all(r.success for r in results)
    assert [r.output_len for r in results] == [r.output_len for r in reqs]


def test_the_step_mix_tells_steps_with_prompt_tokens_from_decodes_alone():
    """Two slots: the first two prompts prefill together; the third waits for the short request to finish, then
    prefills beside the long one's decode. Counted from the step records, exactly."""
    from engine import LLM
    from workbench.bench.datasets import BenchRequest

    llm = LLM(model="tiny-llama", num_kv_blocks=256, max_num_seqs=2)
    reqs = [BenchRequest(list(range(10, 18)), 2), BenchRequest(list(range(20, 28)), 6), BenchRequest([5] * 8, 3)]
    times = serve.TokenTimes()
    results, _ = serve.run_serve_once(llm, reqs, [0.0] * 3, progress=False, recorder=times)
    assert all(r.success for r in results)
    mix = times.step_mix()
    # step 1: prompts 0 and 1 (16 tokens); 2: decodes 0, 1 (0 done); 3: prompt 2 beside decode 1; 4-5: decodes
    # 1 and 2; 6: decode 1 (2 finished with its third token at step 5)
    assert [(m.prompt_tokens, m.decodes) for m in times.steps.values()] == [
        (16, 0),
        (0, 2),
        (8, 1),
        (0, 2),
        (0, 2),
        (0, 1),
    ]
    assert mix["with_prompt"]["steps"] == 2 and mix["with_prompt"]["prompt_tokens_median"] == 12
    assert mix["decode_only"]["steps"] == 4 and mix["decode_only"]["decodes_median"] == 2
    # gaps: request 0 one (ends on step 2), 1 five (one on step 3), 2 two (steps 4, 5): 1 of 8 on a prompt step
    assert 0 < mix["gap_share_with_prompt"] < 0.5
    assert "2 with prompt tokens" in serve.step_mix_line(mix)


def test_guided_requests_are_served_by_both_sides():
    result = serve.run_serve(
        dataset="json_schema",
        num_requests=3,
        dataset_args={"output_len": 12},
        baseline=True,
        log=lambda _: None,
        **TINY,
    )
    for side in ("engine", "baseline"):
        assert result[side]["completed"] == 3 and 3 <= result[side]["total_output_tokens"] <= 36


def test_the_baseline_decodes_json_schemas_as_the_engine_does(tokenizer, tiny_model_path):
    from engine import LLM, SamplingParams, StructuredOutputsParams
    from workbench.bench.throughput import HFBaseline

    reqs = json_schema_requests(3, tokenizer, output_len=16, num_schemas=2, seed=1)
    llm = LLM(model="tiny-llama", num_kv_blocks=64)
    hf = HFBaseline(tiny_model_path, batch_size=1)
    grammars = serve.HFGrammars(tiny_model_path, hf.model.config.vocab_size)
    for r in reqs:
        params = SamplingParams(
            temperature=0.0, max_tokens=16, structured_outputs=StructuredOutputsParams(json=r.json_schema)
        )
        (want,) = llm.generate([r.prompt_token_ids], params, use_tqdm=False)
        steps = serve._hf_generate(hf, [r], grammars)
        assert [t[0] for t in steps.tokens][: len(want.token_ids)] == want.token_ids
    with pytest.raises(ValueError, match="grammars"):
        serve.run_hf_serve_once(hf, reqs, [0.0] * 3, tokenizer.eos_token_id)


def test_serve_cli_returns_0_and_writes_its_section(tmp_path, capsys):
    doc = tmp_path / "BENCHMARKS.md"
    argv = [
        "bench",
        "serve",
        "--model",
        "tiny-llama",
        "--num-kv-blocks",
        "256",
        "--num-prompts",
        "3",
        "--dataset-name",
        "prefix_repetition",
        "--prefix-repetition-prefix-len",
        "16",
        "--prefix-repetition-suffix-len",
        "4",
        "--prefix-repetition-num-prefixes",
        "2",
        "--prefix-repetition-output-len",
        "3",
        "--request-rate",
        "50",
        "--burstiness",
        "0.5",
        "--max-concurrency",
        "2",
        "--write-docs",
        "--docs-path",
        str(doc),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "TTFT p99 ms" in out and "prefix_repetition dataset" in out
    assert "<!-- bench:serve:start -->" in doc.read_text()
    assert main(["bench", "serve", "--model", "tiny-llama", "--goodput", "ttft=5"]) == 2


def test_bench_all_runs_each_benchmark_as_its_own_command(tmp_path, monkeypatch):
    from workbench import cli

    doc = tmp_path / "BENCHMARKS.md"
    monkeypatch.setattr(
        cli,
        "ALL_BENCHES",
        {
            "guided": ["--batch-sizes", "1", "--steps", "1", "--output-len", "8"],
            "roofline": [
                "--batch-sizes",
                "1",
                "--steps",
                "1",
                "--runs",
                "1",
                "--prompt-len",
                "8",
                "--bandwidth-mib",
                "4",
                "--matmul-n",
                "64",
            ],
        },
    )
    argv = ["bench", "all", "--model", "tiny-llama", "--num-kv-blocks", "256", "--write-docs", "--docs-path", str(doc)]
    assert main(argv) == 0
    text = doc.read_text()
    assert "<!-- bench:guided:start -->" in text and "<!-- bench:roofline:start -->" in text
    assert "`workbench bench roofline --batch-sizes 1 --steps 1" in text and "--model tiny-llama" in text
    assert (tmp_path / "bench" / "guided.json").exists() and "bench:gains" not in text  # prefix, spec not run


def test_chaos_cuts_and_malformed_requests_are_refused_or_cut_and_nothing_is_lost(capsys):
    """`--chaos-disconnect` / `--chaos-malformed` on the engine served in-process: a smoke run whose table says
    what was refused and what was lost (nothing), the server empty after."""
    argv = [
        "bench",
        "serve",
        "--model",
        "tiny-llama",
        "--num-kv-blocks",
        "256",
        "--num-prompts",
        "6",
        "--random-input-len",
        "12",
        "--random-output-len",
        "12",
        "--chaos-disconnect",
        "0.34",
        "--chaos-malformed",
        "0.5",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "cut mid-stream by the client" in out and "lost (no [DONE]" in out
    result = serve.run_serve(
        num_requests=6,
        dataset_args={"input_len": 12, "output_len": 12},
        chaos_disconnect=0.34,
        chaos_malformed=0.5,
        log=lambda _: None,
        **TINY,
    )
    http = result["http"]
    assert sum(http["requests"].values()) == 6 and set(http["requests"]) <= {"done", "cut"}
    assert http["requests"].get("cut", 0) <= 2 and result["engine"]["completed"] == http["requests"]["done"]
    assert sum(http["malformed"].values()) == 3 and all(status.startswith("4") for status in http["malformed"])
    assert http["lost"] == 0 and http["health_failed"] == 0 and http["health_ok"] >= 1
    assert http["left"] == {"running": 0, "waiting": 0, "kv_cache_usage_perc": 0}
    with pytest.raises(ValueError, match="chaos_disconnect"):
        serve.run_serve(num_requests=2, chaos_disconnect=1.5, log=lambda _: None, **TINY)
