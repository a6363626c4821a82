"""Speculative decoding: which draft tokens the target model accepted, step by step, and acceptance by position.
Empty until the first spec.* event (an engine with a speculative_config)."""
from __future__ import annotations

import panel as pn
from bokeh.models import HoverTool, Range1d

from engine.events import StepRecord
from workbench.state import EngineState, StepDelta, Verification
from workbench.views.base import View, counts_on, label_ticks, legend_above, new_figure
from workbench.views.empty import EmptyState

ACCEPTED, REJECTED, BONUS, RECOVERED = "#2ca02c", "#d62728", "#f2b701", "#9467bd"


class SpecDecodeView(View):
    """Owns the speculative-decoding view: one row per (step, request) verification, a cell per draft position
    (green accepted, red rejected; hover gives p_target and p_draft), then the token the step emitted after
    the accepted prefix (gold: the bonus token, all drafts accepted; purple: the recovered token after a
    rejection); and the acceptance rate by draft position, from the state's `spec`. Shows an empty state until
    the first spec.* event. Above them, the method and, for guided requests, how many drafts the grammar cut
    before verification."""

    title = "Speculative decoding"

    def __init__(self, state: EngineState | None = None) -> None:
        super().__init__(state)
        self.cells = self.buffer(["x", "y", "step", "request_id", "row", "token_id", "outcome", "p_target",
                                  "p_draft", "color"], name="spec_tokens")
        self.by_position = self.buffer(["position", "proposed", "accepted", "rate"], name="spec_acceptance")
        self._rows = 0
        self.methods = pn.pane.Markdown("", margin=(0, 10))
        content = pn.Column(self.methods, pn.Row(pn.pane.Bokeh(self._tokens_figure()),
                                                 pn.pane.Bokeh(self._acceptance_figure()),
                                                 sizing_mode="stretch_width"), sizing_mode="stretch_width")
        self.empty = EmptyState("No speculative decoding yet: this view fills in when spec events arrive "
                                "(an engine with a speculative_config).", content)

    def _tokens_figure(self):
        fig = new_figure("Draft tokens per step and request", height=300, x_axis_label="draft position",
                         y_axis_label="verification (newest at the bottom)")
        cells = fig.rect(x="x", y="y", width=0.9, height=0.85, source=self.cells.source, fill_color="color",
                         line_color=None, legend_field="outcome")
        fig.add_tools(HoverTool(renderers=[cells], tooltips=[
            ("step", "@step"), ("request", "@request_id"), ("position", "@x"), ("token", "@token_id"),
            ("outcome", "@outcome"), ("p target / draft", "@p_target{0.000} / @p_draft{0.000}")]))
        label_ticks(fig.yaxis, self.cells.source, "y", "row")
        counts_on(fig.xaxis)
        legend_above(fig)
        return fig

    def _acceptance_figure(self):
        fig = new_figure("Acceptance rate by draft position", height=300, x_axis_label="draft position",
                         y_axis_label="accepted / proposed", y_range=Range1d(0, 1.05))
        counts_on(fig.xaxis)
        bars = fig.vbar(x="position", top="rate", width=0.8, source=self.by_position.source, color=ACCEPTED)
        fig.add_tools(HoverTool(renderers=[bars], tooltips=[
            ("position", "@position"), ("accepted", "@accepted / @proposed"), ("rate", "@rate{0.00}")]))
        return fig

    @property
    def panel(self) -> pn.Column:
        return self.empty.panel

    def render(self, record: StepRecord, delta: StepDelta) -> None:
        if not (delta.spec_proposed or delta.verifications):
            return
        self.empty.fill()
        text = f"method: {self.state.spec.method}"
        if self.state.spec.num_cut_by_grammar:  # guided requests: drafts that never reached verification
            text += f" · drafts cut by the grammar: {self.state.spec.num_cut_by_grammar}"
        if self.state.spec.method and self.methods.object != text:
            self.methods.object = text
        for verification in delta.verifications:
            self._verified(verification)
        for position in sorted(delta.spec_positions):
            self._count(position)

    def _verified(self, v: Verification) -> None:
        y = -self._rows
        self._rows += 1
        row = dict(y=y, step=v.step, request_id=v.request_id, row=f"step {v.step} · {v.request_id}")
        for position, (token, ok, p_target, p_draft) in enumerate(v.positions()):
            self.cells.append(x=position, token_id=token, outcome="accepted" if ok else "rejected", p_target=p_target,
                              p_draft=p_draft, color=ACCEPTED if ok else REJECTED, **row)
        self.cells.append(x=len(v.draft_token_ids), token_id=v.emitted_token,
                          outcome="bonus" if v.bonus else "recovered", p_target=None, p_draft=None,
                          color=BONUS if v.bonus else RECOVERED, **row)

    def _count(self, position: int) -> None:
        spec = self.state.spec
        while len(self.by_position) <= position:
            self.by_position.append(position=len(self.by_position), proposed=0, accepted=0, rate=0.0)
        self.by_position.set(position, proposed=spec.proposed[position], accepted=spec.accepted[position],
                             rate=spec.rate(position))

    def reset(self) -> None:
        super().reset()
        self._rows = 0
        self.methods.object = ""
        self.empty.clear()
