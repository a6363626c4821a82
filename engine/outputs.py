"""What a user gets back for a request: its tokens, text, finish reason and timings (and, with n > 1, every
sampled sequence)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestMetrics:
    """Wall-clock times of one request (time.monotonic seconds)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class CompletionOutput:
    """One sampled sequence of a request (vLLM's): a request with ``n`` > 1 has n of them."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None


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
    prompt_logprobs: list[dict[int, float] | None] | None = None  # [None, {prompt token: logprob, top-n...}, ...]
    metrics: RequestMetrics | None = None
    kv_transfer_params: dict[str, Any] | None = None  # for the next instance (P/D: what the decode side loads)
    # Every sampled sequence, as vLLM's RequestOutput.outputs; the flat fields above are outputs[0]'s.
    outputs: list[CompletionOutput] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
