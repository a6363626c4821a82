"""`workbench run` on tiny-llama records a trace of exactly the steps it ran, with the settings it was given;
`workbench export` turns that trace into a well-formed Chrome trace."""

import contextlib
import io
import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.workbench.test_perfetto import check_chrome_trace
from workbench.cli import main
from workbench.trace import read_trace

PROMPTS = ["Hello there", "The capital of France is", "", "Once upon a time, in a land far away, there lived a"]
RUN_FLAGS = [
    "--model",
    "tiny-llama",
    "--block-size",
    "8",
    "--num-kv-blocks",
    "64",
    "--max-num-batched-tokens",
    "16",
    "--no-prefix-caching",
    "--scheduling-policy",
    "priority",
    "--max-num-seqs",
    "2",
    "--max-tokens",
    "5",
    "--ignore-eos",
    "--temperature",
    "0.8",
    "--top-k",
    "50",
    "--seed",
    "1",
]


@dataclass
class Run:
    status: int
    stdout: str
    steps_run: int  # counted by wrapping LLMEngine.step, independently of the trace
    trace_path: Path
    folder: Path


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    from engine.llm_engine import LLMEngine

    folder = tmp_path_factory.mktemp("cli_run")
    (folder / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    trace_path = folder / "run.jsonl"
    steps = []
    original_step = LLMEngine.step

    def counting_step(self):
        steps.append(1)
        return original_step(self)

    stdout = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(stdout):
        mp.setattr(LLMEngine, "step", counting_step)
        status = main(["run", "--prompts", str(folder / "prompts.txt"), "--trace", str(trace_path), *RUN_FLAGS])
    return Run(status, stdout.getvalue(), len(steps), trace_path, folder)


def test_run_writes_a_trace_of_every_step_it_ran(run):
    assert run.status == 0
    records = read_trace(run.trace_path).records
    summary = run.stdout.splitlines()[-1]
    assert f"3 requests, {run.steps_run} steps" in summary and str(run.trace_path) in summary
    assert len(records) == run.steps_run > 0
    assert [r.step for r in records] == list(range(1, run.steps_run + 1))
    last = records[-1]
    assert last.num_waiting == last.num_running == 0 and last.kv.used == 0
    # --max-num-seqs 2: the third prompt waits for a slot, so it cannot all happen in parallel
    assert max(r.num_running for r in records) == 2


def test_run_passes_engine_and_sampling_flags(run):
    trace = read_trace(run.trace_path)
    config = trace.header["config"]
    assert trace.header["model"]["name"] == config["model"] == "tiny-llama"
    assert (config["block_size"], config["num_kv_blocks"], config["max_num_batched_tokens"]) == (8, 64, 16)
    assert config["enable_prefix_caching"] is False and config["scheduling_policy"] == "priority"
    assert max(sum(r.scheduled.values()) for r in trace.records) <= 16
    added = [e for r in trace.records for e in r.of_kind("request.added")]
    assert [e.prompt for e in added] == [p for p in PROMPTS if p]  # the blank line is not a prompt
    assert {e.max_tokens for e in added} == {5}
    finished = [e for r in trace.records for e in r.of_kind("request.finished")]
    assert sorted((e.reason, e.num_output_tokens) for e in finished) == [("length", 5)] * 3  # --ignore-eos


def test_run_prints_each_output_as_the_trace_spells_it(run):
    texts: dict[str, str] = {}
    for record in read_trace(run.trace_path).records:
        for e in record.of_kind("request.tokens"):
            texts[e.request_id] = texts.get(e.request_id, "")[: e.text_offset] + e.text
    lines = run.stdout.splitlines()[:-1]
    assert len(lines) == 3
    for line in lines:
        rid, text = re.fullmatch(r"\[(\w+)\] length, 5 tokens: (.*)", line).groups()
        assert json.loads(text) == texts[rid]


def test_export_writes_a_well_formed_chrome_trace(run, capsys):
    out = run.folder / "run.json"
    assert main(["export", str(run.trace_path), "--chrome", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    groups = check_chrome_trace(json.loads(out.read_text()))
    steps = [s for s in groups["slices"][1, 1] if s["cat"] == "step"]
    assert len(steps) == run.steps_run
    tracks = [t for (pid, cat, _), t in groups["asyncs"].items() if cat == "request"]
    assert len(tracks) == 3
    for track in tracks:
        spans = [e["name"] for e in track if e["ph"] == "b"]
        assert spans[0].startswith("request ") and spans[1:] == ["queued", "prefill", "decode"]
        assert track[-1]["args"]["reason"] == "length"


def test_bad_input_is_an_error_without_a_traceback_or_a_trace(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    assert main(["run", "--prompts", str(tmp_path / "missing.txt"), "--trace", str(trace)]) == 2
    assert "missing.txt" in capsys.readouterr().err
    (tmp_path / "blank.txt").write_text("\n  \n")
    assert main(["run", "--prompts", str(tmp_path / "blank.txt"), "--trace", str(trace)]) == 2
    assert "no prompt" in capsys.readouterr().err
    (tmp_path / "p.txt").write_text("hello\n")
    argv = [
        "run",
        "--prompts",
        str(tmp_path / "p.txt"),
        "--trace",
        str(trace),
        "--model",
        "tiny-llama",
        "--num-kv-blocks",
        "4",
        "--block-size",
        "4",
        "--max-tokens",
        "100",
    ]
    assert main(argv) == 2  # needs more blocks than the cache has: refused before any step
    assert "max_tokens" in capsys.readouterr().err and not trace.exists()
    assert main(["export", str(tmp_path / "missing.jsonl"), "--chrome", str(tmp_path / "o.json")]) == 2
