"""What the scheduler hands the model runner for one step (vLLM's `vllm/v1/core/sched/output.py`). A leaf: the
runner and the KV connectors import this, never the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.reasons import TokenLimit
from engine.request import Request


@dataclass
class ScheduledRequest:
    """One request's share of a step: which of its tokens run, where they start, and where its KV lives."""

    request: Request
    num_new_tokens: int  # drafts included
    num_computed_tokens: int  # before this step
    block_ids: list[int]
    samples: bool  # this step reaches the request's last known token, so a new token is sampled
    spec_token_ids: list[int] = field(default_factory=list)
    limit: TokenLimit | None = None  # why it got fewer tokens than it wanted (None: all it wanted)

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass
class SchedulerOutput:
    """What one step runs, in batch order, plus what the runner must forget."""

    scheduled: list[ScheduledRequest]
    preempted_req_ids: list[str]
    finished_req_ids: set[str]
    kv_connector_metadata: Any = None  # the connector's KVConnectorMetadata (typed there: no import back)
    # the drafts each request that samples may propose for the next step, set by the batch-size schedule of dynamic
    # speculative decoding (vLLM's); None without one: num_speculative_tokens
    num_spec_tokens_to_schedule: int | None = None

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {s.request_id: s.num_new_tokens for s in self.scheduled}

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
