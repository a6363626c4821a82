"""Helpers for tests that start a local server: a free loopback port, and waiting for it to answer."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
