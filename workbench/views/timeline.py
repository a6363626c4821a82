"""The scheduler timeline: what each step spent its token budget on, and how deep the queues were."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import panel as pn
from bokeh.models import HoverTool, TapTool

from engine.events import StepRecord
from engine.journey import waiting_by_reason
from workbench.state import RUNNING, EngineState, StepDelta
from workbench.views.base import SourceBuffer, View, counts_on, fit_to, legend_above, new_figure

PHASE_COLORS = {"prefill": "#1f77b4", "chunk": "#9467bd", "decode": "#2ca02c", "verify": "#d62728"}
# the waiting band: one colour per reason a waiting request is held by (engine/reasons.py's codes)
REASON_COLORS = {
    "budget_spent": "#ff7f0e",
    "unchunked_prompt": "#ffbb78",
    "max_num_seqs": "#8c564b",
    "kv_blocks": "#d62728",
    "grammar": "#9467bd",
    "remote_kv": "#17becf",
    "outputs_in_flight": "#bcbd22",
    "head_of_line": "#e377c2",
    "lower_priority": "#f7b6d2",
    "memory_pressure": "#7f7f7f",
    "preempted": "#000000",
}


def _stacked_bars(fig: Any, source: Any, legend_field: str) -> Any:
    """Bars per step from `bottom` to `top` in their row's `color`; a bar picked (one opens a journey) leaves the
    others their colour."""
    return fig.vbar(
        x="step",
        width=0.8,
        bottom="bottom",
        top="top",
        fill_color="color",
        line_color="white",
        source=source,
        legend_field=legend_field,
        nonselection_fill_alpha=1.0,
        nonselection_line_alpha=1.0,
    )


def _stack(
    buffer: SourceBuffer, step: int, rows: list[tuple[int, dict[str, Any]]], color: Callable[[dict[str, Any]], str]
) -> int:
    """Queue one step's bars, stacked in order: each (height, its other columns); returns the stack's top."""
    bottom = 0
    for height, row in rows:
        buffer.append(step=step, bottom=bottom, top=bottom + height, color=color(row), **row)
        bottom += height
    return bottom


class SchedulerTimeline(View):
    """Owns the scheduler timeline: per step, the tokens each request got, stacked and coloured by phase
    (prefill, chunk, decode, verify), the token budget in the title and as a line (clipped: the axis fits the
    bars), when each step's tokens came back (the next step's, with asynchronous scheduling), the waiting and
    running queue depths, and under them the waiting requests by the reason that held each (engine/reasons.py).
    A bar clicked calls `on_request` with its request id (the Dashboard opens its journey)."""

    title = "Scheduler timeline"

    def __init__(self, state: EngineState | None = None, budget: int | None = None) -> None:
        super().__init__(state)
        self.segments = self.buffer(
            ["step", "bottom", "top", "request_id", "phase", "num_tokens", "color", "back_at"],
            name="scheduler_timeline",
        )
        self.asynchronous = False  # seen a step that took the previous step's tokens
        self.steps = self.buffer(["step", "total", "budget", "num_waiting", "num_running"], name="scheduler_steps")
        self.waiting = self.buffer(
            ["step", "bottom", "top", "reason", "num_requests", "color"], name="waiting_by_reason"
        )
        self.on_request: Callable[[str], None] | None = None
        self.tokens_figure = self._tokens_figure()
        self._panel = pn.Column(
            pn.pane.Bokeh(self.tokens_figure),
            pn.pane.Bokeh(self._queues_figure()),
            pn.pane.Bokeh(self._waiting_figure()),
            sizing_mode="stretch_width",
        )
        self.budget = budget
        self.segments.source.selected.on_change("indices", self._on_tap)

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
        bars = _stacked_bars(fig, self.segments.source, "phase")
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
        fig.add_tools(TapTool(renderers=[bars]))
        legend_above(fig)
        self._x_range = fig.x_range
        return fig

    def _waiting_figure(self):
        fig = new_figure(
            "Waiting, by reason", height=170, x_range=self._x_range, x_axis_label="step", y_axis_label="requests"
        )
        bars = _stacked_bars(fig, self.waiting.source, "reason")
        fig.add_tools(
            HoverTool(
                renderers=[bars], tooltips=[("step", "@step"), ("reason", "@reason"), ("waiting", "@num_requests")]
            )
        )
        fit_to(fig, bars)
        counts_on(fig.xaxis, fig.yaxis)
        legend_above(fig)
        return fig

    def _on_tap(self, attr: str, old: list[int], new: list[int]) -> None:
        if new and self.on_request is not None:
            self.on_request(self.segments.source.data["request_id"][new[0]])

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
        phases = {rid: record.phases.get(rid, "") for rid in record.scheduled}
        total = _stack(
            self.segments,
            record.step,
            [
                (n, {"request_id": rid, "phase": phases[rid], "num_tokens": n, "back_at": back_at})
                for rid, n in record.scheduled.items()
            ],
            lambda row: PHASE_COLORS.get(row["phase"], "#7f7f7f"),
        )
        self.steps.append(
            step=record.step,
            total=total,
            budget=self.budget,
            num_waiting=record.num_waiting,
            num_running=record.num_running,
        )
        # after the state applied the step: a running request the budget did not reach is deferred, not waiting
        requests = self.state.requests
        by_reason = waiting_by_reason(record, lambda rid: rid in requests and requests[rid].status == RUNNING)
        rows = [(n, {"reason": reason, "num_requests": n}) for reason, n in sorted(by_reason.items())]
        _stack(self.waiting, record.step, rows, lambda row: REASON_COLORS.get(row["reason"], "#c7c7c7"))
