"""A `workbench tune` result as Bokeh figures, for the notebook and for the docs' PNG: the Pareto front (goodput
against the first SLO's statistic, every run a point, the front a line, the winner a green star, or the closest an
orange one when none meets the SLOs, the SLO bound dotted) and the sweep (each run in search order, its first SLO
statistic against the bound). Bokeh draws on a canvas, so the PNG is taken by headless Chromium (playwright drives
/usr/bin/chromium, as the browser tests do)."""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path
from typing import Any

CHROMIUM = Path("/usr/bin/chromium")
_CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
FEASIBLE, FAILED, WINNER, CLOSEST = "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e"


def _points(points: list[dict[str, Any]], primary: str) -> Any:
    """One row a run: its place on the plots, its colour and, for the hover, its status and every knob's value."""
    from bokeh.models import ColumnDataSource

    knobs = {name: [str(p["config"][name]) for p in points] for name in (points[0]["config"] if points else {})}
    return ColumnDataSource(
        {
            "run": [p["run"] for p in points],
            "label": [str(p["run"]) for p in points],
            "latency": [p["values"][primary] for p in points],
            "goodput": [p["goodput"] for p in points],
            "color": [FEASIBLE if p["feasible"] else FAILED for p in points],
            "status": ["meets every SLO" if p["feasible"] else "fails " + ", ".join(p["failed"]) for p in points],
            **knobs,
        }
    )


def _tooltips(result: dict[str, Any]) -> list[tuple[str, str]]:
    knobs = result["points"][0]["config"] if result["points"] else {}
    return [
        ("run", "@run"),
        ("goodput", "@goodput{0.00} req/s"),
        ("", "@status"),
        *((name, f"@{name}") for name in knobs),
    ]


def _unit(result: dict[str, Any]) -> str:
    return "simulated ms" if result["settings"]["engine_kwargs"].get("executor") == "simulated" else "ms"


def pareto_figure(result: dict[str, Any]) -> Any:
    """Goodput against the first SLO's statistic: every measured run (blue: meets every SLO, red: fails one), the
    Pareto front joined, the winner (or the closest, when none meets the SLOs) starred, the SLO bound dotted."""
    from bokeh.models import DataRange1d
    from bokeh.models.annotations import Span  # bokeh.models re-exports it too, in a way mypy cannot follow
    from bokeh.models.renderers import DataRenderer  # as Span
    from bokeh.plotting import figure

    primary, slos = result["settings"]["primary"], result["settings"]["slos"]
    fig = figure(
        title=f"Pareto front: goodput against {primary}",
        width=480,
        height=360,
        tooltips=_tooltips(result),
        x_axis_label=f"{primary} ({_unit(result)})",
        y_axis_label="goodput (req/s)",
    )
    front = result["front"]
    fig.line(
        [p["values"][primary] for p in front],
        [p["goodput"] for p in front],
        color="grey",
        line_dash="dashed",
        line_width=2,
        legend_label="Pareto front",
        name="front",
    )
    runs: list[DataRenderer] = []
    for feasible, label in ((True, "meets every SLO"), (False, "fails an SLO")):
        points = [p for p in result["points"] if p["feasible"] == feasible]
        if points:
            runs.append(
                fig.scatter(
                    "latency",
                    "goodput",
                    source=_points(points, primary),
                    color="color",
                    size=10,
                    legend_label=label,
                    name="feasible" if feasible else "failed",
                )
            )
    fig.hover.renderers = runs  # the hover reads the runs' columns, which the front and the star do not have
    best = result["best"]
    if best is not None:
        fig.scatter(
            [best["values"][primary]],
            [best["goodput"]],
            marker="star",
            size=22,
            line_color="black",
            fill_color=WINNER if best["feasible"] else CLOSEST,
            legend_label="winner" if best["feasible"] else "closest",
            name="winner",
        )
    if primary in slos:
        fig.add_layout(Span(location=slos[primary], dimension="height", line_color=FAILED, line_dash="dotted"))
    assert isinstance(fig.x_range, DataRange1d) and isinstance(fig.y_range, DataRange1d)  # figure()'s own ranges
    fig.x_range.range_padding = fig.y_range.range_padding = 0.15
    return _finish(fig)


def sweep_figure(result: dict[str, Any]) -> Any:
    """The search run by run: each run's first SLO statistic as a bar (blue: meets every SLO, red: fails one), the
    SLO bound dotted; the bars are labelled by run number, the hover gives the configuration and goodput."""
    from bokeh.models import DataRange1d
    from bokeh.models.annotations import Span  # as in pareto_figure
    from bokeh.plotting import figure

    primary, slos = result["settings"]["primary"], result["settings"]["slos"]
    source = _points(result["points"], primary)
    fig = figure(
        title=f"The sweep: {primary} of each run, in search order",
        width=480,
        height=360,
        x_range=source.data["label"],
        tooltips=_tooltips(result),
        x_axis_label="run",
        y_axis_label=f"{primary} ({_unit(result)})",
    )
    fig.vbar(x="label", top="latency", width=0.7, source=source, color="color", legend_field="status", name="runs")
    if primary in slos:
        fig.add_layout(Span(location=slos[primary], dimension="width", line_color=FAILED, line_dash="dotted"))
    assert isinstance(fig.y_range, DataRange1d)  # figure()'s own
    fig.y_range.start = 0
    return _finish(fig)


def _finish(fig: Any) -> Any:
    """The legend under the plot, where it hides no point; the toolbar shown only under the mouse (not in a PNG)."""
    fig.add_layout(fig.legend[0], "below")
    fig.legend.orientation = "horizontal"
    fig.legend.label_text_font_size = "9pt"
    fig.toolbar.autohide = True
    return fig


def tune_figures(result: dict[str, Any]) -> Any:
    """The Pareto front and the sweep side by side."""
    from bokeh.layouts import row

    return row(pareto_figure(result), sweep_figure(result))


def save_png(obj: Any, path: str | Path) -> str | None:
    """`obj` (a Bokeh figure or layout) rendered by headless Chromium into a PNG at `path`; None where Chromium or
    playwright is missing."""
    if not CHROMIUM.exists() or importlib.util.find_spec("playwright") is None:
        return None
    from bokeh.embed import file_html
    from bokeh.resources import INLINE
    from playwright.sync_api import sync_playwright

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, sync_playwright() as pw:
        page_file = Path(tmp) / "figure.html"
        page_file.write_text(file_html(obj, INLINE, title=path.stem), encoding="utf-8")
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=_CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 800})
            page.goto(page_file.as_uri())
            # Bokeh's own export waits for the document to be idle: every renderer has drawn
            page.wait_for_function("() => window.Bokeh && Bokeh.documents.length && Bokeh.documents[0].is_idle")
            width, height = page.evaluate(
                "() => { const v = Bokeh.index.roots[0]; "
                "const r = v.el.getBoundingClientRect(); return [r.right, r.bottom]; }"
            )
            page.screenshot(path=str(path), clip={"x": 0, "y": 0, "width": width, "height": height})
        finally:
            browser.close()
    return str(path)
