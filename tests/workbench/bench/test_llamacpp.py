"""llama.cpp's llama-bench as a measured peer without llama.cpp: its JSON output read from a recorded sample (a real
llama-bench of `make llamacpp-ref`, `-p 64 -n 16 -d 8 -r 2 -t 2 -o json` on smollm2-135m's F32 GGUF on a busy
machine), its command lines, the flags that name it, and a stand-in executable that answers as llama-bench does, so
that `bench decode` runs its llama.cpp sides."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from workbench.bench import decode, llamacpp

SAMPLE = Path(__file__).with_name("llama_bench_sample.json")


def fake_llama_bench(tmp_path: Path) -> tuple[Path, Path]:
    """An executable that writes its arguments to a file, a line each call, and prints the recorded sample's
    first test: (the executable, the file of calls)."""
    calls = tmp_path / "calls.jsonl"
    script = tmp_path / "llama-bench"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, sys\n"
        f"open({str(calls)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
        f"print(json.dumps(json.load(open({str(SAMPLE)!r}))[:1]))\n"
    )
    script.chmod(0o755)
    return script, calls


def test_the_recorded_output_reads_as_one_row_per_test():
    rows = llamacpp.parse_llama_bench_json(SAMPLE.read_text())
    assert [(r["n_prompt"], r["n_gen"], r["n_depth"]) for r in rows] == [(64, 0, 8), (0, 16, 8)]  # pp64, tg16 @ d8
    for row in rows:
        assert set(row) == set(llamacpp.FIELDS)
        assert row["avg_ts"] == pytest.approx(sum(row["samples_ts"]) / len(row["samples_ts"]), rel=1e-3)
        assert row["model_type"].startswith("llama") and "F32" in row["model_type"]


@pytest.mark.parametrize(
    "text, message",
    [
        ("llama-bench: error", "not JSON"),
        ("[]", "expected a list of tests"),
        ('[{"avg_ts": 1.0}]', "lacks n_prompt, n_gen"),
    ],
)
def test_output_that_is_not_llama_bench_json_says_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        llamacpp.parse_llama_bench_json(text)


def test_a_test_command_names_its_workload_threads_and_json():
    bench = llamacpp.LlamaBench("/bin/llama-bench", threads=2)
    cmd = bench.command("m.gguf", n_prompt=2048, n_gen=0, batch=512, ubatch=512)
    flags = dict(zip(cmd[1::2], cmd[2::2]))
    assert cmd[0] == "/bin/llama-bench"
    assert flags == {
        "-m": "m.gguf",
        "-p": "2048",
        "-n": "0",
        "-d": "0",
        "-b": "512",
        "-ub": "512",
        "-t": "2",
        "-r": "1",
        "-o": "json",
    }


def _args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    llamacpp.add_llamacpp_args(parser)
    return parser.parse_args(list(extra))


def test_the_flags_find_the_binary_and_ggufs_or_name_what_is_wrong(tmp_path):
    script, _ = fake_llama_bench(tmp_path)
    gguf = tmp_path / "m-q8_0.gguf"
    gguf.write_bytes(b"GGUF")
    args = _args(tmp_path, "--llama-bench", str(script), "--llamacpp-gguf", f"int8={gguf}")
    bench, ggufs = llamacpp.llamacpp_from_args(args, "bench x", ["float32", "int8"])
    assert bench is not None and bench.binary == str(script) and ggufs == {"int8": str(gguf)}
    assert llamacpp.llamacpp_from_args(args, "bench x", ["float32"])[1] == {}  # formats not measured are left out
    args.no_llamacpp = True
    assert llamacpp.llamacpp_from_args(args, "bench x", ["int8"]) == (None, {})
    for flags, message in [
        (["--llamacpp-gguf", "int8"], "expected FORMAT=PATH, got 'int8'"),
        (["--llamacpp-gguf", f"q8_0={gguf}"], "FORMAT is one of float32, bfloat16, int8, got 'q8_0'"),
        (["--llamacpp-gguf", "int8=/nonexistent.gguf"], "no such file '/nonexistent.gguf'"),
        (["--llama-bench", str(gguf)], "--llama-bench: not an executable file"),
    ]:
        with pytest.raises(SystemExit, match=message):
            llamacpp.llamacpp_from_args(_args(tmp_path, *flags), "bench x", ["int8"])


def test_ggufs_without_a_llama_bench_fail_naming_the_make_target(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(llamacpp, "default_llama_bench", lambda isa="native": None)
    args = _args(tmp_path, "--llamacpp-gguf", f"int8={gguf}")  # as where `make llamacpp-ref` was never run
    with pytest.raises(SystemExit, match="needs llama-bench: make llamacpp-ref"):
        llamacpp.llamacpp_from_args(args, "bench x", ["int8"])


def test_decode_runs_llama_bench_per_round_and_divides_the_engine_by_it(tmp_path):
    script, calls = fake_llama_bench(tmp_path)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    result = decode.run_decode(
        model="tiny-llama",
        weight_formats=["float32"],
        max_tokens=4,
        runs=2,
        baseline=False,
        llama_bench=llamacpp.LlamaBench(str(script), threads=2),
        llamacpp_gguf={"float32": str(gguf)},
        log=lambda _: None,
    )
    made = [json.loads(line) for line in calls.read_text().splitlines()]
    assert len(made) == 2  # one call a round: llama-bench warms up by itself
    for call in made:
        flags = dict(zip(call[::2], call[1::2]))
        assert flags["-m"] == str(gguf) and flags["-n"] == "4" and flags["-p"] == "0" and flags["-r"] == "1"
        assert flags["-d"] == str(result["prompt_len"])  # tg after a context as long as the engine's prompt
    engine, peer = result["rows"]
    recorded = json.loads(SAMPLE.read_text())[0]["avg_ts"]
    assert peer["system"] == decode.LLAMACPP and peer["gguf"] == "F32" and peer["tok_s"] == recorded
    assert peer["decode_tok_s"] == recorded  # its tg rate is of decode steps alone
    assert peer["same_tokens_as_engine_fp32"] is None  # llama-bench shows no tokens
    text = decode.format_text(result)
    # the engine's decode rate (its prefill left out, as tg leaves out the context) over llama-bench's
    assert f"{engine['decode_tok_s'] / recorded:.2f}x" in text and str(script) in text
