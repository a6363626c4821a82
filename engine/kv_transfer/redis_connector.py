"""RedisConnector: KV in a Redis server, the KV-cache service every instance talks to.

Keys: iwb:kv:<namespace>:<prompt key>:manifest and ...:L<layer>:<chunk>. The namespace hashes model, dtype,
block size and KV shape; the prompt key is the sha256 chain of its blocks. Values are cut to `chunk_bytes`
(Redis is single-threaded: one 50 MB value would stall every client ~0.1 s). Every key carries a TTL, the
lease: KV nobody loads goes away by itself. Client calls time out after `timeout_s`.
"""

from __future__ import annotations

import json
from typing import ClassVar, cast

import redis

from engine.kv_transfer.store_connector import KVStoreConnector

DEFAULTS = {"ttl_s": 600, "chunk_bytes": 4 << 20, "timeout_s": 5.0}


class RedisConnector(KVStoreConnector):
    """Owns a Redis client (`kv_connector_extra_config["url"]`) and the layout of the keys."""

    name: ClassVar[str] = "RedisConnector"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        extra = {**DEFAULTS, **self.config.kv_connector_extra_config}
        if not extra.get("url"):
            raise ValueError(
                "kv_transfer_config.kv_connector_extra_config.url: required for RedisConnector "
                "(redis://127.0.0.1:PORT/0)"
            )
        self.ttl_s, self.chunk_bytes = int(extra["ttl_s"]), int(extra["chunk_bytes"])
        self.client = redis.Redis.from_url(
            extra["url"], socket_timeout=extra["timeout_s"], socket_connect_timeout=extra["timeout_s"]
        )

    def _k(self, key: str, suffix: str) -> str:
        return f"iwb:kv:{self.namespace}:{key}:{suffix}"

    def _get_manifest(self, key: str) -> dict | None:
        raw = self.client.get(self._k(key, "manifest"))
        return None if raw is None else json.loads(raw)

    def _put(self, key: str, manifest: dict, blobs: list[bytes]) -> bool:
        if self.client.exists(self._k(key, "manifest")):
            return False
        chunks = []
        for i, blob in enumerate(blobs):
            pipe = self.client.pipeline(transaction=False)
            parts = range(0, len(blob), self.chunk_bytes)
            for c, start in enumerate(parts):
                pipe.set(self._k(key, f"L{i}:{c}"), blob[start : start + self.chunk_bytes], ex=self.ttl_s)
            pipe.execute()
            chunks.append(len(parts))
        # the manifest last, and only once: a reader that finds it finds every chunk
        return bool(
            self.client.set(
                self._k(key, "manifest"), json.dumps({**manifest, "chunks": chunks}), ex=self.ttl_s, nx=True
            )
        )

    def _get_layer(self, key: str, manifest: dict, layer_index: int) -> bytes | None:
        parts = self.client.mget([self._k(key, f"L{layer_index}:{c}") for c in range(manifest["chunks"][layer_index])])
        if any(p is None for p in parts):
            return None
        return b"".join(cast(list[bytes], parts))  # redis-py types replies loosely; a chunk is bytes
