"""Mixture-of-experts routing: the tokens each expert took in each sparse layer, in the last step and since the
first one. Empty until the first moe.routed event (a dense model never sends one; the Dashboard adds this tab then)."""

from __future__ import annotations

import panel as pn
from bokeh.models import DataRange1d, HoverTool
from bokeh.palettes import Blues256
from bokeh.plotting import figure
from bokeh.transform import linear_cmap

from engine.events import StepRecord
from workbench.state import EngineState, StepDelta
from workbench.views.base import SourceBuffer, View, counts_on, label_ticks, new_figure
from workbench.views.empty import EmptyState

COLUMNS = ["x", "y", "layer", "expert", "tokens", "share"]


class MoEView(View):
    """Owns the expert-load view: two heatmaps with a row per sparse layer and a column per expert, coloured by
    the tokens routed there relative to that heatmap's busiest cell (hover gives the count): `step_cells` for the
    last step that ran the model, `total_cells` since the first. The counts are the state's `moe`."""

    title = "Experts"

    def __init__(self, state: EngineState | None = None) -> None:
        super().__init__(state)
        self.step_cells = self.buffer(COLUMNS, name="moe_step")
        self.total_cells = self.buffer(COLUMNS, name="moe_total")
        self._shape: tuple[tuple[int, ...], int] = ((), 0)
        self.summary = pn.pane.Markdown("", margin=(0, 10))
        self.step_figure = self._heatmap(self.step_cells, "Tokens per expert and layer, this step")
        self.total_figure = self._heatmap(self.total_cells, "Tokens per expert and layer, since the first step")
        content = pn.Column(
            self.summary,
            pn.Row(pn.pane.Bokeh(self.step_figure), pn.pane.Bokeh(self.total_figure), sizing_mode="stretch_width"),
            sizing_mode="stretch_width",
        )
        self.empty = EmptyState(
            "No expert routing yet: this view fills in when moe.routed events arrive "
            "(a mixture-of-experts model, such as Qwen3-MoE).",
            content,
        )

    @staticmethod
    def _heatmap(buf: SourceBuffer, title: str) -> figure:
        # the first layer on top, as a model is drawn
        fig = new_figure(
            title, height=300, x_axis_label="expert", y_axis_label="layer", y_range=DataRange1d(flipped=True)
        )
        # shares in [0, 1]: the colours keep their meaning as counts grow (no colour bar to rescale)
        cells = fig.rect(
            x="x",
            y="y",
            width=0.95,
            height=0.9,
            source=buf.source,
            line_color=None,
            fill_color=linear_cmap("share", list(reversed(Blues256)), 0, 1),
        )
        fig.add_tools(
            HoverTool(renderers=[cells], tooltips=[("layer", "@layer"), ("expert", "@expert"), ("tokens", "@tokens")])
        )
        label_ticks(fig.yaxis, buf.source, "y", "layer")
        counts_on(fig.xaxis)
        return fig

    @property
    def panel(self) -> pn.Column:
        return self.empty.panel

    def render(self, record: StepRecord, delta: StepDelta) -> None:
        if not delta.moe_routed:
            return
        moe = self.state.moe
        self.empty.fill()
        if self._shape != (moe.layers, moe.num_experts):  # the first routed step: lay out the grid once
            self._shape = (moe.layers, moe.num_experts)
            grid: dict[str, list[float]] = {c: [] for c in COLUMNS}
            for row, layer in enumerate(moe.layers):
                for expert in range(moe.num_experts):
                    for c, v in zip(COLUMNS, (expert, row, layer, expert, 0, 0.0)):
                        grid[c].append(v)
            self.step_cells.replace(grid)
            self.total_cells.replace(grid)
        self._fill(self.step_cells, moe.step_counts)
        self._fill(self.total_cells, moe.total)
        routed = sum(moe.step_counts[0]) if moe.step_counts else 0
        self.summary.object = (
            f"{len(moe.layers)} sparse layers × {moe.num_experts} experts · step {moe.step}: "
            f"{routed} token-expert choices per layer · {moe.num_steps} steps routed"
        )

    @staticmethod
    def _fill(buf: SourceBuffer, counts: list[list[int]]) -> None:
        busiest = max((max(row) for row in counts), default=0) or 1
        width = len(counts[0]) if counts else 0
        for row, values in enumerate(counts):
            for expert, n in enumerate(values):
                index = row * width + expert
                if buf.get(index, "tokens") != n:  # a patch carries only the cells that changed
                    buf.set(index, tokens=n)
                share = n / busiest
                if buf.get(index, "share") != share:
                    buf.set(index, share=share)

    def reset(self) -> None:
        super().reset()
        self._shape = ((), 0)
        self.summary.object = ""
        self.empty.clear()
