"""A private redis-server for tests and `workbench pd`: a child process on a free 127.0.0.1 port, persistence off."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """Owns one redis-server process (Debian's; `.ci/run` installs it) from start() to stop()."""

    def __init__(self, startup_timeout_s: float = 10.0) -> None:
        self.exe = shutil.which("redis-server")
        self.startup_timeout_s = startup_timeout_s
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> RedisServer:
        if self.exe is None:
            raise RuntimeError("redis-server is not installed (apt-get install -y redis-server)")
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        import redis

        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        self.proc = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
