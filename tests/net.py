"""Helpers for tests that start a local server: a free loopback port, and waiting for it to answer."""

from __future__ import annotations

import itertools
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

# Ports are taken below the kernel's ephemeral range (32768 and up on Linux), where every outgoing connection takes
# its local port: a port picked there could be taken by another test's client before this test binds it. Each
# pytest-xdist worker has a band of its own, and walks it, so two workers never pick the same port.
_BAND_START, _BAND_SIZE = 20000, 1500
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0) % 8
_next = itertools.count(random.Random(os.getpid()).randrange(_BAND_SIZE))


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(count: int = 1) -> int:
    """A loopback port nobody listens on, and the `count - 1` after it (a replica of rank r takes port + r)."""
    for _ in range(_BAND_SIZE):
        base = _BAND_START + _WORKER * _BAND_SIZE + next(_next) % (_BAND_SIZE - count)
        if all(_bindable(base + i) for i in range(count)):
            return base
    raise RuntimeError(f"no {count} free consecutive ports in this worker's band")


def wait_for_http(url: str, server: subprocess.Popen, timeout: float, name: str) -> None:
    """Poll `url` until it answers; fail early (with its stderr, if piped) when `server` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            err = server.stderr.read() if server.stderr else ""
            pytest.fail(f"{name} exited with {server.returncode}: {err}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    pytest.fail(f"{name} did not answer at {url} within {timeout} s")


def stop(server: subprocess.Popen, timeout: float = 15) -> None:
    """Terminate a server started by a test, killing it if it does not exit within `timeout` seconds."""
    server.terminate()
    try:
        server.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def serve_cli(args: list[str], cwd: Path, timeout: float = 120) -> Iterator[str]:
    """`workbench serve ARGS` on a free loopback port while the generator is suspended: yields its URL (ending in
    /) once /health answers (open with or without --api-key); then the server is stopped."""
    port = free_port()
    cmd = [sys.executable, "-m", "workbench.cli", "serve", "--port", str(port), *args]
    server = subprocess.Popen(
        cmd,
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        url = f"http://127.0.0.1:{port}/"
        wait_for_http(f"{url}health", server, timeout=timeout, name="workbench serve")
        yield url
    finally:
        stop(server)
