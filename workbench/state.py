"""The engine's state as the dashboards see it, rebuilt from StepRecords alone (so a replayed trace needs no model):
requests with their timings and text, and which request holds which KV block and what hash it carries."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.events import EngineSnapshot, StepRecord

WAITING, RUNNING, PREEMPTED, FINISHED = "waiting", "running", "preempted", "finished"
# the engine's RequestStatus names, as the views group them (every other one is a finished status)
_STATUS = {"WAITING": WAITING, "WAITING_FOR_FSM": WAITING, "WAITING_FOR_REMOTE_KVS": WAITING, "RUNNING": RUNNING,
           "PREEMPTED": PREEMPTED}


@dataclass
class RequestState:
    """One request as seen through its events: queue status, last phase, token counts, timings, text."""

    request_id: str
    prompt: str
    num_prompt_tokens: int
    max_tokens: int
    priority: int
    arrival_ns: int
    status: str = WAITING
    phase: str = ""
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_queried_tokens: int = 0  # tokens its last prefix-cache lookup covered (outputs too, after a preemption)
    num_preemptions: int = 0
    text: str = ""
    first_token_ns: int | None = None
    last_token_ns: int | None = None
    itls_ms: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ttft_ms(self) -> float | None:
        """Arrival to the end of the step that produced the first token (vLLM's TTFT)."""
        if self.first_token_ns is None:
            return None
        return (self.first_token_ns - self.arrival_ns) / 1e6

    @property
    def mean_itl_ms(self) -> float | None:
        return sum(self.itls_ms) / len(self.itls_ms) if self.itls_ms else None

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens


@dataclass
class BlockState:
    """One KV block: the requests holding it (its ref count is their number) and its hash while cached."""

    holders: list[str] = field(default_factory=list)
    block_hash: str | None = None
    parent_hash: str | None = None

    @property
    def ref_cnt(self) -> int:
        return len(self.holders)

    @property
    def kind(self) -> str:
        """"used" (held), "cached" (free but still hittable by its hash) or "free"."""
        if self.holders:
            return "used"
        return "cached" if self.block_hash is not None else "free"


@dataclass
class StepDelta:
    """What one StepRecord changed in an EngineState: the views redraw only this."""

    added: list[str] = field(default_factory=list)
    requests: set[str] = field(default_factory=set)
    blocks: set[int] = field(default_factory=set)
    ttfts_ms: list[float] = field(default_factory=list)
    itls_ms: list[float] = field(default_factory=list)
    num_output_tokens: int = 0


class EngineState:
    """Owns the event-derived model of the engine shared by the views: requests by id, KV blocks by id
    (only those that ever changed; the rest are free), each request's block table, the KV size and the
    last step applied."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Back to an engine that has run no step (shared views keep their reference to this object)."""
        self.requests: dict[str, RequestState] = {}
        self.blocks: dict[int, BlockState] = {}
        self.block_tables: dict[str, tuple[int, ...]] = {}
        self.total_blocks = 0
        self.step = 0

    def load(self, snapshot: EngineSnapshot) -> None:
        """Start from an engine's state between steps (a view attached mid-run, a trace begun mid-run)."""
        self.clear()
        self.step, self.total_blocks = snapshot.step, snapshot.kv.total
        for b in snapshot.blocks:
            self.blocks[b.block_id] = BlockState(block_hash=b.block_hash, parent_hash=b.parent_hash)
        for r in snapshot.requests:
            req = RequestState(r.request_id, r.prompt, r.num_prompt_tokens, r.max_tokens, r.priority, r.arrival_ns,
                               status=_STATUS.get(r.status, FINISHED), num_output_tokens=r.num_output_tokens,
                               num_cached_tokens=r.num_cached_tokens, num_preemptions=r.num_preemptions,
                               text=r.text, finish_reason=r.finish_reason, error=r.error)
            self.requests[r.request_id] = req
            self.block_tables[r.request_id] = tuple(r.block_ids)
            for block_id in r.block_ids:
                self.blocks.setdefault(block_id, BlockState()).holders.append(r.request_id)

    def block(self, block_id: int) -> BlockState:
        return self.blocks.get(block_id) or BlockState()

    def counts(self) -> dict[str, int]:
        """Blocks by kind, as KVUsage counts them (used, cached_free, free)."""
        kinds = [b.kind for b in self.blocks.values()]
        used, cached = kinds.count("used"), kinds.count("cached")
        return {"used": used, "cached_free": cached, "free": self.total_blocks - used - cached}

    def apply(self, record: StepRecord) -> StepDelta:
        """Fold one StepRecord in; return what changed."""
        delta = StepDelta()
        self.step = record.step
        self.total_blocks = record.kv.total
        for event in record.events:
            handler = _HANDLERS.get(event.kind)
            if handler is not None:
                handler(self, event, record, delta)
        for rid, phase in record.phases.items():
            if rid in self.requests:
                self.requests[rid].phase = phase
                delta.requests.add(rid)
        return delta

    # ---- event handlers ---------------------------------------------------------------------------
    def _added(self, e, record: StepRecord, delta: StepDelta) -> None:
        if e.request_id in self.requests:  # a snapshot taken after its add_request holds it already
            return
        self.requests[e.request_id] = RequestState(e.request_id, e.prompt, e.num_prompt_tokens, e.max_tokens,
                                                   e.priority, e.arrival_ns)
        delta.added.append(e.request_id)

    def _scheduled(self, e, record: StepRecord, delta: StepDelta) -> None:
        req = self._touch(e.request_id, delta)
        if req is not None:
            req.status = RUNNING
            req.num_cached_tokens = e.num_cached_tokens

    def _preempted(self, e, record: StepRecord, delta: StepDelta) -> None:
        req = self._touch(e.request_id, delta)
        if req is not None:
            req.status = PREEMPTED
            req.num_preemptions += 1

    def _finished(self, e, record: StepRecord, delta: StepDelta) -> None:
        req = self._touch(e.request_id, delta)
        if req is not None:
            req.status, req.finish_reason, req.error = FINISHED, e.reason, e.error
            req.num_output_tokens = e.num_output_tokens

    def _tokens(self, e, record: StepRecord, delta: StepDelta) -> None:
        delta.num_output_tokens += len(e.token_ids)
        req = self._touch(e.request_id, delta)
        if req is None:
            return
        req.text = req.text[:e.text_offset] + e.text
        req.num_output_tokens = e.num_output_tokens
        if req.first_token_ns is None:
            req.first_token_ns = record.end_ns
            delta.ttfts_ms.append(req.ttft_ms)
        else:
            itl = (record.end_ns - req.last_token_ns) / 1e6
            req.itls_ms.append(itl)
            delta.itls_ms.append(itl)
        req.last_token_ns = record.end_ns

    def _allocated(self, e, record: StepRecord, delta: StepDelta) -> None:
        held = set(self.block_tables.get(e.request_id, ()))
        for block_id in e.block_ids:
            if block_id not in held:
                self.blocks.setdefault(block_id, BlockState()).holders.append(e.request_id)
                delta.blocks.add(block_id)
        self.block_tables[e.request_id] = tuple(e.block_ids)
        self._touch(e.request_id, delta)

    def _freed(self, e, record: StepRecord, delta: StepDelta) -> None:
        for block_id in e.block_ids:
            block = self.blocks.get(block_id)
            if block is not None and e.request_id in block.holders:
                block.holders.remove(e.request_id)
                delta.blocks.add(block_id)
        self.block_tables.pop(e.request_id, None)
        self._touch(e.request_id, delta)

    def _lookup(self, e, record: StepRecord, delta: StepDelta) -> None:
        req = self._touch(e.request_id, delta)
        if req is not None:
            req.num_queried_tokens = req.num_tokens  # events apply in order: this step's tokens come later

    def _cached(self, e, record: StepRecord, delta: StepDelta) -> None:
        block = self.blocks.setdefault(e.block_id, BlockState())
        block.block_hash, block.parent_hash = e.block_hash, e.parent_hash
        delta.blocks.add(e.block_id)

    def _evicted(self, e, record: StepRecord, delta: StepDelta) -> None:
        block = self.blocks.get(e.block_id)
        if block is not None and block.block_hash == e.block_hash:
            block.block_hash = block.parent_hash = None
            delta.blocks.add(e.block_id)

    def _touch(self, rid: str, delta: StepDelta) -> RequestState | None:
        # a trace cut at its start can name requests whose request.added it never saw
        req = self.requests.get(rid)
        if req is not None:
            delta.requests.add(rid)
        return req


_HANDLERS = {
    "request.added": EngineState._added,
    "request.scheduled": EngineState._scheduled,
    "request.preempted": EngineState._preempted,
    "request.finished": EngineState._finished,
    "request.tokens": EngineState._tokens,
    "kv.allocated": EngineState._allocated,
    "kv.freed": EngineState._freed,
    "prefix.lookup": EngineState._lookup,
    "kv.cached": EngineState._cached,
    "kv.evicted": EngineState._evicted,
}
