"""What the command line says when things go wrong, and that the documented commands (docs/cli.md) are the CLI's: a
missing trace or a port in use is one line and status 2, said before any "serving ..." and before a model loads; the
page's `workbench run` names a prompts file that exists and runs; its `workbench bench` line lists every benchmark."""

from __future__ import annotations

import contextlib
import io
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.net import free_port, stop, wait_for_http
from workbench.cli import build_parser, main
from workbench.trace import read_trace

ROOT = Path(__file__).resolve().parents[2]
CLI_PAGE = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")  # the command line's page of the docs site
CEILING_S = 600  # a bound on waits for a condition, far past what a loaded machine needs


@pytest.fixture
def taken_port():
    """A loopback port another server listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _one_line_error(err: str) -> str:
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("workbench: error: "), err
    return lines[0]


def _documented_command(prefix: str) -> str:
    """docs/cli.md's command line that starts with `prefix`, without its comment."""
    found = [line.split("#")[0].strip() for line in CLI_PAGE.splitlines() if line.startswith(prefix)]
    assert len(found) == 1, f"docs/cli.md: expected one line starting {prefix!r}, found {found}"
    return found[0]


@pytest.fixture(scope="module")
def documented_run(tmp_path_factory):
    """docs/cli.md's `workbench run --prompts FILE --trace T`, from the repository's top, on tiny-llama with 4 tokens
    per prompt and T in a temporary folder: (the prompts file, the trace, status, stdout)."""
    argv = _documented_command("workbench run ").split()[1:]
    prompts = ROOT / argv[argv.index("--prompts") + 1]  # the page's paths are relative to the repository's top
    trace = tmp_path_factory.mktemp("documented_run") / "run.jsonl"
    argv[argv.index("--prompts") + 1], argv[argv.index("--trace") + 1] = str(prompts), str(trace)
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        status = main([*argv, "--model", "tiny-llama", "--max-tokens", "4"])
    return prompts, trace, status, stdout.getvalue()


# ---- the documented commands (docs/cli.md) ---------------------------------------------------------------------
def test_the_documented_run_command_runs_its_example_prompts(documented_run):
    prompts, trace, status, stdout = documented_run
    assert prompts.is_file(), f"docs/cli.md's `workbench run` names {prompts}, which the repository lacks"
    lines = [line for line in prompts.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert 3 <= len(lines) <= 12 and len(set(lines)) == len(lines)  # a few varied prompts
    assert status == 0
    assert f"{len(lines)} requests" in stdout.splitlines()[-1]
    added = [e.prompt for r in read_trace(trace).records for e in r.of_kind("request.added")]
    assert added == lines


def test_the_cli_page_lists_every_bench_command():
    line = _documented_command("workbench bench throughput|")  # the listing, not the examples below it
    listed = line.split()[2].split("|")
    bench = next(a for a in build_parser()._subparsers._group_actions if a.dest == "command").choices["bench"]
    known = next(a for a in bench._subparsers._group_actions if a.dest == "bench_name").choices
    assert sorted(listed) == sorted(known), f"docs/cli.md's `{line}` vs the CLI's {sorted(known)}"


# ---- replay: the trace first ---------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["missing", "folder", "not a trace", "binary"])
def test_replay_of_a_bad_trace_is_one_line_before_any_announcement(tmp_path, capsys, case):
    trace = tmp_path / "nope.jsonl"
    if case == "folder":
        trace.mkdir()
    elif case == "not a trace":
        trace.write_text("hello\n")
    elif case == "binary":
        trace.write_bytes(b"\xff\xfe\x00garbage\n")
    assert main(["replay", str(trace), "--port", str(free_port())]) == 2
    captured = capsys.readouterr()
    assert str(trace) in _one_line_error(captured.err) and "replaying" not in captured.err + captured.out


def test_workbench_replay_nope_exits_2_with_one_line(tmp_path):
    """As typed in a shell: `workbench replay nope.jsonl`."""
    result = subprocess.run(
        [sys.executable, "-m", "workbench.cli", "replay", "nope.jsonl", "--port", str(free_port())],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    line = _one_line_error(result.stderr)
    assert "nope.jsonl" in line and "No such file" in line and result.stdout == ""


# ---- a port in use -------------------------------------------------------------------------------------------
def test_serve_on_a_taken_port_says_so_before_loading_the_model(taken_port, capsys):
    # a model that does not exist: were it loaded first, the error would be about it
    assert main(["serve", "--port", str(taken_port), "--model", "no-such-model"]) == 2
    captured = capsys.readouterr()
    line = _one_line_error(captured.err)
    assert f"127.0.0.1:{taken_port}" in line and "--port" in line and "no-such-model" not in line
    assert "serving" not in captured.err + captured.out


def test_replay_on_a_taken_port_says_so_before_any_announcement(documented_run, taken_port, capsys):
    _, trace, _, _ = documented_run
    assert main(["replay", str(trace), "--port", str(taken_port)]) == 2
    captured = capsys.readouterr()
    line = _one_line_error(captured.err)
    assert f"127.0.0.1:{taken_port}" in line and "--port" in line and "replaying" not in captured.err


def test_serve_replay_announces_only_a_server_that_listens(documented_run, taken_port):
    """The port taken between the command's check and the server's bind: the bind's error names the port."""
    from workbench.app import serve_replay

    _, trace, _, _ = documented_run
    said = []
    with pytest.raises(OSError, match=rf"127\.0\.0\.1:{taken_port}.*--port"):
        serve_replay(trace, taken_port, start=False, announce=said.append)
    assert said == []


def test_bad_port_numbers_are_refused_by_the_parser(capsys):
    for port in ("0", "65536"):
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args(["serve", "--port", port])
        assert exit_.value.code == 2 and "--port" in capsys.readouterr().err


def test_replay_announces_its_url_once_it_answers(documented_run):
    _, trace, _, _ = documented_run
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "workbench.cli", "replay", str(trace), "--port", str(port)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        said = []  # the first line, printed once the port is bound, before serving
        reader = threading.Thread(target=lambda: said.append(server.stderr.readline()), daemon=True)
        reader.start()
        # wait on the condition (the line, or the process ending), not on a guess of how long a loaded machine
        # takes to import Panel and read the trace; the ceiling only keeps the loop bounded
        deadline = time.monotonic() + CEILING_S
        while reader.is_alive() and server.poll() is None and time.monotonic() < deadline:
            reader.join(timeout=0.5)
        reader.join(timeout=5)  # the process ended: its last line, if any, is being read
        first = said[0] if said else f"(nothing; exit code {server.poll()})"
        url = f"http://127.0.0.1:{port}/"
        assert first == f"workbench: replaying {trace} at {url} (Ctrl-C stops)\n"
        # it answers: /liveness needs no session, so it answers as soon as the loop serves, however loaded the
        # machine (the 60 s this test gave `/` to build a whole Replay session was not enough on a busy one)
        wait_for_http(f"{url}liveness", server, timeout=60, name="workbench replay")
        # and the page: one request, waited for as long as the server builds it (it fails at once if it dies)
        with urllib.request.urlopen(url, timeout=CEILING_S) as page:
            assert page.status == 200 and b"Inference Workbench replay" in page.read()
    finally:
        stop(server)
