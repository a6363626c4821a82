"""Tensor parallelism per rank: each step's forward split into compute and communication on every rank, and the
bytes each rank put into its all-reduces and all-gathers, from the parallel.step events. An unsharded engine
(tensor_parallel_size=1) sends none: the tab then says so instead of drawing empty axes. Below, for a data-parallel
front end's records, each replica's load and the routing decisions (workbench/views/data_parallel.py)."""

from __future__ import annotations

import panel as pn
from bokeh.models import HoverTool

from engine.events import StepRecord
from workbench.state import EngineState, ParallelStepRow, StepDelta
from workbench.views.base import View, counts_on, legend_above, new_figure
from workbench.views.data_parallel import DataParallelSection
from workbench.views.empty import EmptyState

PART_COLORS = {"compute": "#1f77b4", "communication": "#ff7f0e", "sample": "#2ca02c"}
KIND_COLORS = {"all_reduce": "#9467bd", "all_gather": "#8c564b"}
WAITING = (
    "No per-rank records yet: this tab fills in at the first step of an engine built with "
    "tensor_parallel_size > 1 (the multiproc executor)."
)
UNSHARDED = (
    "This engine runs unsharded (tensor_parallel_size=1): one process holds the whole model, so there are "
    "no ranks and no collectives to draw. Build it with tensor_parallel_size=2 or more to see them."
)
REPLICAS = (
    "Data parallelism: each replica is a whole engine in its own process (tensor_parallel_size=1), so there "
    "are no ranks to draw; below, each replica's load and where each request went."
)
BAR = 0.8  # of a step's width, shared by its ranks' bars


class ParallelView(View):
    """Owns the per-rank view: `segments`, one bar piece per rank, step and part (compute, communication,
    sample; ranks side by side within a step), `transfers`, one bar piece per step and collective kind (KB of one
    rank's tensors), a summary of the state's `parallel` totals, and the data-parallel section (`dp`)."""

    title = "Parallelism"

    def __init__(self, state: EngineState | None = None) -> None:
        super().__init__(state)
        self.segments = self.buffer(
            ["x", "width", "bottom", "top", "step", "rank", "part", "ms", "color"], name="parallel_segments"
        )
        self.transfers = self.buffer(
            ["x", "bottom", "top", "step", "kind", "count", "kb", "color"], name="parallel_bytes"
        )
        self.summary = pn.pane.Markdown("", margin=(0, 10))
        content = pn.Column(
            self.summary, pn.pane.Bokeh(self._timeline()), pn.pane.Bokeh(self._bytes()), sizing_mode="stretch_width"
        )
        self.empty = EmptyState(WAITING, content)
        self.dp = DataParallelSection(self.buffer)
        self.layout = pn.Column(self.empty.panel, self.dp.panel, sizing_mode="stretch_width")

    def _timeline(self):
        fig = new_figure(
            "Each rank's step: compute, communication (inside collectives), sampling",
            x_axis_label="step (one bar per rank, rank 0 left)",
            y_axis_label="ms",
        )
        bars = fig.vbar(
            x="x",
            width="width",
            bottom="bottom",
            top="top",
            source=self.segments.source,
            color="color",
            legend_field="part",
        )
        fig.add_tools(
            HoverTool(
                renderers=[bars],
                tooltips=[("step", "@step"), ("rank", "@rank"), ("part", "@part"), ("ms", "@ms{0.000}")],
            )
        )
        counts_on(fig.xaxis)
        legend_above(fig)
        return fig

    def _bytes(self):
        fig = new_figure("Collective bytes per step (each rank's tensors)", x_axis_label="step", y_axis_label="KB")
        bars = fig.vbar(
            x="x",
            width=BAR,
            bottom="bottom",
            top="top",
            source=self.transfers.source,
            color="color",
            legend_field="kind",
        )
        fig.add_tools(
            HoverTool(
                renderers=[bars],
                tooltips=[("step", "@step"), ("collective", "@kind"), ("calls", "@count"), ("KB", "@kb{0.0}")],
            )
        )
        counts_on(fig.xaxis)
        legend_above(fig)
        return fig

    @property
    def panel(self) -> pn.Column:
        return self.layout

    def render(self, record: StepRecord, delta: StepDelta) -> None:
        self.dp.render(self.state.parallel, delta)
        row = delta.parallel
        if row is None:
            if self.empty.is_empty and record.scheduled:  # the model ran and no rank reported: one process
                self.empty.message.object = UNSHARDED
            elif self.empty.is_empty and self.dp.panel.visible:
                self.empty.message.object = REPLICAS
            return
        self.empty.fill()
        self._segments(row)
        self._transfers(row)
        self.summary.object = self._summary()

    def _segments(self, row: ParallelStepRow) -> None:
        width = BAR / len(row.ranks)
        for r in row.ranks:
            x, bottom = row.step - BAR / 2 + width * (r.rank + 0.5), 0.0
            for part, ms in (("compute", r.compute_ms), ("communication", r.comm_ms), ("sample", r.sample_ms)):
                self.segments.append(
                    x=x,
                    width=width * 0.9,
                    bottom=bottom,
                    top=bottom + ms,
                    step=row.step,
                    rank=r.rank,
                    part=part,
                    ms=ms,
                    color=PART_COLORS[part],
                )
                bottom += ms

    def _transfers(self, row: ParallelStepRow) -> None:
        rank0, bottom = row.ranks[0], 0.0
        for kind in sorted(rank0.bytes):
            kb = rank0.bytes[kind] / 1e3
            self.transfers.append(
                x=row.step,
                bottom=bottom,
                top=bottom + kb,
                step=row.step,
                kind=kind,
                count=rank0.counts[kind],
                kb=kb,
                color=KIND_COLORS.get(kind, "#7f7f7f"),
            )
            bottom += kb

    def _summary(self) -> str:
        par = self.state.parallel
        ranks = [r for row in par.rows for r in row.ranks]
        forward = sum(r.compute_ms + r.comm_ms for r in ranks) or 1.0
        comm = sum(r.comm_ms for r in ranks) / forward
        reduced = par.bytes.get("all_reduce", 0)
        per_token = f"{reduced / par.num_tokens / 1e3:.1f} KB per token" if par.num_tokens else "no token yet"
        return (
            f"tensor_parallel_size={par.tensor_parallel_size} · {len(par.rows)} steps · forward time "
            f"{1 - comm:.0%} compute, {comm:.0%} communication (all ranks) · {reduced / 1e6:.2f} MB "
            f"all-reduced per rank, {per_token}"
        )

    def reset(self) -> None:
        super().reset()
        self.summary.object = ""
        self.empty.message.object = WAITING
        self.empty.clear()
        self.dp.reset()
