"""The scheduler timeline: what each step spent its token budget on, and how deep the queues were."""

from __future__ import annotations

import panel as pn
from bokeh.models import HoverTool

from engine.events import StepRecord
from workbench.state import EngineState, StepDelta
from workbench.views.base import View, counts_on, fit_to, legend_above, new_figure

PHASE_COLORS = {"prefill": "#1f77b4", "chunk": "#9467bd", "decode": "#2ca02c", "verify": "#d62728"}


class SchedulerTimeline(View):
    """Owns the scheduler timeline: per step, the tokens each request got, stacked and coloured by phase
    (prefill, chunk, decode, verify), the token budget in the title and as a line (clipped: the axis fits the
    bars), when each step's tokens came back (the next step's, with asynchronous scheduling), and the waiting and
    running queue depths."""

    title = "Scheduler timeline"

    def __init__(self, state: EngineState | None = None, budget: int | None = None) -> None:
        super().__init__(state)
        self.segments = self.buffer(
            ["step", "bottom", "top", "request_id", "phase", "num_tokens", "color", "back_at"],
            name="scheduler_timeline",
        )
        self.asynchronous = False  # seen a step that took the previous step's tokens
        self.steps = self.buffer(["step", "total", "budget", "num_waiting", "num_running"], name="scheduler_steps")
        self.tokens_figure = self._tokens_figure()
        self._panel = pn.Column(
            pn.pane.Bokeh(self.tokens_figure), pn.pane.Bokeh(self._queues_figure()), sizing_mode="stretch_width"
        )
        self.budget = budget

    @property
    def budget(self) -> int | None:
        return self._budget

    @budget.setter
    def budget(self, budget: int | None) -> None:
        self._budget = budget
        self._retitle()

    def _retitle(self) -> None:
        suffix = f" (budget {self._budget})" if self._budget else ""
        if self.asynchronous:
            suffix += ", scheduled asynchronously: a step's tokens come back in the next step"
        self.tokens_figure.title.text = f"Tokens per step, by request and phase{suffix}"

    def _tokens_figure(self):
        fig = new_figure("Tokens per step, by request and phase", x_axis_label="step", y_axis_label="tokens")
        bars = fig.vbar(
            x="step",
            width=0.8,
            bottom="bottom",
            top="top",
            fill_color="color",
            line_color="white",
            source=self.segments.source,
            legend_field="phase",
        )
        fig.step(
            x="step",
            y="budget",
            source=self.steps.source,
            mode="center",
            color="black",
            line_dash="dashed",
            legend_label="token budget",
        )
        fit_to(fig, bars)
        counts_on(fig.xaxis, fig.yaxis)
        fig.add_tools(
            HoverTool(
                renderers=[bars],
                tooltips=[
                    ("step", "@step"),
                    ("request", "@request_id"),
                    ("phase", "@phase"),
                    ("tokens", "@num_tokens"),
                    ("sampled tokens back at", "@back_at"),
                ],
            )
        )
        legend_above(fig)
        self._x_range = fig.x_range
        return fig

    def _queues_figure(self):
        fig = new_figure(
            "Queue depths", height=190, x_range=self._x_range, x_axis_label="step", y_axis_label="requests"
        )
        fig.step(
            x="step",
            y="num_waiting",
            source=self.steps.source,
            mode="center",
            color="#ff7f0e",
            line_width=2,
            legend_label="waiting",
        )
        fig.step(
            x="step",
            y="num_running",
            source=self.steps.source,
            mode="center",
            color="#2ca02c",
            line_width=2,
            legend_label="running",
        )
        fig.y_range.start = 0
        counts_on(fig.xaxis, fig.yaxis)
        legend_above(fig)
        return fig

    @property
    def panel(self) -> pn.Column:
        return self._panel

    def render(self, record: StepRecord, delta: StepDelta) -> None:
        # synchronous steps take their own batch's tokens; asynchronous ones the previous batch's (or none: 0)
        if record.outputs_of_step not in (None, record.step) and not self.asynchronous:
            self.asynchronous = True
            self._retitle()
        back_at = f"step {record.step + 1}" if self.asynchronous else f"step {record.step}"
        bottom = 0
        for rid, num_tokens in record.scheduled.items():
            phase = record.phases.get(rid, "")
            self.segments.append(
                step=record.step,
                bottom=bottom,
                top=bottom + num_tokens,
                request_id=rid,
                phase=phase,
                num_tokens=num_tokens,
                color=PHASE_COLORS.get(phase, "#7f7f7f"),
                back_at=back_at,
            )
            bottom += num_tokens
        self.steps.append(
            step=record.step,
            total=bottom,
            budget=self.budget,
            num_waiting=record.num_waiting,
            num_running=record.num_running,
        )
