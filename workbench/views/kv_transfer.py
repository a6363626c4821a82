"""KV transfers between instances (disaggregated prefill/decode): bytes moved over time by each instance, and
one row per transfer (save, load or failure). Fed with the records of one instance or of several (a
PDCluster's `records()`); empty until the first kv_transfer.* event.

Also the transfer timeline of each request on each instance (`transfer_timeline`, drawn by
`transfer_timeline_figure`): rebuilt from the step records alone, so it reads a live run or a trace alike."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import panel as pn
from bokeh.models import ColumnDataSource, HoverTool
from bokeh.models.widgets import DataTable, NumberFormatter, TableColumn
from bokeh.plotting import figure

from engine.events import StepRecord
from workbench.state import EngineState, StepDelta, Transfer
from workbench.views.base import View, label_ticks, legend_above, new_figure
from workbench.views.empty import EmptyState

KIND_COLORS = {"kv_transfer.save": "#1f77b4", "kv_transfer.load": "#2ca02c", "kv_transfer.fail": "#d62728"}


class KVTransferView(View):
    """Owns the KV-transfer view: cumulative MB moved per instance against wall-clock seconds (from the first
    transfer), and a table of every transfer with its request, instance, tokens, bytes, ms, MB/s and, for a
    failure, its type, the policy's action and the tokens recomputed; all from the state's `kv_transfer`."""

    title = "KV transfer"

    def __init__(self, state: EngineState | None = None) -> None:
        super().__init__(state)
        self.points = self.buffer(["t", "mb", "instance", "kind", "request_id", "color"], name="kv_transfer_bytes")
        self.rows = self.buffer(
            [
                "request_id",
                "instance",
                "kind",
                "num_tokens",
                "mb",
                "ms",
                "mb_per_s",
                "failure",
                "policy_action",
                "num_recomputed_tokens",
            ],
            name="kv_transfers",
        )
        content = pn.Column(pn.pane.Bokeh(self._figure()), pn.pane.Bokeh(self._table()), sizing_mode="stretch_width")
        self.empty = EmptyState(
            "No KV transfer yet: this view fills in when an instance with a kv_transfer_config "
            "saves or loads KV (see engine.kv_transfer.PDCluster).",
            content,
        )

    def _figure(self):
        fig = new_figure("KV moved per instance (MB, cumulative)", x_axis_label="seconds", y_axis_label="MB")
        dots = fig.scatter(x="t", y="mb", source=self.points.source, color="color", size=7)
        fig.add_tools(
            HoverTool(
                renderers=[dots],
                tooltips=[
                    ("request", "@request_id"),
                    ("instance", "@instance"),
                    ("event", "@kind"),
                    ("MB so far", "@mb"),
                ],
            )
        )
        return fig

    def _table(self) -> DataTable:
        number = NumberFormatter(format="0.00")
        return DataTable(
            source=self.rows.source,
            height=180,
            index_position=None,
            sizing_mode="stretch_width",
            columns=[
                TableColumn(field="request_id", title="request"),
                TableColumn(field="instance", title="instance"),
                TableColumn(field="kind", title="event"),
                TableColumn(field="num_tokens", title="tokens"),
                TableColumn(field="mb", title="MB", formatter=number),
                TableColumn(field="ms", title="ms", formatter=number),
                TableColumn(field="mb_per_s", title="MB/s", formatter=number),
                TableColumn(field="failure", title="failure"),
                TableColumn(field="policy_action", title="action"),
                TableColumn(field="num_recomputed_tokens", title="recomputed"),
            ],
        )

    @property
    def panel(self) -> pn.Column:
        return self.empty.panel

    def render(self, record: StepRecord, delta: StepDelta) -> None:
        for transfer in delta.transfers:
            self._transfer(transfer)
        if delta.transfers:
            self.empty.fill()

    def _transfer(self, t: Transfer) -> None:
        origin_ns = self.state.kv_transfer.origin_ns
        assert origin_ns is not None  # the state sets it at its first transfer, this one at the latest
        self.points.append(
            t=(t.end_ns - origin_ns) / 1e9,
            mb=t.instance_mb,
            instance=t.instance,
            kind=t.kind,
            request_id=t.request_id,
            color=KIND_COLORS[t.kind],
        )
        self.rows.append(
            request_id=t.request_id,
            instance=t.instance,
            kind=t.kind.split(".")[1],
            num_tokens=t.num_tokens,
            mb=t.mb,
            ms=t.ms,
            mb_per_s=t.mb_per_s,
            failure=t.failure,
            policy_action=t.policy_action,
            num_recomputed_tokens=t.num_recomputed_tokens,
        )

    def reset(self) -> None:
        super().reset()
        self.empty.clear()


# ---- the transfer timeline ------------------------------------------------------------------------------------
WAITING, LOADING, RUNNING, HELD = "waiting", "loading", "running", "held"
STATE_COLORS = {WAITING: "#ff7f0e", LOADING: "#2ca02c", RUNNING: "#1f77b4", HELD: "#d62728"}


@dataclass(frozen=True)
class TimelineSpan:
    """One stretch of one request's life on one instance (wall-clock ns, comparable across the processes of one
    machine; a change a step's scheduler made is dated at the end of its schedule stage, see `_decided_ns`):
    `waiting` (added, no blocks yet: on a decode instance, the producer's KV not stored yet, or no room),
    `loading` (blocks allocated, the asynchronous load in flight:
    WAITING_FOR_REMOTE_KVS), `running` (scheduled steps, first to finishing), `held` (finished, its blocks kept
    until the asynchronous save that reads them ended: delay_free_blocks). `first_step` and `last_step` are the
    steps the span starts and ends in; `num_blocks` the blocks the request held then."""

    instance: str
    request_id: str
    state: str
    start_ns: int
    end_ns: int
    first_step: int
    last_step: int
    num_blocks: int


@dataclass(frozen=True)
class TimelineMark:
    """A transfer an instance saw end (save, load or fail), dated when the step that collected it had scheduled (an
    asynchronous transfer is collected before that step's schedule; a synchronous one ran in that step), with
    its ms."""

    instance: str
    request_id: str
    kind: str
    step: int
    t_ns: int
    ms: float


@dataclass
class _Life:
    """What one instance's records say of one request, as the timeline needs it: the records of its steps."""

    arrival_ns: int = 0
    added: StepRecord | None = None  # the first record after add_request (its request.added is there)
    allocated: StepRecord | None = None
    scheduled: StepRecord | None = None
    transfer: StepRecord | None = None  # the step that collected its load (or its failed load)
    finished: StepRecord | None = None
    freed: StepRecord | None = None  # the last step that left it without blocks
    num_blocks: int = 0


@dataclass
class TransferTimeline:
    """Owns the spans and transfer marks of every request on every instance, from their StepRecords."""

    spans: list[TimelineSpan] = field(default_factory=list)
    marks: list[TimelineMark] = field(default_factory=list)

    def span(self, instance: str, request_id: str, state: str) -> TimelineSpan | None:
        return next(
            (s for s in self.spans if (s.instance, s.request_id, s.state) == (instance, request_id, state)), None
        )

    def mark(self, instance: str, request_id: str, kind: str) -> TimelineMark | None:
        return next((m for m in self.marks if (m.instance, m.request_id, m.kind) == (instance, request_id, kind)), None)

    @property
    def origin_ns(self) -> int:
        return min([s.start_ns for s in self.spans] + [m.t_ns for m in self.marks], default=0)


def transfer_timeline(records: dict[str, list[StepRecord]]) -> TransferTimeline:
    """Each instance's requests (by instance name, e.g. a PDCluster's `records()`) as spans and transfer marks,
    read through an EngineState per instance (which handles the events). Only requests whose whole life (added
    to finished, and freed) is in the records get spans."""
    timeline = TransferTimeline()
    for instance, recs in records.items():
        state = EngineState()
        lives: defaultdict[str, _Life] = defaultdict(_Life)
        for record in recs:
            delta = state.apply(record)
            for rid in delta.added:
                lives[rid].arrival_ns, lives[rid].added = state.requests[rid].arrival_ns, record
            for rid in record.scheduled:
                lives[rid].scheduled = lives[rid].scheduled or record
            for rid in delta.finished:
                lives[rid].finished = record
            for rid in delta.requests:
                life, blocks = lives[rid], state.block_tables.get(rid)
                if blocks:
                    life.allocated, life.num_blocks = life.allocated or record, len(blocks)
                elif life.allocated is not None:
                    life.freed = record
            for t in delta.transfers:
                kind = t.kind.split(".")[1]
                if kind != "save" and lives[t.request_id].transfer is None:
                    lives[t.request_id].transfer = record
                timeline.marks.append(
                    TimelineMark(instance, t.request_id, kind, record.step, _decided_ns(record), t.ms)
                )
        for rid, life in lives.items():
            timeline.spans.extend(_spans(instance, rid, life))
    return timeline


def _decided_ns(record: StepRecord) -> int:
    """When the step's scheduling was done: its start plus its schedule stage, which includes waiting for an
    asynchronous transfer when nothing could run, collecting finished transfers (freeing held blocks, making loaded
    requests schedulable) and the schedule itself. The step's start would date them before the wait."""
    return record.start_ns + round(record.timing.get("schedule", 0.0) * 1e6)


def _spans(instance: str, rid: str, life: _Life) -> list[TimelineSpan]:
    added, allocated, scheduled, finished, freed = life.added, life.allocated, life.scheduled, life.finished, life.freed
    if (
        added is None
        or allocated is None
        or scheduled is None
        or finished is None
        or freed is None
        or freed.step < finished.step
    ):
        return []  # added before these records began, or still going (or holding its blocks)
    spans = []

    def add(state: str, start_ns: int, end_ns: int, first: StepRecord, last: StepRecord, blocks: int) -> None:
        spans.append(TimelineSpan(instance, rid, state, start_ns, end_ns, first.step, last.step, blocks))

    add(WAITING, life.arrival_ns, _decided_ns(allocated), added, allocated, 0)
    # parked: its blocks allocated in one step, its first tokens scheduled in a later one, once the load landed
    if scheduled.step > allocated.step:
        end = life.transfer or scheduled
        add(LOADING, _decided_ns(allocated), _decided_ns(end), allocated, end, life.num_blocks)
    add(RUNNING, _decided_ns(scheduled), finished.end_ns, scheduled, finished, life.num_blocks)
    if freed.step > finished.step:  # freed when a later step collected the save that read them
        add(HELD, finished.end_ns, _decided_ns(freed), finished, freed, life.num_blocks)
    return spans


def transfer_timeline_figure(timeline: TransferTimeline, title: str = "Requests on each instance") -> figure:
    """A Gantt chart of `timeline`: one row per (instance, request), its spans coloured by state with the blocks
    held in the hover, and a tick where each save or load was collected."""
    origin = timeline.origin_ns
    rows = sorted({(s.instance, s.request_id) for s in timeline.spans}, key=lambda r: (r[1], r[0]))
    y = {row: -i for i, row in enumerate(rows)}
    labels = ColumnDataSource({"y": list(y.values()), "label": [f"{rid} · {inst}" for inst, rid in y]})
    bars = ColumnDataSource(
        {
            "left": [(s.start_ns - origin) / 1e9 for s in timeline.spans],
            "right": [(s.end_ns - origin) / 1e9 for s in timeline.spans],
            "y": [y[(s.instance, s.request_id)] for s in timeline.spans],
            "state": [s.state for s in timeline.spans],
            "color": [STATE_COLORS[s.state] for s in timeline.spans],
            "steps": [f"{s.first_step}-{s.last_step}" for s in timeline.spans],
            "instance": [s.instance for s in timeline.spans],
            "request_id": [s.request_id for s in timeline.spans],
            "num_blocks": [s.num_blocks for s in timeline.spans],
        }
    )
    marks = [m for m in timeline.marks if (m.instance, m.request_id) in y]
    ticks = ColumnDataSource(
        {
            "t": [(m.t_ns - origin) / 1e9 for m in marks],
            "y": [y[(m.instance, m.request_id)] for m in marks],
            "kind": [m.kind for m in marks],
            "ms": [m.ms for m in marks],
            "step": [m.step for m in marks],
        }
    )
    fig = new_figure(title, height=max(160, 40 + 28 * len(rows)), x_axis_label="seconds")
    hbars = fig.hbar(y="y", left="left", right="right", height=0.7, color="color", source=bars, legend_field="state")
    dots = fig.scatter(x="t", y="y", source=ticks, marker="diamond", size=11, color="black", legend_label="transfer")
    fig.add_tools(
        HoverTool(
            renderers=[hbars],
            tooltips=[
                ("request", "@request_id"),
                ("instance", "@instance"),
                ("state", "@state"),
                ("steps", "@steps"),
                ("blocks held", "@num_blocks"),
            ],
        )
    )
    fig.add_tools(
        HoverTool(
            renderers=[dots], tooltips=[("transfer", "@kind"), ("collected in step", "@step"), ("ms", "@ms{0.0}")]
        )
    )
    label_ticks(fig.yaxis, labels, "y", "label")
    legend_above(fig)
    return fig
