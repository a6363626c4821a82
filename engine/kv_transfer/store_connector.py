"""What every store-backed connector shares: the prompt-prefix key (sha256 chained block hashes), the manifest,
per-block checksums, and the copies between the paged cache and one safetensors blob per layer.

A backend (a shared folder, a Redis server) only puts and gets bytes: `_get_manifest`, `_put`, `_get_layer`.
Loads and saves are synchronous: a load finishes before the forward that needs it, a save before the step ends.
"""
from __future__ import annotations

import abc
import hashlib
import json
import os
import time
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from safetensors.torch import load as st_load, save as st_save

from engine.core.block_hash import extra_keys_for_block, sha256_hash
from engine.events import EventLog, KVTransferFail, KVTransferLoad, KVTransferSave
from engine.kv_transfer.base import KVCache, KVConnectorBase, KVConnectorMetadata, KVLoadError, ReqMeta

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.core.scheduler import SchedulerOutput
    from engine.request import Request

MANIFEST_VERSION = 1


def prompt_key(request: Request, block_size: int) -> str:
    """The sha256 chain over the prompt's blocks, its partial last block included: equal keys, equal prompts
    (salt included), in every process and on every machine, whatever hash the local prefix cache uses."""
    tokens, parent = request.prompt_token_ids, None
    for i in range(0, len(tokens), block_size):
        parent = sha256_hash(parent, tokens[i:i + block_size], extra_keys_for_block(request, i // block_size))
    return parent.hex()


def block_checksums(k: torch.Tensor, v: torch.Tensor) -> list[str]:
    """sha256 of each block's K and V bytes: a bad byte costs only its block."""
    def raw(t: torch.Tensor) -> bytes:
        return t.contiguous().view(torch.uint8).numpy().tobytes()
    return [hashlib.sha256(raw(k[b]) + raw(v[b])).hexdigest()[:32] for b in range(k.shape[0])]


def _failure_of(exc: Exception) -> str:
    return "timeout" if "timeout" in type(exc).__name__.lower() else "store_error"


class KVStoreConnector(KVConnectorBase):
    """Owns the connector's bookkeeping between steps (matched, pending and saved requests) and the transfers;
    a subclass owns the store."""

    name: ClassVar[str]

    def __init__(self, config: EngineConfig, num_layers: int, num_kv_heads: int, head_dim: int,
                 events: EventLog) -> None:
        self.config = config.kv_transfer
        self.block_size = config.block_size
        self.num_layers = num_layers
        self.events = events
        self.instance = self.config.engine_id or f"{self.config.kv_role}-{os.getpid()}"
        # what a manifest must match for a hit: anything else would load the wrong numbers
        self.identity = {"model": str(config.model), "dtype": config.dtype, "block_size": config.block_size,
                         "num_layers": num_layers, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
        self.namespace = hashlib.sha256(json.dumps(self.identity, sort_keys=True).encode()).hexdigest()[:16]
        self._matched: dict[str, tuple[str, int, dict]] = {}  # rid -> (key, end token, manifest)
        self._pending_loads: list[ReqMeta] = []
        self._manifests: dict[str, dict] = {}  # rid -> manifest of its bound load
        self._save_buffers: dict[str, list[KVCache]] = {}
        self._saved: dict[str, dict[str, Any]] = {}  # rid -> kv_transfer_params for the decode side
        self._load_errors: set[int] = set()
        self._missed: set[str] = set()  # requests whose miss was reported

    # ---- the store -----------------------------------------------------------------------------
    @abc.abstractmethod
    def _get_manifest(self, key: str) -> dict | None:
        """The stored manifest of `key`, or None. Raises on an unreachable store."""

    @abc.abstractmethod
    def _put(self, key: str, manifest: dict, blobs: list[bytes]) -> bool:
        """Store the layers, then the manifest last (readers see all or nothing). False if `key` was there."""

    @abc.abstractmethod
    def _get_layer(self, key: str, manifest: dict, layer_index: int) -> bytes | None:
        """One layer's blob, or None if it is gone."""

    # ---- scheduler side ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        wanted = bool(params.get("do_remote_prefill"))
        if not self.config.is_kv_consumer or not (wanted or self.config.kv_role == "kv_consumer"):
            return 0, False
        key = prompt_key(request, self.block_size)
        try:
            manifest = self._get_manifest(key)
        except Exception as exc:  # an unreachable store is a miss, after the client's bounded timeout
            return self._miss(request, wanted, _failure_of(exc), repr(exc))
        if manifest is None:
            return self._miss(request, wanted, "missing", key[:16])
        if params.get("remote_key", key) != key or {k: manifest.get(k) for k in self.identity} != self.identity:
            return self._miss(request, wanted, "mismatch", key[:16])
        end = min(manifest["num_tokens"], request.num_tokens - 1)  # the last token is computed, to sample
        if end <= num_computed_tokens:
            return 0, False
        self._matched[request.request_id] = (key, end, manifest)
        return end - num_computed_tokens, False

    def _miss(self, request: Request, wanted: bool, failure: str, detail: str) -> tuple[int, bool]:
        # a consumer looking on its own: a miss is just a miss; a request that waits for blocks is told once
        if not wanted or request.request_id in self._missed:
            return 0, False
        self._missed.add(request.request_id)
        policy = self.config.kv_load_failure_policy
        self._emit_fail(request.request_id, failure, policy, request.num_tokens - 1 if policy == "recompute" else 0,
                        detail)
        if policy == "fail":
            raise KVLoadError(f"kv_transfer: {failure} KV for request {request.request_id} ({detail})")
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        matched = self._matched.pop(request.request_id, None)
        if matched is None or num_external_tokens == 0:
            return
        key, end, manifest = matched
        self._manifests[request.request_id] = manifest
        remote = (request.kv_transfer_params or {}).get("remote_request_id")
        self._pending_loads.append(ReqMeta(request.request_id, key, list(block_ids), end - num_external_tokens,
                                           end, remote))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        if not self.config.is_kv_producer:
            return meta
        for s in scheduler_output.scheduled:
            request = s.request
            wanted = (request.kv_transfer_params or {}).get("do_remote_decode") or self.config.kv_role == "kv_producer"
            # save once, in the step that completes the prompt's KV
            if wanted and s.num_computed_tokens < request.num_prompt_tokens <= s.num_computed_tokens + s.num_new_tokens:
                meta.saves.append(ReqMeta(s.request_id, prompt_key(request, self.block_size), list(s.block_ids),
                                          0, request.num_prompt_tokens))
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._matched.pop(rid, None)
        self._manifests.pop(rid, None)
        self._missed.discard(rid)
        return False, self._saved.pop(rid, None)  # saves are copies: the blocks are free to go now

    # ---- worker side: loads --------------------------------------------------------------------
    def start_load_kv(self, kv_caches: list[KVCache]) -> None:
        self._load_errors = set()
        for meta in self.connector_metadata.loads:
            self._load(meta, kv_caches)

    def _load(self, meta: ReqMeta, kv_caches: list[KVCache]) -> None:
        t0 = time.perf_counter()
        manifest = self._manifests.pop(meta.request_id)
        bs = self.block_size
        first, last = meta.start // bs, -(-meta.end // bs)  # the blocks the range touches
        bad: set[int] = set()  # block indexes within the request
        failure, detail, num_bytes = None, "", 0
        # whole blocks: `start` is block-aligned (local hits are full blocks), and the slots past `end` in the
        # last block are written by this step's forward or later ones before anything reads them
        ids = torch.tensor(meta.block_ids[first:last], dtype=torch.long)
        for layer, (k_cache, v_cache) in enumerate(kv_caches):
            try:
                blob = self._get_layer(meta.key, manifest, layer)
            except Exception as exc:
                blob, failure, detail = None, _failure_of(exc), repr(exc)
            if blob is None:
                failure = failure or "missing"
                detail = detail or f"layer {layer}"
                bad.update(range(first, last))
                continue
            num_bytes += len(blob)
            tensors = st_load(blob)
            k, v = tensors["key"], tensors["value"]
            sums = block_checksums(k[first:last], v[first:last])
            for b, s in zip(range(first, last), sums):
                if s != manifest["checksums"][layer][b]:
                    bad.add(b)
                    failure, detail = "corrupt", f"layer {layer} block {b}"
            k_cache.index_copy_(0, ids.to(k_cache.device), k[first:last].to(k_cache))
            v_cache.index_copy_(0, ids.to(v_cache.device), v[first:last].to(v_cache))
        ms = (time.perf_counter() - t0) * 1e3
        if bad:
            self._load_errors.update(meta.block_ids[b] for b in bad)
            policy = self.config.kv_load_failure_policy
            recomputed = meta.end - max(meta.start, min(bad) * bs) if policy == "recompute" else 0
            self._emit_fail(meta.request_id, failure, policy, recomputed, detail)
            return
        self.events.emit(KVTransferLoad, request_id=meta.request_id, instance=self.instance, connector=self.name,
                         key=meta.key[:16], num_blocks=last - first, num_tokens=meta.end - meta.start,
                         num_bytes=num_bytes, ms=ms, mb_per_s=num_bytes / 1e3 / max(ms, 1e-6),
                         remote_request_id=meta.remote_request_id)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._load_errors

    # ---- worker side: saves --------------------------------------------------------------------
    def save_kv_layer(self, layer_index: int, kv_layer: KVCache) -> None:
        for meta in self.connector_metadata.saves:
            index = torch.tensor(meta.block_ids[:-(-meta.end // self.block_size)], dtype=torch.long)
            self._save_buffers.setdefault(meta.request_id, []).append(
                (kv_layer[0][index].cpu(), kv_layer[1][index].cpu()))

    def wait_for_save(self) -> None:
        for meta in self.connector_metadata.saves:
            self._save(meta, self._save_buffers.pop(meta.request_id))
        self.clear_connector_metadata()

    def _save(self, meta: ReqMeta, layers: list[KVCache]) -> None:
        t0 = time.perf_counter()
        blobs = [st_save({"key": k.contiguous(), "value": v.contiguous()}) for k, v in layers]
        manifest = {**self.identity, "version": MANIFEST_VERSION, "num_tokens": meta.end,
                    "checksums": [block_checksums(k, v) for k, v in layers],
                    "producer": {"engine_id": self.instance, "request_id": meta.request_id}}
        try:
            stored = self._put(meta.key, manifest, blobs)  # a second copy of the same key is dropped: idempotent
        except Exception as exc:
            self._emit_fail(meta.request_id, "save_error", "none", 0, repr(exc))
            return
        ms = (time.perf_counter() - t0) * 1e3
        num_bytes = sum(len(b) for b in blobs) if stored else 0
        self.events.emit(KVTransferSave, request_id=meta.request_id, instance=self.instance, connector=self.name,
                         key=meta.key[:16], num_blocks=len(layers[0][0]), num_tokens=meta.end, num_bytes=num_bytes,
                         ms=ms, mb_per_s=num_bytes / 1e3 / max(ms, 1e-6))
        self._saved[meta.request_id] = {"do_remote_prefill": True, "do_remote_decode": False,
                                        "remote_engine_id": self.instance, "remote_request_id": meta.request_id,
                                        "remote_key": meta.key, "remote_num_tokens": meta.end}

    def _emit_fail(self, request_id: str, failure: str, action: str, recomputed: int, detail: str) -> None:
        self.events.emit(KVTransferFail, request_id=request_id, instance=self.instance, connector=self.name,
                         failure=failure, policy_action=action, num_recomputed_tokens=recomputed, detail=detail)
