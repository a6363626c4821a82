"""The view of an attached server (workbench/attach.py): its KV cache as its KV events tell it (a map of the block
hashes stored, removed and cleared, and the chains they form), its hit-able prefixes, and its load over time as its
/metrics tell it; with what these sources cannot tell, said plainly. `attach()` opens it in a notebook,
`serve_attach()` serves it (`workbench attach`).

    from workbench.views.attached import attach
    board = attach("tcp://HOST:5557", metrics="http://HOST:8000/metrics", replay="tcp://HOST:5558")
    board          # the cell's output: the live dashboard;  board.close() closes its sockets and threads
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import panel as pn
from bokeh.models import HoverTool, Range1d

from workbench.attach import (
    CLEARED,
    HITTABLE,
    ORPHANED,
    REMOVED,
    UNKNOWABLE,
    AttachedState,
    Attachment,
    HashNode,
    format_hash,
)
from workbench.views.base import SourceBuffer, counts_on, ensure_extension, legend_above, new_figure
from workbench.views.colors import FREE_COLOR
from workbench.views.prefix import chains_figure
from workbench.views.sync import connect, drawing

STATUS_COLORS = {HITTABLE: "#31a354", ORPHANED: "#a1d99b", REMOVED: "#bdbdbd", CLEARED: FREE_COLOR}
SHARED_LINE = "black"  # the outline of a hash several stored chains go on from
_CELL_COLUMNS = ("x", "y", "hash", "parent", "status", "copies", "depth", "tokens", "children", "color", "line")
_METRIC_COLUMNS = ("t", "running", "waiting", "kv_usage", "hit_rate", "prompt_tps", "generation_tps")
MAX_PREFIXES = 200  # the longest prefixes listed (a busy server's cache holds thousands)
_PREFIX_COLUMNS = {"prefix": "last block", "blocks": "blocks", "tokens": "tokens", "first": "first block's tokens"}


def _legend() -> pn.pane.HTML:
    """The map's colours, named (the figure draws one glyph for every status)."""
    swatch = '<span style="display:inline-block;width:12px;height:12px;background:{};{}margin:0 4px 0 12px"></span>{}'
    items = [swatch.format(color, "", status) for status, color in STATUS_COLORS.items()]
    items.append(swatch.format("white", f"border:2px solid {SHARED_LINE};", "a prefix several chains share"))
    return pn.pane.HTML("".join(items), margin=(0, 10))


class AttachedView:
    """Owns the layout of an attached server's view and what it has drawn of an AttachedState: the block-hash map
    (one cell per hash in the order first stored, coloured by status, outlined where a prefix is shared), the chains
    (each hash at its depth, linked to its parent), the hit-able prefixes' table, the metrics over time, a summary
    line, the notes (gaps, restarts) and what cannot be known. `refresh()` draws what changed since the last call
    (a periodic callback calls it); it reads the state under its lock and never changes it."""

    title = "Attached server"

    def __init__(
        self, state: AttachedState, kv_events: str = "", metrics: str | None = None, max_cells: int = 4096
    ) -> None:
        ensure_extension()
        self.state, self.max_cells = state, max_cells
        self.cells = SourceBuffer(_CELL_COLUMNS, name="attached_block_map")
        self.nodes = SourceBuffer(("x", "y", "hash", "parent", "status", "tokens", "color"), name="attached_chains")
        self.links = SourceBuffer(("x0", "y0", "x1", "y1"), name="attached_chain_links")
        self.series = SourceBuffer(_METRIC_COLUMNS, name="attached_metrics")
        self._drawn: list[tuple] = []  # per slot, the cell's changing columns as last drawn
        self._placed: dict[Any, tuple[int, int]] = {}  # hash -> its (x, y) on the chains figure
        self._lanes = 0
        self._continued: set[Any] = set()  # hashes whose chain goes on in their lane
        self._columns = 32
        self._version = -1
        self._epoch = 0
        self._samples_drawn = 0
        source = f"`{kv_events}`" + (f" and `{metrics}`" if metrics else " (no --metrics: no load shown)")
        self.heading = pn.pane.Markdown(f"## Attached: {source}", margin=(0, 10))
        self.summary = pn.pane.Markdown("nothing received yet", margin=(0, 10), css_classes=["attached-summary"])
        self.notes = pn.pane.Alert("", alert_type="warning", visible=False, sizing_mode="stretch_width")
        self.unknowable = pn.pane.Alert(UNKNOWABLE, alert_type="info", sizing_mode="stretch_width")
        self.prefixes = pn.widgets.Tabulator(
            self._prefix_frame([]),
            show_index=False,
            disabled=True,
            height=220,
            sizing_mode="stretch_width",
            titles=_PREFIX_COLUMNS,
        )
        self.map_figure = self._map_figure()
        self._panel = pn.Column(
            self.heading,
            self.summary,
            self.notes,
            pn.Tabs(
                (
                    "KV blocks",
                    pn.Column(_legend(), pn.pane.Bokeh(self.map_figure), self.unknowable, sizing_mode="stretch_width"),
                ),
                (
                    "Prefix cache",
                    pn.Column(
                        f"### Longest hit-able prefixes (the {MAX_PREFIXES} longest)",
                        self.prefixes,
                        pn.pane.Bokeh(self._chains_figure()),
                        sizing_mode="stretch_width",
                    ),
                ),
                ("Metrics", pn.Column(*self._metric_figures(), sizing_mode="stretch_width")),
                dynamic=False,
            ),
            sizing_mode="stretch_width",
        )

    # ---- figures --------------------------------------------------------------------------------------------
    def _map_figure(self) -> Any:
        fig = new_figure(
            "KV block hashes, in the order first stored (a cell is a hash; hover for its chain, copies and tokens)",
            height=200,
            tools="pan,wheel_zoom,reset",
            x_range=Range1d(start=-0.5, end=self._columns - 0.5),
            y_range=Range1d(start=-0.5, end=0.5),
        )
        cells = fig.rect(
            "x", "y", 0.9, 0.9, fill_color="color", line_color="line", line_width=2, source=self.cells.source
        )
        fig.add_tools(
            HoverTool(
                renderers=[cells],
                tooltips=[
                    ("hash", "@hash"),
                    ("parent", "@parent"),
                    ("status", "@status"),
                    ("blocks holding it", "@copies"),
                    ("blocks before it", "@depth"),
                    ("chains going on", "@children"),
                    ("tokens", "@tokens"),
                ],
            )
        )
        fig.axis.visible = False
        fig.grid.visible = False
        return fig

    def _chains_figure(self) -> Any:
        return chains_figure(
            "Chains: each hash at its position, linked to its parent (a new lane where a prefix branches)",
            self.nodes.source,
            self.links.source,
            [("hash", "@hash"), ("parent", "@parent"), ("status", "@status"), ("tokens", "@tokens")],
        )

    def _metric_figures(self) -> list[Any]:
        source = self.series.source
        requests = new_figure(
            "Requests (vllm:num_requests_running, _waiting)", x_axis_label="s", y_axis_label="requests"
        )
        requests.line(x="t", y="running", source=source, line_width=2, legend_label="running")
        requests.line(x="t", y="waiting", source=source, line_width=2, color="#ff7f0e", legend_label="waiting")
        counts_on(requests.yaxis)
        shares = new_figure(
            "KV cache usage (vllm:kv_cache_usage_perc) and prefix-cache hit rate (hits / queries, per scrape)",
            x_axis_label="s",
            y_range=Range1d(start=0, end=1.05),
        )
        shares.line(x="t", y="kv_usage", source=source, line_width=2, legend_label="KV usage")
        shares.scatter(x="t", y="hit_rate", source=source, color="#31a354", size=5, legend_label="hit rate")
        rates = new_figure(
            "Throughput (rates of vllm:prompt_tokens, vllm:generation_tokens)", x_axis_label="s", y_axis_label="tok/s"
        )
        rates.line(x="t", y="prompt_tps", source=source, line_width=2, legend_label="prompt")
        rates.line(x="t", y="generation_tps", source=source, line_width=2, color="#ff7f0e", legend_label="generation")
        for fig in (requests, shares, rates):
            legend_above(fig)
        return [
            pn.Row(pn.pane.Bokeh(requests), pn.pane.Bokeh(shares), sizing_mode="stretch_width"),
            pn.pane.Bokeh(rates),
        ]

    @property
    def panel(self) -> pn.Column:
        return self._panel

    def __panel__(self) -> pn.Column:
        return self._panel

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> Any:
        bundle = self._panel._repr_mimebundle_(include, exclude)
        connect(self._panel)
        return bundle

    # ---- drawing --------------------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Draw what changed in the state since the last call (nothing, if nothing had)."""
        state = self.state
        with state.lock:
            if state.version == self._version:
                return
            self._version = state.version
            if state.epoch != self._epoch:  # a restarted server: its hashes are drawn anew
                self._epoch = state.epoch
                self._forget()
            with drawing(self._panel):
                hittable, children = state.hittable(), state.children()
                shown = list(state.nodes.values())[: self.max_cells]
                if self._grid_for(len(shown)) != self._columns:
                    self._columns = self._grid_for(len(shown))
                    self._drawn = []
                    self.cells.clear()
                for node in shown:
                    self._cell(node, state.status(node.block_hash, hittable), children.get(node.block_hash, 0))
                    self._chain(node, state.status(node.block_hash, hittable))
                rows = max(1, math.ceil(len(shown) / self._columns))
                self.map_figure.y_range.update(start=-rows + 0.5, end=0.5)
                self.map_figure.x_range.update(start=-0.5, end=self._columns - 0.5)
                self.map_figure.height = min(600, rows * 20) + 60
                self._metrics()
                self.prefixes.value = self._prefix_frame(state.prefixes()[:MAX_PREFIXES])
                for buf in (self.cells, self.nodes, self.links, self.series):
                    buf.flush()
                self.summary.object = self._summary(len(hittable))
                self.notes.param.update(object="\n\n".join(state.notes[-8:]), visible=bool(state.notes))

    def _forget(self) -> None:
        self._drawn, self._placed, self._continued, self._lanes = [], {}, set(), 0
        for buf in (self.cells, self.nodes, self.links):
            buf.clear()

    @staticmethod
    def _grid_for(num_cells: int) -> int:
        return 32 * max(1, math.ceil(math.sqrt(num_cells / 1024)))

    def _cell(self, node: HashNode, status: str, children: int) -> None:
        changing = (status, node.copies, children)
        if node.slot < len(self._drawn):
            if self._drawn[node.slot] == changing:
                return
            self._drawn[node.slot] = changing
            self.cells.set(node.slot, **self._cell_values(node, status, children))
            return
        self._drawn.append(changing)
        self.cells.append(
            x=node.slot % self._columns,
            y=-(node.slot // self._columns),
            hash=format_hash(node.block_hash),
            parent=format_hash(node.parent),
            depth="?" if node.depth is None else str(node.depth),
            tokens=" ".join(map(str, node.token_ids[:16])) + (" ..." if len(node.token_ids) > 16 else ""),
            **self._cell_values(node, status, children),
        )

    @staticmethod
    def _cell_values(node: HashNode, status: str, children: int) -> dict[str, Any]:
        return {
            "status": status,
            "copies": node.copies,
            "children": children,
            "color": STATUS_COLORS[status],
            "line": SHARED_LINE if children > 1 else None,
        }

    def _chain(self, node: HashNode, status: str) -> None:
        """Place a hash on the chains figure once (in its parent's lane if its first child, else a new lane), and
        colour it by its status every time."""
        if node.block_hash in self._placed:
            self.nodes.set(node.slot, status=status, color=STATUS_COLORS[status])
            return
        parent = self._placed.get(node.parent) if node.parent is not None else None
        x = node.depth if node.depth is not None else (parent[0] + 1 if parent else 0)
        if parent is not None and node.parent not in self._continued:
            y = parent[1]
            self._continued.add(node.parent)
        else:
            y = -self._lanes
            self._lanes += 1
        if parent is not None:
            self.links.append(x0=parent[0], y0=parent[1], x1=x, y1=y)
        self._placed[node.block_hash] = (x, y)
        self.nodes.append(
            x=x,
            y=y,
            hash=format_hash(node.block_hash),
            parent=format_hash(node.parent),
            status=status,
            tokens=len(node.token_ids),
            color=STATUS_COLORS[status],
        )

    def _metrics(self) -> None:
        samples = list(self.state.samples)
        new = samples[max(0, len(samples) - (self.state.num_samples - self._samples_drawn)) :]
        previous = samples[-len(new) - 1] if len(samples) > len(new) else None
        for sample in new:
            values = sample.values
            self.series.append(
                t=round(sample.t, 3),
                running=values.get("vllm:num_requests_running", math.nan),
                waiting=values.get("vllm:num_requests_waiting", math.nan),
                kv_usage=values.get("vllm:kv_cache_usage_perc", math.nan),
                hit_rate=_or_nan(self.state.hit_rate(previous, sample) if previous else None),
                prompt_tps=_or_nan(self.state.rate("vllm:prompt_tokens_total", previous, sample) if previous else None),
                generation_tps=_or_nan(
                    self.state.rate("vllm:generation_tokens_total", previous, sample) if previous else None
                ),
            )
            previous = sample
        self._samples_drawn = self.state.num_samples

    @staticmethod
    def _prefix_frame(prefixes: list) -> pd.DataFrame:
        frame = pd.DataFrame(
            {
                "prefix": pd.Series([format_hash(p.leaf) for p in prefixes], dtype="object"),
                "blocks": pd.Series([p.num_blocks for p in prefixes], dtype="int64"),
                "tokens": pd.Series([p.num_tokens for p in prefixes], dtype="int64"),
                "first": pd.Series([" ".join(map(str, p.first_token_ids[:16])) for p in prefixes], dtype="object"),
            }
        )
        return frame

    def _summary(self, num_hittable: int) -> str:
        s = self.state
        if s.last_seq < 0 and not s.samples:
            return "nothing received yet"
        resident = s.num_resident_blocks
        blocks = f"{resident} blocks hold {len(s.resident())} stored hashes"
        if s.num_blocks:
            blocks += f" (of the {s.num_blocks} the server's cache has; the rest are free, or held but not full)"
        parts = [
            f"batch {s.last_seq} ({s.num_batches} read)" if s.last_seq >= 0 else "no KV event batch yet",
            blocks,
            f"{num_hittable} hit-able",
            "events: " + ", ".join(f"{n} {name}" for name, n in s.event_counts.items()),
        ]
        if s.ranks:
            parts.append("data-parallel rank " + ", ".join(map(str, sorted(s.ranks))))
        if s.lost_batches or s.unknown_removed:
            parts.append(f"{s.lost_batches} batches lost, {s.unknown_removed} removals of hashes not seen stored")
        line = " · ".join(parts)
        if s.samples:
            m = s.samples[-1].values
            rate = s.hit_rate()
            metrics = [
                f"running {_shown(m.get('vllm:num_requests_running'))}",
                f"waiting {_shown(m.get('vllm:num_requests_waiting'))}",
                f"KV usage {_shown(m.get('vllm:kv_cache_usage_perc'), '.1%')}",
                f"prefix-cache hit rate {_shown(rate, '.1%')} since start",
                f"{_shown(m.get('vllm:request_success_total'))} requests done",
                f"{_shown(m.get('vllm:num_preemptions_total'))} preemptions",
            ]
            line += "\n\n/metrics: " + " · ".join(metrics)
        if s.metrics_error:
            line += f"\n\n/metrics: the last scrape failed: {s.metrics_error}"
        return line


def _shown(value: float | None, spec: str = ".0f") -> str:
    """A metric's value for the summary; "-" where the server does not expose it."""
    return "-" if value is None else format(value, spec)


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else value


# ---- in a notebook, and served -----------------------------------------------------------------------
@dataclass
class AttachedDashboard:
    """Owns an Attachment and the view drawn from its state, and the periodic redraw (every `period_ms`, where an
    event loop runs: a notebook's kernel, a Panel server). `close()` stops the redraw and the attachment (threads
    and sockets)."""

    attachment: Attachment
    view: AttachedView
    period_ms: int = 250
    _callback: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.view.refresh()
        try:
            self._callback = pn.state.add_periodic_callback(self.view.refresh, period=self.period_ms)
        except RuntimeError:  # no event loop (a script, a test): refresh() by hand
            self._callback = None

    @property
    def state(self) -> AttachedState:
        return self.attachment.state

    def __panel__(self) -> Any:
        return self.view.panel

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> Any:
        return self.view._repr_mimebundle_(include, exclude)

    def close(self) -> None:
        if self._callback is not None:
            self._callback.stop()
            self._callback = None
        self.attachment.close()


def attach(kv_events: str, metrics: str | None = None, replay: str | None = None, **options: Any) -> AttachedDashboard:
    """The live dashboard of a running vLLM server (or `workbench serve`) in a notebook, from its KV events
    (`kv_events`, and `replay` to read from batch 0) and its `metrics` URL; `options` are Attachment's others
    (`block_size`, `num_blocks`, `topic`, `metrics_interval_s`, `connect_timeout_s`), `workbench attach`'s flags.
    End the cell with it to show it; `.close()` closes its sockets and threads."""
    attachment = Attachment(kv_events, metrics, replay, **options)
    return AttachedDashboard(attachment, AttachedView(attachment.state, attachment.kv_events, attachment.metrics))


def serve_attach(
    attachment: Attachment, port: int, start: bool = True, announce: Callable[[str], Any] | None = None
) -> Any:
    """Serve the view of an attachment on 127.0.0.1:`port` (each browser session its own view of the one state,
    redrawn every 250 ms); `start`: until interrupted, then the attachment is closed."""
    from workbench.app import _server

    def session() -> Any:
        view = AttachedView(attachment.state, attachment.kv_events, attachment.metrics)
        view.refresh()
        callback = pn.state.add_periodic_callback(view.refresh, period=250)
        pn.state.on_session_destroyed(lambda _context: callback.stop())
        return view.panel

    try:
        return _server(session, port, "Inference Workbench: attached", start, announce)
    finally:
        if start:
            attachment.close()
