"""`workbench tune`: SLO parsing, the search's budget and pruning, the Pareto front, the verdict when nothing meets
the SLOs, and a tiny run on tiny-llama whose printed command re-runs the winner. Behaviour only: no timing is
asserted (the fake measurements below stand for a machine whose latencies follow the knobs as described)."""

import shlex

import pytest

from workbench.bench import tune
from workbench.bench.tune_figures import CHROMIUM, FAILED, FEASIBLE, pareto_figure, sweep_figure
from workbench.cli import main

SPACE = {
    "max_num_batched_tokens": [64, 256, 1024],
    "max_num_seqs": [4, 16, 64],
    "long_prefill_token_threshold": [0],
    "enable_prefix_caching": [True],
    "num_speculative_tokens": [0],
    "block_size": [16],
}


def fake_measure(calls):
    """Latency rises with the budget and the sequences per step (ITL), TTFT falls with both; goodput rises."""

    def measure(config):
        calls.append(config)
        b, s = config["max_num_batched_tokens"], config["max_num_seqs"]
        return {
            "goodput": b / 64 + s / 4,
            "output_throughput": 1.0,
            "values": {"itl_p99": 10 * b / 64 + 5 * s, "ttft_p99": 4000 / b + 200 / s},
        }

    return measure


def test_slo_keys_are_parsed_and_bad_ones_refused_naming_the_key():
    assert tune.parse_slo(["ttft_p99:1000", "itl_median:50", "e2el_mean:9000", "tpot_p90.5:20"]) == {
        "ttft_p99": 1000.0,
        "itl_median": 50.0,
        "e2el_mean": 9000.0,
        "tpot_p90.5": 20.0,
    }
    for bad, named in (
        ("ttft_p999:5", "ttft_p999"),
        ("latency_p99:5", "latency_p99"),
        ("itl:5", "'itl'"),
        ("ttft_p99:fast", "ttft_p99"),
        ("ttft_p99:-1", "ttft_p99"),
        ("ttft_p99", "ttft_p99"),
    ):
        with pytest.raises(ValueError, match="--slo") as err:
            tune.parse_slo([bad])
        assert named in str(err.value)
    with pytest.raises(ValueError, match="given twice"):
        tune.parse_slo(["ttft_p99:1", "ttft_p99:2"])


def test_goodput_counts_the_per_request_slos_unless_given():
    slos = {"ttft_p99": 1000.0, "ttft_p90": 500.0, "itl_p99": 200.0, "e2el_mean": 9000.0}
    assert tune.goodput_bounds(slos, None) == {"ttft": 500.0, "e2el": 9000.0}  # ITL is per gap, not per request
    assert tune.goodput_bounds(slos, {"tpot": 50.0}) == {"tpot": 50.0}


def test_the_search_honours_its_run_budget():
    for budget in (1, 3, 5):
        calls = []
        result = tune.tune(SPACE, fake_measure(calls), {"itl_p99": 10_000}, budget, "itl_p99")
        assert len(calls) == len(result["points"]) == budget


def test_a_failed_itl_slo_prunes_larger_budgets_and_a_failed_ttft_slo_smaller_ones():
    calls = []
    result = tune.tune(SPACE, fake_measure(calls), {"itl_p99": 100}, 20, "itl_p99")
    measured = [tune.config_key(c) for c in calls]
    assert len(set(measured)) == len(measured)  # nothing measured twice
    for p in result["points"]:
        if "itl_p99" in p["failed"]:  # nothing with a larger budget or more sequences, the rest equal, was run
            c = p["config"]
            assert not any(
                o["max_num_batched_tokens"] > c["max_num_batched_tokens"] and o["max_num_seqs"] == c["max_num_seqs"]
                for o in calls
                if o is not c
            )
    assert result["pruned"] and all("itl_p99" in p["reason"] for p in result["pruned"])
    assert all(p["feasible"] for p in [result["best"]])
    rule = tune.prune_rules(
        {**tune.start_config(SPACE), "max_num_batched_tokens": 256}, {"ttft_p99": 900.0}, {"ttft_p99": 500.0}, SPACE
    )
    budget = next(r for r in rule if r.knob == "max_num_batched_tokens")
    others = tune.start_config(SPACE)
    assert budget.prunes({**others, "max_num_batched_tokens": 64})
    assert not budget.prunes({**others, "max_num_batched_tokens": 1024})


def test_the_pareto_front_is_non_dominated_and_holds_every_undominated_point():
    calls = []
    result = tune.tune(SPACE, fake_measure(calls), {"ttft_p99": 10_000}, 9, "ttft_p99")
    front, points = tune.pareto_front(result["points"], "ttft_p99"), result["points"]
    assert front
    for p in points:
        beaten = any(
            q["goodput"] >= p["goodput"]
            and q["values"]["ttft_p99"] <= p["values"]["ttft_p99"]
            and q is not p
            and (q["goodput"], q["values"]["ttft_p99"]) != (p["goodput"], p["values"]["ttft_p99"])
            for q in points
        )
        assert (p in front) == (not beaten)


def test_an_impossible_slo_names_the_closest_configuration():
    result = {"settings": {"slos": {"itl_p99": 1.0}}, "best": None}
    result["best"] = tune.tune(SPACE, fake_measure([]), {"itl_p99": 1.0}, 3, "itl_p99")["best"]
    text = tune.verdict(result)
    assert not result["best"]["feasible"]
    assert text.startswith("no configuration meets itl_p99 <= 1 ms; the closest") and "max_num_batched_tokens=" in text


def test_tiny_tune_through_the_cli_and_its_command_re_runs_the_winner(tmp_path, capsys):
    out_json, doc = tmp_path / "tune.json", tmp_path / "BENCHMARKS.md"
    workload = [
        "--model",
        "tiny-llama",
        "--num-kv-blocks",
        "256",
        "--num-prompts",
        "4",
        "--random-input-len",
        "16",
        "--random-output-len",
        "4",
        "--request-rate",
        "50",
        "--slo",
        "ttft_p99:60000",
        "itl_p99:60000",
    ]
    argv = [
        "tune",
        *workload,
        "--max-num-batched-tokens",
        "32",
        "128",
        "--max-num-seqs",
        "4",
        "16",
        "--max-runs",
        "3",
        "--output-json",
        str(out_json),
        "--write-docs",
        "--docs-path",
        str(doc),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    import json

    result = json.loads(out_json.read_text())
    assert len(result["points"]) <= 3 and result["best"]["feasible"]
    assert "<!-- bench:tune:start -->" in doc.read_text() and (tmp_path / "bench" / "tune.json").exists()
    # the PNG of the front and the sweep, where Chromium renders it (CI installs it)
    png = tmp_path / "img" / "tune.png"
    assert png.exists() == CHROMIUM.exists() == ("](img/tune.png)" in doc.read_text())
    assert not png.exists() or png.read_bytes().startswith(b"\x89PNG")
    command = result["command"]
    assert command in out and command.startswith("workbench tune ")
    # the printed command pins every knob to the winner's value and measures it again: it meets the SLOs again
    assert main(shlex.split(command)[1:] + ["--output-json", str(out_json)]) == 0
    again = json.loads(out_json.read_text())
    assert len(again["points"]) == 1 and again["best"]["config"] == result["best"]["config"]
    assert again["best"]["feasible"]


@pytest.mark.parametrize(
    "bad, named",
    [
        (["--slo", "ttft_p999:5"], "ttft_p999"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--block-size", "12"], "--block-size"),
        (["--enable-prefix-caching", "maybe"], "--enable-prefix-caching"),
    ],
)
def test_bad_flags_are_refused_naming_the_flag(bad, named, capsys):
    try:
        code = main(["tune", "--model", "tiny-llama", *bad])
    except SystemExit as exc:  # argparse refuses types before anything runs
        code = exc.code
    assert code == 2 and named in capsys.readouterr().err


def test_runs_left_after_the_one_knob_passes_go_to_configurations_that_change_several_knobs():
    space = {**SPACE, "max_num_batched_tokens": [64, 256], "max_num_seqs": [4, 16]}
    calls = []

    def measure(config):  # the start, (64, 4), is the best of all: no one-knob change beats it
        calls.append(config)
        return {
            "goodput": 10.0 if (config["max_num_batched_tokens"], config["max_num_seqs"]) == (64, 4) else 1.0,
            "output_throughput": 1.0,
            "values": {"ttft_p99": 1.0},
        }

    result = tune.tune(space, measure, {"ttft_p99": 100.0}, 4, "ttft_p99")
    assert [(c["max_num_batched_tokens"], c["max_num_seqs"]) for c in calls] == [(64, 4), (256, 4), (64, 16), (256, 16)]
    assert result["untried"] == 0 and result["best"]["config"]["max_num_batched_tokens"] == 64


# Llama-3.1-70B on 8 simulated H100s: 1024-token prompts, so a 2048-token budget takes a whole prompt in a step that
# stalls every decode beside it (ITL ~40 simulated ms) and a 256-token budget chunks it (ITL ~15 ms, TTFT later)
SIMULATED_70B = [
    "--model",
    "llama-3.1-70b",
    "--executor",
    "simulated",
    "--hardware",
    "h100-sxm",
    "--tensor-parallel-size",
    "8",
    "--num-prompts",
    "16",
    "--random-input-len",
    "1024",
    "--random-output-len",
    "32",
    "--request-rate",
    "8",
    "--slo",
    "ttft_p99:250",
    "itl_p99:30",
]


def test_a_simulated_70b_tune_is_deterministic_and_its_winner_meets_the_slo_again(tmp_path, capsys):
    import json

    out_json = tmp_path / "tune.json"
    argv = [
        "tune",
        *SIMULATED_70B,
        "--max-num-batched-tokens",
        "256",
        "2048",
        "--max-num-seqs",
        "8",
        "64",
        "--max-runs",
        "3",
        "--output-json",
        str(out_json),
    ]
    assert main(argv) == 0
    first = capsys.readouterr().out
    result = json.loads(out_json.read_text())
    assert 1 <= len(result["points"]) <= 3 and len(result["points"]) + len(result["pruned"]) + result["untried"] == 4
    best = result["best"]
    assert best["feasible"] and best["config"]["max_num_batched_tokens"] == 256
    assert "simulated time" in first and "h100-sxm" in first
    for flag in ("--executor simulated", "--hardware h100-sxm", "--tensor-parallel-size 8"):
        assert flag in result["command"] and flag in first
    assert result["serve_command"].startswith("vllm serve meta-llama/Llama-3.1-70B ")
    assert "--tensor-parallel-size 8" in result["serve_command"]
    # the simulated clock makes a tune a function of its flags: the same command prints the same table, digit for digit
    assert main(argv) == 0
    assert capsys.readouterr().out == first
    # the reproducing command measures the winner again on the simulated clock: the same numbers, exactly (ITL gaps
    # are subtracted in integer ns, so the wall time each engine was made at cancels out)
    assert main(shlex.split(result["command"])[1:] + ["--output-json", str(out_json)]) == 0
    again = json.loads(out_json.read_text())
    assert len(again["points"]) == 1 and again["best"]["config"] == best["config"] and again["best"]["feasible"]
    assert again["best"]["values"] == best["values"]


def test_the_figures_show_every_run_the_front_the_winner_and_the_bound():
    slos = {"itl_p99": 100.0}
    search = tune.tune(SPACE, fake_measure([]), slos, 6, "itl_p99")
    result = {
        **search,
        "front": tune.pareto_front(search["points"], "itl_p99"),
        "settings": {"primary": "itl_p99", "slos": slos, "engine_kwargs": {}},
    }
    points, best = result["points"], result["best"]
    assert any(p["feasible"] for p in points) and not all(p["feasible"] for p in points)
    fig = pareto_figure(result)
    shown = {}
    for name, feasible in (("feasible", True), ("failed", False)):
        data = fig.select_one({"name": name}).data_source.data
        shown.update(zip(data["run"], zip(data["latency"], data["goodput"], data["color"])))
        assert all(p["feasible"] == feasible for p in points if p["run"] in data["run"])
    assert shown == {
        p["run"]: (p["values"]["itl_p99"], p["goodput"], FEASIBLE if p["feasible"] else FAILED) for p in points
    }
    front = fig.select_one({"name": "front"}).data_source.data
    assert (front["x"], front["y"]) == (
        [p["values"]["itl_p99"] for p in result["front"]],
        [p["goodput"] for p in result["front"]],
    )
    star = fig.select_one({"name": "winner"}).data_source.data
    assert (star["x"], star["y"]) == ([best["values"]["itl_p99"]], [best["goodput"]]) and best["feasible"]
    assert [span.location for span in fig.center if type(span).__name__ == "Span"] == [100.0]
    bars = sweep_figure(result).select_one({"name": "runs"}).data_source.data
    assert bars["label"] == [str(p["run"]) for p in points] == list(map(str, range(1, len(points) + 1)))
    assert bars["latency"] == [p["values"]["itl_p99"] for p in points]
