"""Why, in the dashboard: a request's journey (`LLMEngine.explain`) and a KV block's life (`LLMEngine.block_life`),
each opened by a click (a request in the requests table or on the timeline, a block on the block map), and where
they come from (`Explanations`): the live engine's public API, or the records the dashboard was fed (a replay),
folded only when something is opened, for that request alone (a long queue's journeys cost ~1 ms a step to fold)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import panel as pn

from engine.block_life import BlockLife, BlockLifeRecorder
from engine.events import PrefixSkipped, StepRecord
from engine.journey import Journey, JourneyRecorder
from workbench.state import EngineState, StepDelta
from workbench.views.base import View
from workbench.views.sync import drawing

MAX_SPAN_ROWS = 60  # the journey's table shows its first and last spans beyond this (a long decode is one span)
JOURNEY_HINT = "Click a request in the requests table or on the timeline to see its journey: each step, and why."
BLOCK_HINT = "Click a block on the KV block map to see its life: allocated, filled, cached, hit, freed, evicted."


def _ms(ns: int) -> str:
    return f"{ns / 1e6:.3f} ms"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _steps(first: int, last: int) -> str:
    return str(first) if first == last else f"{first}-{last}"


class Explanations:
    """Owns where journeys and block lives come from: an engine's `explain` / `block_life` (`attach`; called under
    the engine's lock), or else the records the dashboard was fed (`observe`), folded when asked: the journey of
    the request asked for alone, incrementally while it stays the one asked for, and block lives likewise."""

    def __init__(self, block_size: int = 16) -> None:
        self.block_size = block_size  # of the records' engine (a trace's header says it)
        self.lock: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        self._explain: Callable[[str], Journey] | None = None
        self._block_life: Callable[[int], list[BlockLife]] | None = None
        self.records: list[StepRecord] = []
        self.keep_records = True
        self._journey: tuple[JourneyRecorder, int] | None = None  # the request folded alone, records folded
        self._blocks: tuple[BlockLifeRecorder, int] | None = None

    def attach(
        self,
        explain: Callable[[str], Journey] | None,
        block_life: Callable[[int], list[BlockLife]] | None,
        lock: contextlib.AbstractContextManager[Any] | None = None,
        keep_records: bool = True,
    ) -> None:
        """Read a live engine's (None: fold the records fed from now on; with `keep_records` False, keep none and
        explain nothing: a data-parallel front end's records hold no steps to explain, and a server runs for days)."""
        self._explain, self._block_life = explain, block_life
        self.lock = lock if lock is not None else contextlib.nullcontext()
        self.keep_records = keep_records
        self.clear()

    @property
    def live(self) -> bool:
        return self._explain is not None

    def observe(self, records: Sequence[StepRecord]) -> None:
        if not self.live and self.keep_records:  # a live engine keeps its own
            self.records.extend(records)

    def clear(self) -> None:
        self.records, self._journey, self._blocks = [], None, None

    def explain(self, request_id: str) -> Journey:
        """The request's journey (KeyError if never seen); call under `lock`."""
        if self._explain is not None:
            return self._explain(request_id)
        recorder, folded = self._journey if self._journey is not None else (JourneyRecorder(only=request_id), 0)
        if recorder.only != request_id:
            recorder, folded = JourneyRecorder(only=request_id), 0
        for record in self.records[folded:]:
            recorder.observe(record)
        self._journey = recorder, len(self.records)
        return recorder.journey(request_id)

    def block_life(self, block_id: int) -> list[BlockLife]:
        """The block's lives, oldest first; call under `lock`."""
        if self._block_life is not None:
            return self._block_life(block_id)
        recorder, folded = self._blocks if self._blocks is not None else (BlockLifeRecorder(self.block_size), 0)
        for record in self.records[folded:]:
            recorder.observe(record)
        self._blocks = recorder, len(self.records)
        return recorder.life(block_id)


# ---- a journey as text --------------------------------------------------------------------------------------
def _span_rows(journey: Journey) -> list[str]:
    spans = journey.spans
    if len(spans) > MAX_SPAN_ROWS:
        half = MAX_SPAN_ROWS // 2
        spans = [*spans[:half], None, *spans[-half:]]  # type: ignore[list-item]  # None: the rows left out
    rows = ["| steps | state | got | why not more | counts as | time |", "|---|---|---|---|---|---|"]
    for span in spans:
        if span is None:
            rows.append(f"| ... | {len(journey.spans) - MAX_SPAN_ROWS} spans left out | | | | |")
            continue
        got = f"{span.phase} {_count(span.num_tokens, 'token')}" if span.phase else "-"
        if span.phase and span.num_steps > 1:
            got += " each"
        why = f"`{span.reason.code}`: {span.reason.describe()}" if span.reason is not None else ""
        rows.append(
            f"| {_steps(span.first_step, span.last_step)} | {span.state} | {got} | {why} | {span.part} "
            f"| {_ms(span.ns)} |"
        )
    return rows


def _parts(name: str, breakdown: Any) -> str:
    if breakdown is None:
        return f"- **{name}**: not yet"
    parts = " + ".join(f"{part} {_ms(ns)}" for part, ns in breakdown.parts_ns.items())
    return f"- **{name}** {_ms(breakdown.total_ns)} = {parts}"


def _admission_hits(journey: Journey) -> str:
    """The prefix hits of the lookups that admitted it (at its start, and at each resume after a preemption); a
    waiting request looks again every step, and those lookups are counted, not added."""
    scheduled = {step for step, span in journey.steps() if span.phase}
    admitted, waiting, skipped = [], 0, None
    for e in journey.lookups:
        if isinstance(e, PrefixSkipped):
            skipped = e
        elif e.step in scheduled:
            miss = f"; then {e.miss.describe()}" if e.miss is not None else ""
            admitted.append(f"{_count(e.num_hit_tokens, 'token')} at step {e.step}{miss}")
        else:
            waiting += 1
    text = "; ".join(admitted) or "none"
    if waiting:
        text += f" ({_count(waiting, 'lookup')} more while it waited)"
    if skipped is not None:
        text += f" (skipped: {skipped.reason.describe()})"
    return text


def journey_totals(journey: Journey) -> list[str]:
    """The journey's totals as Markdown bullets: waiting by reason, prefill chunks, preemptions and recomputed
    tokens, prefix hits, decode steps, and TTFT and end-to-end latency split into parts."""
    latency = journey.latency
    waits = [
        f"`{part[5:]}` {_count(latency.parts_steps[part], 'step')} ({_ms(ns)})"
        for part, ns in latency.parts_ns.items()
        if part.startswith("wait:")
    ]
    hits = _admission_hits(journey)
    return [
        f"- **waiting, by reason**: {', '.join(waits) if waits else 'never'}",
        f"- **prefill chunks**: {journey.num_prefill_chunks}",
        f"- **preemptions**: {len(journey.preemptions)}; {journey.num_lost_tokens} computed tokens lost, "
        f"{journey.num_recomputed_tokens} recomputed",
        f"- **prefix hits**: {hits}",
        f"- **decode steps**: {journey.num_decode_steps}",
        _parts("TTFT", journey.ttft),
        _parts("end to end" if journey.finish_reason else "so far", journey.latency),
    ]


def journey_markdown(journey: Journey) -> str:
    """The journey as Markdown: a heading, its spans (state, tokens got, why not more, time) and its totals."""
    status = f"finished ({journey.finish_reason})" if journey.finish_reason else "live"
    return "\n".join(
        [
            f"### Journey of request {journey.request_id} · {status}",
            "",
            *_span_rows(journey),
            "",
            *journey_totals(journey),
        ]
    )


# ---- a block's life as text -----------------------------------------------------------------------------------
def _who(events: list[tuple[int, str]]) -> str:
    return ", ".join(f"{rid} (step {step})" for step, rid in events) or "nobody"


def _life_lines(number: int, life: BlockLife) -> list[str]:
    current = "" if life.ended_step is not None else " · current"
    lines = [f"**life {number}**{current}", f"- allocated at step {life.allocated_step} to {life.allocated_to}"]
    lines.append(f"- filled at step {life.filled_step}" if life.filled_step is not None else "- not filled")
    if life.cached_step is not None:
        lines.append(f"- hashed and cached at step {life.cached_step} (hash {(life.block_hash or '')[:12]})")
    lines += [f"- hit by {_who(life.hits)}", f"- freed by {_who(life.freed)}"]
    if life.evicted_step is not None:
        why = life.eviction.describe() if life.eviction is not None else ""
        lines.append(f"- hash evicted at step {life.evicted_step}: {why}")
    if life.ended_step is not None:
        gaps = ", ".join(f"{g:.4f} s" for g in life.reuse_gaps_s) or "none"
        lines.append(
            f"- ended at step {life.ended_step}, allocated to {life.ended_for}: lifetime {life.lifetime_s:.4f} s, "
            f"idle before evict {life.idle_s:.4f} s, reuse gaps {gaps}"
        )
    return lines


def block_life_markdown(block_id: int, lives: list[BlockLife]) -> str:
    """A block's lives as Markdown, the current one first (vLLM's metrics on each one that ended)."""
    if not lives:
        return f"### Life of block {block_id}\n\nNever allocated in the steps seen."
    lines = [f"### Life of block {block_id} · {len(lives)} {'life' if len(lives) == 1 else 'lives'} seen"]
    for number, life in reversed(list(enumerate(lives, 1))):
        lines += ["", *_life_lines(number, life)]
    return "\n".join(lines)


class _Opened(View):
    """What the journey and the block-life panels share: the Markdown pane, what is open, and a refresh after each
    batch of records that changed it."""

    hint = ""  # what the panel says before anything is opened
    css_class = ""  # lets a browser test find the panel

    def __init__(self, state: EngineState | None = None, explanations: Explanations | None = None) -> None:
        super().__init__(state)
        self.explanations = explanations if explanations is not None else Explanations()
        self.markdown = pn.pane.Markdown(self.hint, sizing_mode="stretch_width", margin=(0, 10))
        self._panel = pn.Column(self.markdown, sizing_mode="stretch_width", css_classes=[self.css_class])
        self._dirty = False

    @property
    def panel(self) -> pn.Column:
        return self._panel

    def _text(self) -> str:
        raise NotImplementedError

    def _redraw(self) -> None:
        with self.explanations.lock:  # a live engine's journey changes as it steps: read it whole
            text = self._text()
        self.markdown.object = text

    def _open(self) -> None:
        with drawing(self.panel):
            self._redraw()

    def flush(self) -> None:
        if self._dirty:
            self._redraw()
            self._dirty = False

    def reset(self) -> None:
        super().reset()
        self._dirty = False
        self.markdown.object = self.hint


class JourneyView(_Opened):
    """Owns the journey panel: the journey of the request opened (`open`), as Markdown, redrawn after each batch of
    records while it lives. Alone, `JourneyView(journey=...)` shows a Journey once (a notebook's)."""

    title = "Journey"
    hint = JOURNEY_HINT
    css_class = "workbench-journey"

    def __init__(
        self,
        state: EngineState | None = None,
        explanations: Explanations | None = None,
        journey: Journey | None = None,
    ) -> None:
        super().__init__(state, explanations)
        self.request_id: str | None = None
        self._final = False
        if journey is not None:
            self.markdown.object = journey_markdown(journey)

    def open(self, request_id: str) -> None:
        """Show `request_id`'s journey (and follow it while it lives)."""
        self.request_id, self._final = request_id, False
        self._open()

    def _text(self) -> str:
        assert self.request_id is not None
        try:
            journey = self.explanations.explain(self.request_id)
        except (KeyError, ValueError) as exc:  # never seen, forgotten, or a parent of n > 1 (its children have one)
            return f"### Journey of request {self.request_id}\n\n{exc.args[0] if exc.args else exc}"
        self._final = journey.finish_reason is not None
        return journey_markdown(journey)

    def render(self, record: StepRecord, delta: StepDelta) -> None:
        # a waiting request is in no delta (deferred is not a state change), yet its journey grows each step
        self._dirty = self._dirty or (self.request_id is not None and not self._final)

    def reset(self) -> None:
        super().reset()
        self.request_id, self._final = None, False


class BlockLifeView(_Opened):
    """Owns the block-life panel: the lives of the block opened (`open`), as Markdown, redrawn after each batch of
    records that touched it."""

    title = "Block life"
    hint = BLOCK_HINT
    css_class = "workbench-block-life"

    def __init__(self, state: EngineState | None = None, explanations: Explanations | None = None) -> None:
        super().__init__(state, explanations)
        self.block_id: int | None = None

    def open(self, block_id: int) -> None:
        self.block_id = block_id
        self._open()

    def _text(self) -> str:
        assert self.block_id is not None
        return block_life_markdown(self.block_id, self.explanations.block_life(self.block_id))

    def render(self, record: StepRecord, delta: StepDelta) -> None:
        self._dirty = self._dirty or (self.block_id is not None and self.block_id in delta.blocks)

    def reset(self) -> None:
        super().reset()
        self.block_id = None
