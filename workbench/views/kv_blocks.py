"""The KV block map: every block of the cache as a cell, and the block table of one request over it."""

from __future__ import annotations

import math
from collections.abc import Callable

import panel as pn
from bokeh.models import HoverTool, Range1d, TapTool

from engine.events import StepRecord
from workbench.state import EngineState, StepDelta
from workbench.views.base import View, new_figure
from workbench.views.colors import CACHED_FREE_COLOR, FREE_COLOR, request_color
from workbench.views.sync import drawing

NO_REQUEST = "(none)"
_CELL_COLUMNS = ("x", "y", "block_id", "kind", "holders", "ref_cnt", "hash", "color")


class KVBlockMap(View):
    """Owns the KV block map: one cell per block (ids 1..total; block 0 is the null block), coloured free,
    cached-free, or by the request holding it; hover gives block id, ref count, holders and hash prefix.
    Selecting a request draws its block table over the map, in order; a cell clicked calls `on_block` with its
    block id (the Dashboard opens its life). Caches beyond `max_blocks` show their first `max_blocks` blocks
    (allocation takes the free queue's head, so those are the first used)."""

    title = "KV block map"

    def __init__(self, state: EngineState | None = None, num_blocks: int | None = None, max_blocks: int = 4096) -> None:
        super().__init__(state)
        self.max_blocks = max_blocks
        self.cells = self.buffer(_CELL_COLUMNS, name="kv_block_map")
        self.table = self.buffer(["x", "y", "order", "block_id"], name="kv_block_table")
        self.select = pn.widgets.Select(label="Block table of request", options=[NO_REQUEST], width=220)
        self.select.param.watch(self._on_select, "value")
        self.on_block: Callable[[int], None] | None = None
        self.note = pn.pane.Markdown("", margin=(0, 10))
        self._columns = 32
        self._total = self._num_shown = 0
        self.figure = self._figure()
        self._panel = pn.Column(pn.Row(self.select, self.note), pn.pane.Bokeh(self.figure), sizing_mode="stretch_width")
        self.show_blocks(num_blocks)

    def _figure(self):
        fig = new_figure(
            "KV blocks: free / cached-free / used by request",
            height=200,
            tools="pan,wheel_zoom,reset",
            x_range=Range1d(-0.5, self._columns - 0.5),
            y_range=Range1d(-0.5, 0.5),
        )
        cells = fig.rect(
            x="x",
            y="y",
            width=0.92,
            height=0.92,
            fill_color="color",
            line_color=None,
            source=self.cells.source,
            nonselection_fill_alpha=1.0,  # a cell picked opens its life: the map keeps its colours
        )
        fig.rect(
            x="x",
            y="y",
            width=0.92,
            height=0.92,
            fill_alpha=0,
            line_color="black",
            line_width=2,
            source=self.table.source,
        )
        fig.line(x="x", y="y", source=self.table.source, color="black", line_width=1.5, line_alpha=0.7)
        fig.text(
            x="x",
            y="y",
            text="order",
            source=self.table.source,
            text_align="center",
            text_baseline="middle",
            text_font_size="9px",
        )
        fig.add_tools(
            HoverTool(
                renderers=[cells],
                tooltips=[
                    ("block", "@block_id"),
                    ("state", "@kind"),
                    ("ref count", "@ref_cnt"),
                    ("held by", "@holders"),
                    ("hash", "@hash"),
                ],
            )
        )
        fig.add_tools(TapTool(renderers=[cells]))
        self.cells.source.selected.on_change("indices", self._on_tap)
        fig.axis.visible = False
        fig.grid.visible = False
        return fig

    def _on_tap(self, attr: str, old: list[int], new: list[int]) -> None:
        if new and self.on_block is not None:
            self.on_block(int(self.cells.source.data["block_id"][new[0]]))

    @property
    def panel(self) -> pn.Column:
        return self._panel

    # ---- cells ----------------------------------------------------------------------------------------
    def _cell(self, block_id: int) -> dict:
        block = self.state.block(block_id)
        kind = block.kind
        color = {"free": FREE_COLOR, "cached": CACHED_FREE_COLOR}.get(kind) or request_color(block.holders[0])
        return {
            "kind": kind,
            "holders": ", ".join(block.holders),
            "ref_cnt": block.ref_cnt,
            "hash": (block.block_hash or "")[:12],
            "color": color,
        }

    def show_blocks(self, num_blocks: int | None) -> None:
        """Draw a cache of `num_blocks` blocks, all free, before its first step (None: wait for that step)."""
        if num_blocks:
            self._lay_out(num_blocks)

    def _lay_out(self, total: int) -> None:
        """Place every shown block on the grid (a new cache size): the one O(total) redraw."""
        shown = min(total, self.max_blocks)
        self._total, self._num_shown = total, shown
        self._columns = 32 * max(1, math.ceil(math.sqrt(shown / 1024)))
        rows = max(1, math.ceil(shown / self._columns))
        data: dict[str, list] = {c: [] for c in _CELL_COLUMNS}
        for block_id in range(1, shown + 1):
            row = {
                "x": (block_id - 1) % self._columns,
                "y": -((block_id - 1) // self._columns),
                "block_id": block_id,
                **self._cell(block_id),
            }
            for c in _CELL_COLUMNS:
                data[c].append(row[c])
        self.cells.replace(data)
        self.figure.x_range.update(start=-0.5, end=self._columns - 0.5)
        self.figure.y_range.update(start=-rows + 0.5, end=0.5)
        self.figure.height = min(600, rows * 20) + 60
        self.note.object = f"showing blocks 1..{shown} of {total}" if shown < total else f"{total} blocks"

    def render(self, record: StepRecord, delta: StepDelta) -> None:
        if record.kv.total != self._total:
            self._lay_out(record.kv.total)
        else:
            for block_id in delta.blocks:
                if 1 <= block_id <= self._num_shown:
                    self.cells.set(block_id - 1, **self._cell(block_id))
        if delta.added:
            self.select.options = [NO_REQUEST, *self.state.requests]
        if self.select.value in delta.requests:
            self._draw_table()

    # ---- the selected request's block table -------------------------------------------------------------
    def _draw_table(self) -> None:
        block_ids = [b for b in self.state.block_tables.get(self.select.value, ()) if 1 <= b <= self._num_shown]
        self.table.replace(
            {
                "x": [(b - 1) % self._columns for b in block_ids],
                "y": [-((b - 1) // self._columns) for b in block_ids],
                "order": [str(i) for i in range(len(block_ids))],
                "block_id": block_ids,
            }
        )

    def _on_select(self, event) -> None:
        with drawing(self.panel):
            self._draw_table()

    def show_state(self) -> None:
        self.select.options = [NO_REQUEST, *self.state.requests]

    def reset(self, num_blocks: int | None = None) -> None:
        super().reset()
        self._total = self._num_shown = 0
        self.select.options = [NO_REQUEST]
        self.select.value = NO_REQUEST
        self.show_blocks(num_blocks)
