"""The requests table: every request's status, phase, token counts, latencies, finish reason and growing text."""

from __future__ import annotations

import pandas as pd
import panel as pn
from bokeh.models.widgets import NumberFormatter

from engine.events import StepRecord
from workbench.state import EngineState, RequestState, StepDelta
from workbench.views.base import View

COLUMNS = {  # field: title; the text early and wrapped, so a notebook cell at 1280 px shows it
    "request_id": "request",
    "status": "status",
    "phase": "phase",
    "text": "text",
    "num_prompt_tokens": "prompt",
    "num_output_tokens": "output",
    "num_cached_tokens": "cached",
    "ttft_ms": "TTFT ms",
    "itl_ms": "ITL ms",
    "finish_reason": "finish",
}
_DTYPES = {
    "request_id": "object",
    "status": "object",
    "phase": "object",
    "num_prompt_tokens": "int64",
    "num_output_tokens": "int64",
    "num_cached_tokens": "int64",
    "ttft_ms": "float64",
    "itl_ms": "float64",
    "finish_reason": "object",
    "text": "object",
}


def _row(req: RequestState) -> dict:
    finish = req.finish_reason or ""
    if req.error:
        finish = f"{finish}: {req.error}"
    return {
        "request_id": req.request_id,
        "status": req.status,
        "phase": req.phase,
        "num_prompt_tokens": req.num_prompt_tokens,
        "num_output_tokens": req.num_output_tokens,
        "num_cached_tokens": req.num_cached_tokens,
        "ttft_ms": req.ttft_ms,
        "itl_ms": req.mean_itl_ms,
        "finish_reason": finish,
        "text": req.text,
    }


def _frame(rows: list[dict]) -> pd.DataFrame:
    # explicit dtypes: an empty frame of object columns breaks Tabulator's updates
    return pd.DataFrame(rows, columns=list(COLUMNS)).astype(_DTYPES)


class RequestsView(View):
    """Owns the requests table (a Panel Tabulator): one row per request in arrival order. Its `.value` is
    replaced when a step changed a row (Bokeh's DataTable does not redraw patched cells, and Tabulator's
    stream drops rows in JupyterLab). TTFT runs from arrival to the end of the step that gave the first
    token; ITL is the mean gap between the steps that gave it tokens after that."""

    title = "Requests"

    def __init__(self, state: EngineState | None = None) -> None:
        super().__init__(state)
        self._rows: list[dict] = []
        self._index: dict[str, int] = {}
        self._dirty = False
        float_format = NumberFormatter(format="0.0", nan_format="-")
        self.table = pn.widgets.Tabulator(
            _frame([]),
            show_index=False,
            disabled=True,
            selectable=1,
            height=280,
            sizing_mode="stretch_width",
            titles=COLUMNS,
            widths={"text": 320},
            formatters={"ttft_ms": float_format, "itl_ms": float_format, "text": {"type": "textarea"}},
        )

    @property
    def panel(self) -> pn.widgets.Tabulator:
        return self.table

    def render(self, record: StepRecord, delta: StepDelta) -> None:
        for rid in delta.added:
            self._index[rid] = len(self._rows)
            self._rows.append({})
        for rid in set(delta.added) | delta.requests:
            if rid in self._index:
                self._rows[self._index[rid]] = _row(self.state.requests[rid])
                self._dirty = True

    def show_state(self) -> None:
        for rid, req in self.state.requests.items():
            self._index[rid] = len(self._rows)
            self._rows.append(_row(req))
        self._dirty = True

    def flush(self) -> None:
        if self._dirty:
            self.table.value = _frame(self._rows)
            self._dirty = False

    def reset(self) -> None:
        super().reset()
        self._rows, self._index, self._dirty = [], {}, False
        self.table.value = _frame([])
