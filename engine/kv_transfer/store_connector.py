"""What every store-backed connector shares: the prompt-prefix key (sha256 chained block hashes), the manifest,
per-block checksums, and the copies between the paged cache and one safetensors blob per layer.

A backend (a shared folder, a Redis server) only puts and gets bytes: `_get_manifest`, `_put`, `_get_layer`.

By default transfers are synchronous: a load finishes before the forward that needs it, a save before the step
ends. With `kv_connector_extra_config={"async_transfers": True}` they run on a transfer thread while steps go on:
a loading request waits in WAITING_FOR_REMOTE_KVS, a saving request's blocks stay held until the store has them
(delay_free_blocks), and a consumer waits up to `load_wait_s` for a producer's save to land before calling it a miss.
"""

from __future__ import annotations

import abc
import hashlib
import json
import os
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from engine.core.block_hash import extra_keys_for_block, sha256_hash
from engine.events import EventLog, KVTransferFail, KVTransferLoad, KVTransferSave
from engine.kv_transfer.base import KVCache, KVConnectorBase, KVConnectorMetadata, KVLoadError, ReqMeta

if TYPE_CHECKING:
    from engine.config import EngineConfig, KVTransferConfig
    from engine.core.sched.output import SchedulerOutput
    from engine.request import Request

MANIFEST_VERSION = 1


def prompt_key(request: Request, block_size: int) -> str:
    """The sha256 chain over the prompt's blocks, its partial last block included: equal keys, equal prompts
    (salt included), in every process and on every machine, whatever hash the local prefix cache uses."""
    tokens, parent = request.prompt_token_ids, None
    for i in range(0, len(tokens), block_size):
        parent = sha256_hash(parent, tokens[i : i + block_size], extra_keys_for_block(request, i // block_size))
    if parent is None:
        raise ValueError(f"request {request.request_id}: an empty prompt has no key")
    return parent.hex()


def block_checksums(k: torch.Tensor, v: torch.Tensor) -> list[str]:
    """sha256 of each block's K and V bytes: a bad byte costs only its block."""

    def raw(t: torch.Tensor) -> bytes:
        return t.contiguous().view(torch.uint8).numpy().tobytes()

    return [hashlib.sha256(raw(k[b]) + raw(v[b])).hexdigest()[:32] for b in range(k.shape[0])]


def _failure_of(exc: Exception) -> str:
    return "timeout" if "timeout" in type(exc).__name__.lower() else "store_error"


@dataclass
class TransferResult:
    """What one load or save did, measured where it ran (maybe a transfer thread); events are emitted from it
    on the engine's thread, in the step that sees it finish."""

    meta: ReqMeta
    num_bytes: int = 0
    ms: float = 0.0
    num_blocks: int = 0
    bad: set[int] = field(default_factory=set)  # block indexes within the request
    failure: str | None = None
    detail: str = ""


class KVStoreConnector(KVConnectorBase):
    """Owns the connector's bookkeeping between steps (matched, pending and saved requests) and the transfers;
    a subclass owns the store."""

    name: ClassVar[str]

    def __init__(
        self, config: EngineConfig, num_layers: int, num_kv_heads: int, head_dim: int, events: EventLog
    ) -> None:
        if config.kv_transfer is None:
            raise ValueError("kv_transfer_config: a connector needs one")
        self.config: KVTransferConfig = config.kv_transfer
        self.block_size = config.block_size
        self.num_layers = num_layers
        self.events = events
        self.instance = self.config.engine_id or f"{self.config.kv_role}-{os.getpid()}"
        # what a manifest must match for a hit: anything else would load the wrong numbers
        self.identity = {
            "model": str(config.model),
            "dtype": config.dtype,
            "kv_cache_dtype": str(config.kv_cache_torch_dtype).removeprefix("torch."),
            "block_size": config.block_size,
            "num_layers": num_layers,
            "num_kv_heads": num_kv_heads,
            "head_dim": head_dim,
        }
        self.namespace = hashlib.sha256(json.dumps(self.identity, sort_keys=True).encode()).hexdigest()[:16]
        self._matched: dict[str, tuple[str, int, dict]] = {}  # rid -> (key, end token, manifest)
        self._pending_loads: list[ReqMeta] = []
        self._manifests: dict[str, dict] = {}  # rid -> manifest of its bound load
        self._save_layers: list[KVCache] = []  # the paged cache's layers, as save_kv_layer is given them
        self._saved: dict[str, dict[str, Any]] = {}  # rid -> kv_transfer_params for the decode side
        self._load_errors: set[int] = set()
        self._missed: set[str] = set()  # requests whose miss was reported
        # requests whose load came back bad: they compute their KV here from then on. An asynchronous load that
        # failed at block 0 sends its request back to the waiting queue with nothing computed; matched again, it
        # would load the same bad entry again, forever
        self._failed_loads: set[str] = set()
        extra = self.config.kv_connector_extra_config
        self.async_transfers = bool(extra.get("async_transfers", False))
        # a decode request can arrive before its producer's asynchronous save is stored: look again for a while
        self.load_wait_s = float(extra.get("load_wait_s", 10.0 if self.async_transfers else 0.0))
        self._first_miss: dict[str, float] = {}  # rid -> when its KV was first found missing
        # one thread: transfers of one instance run in order, beside the steps
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kv-transfer") if self.async_transfers else None
        self._inflight: dict[str, tuple[str, Future]] = {}  # rid -> ("load" | "save", its transfer)

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
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        wanted = bool(params.get("do_remote_prefill"))
        if not self.config.is_kv_consumer or not (wanted or self.config.kv_role == "kv_consumer"):
            return 0, False
        if request.request_id in self._failed_loads:
            return 0, False
        key = prompt_key(request, self.block_size)
        try:
            manifest = self._get_manifest(key)
        except Exception as exc:  # an unreachable store is a miss, after the client's bounded timeout
            return self._miss(request, wanted, _failure_of(exc), repr(exc))
        if manifest is None:
            if wanted and self._still_waiting(request.request_id):
                return None, False
            return self._miss(request, wanted, "missing", key[:16])
        self._first_miss.pop(request.request_id, None)
        if params.get("remote_key", key) != key or {k: manifest.get(k) for k in self.identity} != self.identity:
            return self._miss(request, wanted, "mismatch", key[:16])
        end = min(manifest["num_tokens"], request.num_tokens - 1)  # the last token is computed, to sample
        if end <= num_computed_tokens:
            return 0, False
        self._matched[request.request_id] = (key, end, manifest)
        return end - num_computed_tokens, self.async_transfers

    def _still_waiting(self, request_id: str) -> bool:
        first = self._first_miss.setdefault(request_id, time.monotonic())
        return time.monotonic() - first < self.load_wait_s

    def _miss(self, request: Request, wanted: bool, failure: str, detail: str) -> tuple[int, bool]:
        # a consumer looking on its own: a miss is just a miss; a request that waits for blocks is told once
        if not wanted or request.request_id in self._missed:
            return 0, False
        self._missed.add(request.request_id)
        policy = self.config.kv_load_failure_policy
        self._emit_fail(
            request.request_id, failure, policy, request.num_tokens - 1 if policy == "recompute" else 0, detail
        )
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
        self._pending_loads.append(
            ReqMeta(request.request_id, key, list(block_ids), end - num_external_tokens, end, remote)
        )

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
                meta.saves.append(
                    ReqMeta(
                        s.request_id,
                        prompt_key(request, self.block_size),
                        list(s.block_ids),
                        0,
                        request.num_prompt_tokens,
                    )
                )
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._matched.pop(rid, None)
        self._missed.discard(rid)
        self._failed_loads.discard(rid)
        self._first_miss.pop(rid, None)
        self._manifests.pop(rid, None)
        # a transfer thread still reading (save) or writing (load) the blocks: they stay held until it ends
        return rid in self._inflight, self._saved.pop(rid, None)

    # ---- worker side: loads --------------------------------------------------------------------
    def start_load_kv(self, kv_caches: list[KVCache]) -> None:
        self._load_errors = set()
        for meta in self.connector_metadata.loads:
            manifest = self._manifests.pop(meta.request_id)
            self._run("load", meta, partial(self._load, meta, manifest, kv_caches))

    def _load(self, meta: ReqMeta, manifest: dict, kv_caches: list[KVCache]) -> TransferResult:
        t0 = time.perf_counter()
        bs = self.block_size
        first, last = meta.start // bs, -(-meta.end // bs)  # the blocks the range touches
        result = TransferResult(meta, num_blocks=last - first)
        # whole blocks: `start` is block-aligned (local hits are full blocks), and the slots past `end` in the
        # last block are written by this step's forward or later ones before anything reads them
        ids = torch.tensor(meta.block_ids[first:last], dtype=torch.long)
        for layer, (k_cache, v_cache) in enumerate(kv_caches):
            try:
                blob = self._get_layer(meta.key, manifest, layer)
            except Exception as exc:
                blob, result.failure, result.detail = None, _failure_of(exc), repr(exc)
            if blob is None:
                result.failure = result.failure or "missing"
                result.detail = result.detail or f"layer {layer}"
                result.bad.update(range(first, last))
                continue
            result.num_bytes += len(blob)
            tensors = st_load(blob)
            k, v = tensors["key"], tensors["value"]
            sums = block_checksums(k[first:last], v[first:last])
            for b, s in zip(range(first, last), sums):
                if s != manifest["checksums"][layer][b]:
                    result.bad.add(b)
                    result.failure, result.detail = "corrupt", f"layer {layer} block {b}"
            k_cache.index_copy_(0, ids.to(k_cache.device), k[first:last].to(k_cache))
            v_cache.index_copy_(0, ids.to(v_cache.device), v[first:last].to(v_cache))
        result.ms = (time.perf_counter() - t0) * 1e3
        return result

    def _report_load(self, result: TransferResult) -> None:
        meta = result.meta
        if result.bad:
            self._load_errors.update(meta.block_ids[b] for b in result.bad)
            self._failed_loads.add(meta.request_id)
            policy = self.config.kv_load_failure_policy
            start = max(meta.start, min(result.bad) * self.block_size)
            failure = result.failure or "corrupt"  # a bad block always has its failure named
            self._emit_fail(
                meta.request_id, failure, policy, meta.end - start if policy == "recompute" else 0, result.detail
            )
            return
        self.events.emit(
            KVTransferLoad,
            request_id=meta.request_id,
            instance=self.instance,
            connector=self.name,
            key=meta.key[:16],
            num_blocks=result.num_blocks,
            num_tokens=meta.end - meta.start,
            num_bytes=result.num_bytes,
            ms=result.ms,
            mb_per_s=result.num_bytes / 1e3 / max(result.ms, 1e-6),
            remote_request_id=meta.remote_request_id,
        )

    # ---- worker side: both ---------------------------------------------------------------------
    def _run(self, kind: str, meta: ReqMeta, job: Callable[[], TransferResult]) -> None:
        """Do a transfer now, or hand it to the transfer thread; its events come when it is done."""
        if self._pool is None:
            self._report(kind, job())
        else:
            self._inflight[meta.request_id] = (kind, self._pool.submit(job))

    def _report(self, kind: str, result: TransferResult) -> None:
        (self._report_load if kind == "load" else self._report_save)(result)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """Collect the transfer thread's finished work: (requests done saving, requests done loading). Load
        errors among them are in get_block_ids_with_load_errors() until the next start_load_kv."""
        self._load_errors = set()
        done: dict[str, set[str]] = {"save": set(), "load": set()}
        for rid, (kind, future) in list(self._inflight.items()):
            if future.done():
                del self._inflight[rid]
                self._report(kind, future.result())
                done[kind].add(rid)
        return done["save"], done["load"]

    @property
    def has_inflight_transfers(self) -> bool:
        return bool(self._inflight)

    def wait_for_transfers(self, timeout: float) -> None:
        """Block until some in-flight transfer ends, or `timeout` s: the engine's wait when nothing can run."""
        if self._inflight:
            wait([f for _, f in self._inflight.values()], timeout=timeout, return_when=FIRST_COMPLETED)
        else:  # a consumer waiting for a producer's save to land: look again soon
            time.sleep(min(timeout, 0.01))

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._load_errors

    # ---- worker side: saves --------------------------------------------------------------------
    def save_kv_layer(self, layer_index: int, kv_layer: KVCache) -> None:
        # references, not copies: the save reads the blocks, which stay held until it is done
        if self.connector_metadata.saves:
            self._save_layers.append(kv_layer)

    def wait_for_save(self) -> None:
        layers, self._save_layers = self._save_layers, []
        for meta in self.connector_metadata.saves:
            # the decode side's kv_transfer_params are known now; an asynchronous save lands soon after
            self._saved[meta.request_id] = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": self.instance,
                "remote_request_id": meta.request_id,
                "remote_key": meta.key,
                "remote_num_tokens": meta.end,
            }
            self._run("save", meta, partial(self._save, meta, layers))
        self.clear_connector_metadata()

    def _save(self, meta: ReqMeta, kv_layers: list[KVCache]) -> TransferResult:
        t0 = time.perf_counter()
        index = torch.tensor(meta.block_ids[: -(-meta.end // self.block_size)], dtype=torch.long)
        layers = [(k[index].cpu(), v[index].cpu()) for k, v in kv_layers]
        result = TransferResult(meta, num_blocks=len(index))
        blobs = [st_save({"key": k.contiguous(), "value": v.contiguous()}) for k, v in layers]
        manifest = {
            **self.identity,
            "version": MANIFEST_VERSION,
            "num_tokens": meta.end,
            "checksums": [block_checksums(k, v) for k, v in layers],
            "producer": {"engine_id": self.instance, "request_id": meta.request_id},
        }
        try:
            stored = self._put(meta.key, manifest, blobs)  # a second copy of the same key is dropped: idempotent
        except Exception as exc:
            result.failure, result.detail = "save_error", repr(exc)
            return result
        result.ms = (time.perf_counter() - t0) * 1e3
        result.num_bytes = sum(len(b) for b in blobs) if stored else 0
        return result

    def _report_save(self, result: TransferResult) -> None:
        meta = result.meta
        if result.failure:
            self._saved.pop(meta.request_id, None)  # a synchronous save's request is told before it finishes
            self._emit_fail(meta.request_id, result.failure, "none", 0, result.detail)
            return
        self.events.emit(
            KVTransferSave,
            request_id=meta.request_id,
            instance=self.instance,
            connector=self.name,
            key=meta.key[:16],
            num_blocks=result.num_blocks,
            num_tokens=meta.end,
            num_bytes=result.num_bytes,
            ms=result.ms,
            mb_per_s=result.num_bytes / 1e3 / max(result.ms, 1e-6),
        )

    def _emit_fail(self, request_id: str, failure: str, action: str, recomputed: int, detail: str) -> None:
        self.events.emit(
            KVTransferFail,
            request_id=request_id,
            instance=self.instance,
            connector=self.name,
            failure=failure,
            policy_action=action,
            num_recomputed_tokens=recomputed,
            detail=detail,
        )
