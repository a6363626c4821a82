"""LLM.generate's progress bar: drawn for an interactive terminal, never into a pipe or a log file."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

GENERATE = """
from engine import LLM, SamplingParams
llm = LLM(model="tiny-llama", num_kv_blocks=64)
outs = llm.generate(["Hello there", "The capital of France is"], SamplingParams(max_tokens=3, ignore_eos=True){})
print("tokens", [len(o.token_ids) for o in outs])
"""


def _generate_piped(extra: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", GENERATE.format(extra)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_generate_writes_no_progress_bar_into_a_pipe(tiny_model_path):
    result = _generate_piped()
    assert result.returncode == 0, result.stderr
    assert "tokens [3, 3]" in result.stdout
    # tqdm's bar: "generate: 100%|##########| 2/2 [00:00<00:00, 9.81req/s]", redrawn with \r
    for mark in ("generate:", "req/s", "\r"):
        assert mark not in result.stderr, f"progress bar written to a pipe: {result.stderr!r}"


def _generate_on_a_terminal(extra: str = "") -> str:
    """stderr of the generate script when stderr is a terminal (a pseudo-terminal here)."""
    import fcntl
    import os
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a new pty is 0 columns wide
    proc = subprocess.Popen(
        [sys.executable, "-c", GENERATE.format(extra)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=slave
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: every writer has closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    assert proc.wait(timeout=300) == 0, b"".join(chunks).decode(errors="replace")
    return b"".join(chunks).decode(errors="replace")


def test_generate_keeps_the_bar_on_a_terminal_unless_use_tqdm_is_false(tiny_model_path):
    assert "generate: 100%" in _generate_on_a_terminal()
    assert "generate:" not in _generate_on_a_terminal(", use_tqdm=False")
