"""The KV connector interface, as vLLM V1's `KVConnectorBase_V1`: a scheduler side that decides which tokens
come from outside and what leaves, and a worker side that moves KV between the paged cache and elsewhere.

In this engine one connector object serves both sides (scheduler and runner share a process); the split
stays in the method names so that a reader of vLLM finds each hook where it expects it.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from engine.core.sched.output import SchedulerOutput
    from engine.request import Request

KVCache = tuple[torch.Tensor, torch.Tensor]  # K and V of one layer, [num_blocks, block_size, kv heads, head dim]


class KVLoadError(Exception):
    """External KV a request asked for cannot be had, and the policy is "fail": the request finishes with an error."""


@dataclass
class ReqMeta:
    """One request's transfer this step: its key, its block ids, and the token range [start, end) to move."""

    request_id: str
    key: str
    block_ids: list[int]
    start: int
    end: int
    remote_request_id: str | None = None


@dataclass
class KVConnectorMetadata:
    """What the scheduler side tells the worker side for one step: the loads to do before the forward and
    the saves to do after it."""

    loads: list[ReqMeta] = field(default_factory=list)
    saves: list[ReqMeta] = field(default_factory=list)


class KVConnectorBase(abc.ABC):
    """Owns the moves of KV between this instance's paged cache and a store other instances reach."""

    # ---- scheduler side ---------------------------------------------------------------------------
    @abc.abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond `num_computed_tokens` (local prefix hits) whose KV can be loaded from outside, and whether
        the load is asynchronous (the request then waits in WAITING_FOR_REMOTE_KVS). None tokens: not known yet,
        ask again next step. Raises KVLoadError when the request must fail (policy "fail")."""

    @abc.abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """Blocks were allocated for the request: remember where its `num_external_tokens` will be loaded."""

    @abc.abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """The step's loads and saves, for the worker side; resets the scheduler side's per-step state."""

    @abc.abstractmethod
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """(delay_free_blocks: whether the blocks stay held until an asynchronous transfer of them ends, and
        get_finished reports it; the kv_transfer_params that let another instance load this request's KV)."""

    # ---- worker side ------------------------------------------------------------------------------
    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        self._connector_metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = KVConnectorMetadata()

    @property
    def connector_metadata(self) -> KVConnectorMetadata:
        return getattr(self, "_connector_metadata", None) or KVConnectorMetadata()

    @abc.abstractmethod
    def start_load_kv(self, kv_caches: list[KVCache]) -> None:
        """Begin (or, for a synchronous connector, do) the bound loads into the paged cache."""

    def wait_for_layer_load(self, layer_index: int) -> None:
        """Block until the layer's KV is in place. Synchronous connectors finish every layer in start_load_kv."""

    @abc.abstractmethod
    def save_kv_layer(self, layer_index: int, kv_layer: KVCache) -> None:
        """Take the bound saves' KV of one layer out of the paged cache."""

    @abc.abstractmethod
    def wait_for_save(self) -> None:
        """Block until every save of this step is stored."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(requests whose asynchronous save ended, requests whose asynchronous load ended). Nothing is
        asynchronous in a synchronous connector."""
        return set(), set()

    @property
    def has_inflight_transfers(self) -> bool:
        """Whether an asynchronous transfer is still running."""
        return False

    def wait_for_transfers(self, timeout: float) -> None:
        """Block until some asynchronous transfer ends, or `timeout` s; called when no request can run."""

    @abc.abstractmethod
    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks the last start_load_kv could not fill; the scheduler recomputes or fails their requests."""
