"""Data parallelism in the Parallelism tab: each replica's load over time and every routing decision with the score
each replica had at that moment, from a DP front end's records (dp.load, dp.routed, dp.replica_dead). Hidden until
the first such event: an engine that is not a front end sends none."""

from __future__ import annotations

from collections.abc import Callable

import panel as pn
from bokeh.models import HoverTool
from bokeh.models.widgets import DataTable, TableColumn

from engine.events import DPLoad, DPRouted
from workbench.state import ParallelState, StepDelta
from workbench.views.base import SourceBuffer, counts_on, legend_above, new_figure
from workbench.views.colors import REQUEST_PALETTE

MARKERS = {"waiting": "triangle", "running": "circle"}


def replica_color(index: int) -> str:
    return REQUEST_PALETTE[index % len(REQUEST_PALETTE)]


class DataParallelSection:
    """Owns the data-parallel part of the Parallelism tab: `loads`, a point per replica, dp.load and count
    (waiting, running) at seconds since the first DP event (`origin_ns`); `routes`, a table row per routing
    decision; and a summary of the state's replicas, requests per replica and deaths. `buffer` makes the
    SourceBuffers (the owning view's, so that it flushes and clears them)."""

    def __init__(self, buffer: Callable[..., SourceBuffer]) -> None:
        self.loads = buffer(
            ["t", "count", "replica", "what", "series", "step", "kv_used", "color", "marker"], name="dp_loads"
        )
        self.routes = buffer(
            ["step", "request_id", "replica", "rule", "scores", "waiting", "running", "prefix_hit_blocks"],
            name="dp_routes",
        )
        self.origin_ns: int | None = None
        self.summary = pn.pane.Markdown("", margin=(0, 10))
        # the figure and table are built at the first DP event: most engines send none, and a dashboard's every
        # session would pay for them (a Bokeh figure costs a good part of a second on a loaded 2-core machine)
        self.panel = pn.Column(sizing_mode="stretch_width", visible=False)

    def _load_figure(self):
        fig = new_figure(
            "Each replica's load: waiting (x 4 in the score) and running requests",
            x_axis_label="s since the first routing event",
            y_axis_label="requests",
        )
        points = fig.scatter(
            x="t", y="count", source=self.loads.source, color="color", marker="marker", size=8, legend_field="series"
        )
        fig.add_tools(
            HoverTool(
                renderers=[points],
                tooltips=[
                    ("replica", "@replica"),
                    ("", "@what @count"),
                    ("KV blocks used", "@kv_used"),
                    ("record", "@step"),
                ],
            )
        )
        counts_on(fig.yaxis)
        legend_above(fig)
        return fig

    def _table(self) -> DataTable:
        columns = [
            TableColumn(field="step", title="record"),
            TableColumn(field="request_id", title="request"),
            TableColumn(field="replica", title="sent to"),
            TableColumn(field="rule", title="rule"),
            TableColumn(field="scores", title="score per replica (waiting x 4 + running)"),
            TableColumn(field="waiting", title="waiting"),
            TableColumn(field="running", title="running"),
            TableColumn(field="prefix_hit_blocks", title="cached prefix blocks"),
        ]
        return DataTable(
            source=self.routes.source, columns=columns, height=200, index_position=None, sizing_mode="stretch_width"
        )

    def render(self, state: ParallelState, delta: StepDelta) -> None:
        if not (delta.dp_loads or delta.dp_routes or delta.dp_dead):
            return
        if not self.panel.objects:
            self.panel.extend(
                [
                    "### Data parallelism: replicas behind the load balancer",
                    self.summary,
                    pn.pane.Bokeh(self._load_figure()),
                    pn.pane.Bokeh(self._table()),
                ]
            )
        self.panel.visible = True
        for decision in delta.dp_routes:  # a record's decisions precede its loads: the origin is the earliest
            self._route(decision)
        for load in delta.dp_loads:
            self._load(load)
        self.summary.object = self._summary(state)

    def _seconds(self, time_ns: int) -> float:
        if self.origin_ns is None:
            self.origin_ns = time_ns
        return (time_ns - self.origin_ns) / 1e9

    def _load(self, load: DPLoad) -> None:
        t = self._seconds(load.time_ns)
        for what, count in (("waiting", load.waiting), ("running", load.running)):
            self.loads.append(
                t=t,
                count=count,
                replica=load.replica,
                what=what,
                series=f"{load.replica} {what}",
                step=load.step,
                kv_used=load.kv_used,
                color=replica_color(load.replica_index),
                marker=MARKERS[what],
            )

    def _route(self, decision: DPRouted) -> None:
        self._seconds(decision.time_ns)

        def cells(values: tuple) -> str:
            return " · ".join(str(v) for v in values)

        self.routes.append(
            step=decision.step,
            request_id=decision.request_id,
            replica=decision.replica,
            rule=decision.rule,
            scores=cells(decision.scores),
            waiting=cells(decision.waiting),
            running=cells(decision.running),
            prefix_hit_blocks=cells(decision.prefix_hit_blocks),
        )

    @staticmethod
    def _summary(state: ParallelState) -> str:
        sent: dict[str, int] = {}
        for decision in state.routes:
            sent[decision.replica] = sent.get(decision.replica, 0) + 1
        per_replica = ", ".join(f"{name} {n}" for name, n in sorted(sent.items())) or "none yet"
        dead = "".join(f" · **{name} died**: {error}" for name, error in state.dead.items())
        return (
            f"data_parallel_size={state.data_parallel_size} · {len(state.routes)} requests routed ({per_replica}){dead}"
        )

    def reset(self) -> None:
        self.origin_ns = None
        self.summary.object = ""
        self.panel.visible = False
