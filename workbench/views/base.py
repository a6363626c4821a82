"""What every view shares: Panel's extension loaded once (inline), a buffered ColumnDataSource, and the View base."""
from __future__ import annotations

from typing import Any, ClassVar, Iterable

import panel as pn
from bokeh.models import ColumnDataSource
from bokeh.plotting import figure

from engine.events import StepRecord
from workbench.state import EngineState, StepDelta

_extension_loaded = False


def ensure_extension() -> None:
    """Load Panel's extension once per process, its JavaScript inline: offline, the CDN default renders nothing."""
    global _extension_loaded
    pn.config.inline = True
    if not _extension_loaded:
        pn.extension("tabulator", inline=True)  # Tabulator ships its own JavaScript: named, or a notebook lacks it
        _extension_loaded = True


def push(viewable: Any) -> None:
    """Send pending Bokeh changes to a notebook's browser; Panel does this itself under a server."""
    pn.io.push_notebook(viewable)


def new_figure(title: str, height: int = 260, **kwargs: Any) -> figure:
    kwargs.setdefault("tools", "pan,wheel_zoom,box_zoom,reset,save")
    fig = figure(title=title, height=height, sizing_mode="stretch_width", toolbar_location="above", **kwargs)
    fig.toolbar.logo = None
    return fig


def legend_above(fig: figure) -> None:
    """Move the figure's legend above the plot, where it never hides data."""
    legend = fig.legend[0]
    legend.orientation = "horizontal"
    legend.margin = 0
    legend.padding = 2
    fig.center.remove(legend)
    fig.add_layout(legend, "above")


class SourceBuffer:
    """Owns one ColumnDataSource and the rows and cell changes not yet sent to it: a flush sends them as
    one stream and one patch, so a step costs messages in proportion to what changed, not to the history.
    (Bokeh's DataTable does not redraw patched cells: tables that change rows use Panel's Tabulator.)"""

    def __init__(self, columns: Iterable[str], name: str | None = None) -> None:
        self.columns = list(columns)
        self.source = ColumnDataSource({c: [] for c in self.columns}, name=name)
        self._sent = 0
        self._rows: dict[str, list] = {c: [] for c in self.columns}
        self._patches: dict[str, dict[int, Any]] = {}

    def __len__(self) -> int:
        return self._sent + len(self._rows[self.columns[0]])

    def append(self, **row: Any) -> int:
        """Queue a row; returns its index."""
        for c in self.columns:
            self._rows[c].append(row[c])
        return len(self) - 1

    def set(self, index: int, **values: Any) -> None:
        """Queue new values for cells of row `index` (a row still queued is changed in place)."""
        for c, v in values.items():
            if index >= self._sent:
                self._rows[c][index - self._sent] = v
            else:
                self._patches.setdefault(c, {})[index] = v

    def get(self, index: int, column: str) -> Any:
        if index >= self._sent:
            return self._rows[column][index - self._sent]
        return self._patches.get(column, {}).get(index, self.source.data[column][index])

    def flush(self) -> None:
        if self._patches:
            self.source.patch({c: sorted(p.items()) for c, p in self._patches.items()})
            self._patches = {}
        if self._rows[self.columns[0]]:
            self.source.stream(self._rows)
            self._sent = len(self.source.data[self.columns[0]])
            self._rows = {c: [] for c in self.columns}

    def replace(self, data: dict[str, list]) -> None:
        """Set the whole data at once (a reset, a new KV size)."""
        self._patches = {}
        self._rows = {c: [] for c in self.columns}
        self.source.data = {c: list(data[c]) for c in self.columns}
        self._sent = len(data[self.columns[0]])

    def clear(self) -> None:
        self.replace({c: [] for c in self.columns})


class View:
    """Base of the dashboard views. Owns a Panel layout (`panel`, also `__panel__`) and the SourceBuffers it
    draws from. Alone, a view owns its EngineState and is fed with `update(record)` / `extend(records)`; in a
    Dashboard, views share one state and the Dashboard calls `render` and `flush`."""

    title: ClassVar[str] = ""

    def __init__(self, state: EngineState | None = None) -> None:
        ensure_extension()
        self._owns_state = state is None
        self.state = EngineState() if state is None else state
        self._buffers: list[SourceBuffer] = []

    def buffer(self, columns: Iterable[str], name: str | None = None) -> SourceBuffer:
        buf = SourceBuffer(columns, name)
        self._buffers.append(buf)
        return buf

    @property
    def panel(self) -> pn.viewable.Viewable:
        raise NotImplementedError

    def __panel__(self) -> pn.viewable.Viewable:
        return self.panel

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> Any:
        return self.panel._repr_mimebundle_(include, exclude)  # a notebook cell that ends with it shows it

    def render(self, record: StepRecord, delta: StepDelta) -> None:
        """Queue the changes one record made (the state has applied it already)."""
        raise NotImplementedError

    def flush(self) -> None:
        for buf in self._buffers:
            buf.flush()

    def update(self, record: StepRecord) -> None:
        self.extend([record])

    def extend(self, records: Iterable[StepRecord]) -> None:
        if not self._owns_state:
            raise RuntimeError(f"{type(self).__name__} shares its state: feed the Dashboard that owns it")
        for record in records:
            self.render(record, self.state.apply(record))
        self.flush()
        push(self.panel)

    def reset(self) -> None:
        """Forget everything shown (and the state, if this view owns it)."""
        if self._owns_state:
            self.state.clear()
        for buf in self._buffers:
            buf.clear()
