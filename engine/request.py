"""Requests and their parameters: what a user asks for, and the state the engine keeps for it."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch


class RequestStatus(enum.IntEnum):
    """Where a request is in its life. Every status after PREEMPTED is a finished one."""

    WAITING = 0
    WAITING_FOR_FSM = 1  # its grammar is still compiling
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


def _check_type(name: str, value: Any, types: type | tuple[type, ...], allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    # bool is an int subclass; a flag where a number belongs is a mistake worth naming
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise TypeError(f"{name}: expected {types}, got bool")
    if not isinstance(value, types):
        raise TypeError(f"{name}: expected {getattr(types, '__name__', types)}, got {type(value).__name__}")


@dataclass
class StructuredOutputsParams:
    """What a guided request must follow: exactly one of json, json_object, regex, choice, grammar."""

    json: dict | str | type | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError(
                "structured_outputs: exactly one of json, json_object, regex, choice, grammar must be set; "
                f"got {given or 'none'}"
            )
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice: must be a non-empty list of non-empty strings")


@dataclass
class SamplingParams:
    """How to sample one request's tokens and when to stop. Validated on construction."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables, as in vLLM
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        _check_type("temperature", self.temperature, (int, float))
        _check_type("top_p", self.top_p, (int, float))
        _check_type("top_k", self.top_k, int)
        _check_type("min_p", self.min_p, (int, float))
        _check_type("seed", self.seed, int, allow_none=True)
        _check_type("max_tokens", self.max_tokens, int)
        _check_type("min_tokens", self.min_tokens, int)
        _check_type("logprobs", self.logprobs, int, allow_none=True)
        _check_type("structured_outputs", self.structured_outputs, StructuredOutputsParams, allow_none=True)
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k: must be -1, 0 (off) or >= 1, got {self.top_k}")
        if self.top_k == -1:
            self.top_k = 0
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p: must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens: must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs: must be >= 0, got {self.logprobs}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop: must be a string or a list of non-empty strings")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids):
            raise TypeError("stop_token_ids: must be a list of int")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


def batch_prompts(prompts, params: SamplingParams | Sequence[SamplingParams] | None
                  ) -> list[tuple[str | list[int], SamplingParams]]:
    """One prompt (text or token ids) or a list of them, with one SamplingParams for all or one per prompt, as
    (prompt, params) pairs: what LLM.generate and PDCluster.generate take."""
    if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    prompts = list(prompts)
    if params is None or isinstance(params, SamplingParams):
        params = [params or SamplingParams()] * len(prompts)
    elif len(params) != len(prompts):
        raise ValueError(f"params: {len(params)} given for {len(prompts)} prompts")
    return list(zip(prompts, params))


@dataclass
class RequestMetrics:
    """Wall-clock times of one request (time.monotonic seconds)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """What a user gets back for a request: its tokens, its text and why it finished."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_cached_tokens: int = 0
    stop_reason: int | str | None = None
    error: str | None = None
    logprobs: list[dict[int, float]] | None = None
    metrics: RequestMetrics | None = None
    kv_transfer_params: dict[str, Any] | None = None  # for the next instance (P/D: what the decode side loads)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 until then
        self.spec_token_ids: list[int] = []
        self.spec_draft_probs: torch.Tensor | None = None  # [len(spec_token_ids), V] for draft-model drafts
        self.block_hashes: list = []
        self.num_preemptions = 0
        self.num_prefill_chunks = 0  # chunks scheduled since the last (re)start of its prefill
        self.prefill_len = 0  # tokens that prefill covers (the prompt, plus outputs after a preemption)
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.logprobs: list[dict[int, float]] | None = [] if sampling_params.logprobs is not None else None
        self.generator: torch.Generator | None = None
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

    def __lt__(self, other: "Request") -> bool:
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
