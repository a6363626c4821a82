"""A private Redis server (persistence off, loopback only) and kv_transfer_config builders for each connector."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from engine.kv_transfer.redis_server import RedisServer

CONNECTORS = ("shared_storage", "redis")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One server for the session; `.client` talks to it."""
    redis = pytest.importorskip("redis", reason="the kv extra (redis, hiredis) is not installed")
    server = RedisServer()
    if server.exe is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server; .ci/run does it)")
    server.start()
    server.client = redis.Redis.from_url(server.url)
    yield server
    server.stop()


@pytest.fixture(scope="module", params=CONNECTORS)
def kv_config(request, tmp_path_factory) -> Callable[..., dict]:
    """kv_config(role, **overrides) -> a kv_transfer_config for this module's store (one per connector)."""
    if request.param == "redis":
        server = request.getfixturevalue("redis_server")
        server.client.flushall()
        extra = {"url": server.url, "timeout_s": 0.5}
    else:
        extra = {"shared_storage_path": str(tmp_path_factory.mktemp("kv_store"))}

    def make(role: str, policy: str = "recompute", **extra_overrides) -> dict:
        return {
            "kv_connector": request.param,
            "kv_role": role,
            "kv_load_failure_policy": policy,
            "kv_connector_extra_config": {**extra, **extra_overrides},
        }

    make.connector = request.param
    return make
