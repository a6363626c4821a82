"""What every view shares: Panel's extension loaded once (inline), a buffered ColumnDataSource, and the View base."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import panel as pn
from bokeh.models import BasicTicker, ColumnDataSource, CustomJSTickFormatter, DataRange1d
from bokeh.plotting import figure
from panel.viewable import Viewable

from engine.events import StepRecord
from workbench.state import EngineState, StepDelta
from workbench.views.sync import connect, drawing, drop_echoes_script

_extension_loaded = False


def ensure_extension() -> None:
    """Load Panel's extension once per process, its JavaScript inline: offline, the CDN default renders nothing.
    In a notebook, also the script that keeps the browser from echoing the kernel's changes back."""
    global _extension_loaded
    pn.config.inline = True  # type: ignore[misc]  # a read-only property in Panel's types; its __setattr__ sets it
    if not _extension_loaded:
        pn.extension("tabulator", inline=True)  # Tabulator ships its own JavaScript: named, or a notebook lacks it
        _batch_inline_stylesheets()
        if _in_kernel():
            from IPython.display import HTML, display

            display(HTML(drop_echoes_script()))
        _extension_loaded = True


def _batch_inline_stylesheets() -> None:
    """Before a notebook shows a Panel object inline, Panel swaps each Bokeh model's imported stylesheets for inline
    ones, one model at a time (panel.viewable: patch_inline_stylesheets), and every swap makes Bokeh walk the whole
    document again to index its models: quadratic in the models, 25 s for a Workbench on these CPUs. Here the
    document's index is frozen while Panel swaps (Bokeh's own `Document.models.freeze`) and rebuilt once, just
    before Panel renders the bundle. Only inside a display: Panel also swaps the stylesheets of models that change
    in a live document, where nothing would rebuild a frozen index."""
    import panel.viewable as viewable

    patch, render, display = viewable.patch_inline_stylesheets, viewable.render_mimebundle, Viewable._repr_mimebundle_
    frozen: dict[int, Any] = {}  # id(document) -> its freeze, entered
    displaying = False

    def patch_frozen(model: Any) -> None:
        doc = model.document
        if doc is not None and displaying and id(doc) not in frozen:
            frozen[id(doc)] = freeze = doc.models.freeze()
            freeze.__enter__()
        patch(model)

    def render_thawed(model: Any, doc: Any, *args: Any, **kwargs: Any) -> Any:
        if (freeze := frozen.pop(id(doc), None)) is not None:
            freeze.__exit__(None, None, None)  # one walk of the document, with every stylesheet in place
        return render(model, doc, *args, **kwargs)

    def display_batched(self: Any, include: Any = None, exclude: Any = None) -> Any:
        nonlocal displaying
        displaying = True
        try:
            return display(self, include, exclude)
        finally:
            displaying = False
            while frozen:  # a display that failed before rendering: thaw what it froze
                frozen.popitem()[1].__exit__(None, None, None)

    viewable.patch_inline_stylesheets, viewable.render_mimebundle = patch_frozen, render_thawed
    Viewable._repr_mimebundle_ = display_batched  # type: ignore[method-assign]


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def new_figure(title: str, height: int = 260, **kwargs: Any) -> figure:
    kwargs.setdefault("tools", "pan,wheel_zoom,box_zoom,reset,save")
    fig = figure(title=title, height=height, sizing_mode="stretch_width", toolbar_location="above", **kwargs)
    fig.toolbar.logo = None
    return fig


def counts_on(*axes: Any) -> None:
    """Integer ticks on axes that count (steps, tokens, requests, blocks): no 0.5 request."""
    for axis in axes:
        axis.ticker = BasicTicker(min_interval=1)


def fit_to(fig: figure, *renderers: Any, start: float = 0) -> None:
    """Scale the y axis to these renderers' data only (a budget or a total drawn beside the data would squash
    it: 2048 tokens of budget over bars of 13), from `start`."""
    fig.y_range = DataRange1d(renderers=list(renderers), start=start)


def label_ticks(axis: Any, source: ColumnDataSource, position: str, label: str) -> None:
    """Name an axis's ticks after a column: rows or bars sit at integer `position`s (0, 1, ... or 0, -1, ...),
    and the tick at one reads that row's `label` (the axis thins its ticks as rows grow, as it does numbers)."""
    axis.ticker = BasicTicker(min_interval=1)
    axis.formatter = CustomJSTickFormatter(
        args={"source": source},
        code=f"""
        const i = source.data.{position}.indexOf(tick);
        return i < 0 ? "" : String(source.data.{label}[i]);""",
    )


def legend_above(fig: figure) -> None:
    """Move the figure's legend above the plot, where it never hides data."""
    legend = fig.legend[0]
    legend.orientation = "horizontal"
    legend.margin = 0
    legend.padding = 2  # type: ignore[assignment]  # bokeh's stub types Legend.padding as the Property itself
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
            self.source.stream(dict(self._rows))  # dict(): typed as bokeh's DataDict, which a dict[str, list] is not
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
        bundle = self.panel._repr_mimebundle_(include, exclude)  # a notebook cell that ends with it shows it
        connect(self.panel)
        return bundle

    def render(self, record: StepRecord, delta: StepDelta) -> None:
        """Queue the changes one record made, read from `self.state` (which has applied it already) and `delta`;
        never from `record.events` (the state handles each event once)."""
        raise NotImplementedError

    def flush(self) -> None:
        for buf in self._buffers:
            buf.flush()

    def update(self, record: StepRecord) -> None:
        self.extend([record])

    def extend(self, records: Iterable[StepRecord]) -> None:
        if not self._owns_state:
            raise RuntimeError(f"{type(self).__name__} shares its state: feed the Dashboard that owns it")
        with drawing(self.panel):
            for record in records:
                self.render(record, self.state.apply(record))
            self.flush()

    def show_state(self) -> None:
        """Queue what the state holds before any record (a snapshot); views of per-step history show nothing."""

    def reset(self) -> None:
        """Forget everything shown (and the state, if this view owns it)."""
        if self._owns_state:
            self.state.clear()
        for buf in self._buffers:
            buf.clear()
