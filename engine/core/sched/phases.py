"""What each scheduled request does in a step, named for display: "prefill" (its whole (re)prefill in one step),
"chunk" i of n (part of a prefill), "decode", or "verify" (drafts verified).

The scheduler has no phases (as in vLLM: each request only catches its computed tokens up with its tokens), so the
name needs history the scheduler does not keep: where the request's current prefill started and how many tokens
it covers. Without it, a 1-token last chunk would look like a decode.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.sched.output import ScheduledRequest, SchedulerOutput
from engine.events import EventLog, RequestScheduled


@dataclass
class _Prefill:
    """A request's current prefill: the tokens it covers (the prompt, plus the outputs after a preemption) and
    the chunks scheduled for it so far."""

    num_tokens: int
    num_chunks: int = 0


class PhaseTracker:
    """Owns the prefill history of every request it has labelled, until the request finishes or is preempted
    (its next prefill starts afresh); labels each step's scheduled requests and emits their request.scheduled
    events. The scheduler neither reads nor writes it."""

    def __init__(self, events: EventLog) -> None:
        self.events = events
        self._prefills: dict[str, _Prefill] = {}

    def label(self, output: SchedulerOutput) -> dict[str, str]:
        """Emit request.scheduled for each request that runs this step, in batch order; returns {request id: phase}.
        Call it once per step, after anything that withdraws a scheduled request (a failed KV load): a withdrawn
        chunk never ran, so it is not counted, and the recompute that follows is labelled a prefill."""
        # first: a finished request's id may come back (a new request) in this very output
        for request_id in (*output.finished_req_ids, *output.preempted_req_ids):
            self._prefills.pop(request_id, None)
        phases = {}
        for s in output.scheduled:
            phase, index, count = self._phase(s)
            self.events.emit(
                RequestScheduled,
                request_id=s.request_id,
                num_tokens=s.num_new_tokens,
                phase=phase,
                num_computed_tokens=s.num_computed_tokens,
                chunk_index=index,
                num_chunks=count,
                num_cached_tokens=max(s.request.num_cached_tokens, 0),
                limit=s.limit,
            )
            phases[s.request_id] = phase
        return phases

    def _phase(self, s: ScheduledRequest) -> tuple[str, int, int]:
        """(phase, chunk index, number of chunks). A prefill covers the tokens known when it started; once they
        are computed, the request decodes (or verifies, when drafts ride along)."""
        if s.spec_token_ids:
            return "verify", 0, 0
        prefill = self._prefills.get(s.request_id)
        if prefill is not None and s.num_computed_tokens >= prefill.num_tokens:
            return "decode", 0, 0
        if prefill is None:
            prefill = self._prefills[s.request_id] = _Prefill(s.request.num_tokens)
        prefill.num_chunks += 1
        index, remaining = prefill.num_chunks, prefill.num_tokens - s.num_computed_tokens
        num_new = s.num_new_tokens  # no drafts here: they ride only on a request past its prefill
        if index == 1 and num_new == remaining:
            return "prefill", 1, 1
        # projected at this chunk's size: exact on the last chunk
        return "chunk", index, index + -(-(remaining - num_new) // num_new)
