"""A request's journey, folded from the StepRecords' events: each step it lived through (its state, the tokens it
got, why not more), its prefix lookups and preemptions, and its latency split into parts that add up to it.

Every step's time is given to each live request the step decided something about: from the end of the request's
previous such step (its arrival for the first) to the end of this one, so nothing is counted twice or lost and
the parts add up to first-token and finish times measured at step ends, on the engine's clock. A step's part
names what the request did in it: "prefill" (a chunk of its first prefill), "recompute" (of a prefill after a
preemption), "decode" (decode or verify), "preempted" (the step it lost its blocks), "wait:<code>" (it got no
tokens, for that reason: engine/reasons.py), "finish" (it only finished: aborted, or failed at admission).

`Explainer` folds a whole engine's records (live, as LLMEngine.explain does, or a trace's: `Explainer.from_records`)
into journeys and block lives (engine/block_life.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from engine.block_life import BlockLife, BlockLifeRecorder, KVBlockMetrics
from engine.events import (
    Event,
    PrefixLookup,
    PrefixSkipped,
    RequestAdded,
    RequestDeferred,
    RequestFinished,
    RequestPreempted,
    RequestScheduled,
    RequestTokens,
    StepRecord,
)
from engine.reasons import Reason

MAX_FINISHED = 10_000  # finished requests whose journeys are kept (the oldest forgotten first)


@dataclass
class JourneySpan:
    """Consecutive steps in which a request did the same thing: its `state` ("waiting", "running", "preempted",
    "finished"), its `phase` when scheduled, the tokens it got in each step, why it got no more (None: it got all
    it wanted), the latency `part` its time counts in and that time (`ns`)."""

    first_step: int
    last_step: int
    state: str
    phase: str | None
    num_tokens: int
    reason: Reason | None
    part: str
    ns: int

    @property
    def num_steps(self) -> int:
        return self.last_step - self.first_step + 1

    def describe(self) -> str:
        steps = f"step {self.first_step}" if self.num_steps == 1 else f"steps {self.first_step}-{self.last_step}"
        tokens = "1 token" if self.num_tokens == 1 else f"{self.num_tokens} tokens"
        got = f"{self.phase} {tokens}" if self.phase else self.state
        if self.phase and self.num_steps > 1:
            got += " each"
        why = f": {self.reason.describe()}" if self.reason is not None else ""
        return f"{steps}: {got}{why} ({self.ns / 1e6:.3f} ms)"


@dataclass
class LatencyBreakdown:
    """A latency split into parts (see the module's docstring): ns and steps per part; they add up to `total_ns`."""

    parts_ns: dict[str, int] = field(default_factory=dict)
    parts_steps: dict[str, int] = field(default_factory=dict)

    @property
    def total_ns(self) -> int:
        return sum(self.parts_ns.values())

    def add(self, part: str, ns: int) -> None:
        self.parts_ns[part] = self.parts_ns.get(part, 0) + ns
        self.parts_steps[part] = self.parts_steps.get(part, 0) + 1

    def copy(self) -> LatencyBreakdown:
        return LatencyBreakdown(dict(self.parts_ns), dict(self.parts_steps))


@dataclass
class Journey:
    """One request's journey as the events tell it. `arrival_ns` is None when its request.added came before the
    records began (a trace that starts mid-run): its parts then start at the first step seen. `ttft` covers
    arrival to the end of the step that delivered its first token, `latency` arrival to the end of its last step
    so far (its finish, once `finish_reason` is set)."""

    request_id: str
    arrival_ns: int | None
    spans: list[JourneySpan] = field(default_factory=list)
    lookups: list[PrefixLookup | PrefixSkipped] = field(default_factory=list)
    preemptions: list[RequestPreempted] = field(default_factory=list)
    first_token_ns: int | None = None
    finished_ns: int | None = None
    finish_reason: str | None = None
    ttft: LatencyBreakdown | None = None
    latency: LatencyBreakdown = field(default_factory=LatencyBreakdown)
    num_prefill_chunks: int = 0  # steps that computed part of its first prefill
    num_recomputed_tokens: int = 0  # tokens computed again after preemptions
    num_decode_steps: int = 0

    @property
    def num_prefix_hit_tokens(self) -> int:
        """Tokens its lookups found cached (a resumed request looks again)."""
        return sum(e.num_hit_tokens for e in self.lookups if isinstance(e, PrefixLookup))

    @property
    def num_lost_tokens(self) -> int:
        """Computed tokens its preemptions threw away."""
        return sum(e.num_computed_tokens for e in self.preemptions)

    def steps(self) -> Iterator[tuple[int, JourneySpan]]:
        """(step, the span it is in), for each step it lived through."""
        for span in self.spans:
            for step in range(span.first_step, span.last_step + 1):
                yield step, span

    def at(self, step: int) -> JourneySpan:
        """The span of `step`; KeyError if the request lived no such step."""
        for span in self.spans:
            if span.first_step <= step <= span.last_step:
                return span
        raise KeyError(f"step {step}: request {self.request_id} has no decision in it")

    def describe(self) -> str:
        """The journey as text: its spans, lookups, preemptions and latency parts."""
        lines = [f"request {self.request_id}"]
        lines += [f"  {span.describe()}" for span in self.spans]
        for e in self.lookups:
            if isinstance(e, PrefixSkipped):
                lines.append(f"  prefix cache at step {e.step}: skipped, {e.reason.describe()}")
            else:
                miss = f"; missed: {e.miss.describe()}" if e.miss is not None else ""
                lines.append(f"  prefix cache at step {e.step}: {e.num_hit_tokens} tokens hit{miss}")
        for p in self.preemptions:
            why = f": {p.reason.describe()}" if p.reason is not None else ""
            lines.append(f"  preempted at step {p.step}, {p.num_computed_tokens} computed tokens lost{why}")
        for name, breakdown in (("TTFT", self.ttft), ("latency", self.latency)):
            if breakdown is not None:
                parts = ", ".join(f"{k} {v / 1e6:.3f} ms" for k, v in breakdown.parts_ns.items())
                lines.append(f"  {name} {breakdown.total_ns / 1e6:.3f} ms = {parts}")
        return "\n".join(lines)

    def add_step(
        self, step: int, state: str, phase: str | None, num_tokens: int, reason: Reason | None, part: str, ns: int
    ) -> None:
        """Count one step of the journey: it extends the last span when the step repeats it."""
        last = self.spans[-1] if self.spans else None
        if (  # field by field, cheapest first: a long queue's waiting requests come through here every step
            last is not None
            and last.last_step == step - 1
            and last.part == part
            and last.state == state
            and last.num_tokens == num_tokens
            and last.phase == phase
            and (last.reason is reason or last.reason == reason)
        ):
            last.last_step, last.ns = step, last.ns + ns
        else:
            self.spans.append(JourneySpan(step, step, state, phase, num_tokens, reason, part, ns))
        self.latency.add(part, ns)


@dataclass(slots=True)
class _StepOfRequest:
    """What one step did with one request, gathered from the step's events before its time is given out."""

    track: _Track
    state: str = ""
    phase: str | None = None
    num_tokens: int = 0
    reason: Reason | None = None
    part: str = ""
    first_token: bool = False
    finish_reason: str | None = None


@dataclass(slots=True)
class _Track:
    """A live request's journey and what the fold needs to go on with it."""

    journey: Journey
    last_ns: int  # the end of the last interval given to it
    running: bool = False
    recomputing: bool = False  # preempted, its prefill not yet done again


class JourneyRecorder:
    """Owns the journeys of the requests seen in the StepRecords given to `observe`: every live one, and the last
    MAX_FINISHED finished ones; with `only`, that one request's alone (a dashboard folds a trace for the request
    it opens, and pays nothing for the rest of a long queue)."""

    def __init__(self, max_finished: int = MAX_FINISHED, only: str | None = None) -> None:
        self.max_finished = max_finished
        self.only = only
        self._live: dict[str, _Track] = {}
        self._finished: OrderedDict[str, Journey] = OrderedDict()

    def journey(self, request_id: str) -> Journey:
        track = self._live.get(request_id)
        if track is not None:
            return track.journey
        if request_id in self._finished:
            return self._finished[request_id]
        raise KeyError(f"request_id: {request_id!r} has no journey (never seen, or forgotten)")

    def observe(self, record: StepRecord) -> None:
        steps: dict[str, _StepOfRequest] = {}
        only = self.only
        for e in record.events:
            # every event the fold reads names its request, but request.deferred, which names several
            if only is None or getattr(e, "request_id", only) == only:
                self._event(e, record, steps)
        for s in steps.values():
            self._close(s, record)

    def _track(self, request_id: str, record: StepRecord) -> _Track:
        track = self._live.get(request_id)
        if track is None:  # its request.added came before the records began
            track = self._live[request_id] = _Track(Journey(request_id, None), record.start_ns)
        return track

    def _step_of(self, request_id: str, record: StepRecord, steps: dict[str, _StepOfRequest]) -> _StepOfRequest:
        s = steps.get(request_id)
        if s is None:
            s = steps[request_id] = _StepOfRequest(self._track(request_id, record))
        return s

    def _event(self, e: Event, record: StepRecord, steps: dict[str, _StepOfRequest]) -> None:
        if isinstance(e, RequestAdded):
            self._finished.pop(e.request_id, None)  # an id used again starts a new journey
            self._live[e.request_id] = _Track(Journey(e.request_id, e.arrival_ns), e.arrival_ns)
        elif isinstance(e, RequestScheduled):
            self._scheduled(e, self._step_of(e.request_id, record, steps))
        elif isinstance(e, RequestDeferred):
            part = f"wait:{e.reason.code}"
            ids = e.request_ids if self.only is None else (self.only,) if self.only in e.request_ids else ()
            for rid in ids:
                s = self._step_of(rid, record, steps)
                s.state, s.reason, s.part = "running" if s.track.running else "waiting", e.reason, part
        elif isinstance(e, RequestPreempted):
            s = self._step_of(e.request_id, record, steps)
            s.track.running, s.track.recomputing = False, True
            s.track.journey.preemptions.append(e)
            s.state, s.reason, s.part = "preempted", e.reason, "preempted"
        elif isinstance(e, PrefixLookup | PrefixSkipped):
            self._track(e.request_id, record).journey.lookups.append(e)
        elif isinstance(e, RequestTokens):
            if e.token_ids and self._track(e.request_id, record).journey.ttft is None:
                self._step_of(e.request_id, record, steps).first_token = True
        elif isinstance(e, RequestFinished):
            self._step_of(e.request_id, record, steps).finish_reason = e.reason

    @staticmethod
    def _scheduled(e: RequestScheduled, s: _StepOfRequest) -> None:
        track = s.track
        journey = track.journey
        track.running = True
        s.state, s.phase, s.num_tokens, s.reason = "running", e.phase, e.num_tokens, e.limit
        if e.phase in ("decode", "verify"):
            track.recomputing = False
            journey.num_decode_steps += 1
            s.part = "decode"
        elif track.recomputing:
            journey.num_recomputed_tokens += e.num_tokens
            s.part = "recompute"
        else:
            journey.num_prefill_chunks += 1
            s.part = "prefill"

    def _close(self, s: _StepOfRequest, record: StepRecord) -> None:
        """Give the request its time up to this step's end, in this step's part."""
        track = s.track
        journey, end = track.journey, record.end_ns
        if s.finish_reason is not None and not s.state:
            s.state, s.part = "finished", "finish"
        if s.state:
            journey.add_step(record.step, s.state, s.phase, s.num_tokens, s.reason, s.part, end - track.last_ns)
            track.last_ns = end
        if s.first_token:
            journey.first_token_ns, journey.ttft = end, journey.latency.copy()
        if s.finish_reason is not None:
            journey.finished_ns, journey.finish_reason = end, s.finish_reason
            del self._live[journey.request_id]
            self._finished[journey.request_id] = journey
            if len(self._finished) > self.max_finished:
                self._finished.popitem(last=False)


PREEMPTED = "preempted"  # waiting_by_reason's label for the requests preempted in the step


def waiting_by_reason(record: StepRecord, is_running: Callable[[str], bool]) -> dict[str, int]:
    """How many requests waited at the end of this step, by why: the code of the request.deferred reason that held
    each (engine/reasons.py), PREEMPTED for those preempted in it. `is_running(request_id)` tells a running request
    the budget did not reach (deferred too, but not waiting) from a waiting one, as of the step's start. Every
    waiting request has one of the two in every step the scheduler ran: the counts add up to `num_waiting`."""
    counts: dict[str, int] = {}
    for e in record.events:
        if isinstance(e, RequestDeferred):
            n = sum(1 for rid in e.request_ids if not is_running(rid))
            if n:
                counts[e.reason.code] = counts.get(e.reason.code, 0) + n
        elif isinstance(e, RequestPreempted):
            counts[PREEMPTED] = counts.get(PREEMPTED, 0) + 1
    return counts


class Explainer:
    """Owns the journeys of requests (JourneyRecorder) and the lives of KV blocks (BlockLifeRecorder) folded from
    one engine's StepRecords, in step order: LLMEngine feeds it every step; `from_records` folds a trace's."""

    def __init__(self, block_size: int, max_finished: int = MAX_FINISHED) -> None:
        self.journeys = JourneyRecorder(max_finished)
        self.blocks = BlockLifeRecorder(block_size)

    @classmethod
    def from_records(cls, records: Iterable[StepRecord], block_size: int) -> Explainer:
        explainer = cls(block_size)
        for record in records:
            explainer.observe(record)
        return explainer

    def observe(self, record: StepRecord) -> None:
        self.journeys.observe(record)
        self.blocks.observe(record)

    def explain(self, request_id: str) -> Journey:
        """The request's journey so far (KeyError if never seen, or forgotten)."""
        return self.journeys.journey(request_id)

    def block_life(self, block_id: int) -> list[BlockLife]:
        """The block's lives, oldest first, the current one last."""
        return self.blocks.life(block_id)

    @property
    def kv_block_metrics(self) -> KVBlockMetrics:
        return self.blocks.metrics
