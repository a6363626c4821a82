"""The engine's state for one request (Request) and where it is in its life (RequestStatus)."""

from __future__ import annotations

import enum
import time
from typing import Any

import torch

from engine.outputs import RequestMetrics
from engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Where a request is in its life. Every status after PREEMPTED is a finished one."""

    WAITING = 0
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = 1  # its grammar is still compiling (vLLM 0.33's name)
    WAITING_FOR_FSM = 1  # the same status under the name the 2025 article (and vLLM before 0.10) gave it
    WAITING_FOR_REMOTE_KVS = 2  # its KV is being loaded from another instance
    RUNNING = 3
    PREEMPTED = 4
    FINISHED_STOPPED = 5
    FINISHED_LENGTH_CAPPED = 6
    FINISHED_ABORTED = 7
    FINISHED_ERROR = 8

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One request's engine state: its tokens, how many have KV computed, its status and block hashes.

    The scheduler owns the status and `num_computed_tokens`; the KV cache manager owns `block_hashes`;
    the runner reads the tokens and owns the per-request random generator.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.priority = priority
        self.cache_salt = cache_salt
        self.metrics = RequestMetrics(arrival_time=time.monotonic() if arrival_time is None else arrival_time)
        self.status = RequestStatus.WAITING
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        # asynchronous scheduling (vLLM's AsyncScheduler): tokens scheduled whose outputs have not come back yet
        # (counted in num_computed_tokens), the output tokens they will add (not yet in all_token_ids), and, after a
        # preemption, how many of the in-flight tokens' outputs will still arrive, for a request that restarted
        self.num_in_flight_tokens = 0
        self.num_output_placeholders = 0
        self.num_stale_output_tokens = 0
        self.is_prefill_chunk = False  # its last schedule left prompt (or recomputed output) still to compute
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 until then
        self.spec_token_ids: list[int] = []
        self.spec_draft_probs: torch.Tensor | None = None  # [len(spec_token_ids), V] for draft-model drafts
        self.block_hashes: list = []
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.logprobs: list[dict[int, float]] | None = [] if sampling_params.logprobs is not None else None
        # vLLM's layout: None for the first prompt token (nothing predicts it), then one dict per prompt token
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] if sampling_params.prompt_logprobs is not None else None
        )
        self.generator: torch.Generator | None = None
        self.bad_words_token_ids: list[list[int]] = []  # sampling_params.bad_words, tokenized at add_request
        self.kv_transfer_params = kv_transfer_params  # vLLM's names: do_remote_prefill, remote_request_id, ...
        self.kv_transfer_params_out: dict[str, Any] | None = None  # set by the connector when it finishes

    @property
    def arrival_time(self) -> float:
        return self.metrics.arrival_time

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __lt__(self, other: Request) -> bool:
        # Priority queue order: lower priority value first, then earlier arrival, then id for a total order.
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority,
            other.arrival_time,
            other.request_id,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
