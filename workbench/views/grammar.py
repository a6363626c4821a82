"""Guided decoding: for each guided request, its output so far with the number of tokens the grammar allowed
at each position, and what compiling each grammar cost. Empty until the first grammar.* event."""

from __future__ import annotations

import panel as pn
from bokeh.models import HoverTool
from bokeh.models.annotations import ColorBar
from bokeh.models.widgets import DataTable, NumberFormatter, TableColumn
from bokeh.transform import log_cmap

from engine.events import StepRecord
from workbench.state import EngineState, GrammarPosition, StepDelta
from workbench.views.base import View, counts_on, label_ticks, new_figure
from workbench.views.empty import EmptyState

_VOCAB = 49152  # the colour scale's top: SmolLM2's vocabulary (a position that allows every token)


class GrammarView(View):
    """Owns the grammar view: one lane per guided request, one cell per output position coloured by how many
    tokens the grammar allowed there (log scale) and labelled with the token sampled; and a table of grammar
    compile times, from the state's `grammar`. Shows an empty state until the first grammar.* event."""

    title = "Grammar"

    def __init__(self, state: EngineState | None = None) -> None:
        super().__init__(state)
        self.cells = self.buffer(
            ["x", "y", "request_id", "num_allowed_tokens", "sampled_token", "text", "terminated", "jump_forward"],
            name="grammar_steps",
        )
        self.compiled = self.buffer(["request_id", "ms", "cache_hit"], name="grammar_compiled")
        self._lane: dict[str, int] = {}  # request id -> its row, in the order of their first grammar step
        table = DataTable(
            source=self.compiled.source,
            height=120,
            width=360,
            index_position=None,
            columns=[
                TableColumn(field="request_id", title="request"),
                TableColumn(field="ms", title="compile ms", formatter=NumberFormatter(format="0.0")),
                TableColumn(field="cache_hit", title="cache hit"),
            ],
        )
        content = pn.Column(pn.pane.Bokeh(self._figure()), pn.pane.Bokeh(table), sizing_mode="stretch_width")
        self.empty = EmptyState(
            "No guided request yet: this view fills in when grammar events arrive "
            "(requests with a JSON schema, regex, choice or grammar).",
            content,
        )

    def _figure(self):
        fig = new_figure(
            "Allowed tokens per output position (guided requests)",
            height=280,
            x_axis_label="output position",
            y_axis_label="request",
        )
        colors = log_cmap("num_allowed_tokens", "Viridis256", 1, _VOCAB)
        cells = fig.rect(
            x="x", y="y", width=0.95, height=0.9, source=self.cells.source, line_color=None, fill_color=colors
        )
        fig.text(
            x="x",
            y="y",
            text="text",
            source=self.cells.source,
            text_align="center",
            text_baseline="middle",
            text_font_size="9px",
            text_color="white",
        )
        fig.add_tools(
            HoverTool(
                renderers=[cells],
                tooltips=[
                    ("request", "@request_id"),
                    ("position", "@x"),
                    ("allowed tokens", "@num_allowed_tokens"),
                    ("token", "@sampled_token @text"),
                    ("terminated", "@terminated"),
                    ("forced next", "@jump_forward"),
                ],
            )
        )
        label_ticks(fig.yaxis, self.cells.source, "y", "request_id")
        counts_on(fig.xaxis)
        fig.add_layout(ColorBar(color_mapper=colors["transform"], title="tokens allowed", width=10), "right")
        return fig

    @property
    def panel(self) -> pn.Column:
        return self.empty.panel

    def render(self, record: StepRecord, delta: StepDelta) -> None:
        for compiled in delta.grammar_compiles:
            self.compiled.append(request_id=compiled.request_id, ms=compiled.ms, cache_hit=compiled.cache_hit)
        for position in delta.grammar_steps:
            self._step(position)
        if delta.grammar_compiles or delta.grammar_steps:
            self.empty.fill()

    def _step(self, p: GrammarPosition) -> None:
        lane = self._lane.setdefault(p.request_id, len(self._lane))
        self.cells.append(
            x=p.position,
            y=-lane,
            request_id=p.request_id,
            num_allowed_tokens=p.num_allowed_tokens,
            sampled_token=p.sampled_token,
            text=p.text,
            terminated=p.terminated,
            jump_forward=p.jump_forward or "",
        )

    def reset(self) -> None:
        super().reset()
        self._lane = {}
        self.empty.clear()
