"""Export step traces as Chrome trace JSON (the Trace Event Format), for ui.perfetto.dev and chrome://tracing.

One process per trace (several traces: the instances of a prefill/decode pair, on one wall clock). In each:
- thread "engine": a complete slice per step, its stages (schedule, forward, sample, update) nested inside;
- thread "kv transfer": a slice per kv_transfer.save / kv_transfer.load event;
- an async track per request: a `request <id>` span holding its queued, prefill and decode spans;
- counters: KV blocks (used, cached_free, free), queues (waiting, running), tokens per step by phase.
Flow arrows follow a request's KV: prefill step -> save -> load (on the decode side) -> the step that used it.
Timestamps are microseconds from the earliest instant in the traces."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from engine.events import (
    Event,
    KVTransferDone,
    RequestAdded,
    RequestFinished,
    RequestPreempted,
    RequestScheduled,
    RequestTokens,
    StepRecord,
)
from workbench.trace import Trace

ENGINE_TID = 1
TRANSFER_TID = 2
STAGES = ("schedule", "forward", "sample", "update")
TOKEN_PHASES = ("prefill", "chunk", "decode", "verify")
# the request.scheduled phase -> the span a request's async track shows for it
SPAN_OF_PHASE = {"prefill": "prefill", "chunk": "prefill", "decode": "decode", "verify": "decode"}
REQUEST_CAT = "request"
FLOW_CAT = "kv_transfer"
_MIN_SLICE_NS = 1000  # a transfer slice needs some width to hold its flow arrow


@dataclass
class _Anchor:
    """A point inside a thread slice that a flow arrow binds to."""

    pid: int
    tid: int
    ts_ns: int


@dataclass
class _Transfers:
    """The KV transfers seen so far, keyed by the producer's request id: where each arrow passes."""

    saves: dict[str, tuple[_Anchor, _Anchor]] = field(default_factory=dict)  # prefill step, save slice
    loads: dict[str, tuple[_Anchor, _Anchor]] = field(default_factory=dict)  # load slice, step that used it


class _RequestSpans:
    """Owns the async tracks of one process: per request, an outer span and the phase span now open."""

    def __init__(self, pid: int, emit: Callable[..., None]) -> None:
        self.pid = pid
        self.emit = emit
        self.open: dict[str, str] = {}  # request id -> name of its open phase span
        self.done: set[str] = set()  # finished: a request.tokens can follow the request.finished of its step

    def _event(self, ph: str, rid: str, name: str, ts_ns: int, args: dict[str, Any] | None = None) -> None:
        # ids are made unique per process: the same request id may live in two instances
        self.emit(
            ph=ph,
            ts_ns=ts_ns,
            pid=self.pid,
            tid=ENGINE_TID,
            name=name,
            cat=REQUEST_CAT,
            id=f"{self.pid}:{rid}",
            args=args or {},
        )

    def start(self, rid: str, ts_ns: int, args: dict[str, Any]) -> None:
        self._event("b", rid, f"request {rid}", ts_ns, args)
        self._event("b", rid, "queued", ts_ns)
        self.open[rid] = "queued"

    def move(self, rid: str, span: str, ts_ns: int, args: dict[str, Any] | None = None) -> None:
        """Close the request's open phase span at ts and open `span` (same-named spans are left alone)."""
        if self.open.get(rid) == span:
            return
        self._event("e", rid, self.open[rid], ts_ns)
        self._event("b", rid, span, ts_ns, args)
        self.open[rid] = span

    def finish(self, rid: str, ts_ns: int, args: dict[str, Any]) -> None:
        self._event("e", rid, self.open.pop(rid), ts_ns)
        self.done.add(rid)
        self._event("e", rid, f"request {rid}", ts_ns, args)

    def finish_all(self, ts_ns: int) -> None:
        for rid in list(self.open):
            self.finish(rid, ts_ns, {"unfinished": True})


# the request.* events: they open, move and close their request's span
_REQUEST_EVENTS = (RequestAdded, RequestTokens, RequestScheduled, RequestPreempted, RequestFinished)


def _payload(event: Any) -> dict[str, Any]:
    return {k: v for k, v in event.to_dict().items() if k not in ("kind", "step")}


class _ChromeTraceBuilder:
    """Owns the Chrome trace being built: its events, the time origin and the KV transfers seen."""

    def __init__(self, origin_ns: int) -> None:
        self.origin_ns = origin_ns
        self.events: list[dict[str, Any]] = []
        self.transfers = _Transfers()
        self._cursor: dict[tuple[int, int], int] = {}  # (pid, tid) -> end of its last transfer slice

    def us(self, ns: int) -> float:
        return round((ns - self.origin_ns) / 1000, 3)

    def emit(self, ph: str, ts_ns: int, pid: int, tid: int, **fields: Any) -> None:
        self.events.append({"ph": ph, "ts": self.us(ts_ns), "pid": pid, "tid": tid, **fields})

    def slice(self, pid: int, tid: int, name: str, cat: str, start_ns: int, end_ns: int, args: dict[str, Any]) -> None:
        self.emit("X", start_ns, pid, tid, dur=round((end_ns - start_ns) / 1000, 3), name=name, cat=cat, args=args)

    def metadata(self, pid: int, name: str, threads: dict[int, str]) -> None:
        self.events.append({"ph": "M", "pid": pid, "tid": 0, "name": "process_name", "args": {"name": name}})
        self.events.append({"ph": "M", "pid": pid, "tid": 0, "name": "process_sort_index", "args": {"sort_index": pid}})
        for tid, thread in threads.items():
            self.events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": thread}})

    # ---- one process ----------------------------------------------------------------------------
    def add_trace(self, pid: int, trace: Trace, name: str) -> None:
        threads = {ENGINE_TID: "engine"}
        if any(e.kind.startswith("kv_transfer.") for r in trace.records for e in r.events):
            threads[TRANSFER_TID] = "kv transfer"
        self.metadata(pid, name, threads)
        spans = _RequestSpans(pid, self.emit)
        for record in trace.records:
            self.step(pid, record)
            self.counters(pid, record)
            for event in record.events:
                self.request_event(spans, record, event)
                self.transfer_event(pid, record, event)
        if trace.records:
            spans.finish_all(trace.records[-1].end_ns)

    def step(self, pid: int, record: StepRecord) -> None:
        d = record.to_dict()
        args = {k: d[k] for k in ("scheduled", "phases", "num_waiting", "num_running", "kv", "timing")}
        self.slice(pid, ENGINE_TID, f"step {record.step}", "step", record.start_ns, record.end_ns, args)
        cursor = record.start_ns
        for stage in STAGES:  # laid end to end in the order step() runs them, clipped to the step
            if stage not in record.timing:
                continue
            end = min(cursor + int(record.timing[stage] * 1e6), record.end_ns)
            self.slice(pid, ENGINE_TID, stage, "stage", cursor, end, {"ms": record.timing[stage]})
            cursor = end

    def counters(self, pid: int, record: StepRecord) -> None:
        tokens = dict.fromkeys(TOKEN_PHASES, 0)
        for rid, n in record.scheduled.items():
            phase = record.phases.get(rid, "prefill")
            tokens[phase] = tokens.get(phase, 0) + n
        self.emit("C", record.start_ns, pid, ENGINE_TID, name="tokens per step", args=tokens)
        kv = record.kv
        self.emit(
            "C",
            record.end_ns,
            pid,
            ENGINE_TID,
            name="KV blocks",
            args={"used": kv.used, "cached_free": kv.cached_free, "free": kv.free},
        )
        self.emit(
            "C",
            record.end_ns,
            pid,
            ENGINE_TID,
            name="queues",
            args={"waiting": record.num_waiting, "running": record.num_running},
        )

    def request_event(self, spans: _RequestSpans, record: StepRecord, event: Event) -> None:
        if not isinstance(event, _REQUEST_EVENTS) or event.request_id in spans.done:
            return
        rid = event.request_id
        if isinstance(event, RequestAdded):
            spans.start(rid, event.arrival_ns or record.start_ns, _payload(event))
            return
        if rid not in spans.open:  # its request.added lies before the trace began
            spans.start(rid, record.start_ns, {"request_id": rid})
        if isinstance(event, RequestScheduled):
            spans.move(rid, SPAN_OF_PHASE.get(event.phase, "prefill"), record.start_ns, _payload(event))
        elif isinstance(event, RequestTokens) and spans.open[rid] == "prefill":
            spans.move(rid, "decode", record.end_ns)  # the first token closes the prefill
        elif isinstance(event, RequestPreempted):
            spans.move(rid, "queued", record.start_ns, _payload(event))
        elif isinstance(event, RequestFinished):
            spans.finish(rid, record.end_ns, _payload(event))

    # ---- KV transfers -----------------------------------------------------------------------------
    def transfer_event(self, pid: int, record: StepRecord, event: Event) -> None:
        if event.kind not in ("kv_transfer.save", "kv_transfer.load"):
            return
        # the kind names a KVTransferSave or KVTransferLoad (`ms` and `remote_request_id` are read as optional: a
        # stand-in with the kind and request_id will do)
        rid = cast(KVTransferDone, event).request_id
        timing = record.timing
        # save runs after the forward pass (wait_for_save), load before it (start_load_kv)
        offset_ms = timing.get("schedule", 0.0) + (timing.get("forward", 0.0) if event.kind.endswith("save") else 0)
        key = (pid, TRANSFER_TID)
        start = max(record.start_ns + int(offset_ms * 1e6), self._cursor.get(key, 0))
        end = start + max(int((getattr(event, "ms", None) or 0.0) * 1e6), _MIN_SLICE_NS)
        self._cursor[key] = end
        self.slice(pid, TRANSFER_TID, event.kind, FLOW_CAT, start, end, _payload(event))
        step_anchor = _Anchor(pid, ENGINE_TID, (record.start_ns + record.end_ns) // 2)
        transfer_anchor = _Anchor(pid, TRANSFER_TID, (start + end) // 2)
        if event.kind.endswith("save"):
            self.transfers.saves[rid] = (step_anchor, transfer_anchor)
        else:  # the decode side may know the producer's request under another id
            producer_id = getattr(event, "remote_request_id", None) or rid
            self.transfers.loads[producer_id] = (transfer_anchor, step_anchor)

    def flows(self) -> None:
        """One arrow per transferred request, through every anchor it has, in time order."""
        for flow_id, rid in enumerate(sorted(set(self.transfers.saves) | set(self.transfers.loads)), 1):
            anchors = [*self.transfers.saves.get(rid, ()), *self.transfers.loads.get(rid, ())]
            anchors.sort(key=lambda a: a.ts_ns)
            for i, a in enumerate(anchors):
                ph = "s" if i == 0 else "f" if i == len(anchors) - 1 else "t"
                extra = {} if ph == "s" else {"bp": "e"}  # bind to the enclosing slice, not the next one
                self.emit(
                    ph,
                    a.ts_ns,
                    a.pid,
                    a.tid,
                    id=flow_id,
                    cat=FLOW_CAT,
                    name="kv transfer",
                    args={"request_id": rid},
                    **extra,
                )

    def result(self) -> dict[str, Any]:
        # metadata first, then by time; the sort is stable, so a parent slice stays before its children
        events = sorted(self.events, key=lambda e: (e["ph"] != "M", e.get("ts", 0.0)))
        return {"traceEvents": events, "displayTimeUnit": "ms"}


def _origin_ns(traces: Sequence[Trace]) -> int:
    instants = [r.start_ns for t in traces for r in t.records]
    instants += [
        e.arrival_ns
        for t in traces
        for r in t.records
        for e in r.events
        if isinstance(e, RequestAdded) and e.arrival_ns
    ]
    return min(instants, default=0)


def _process_name(trace: Trace, index: int, count: int) -> str:
    model = (trace.header.get("model") or {}).get("name", "?")
    instance = trace.header.get("instance") or ("engine" if count == 1 else f"engine {index}")
    return f"{instance} ({model})"


def chrome_trace(traces: Trace | Sequence[Trace]) -> dict[str, Any]:
    """The Chrome trace (a dict with `traceEvents` and `displayTimeUnit`) of one trace or of several
    instances' traces (one process each, sharing the wall clock)."""
    traces = [traces] if isinstance(traces, Trace) else list(traces)
    builder = _ChromeTraceBuilder(_origin_ns(traces))
    for index, trace in enumerate(traces):
        builder.add_trace(index + 1, trace, _process_name(trace, index, len(traces)))
    builder.flows()
    return builder.result()


def export_chrome_trace(trace: Trace | Sequence[Trace], path: str | os.PathLike) -> dict[str, Any]:
    """Write the Chrome trace of `trace` (or of several instances' traces) to `path`; returns it."""
    result = chrome_trace(trace)
    Path(path).write_text(json.dumps(result, separators=(",", ":")), encoding="utf-8")
    return result
