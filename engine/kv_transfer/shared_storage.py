"""ExampleConnector (vLLM 0.33's name; SharedStorageConnector before, and in the article): KV in a folder any
instance can reach (a local disk, or NFS across machines).

Layout: <shared_storage_path>/<namespace>/<prompt key>/ with layer_NNN.safetensors and manifest.json. A save
writes a temporary folder and renames it into place: readers see a whole entry or none. Entries older than
`ttl_s` (the lease, as Redis keys' TTL) are removed by the next save in the namespace: KV that no decode instance
came for (it was killed, say) does not pile up.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import ClassVar

from engine.kv_transfer.store_connector import KVStoreConnector

MANIFEST = "manifest.json"


class ExampleConnector(KVStoreConnector):
    """Owns the folder tree under `kv_connector_extra_config["shared_storage_path"]`."""

    name: ClassVar[str] = "ExampleConnector"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        path = self.config.kv_connector_extra_config.get("shared_storage_path")
        if not path:
            raise ValueError(
                "kv_transfer_config.kv_connector_extra_config.shared_storage_path: required for ExampleConnector"
            )
        self.root = Path(path) / self.namespace
        self.root.mkdir(parents=True, exist_ok=True)
        self.ttl_s = float(self.config.kv_connector_extra_config.get("ttl_s", 600))

    def entry(self, key: str) -> Path:
        return self.root / key

    def _get_manifest(self, key: str) -> dict | None:
        try:
            return json.loads((self.entry(key) / MANIFEST).read_text())
        except FileNotFoundError:
            return None

    def _put(self, key: str, manifest: dict, blobs: list[bytes]) -> bool:
        final = self.entry(key)
        if final.exists():
            return False
        tmp = self.root / f".{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        tmp.mkdir()
        for i, blob in enumerate(blobs):
            (tmp / f"layer_{i:03d}.safetensors").write_bytes(blob)
        (tmp / MANIFEST).write_text(json.dumps(manifest))
        try:
            os.rename(tmp, final)
        except OSError:  # another writer won the race with the same bytes
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        self._expire()
        return True

    def _expire(self) -> None:
        """Remove entries whose lease ran out (by the folder's modification time: when it was stored)."""
        deadline = time.time() - self.ttl_s
        for entry in self.root.iterdir():
            try:
                if not entry.name.startswith(".") and entry.stat().st_mtime < deadline:
                    # renamed away first: a reader sees the whole entry or none, never half of one
                    doomed = self.root / f".{entry.name}.{uuid.uuid4().hex[:8]}.expired"
                    os.rename(entry, doomed)
                    shutil.rmtree(doomed, ignore_errors=True)
            except FileNotFoundError:  # another instance expired it first
                continue

    def _get_layer(self, key: str, manifest: dict, layer_index: int) -> bytes | None:
        try:
            return (self.entry(key) / f"layer_{layer_index:03d}.safetensors").read_bytes()
        except FileNotFoundError:
            return None


SharedStorageConnector = ExampleConnector  # the name vLLM gave it before 0.33, which the article uses
