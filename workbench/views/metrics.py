"""Engine metrics: throughput per step, TTFT and ITL distributions, KV usage over time."""

from __future__ import annotations

import math

import panel as pn
from bokeh.models import DataRange1d, HoverTool

from engine.events import StepRecord
from workbench.state import EngineState, StepDelta
from workbench.views.base import View, counts_on, fit_to, legend_above, new_figure
from workbench.views.colors import CACHED_FREE_COLOR

# Fixed log-spaced bins (10 per decade, 0.1 ms to 1000 s): a new latency updates one bin, never a rebinning.
_BINS_PER_DECADE, _LOW_DECADE, _NUM_DECADES = 10, -1, 7
_NUM_BINS = _BINS_PER_DECADE * _NUM_DECADES
_TOTALS = ("steps", "tokens", "output", "seconds", "ttft_ms", "ttfts", "itl_ms", "itls", "finished", "requests")


def latency_bin(ms: float) -> int:
    """The histogram bin of a latency in ms (values off the range land in the first or last bin)."""
    if ms <= 0:
        return 0
    index = math.floor((math.log10(ms) - _LOW_DECADE) * _BINS_PER_DECADE)
    return min(max(index, 0), _NUM_BINS - 1)


def _edges() -> tuple[list[float], list[float]]:
    edges = [10 ** (_LOW_DECADE + i / _BINS_PER_DECADE) for i in range(_NUM_BINS + 1)]
    return edges[:-1], edges[1:]


class MetricsView(View):
    """Owns the metrics view: tokens per second of each step (scheduled, and output), histograms of TTFT and
    ITL on fixed log bins, KV blocks used and cached-free over time, and a line of totals."""

    title = "Metrics"

    def __init__(self, state: EngineState | None = None) -> None:
        super().__init__(state)
        self.throughput = self.buffer(["step", "tokens_per_s", "output_tokens_per_s"], name="metrics_throughput")
        self.ttft = self.buffer(["left", "right", "count"], name="metrics_ttft")
        self.itl = self.buffer(["left", "right", "count"], name="metrics_itl")
        self.kv = self.buffer(["step", "used", "cached_free", "total"], name="metrics_kv")
        self._clear_histograms()
        self.summary = pn.pane.Markdown("no step yet", margin=(0, 10))
        self._totals: dict[str, float] = dict.fromkeys(_TOTALS, 0)  # counts, and seconds and milliseconds
        self._panel = pn.Column(
            self.summary,
            pn.Row(
                pn.pane.Bokeh(self._throughput_figure()), pn.pane.Bokeh(self._kv_figure()), sizing_mode="stretch_width"
            ),
            pn.Row(
                pn.pane.Bokeh(self._histogram("TTFT (ms)", self.ttft, "#1f77b4")),
                pn.pane.Bokeh(self._histogram("ITL (ms)", self.itl, "#ff7f0e")),
                sizing_mode="stretch_width",
            ),
            sizing_mode="stretch_width",
        )

    def _throughput_figure(self):
        fig = new_figure("Throughput per step", x_axis_label="step", y_axis_label="tokens / s")
        counts_on(fig.xaxis)
        fig.line(x="step", y="tokens_per_s", source=self.throughput.source, line_width=2, legend_label="scheduled")
        fig.line(
            x="step",
            y="output_tokens_per_s",
            source=self.throughput.source,
            line_width=2,
            color="#ff7f0e",
            legend_label="output",
        )
        legend_above(fig)
        return fig

    def _kv_figure(self):
        """Blocks used and cached-free; the cache's size in the title and as a line the axis does not fit to (a
        1455-block cache would flatten 30 used blocks)."""
        fig = new_figure("KV cache usage (blocks)", x_axis_label="step", y_axis_label="blocks")
        areas = fig.varea_stack(
            ["used", "cached_free"],
            x="step",
            source=self.kv.source,
            color=["#1f77b4", CACHED_FREE_COLOR],
            legend_label=["used", "cached-free"],
        )
        fig.line(x="step", y="total", source=self.kv.source, color="black", line_dash="dashed", legend_label="total")
        fit_to(fig, *areas)
        counts_on(fig.xaxis, fig.yaxis)
        legend_above(fig)
        self.kv_figure = fig
        return fig

    def _histogram(self, title: str, buf, color: str):
        fig = new_figure(
            title, x_axis_type="log", x_axis_label="ms", y_axis_label="count", y_range=DataRange1d(start=0)
        )
        counts_on(fig.yaxis)
        bars = fig.quad(
            left="left", right="right", bottom=0, top="count", source=buf.source, fill_color=color, line_color="white"
        )
        fig.add_tools(
            HoverTool(renderers=[bars], tooltips=[("ms", "@left{0.0[00]} - @right{0.0[00]}"), ("count", "@count")])
        )
        return fig

    def _clear_histograms(self) -> None:
        left, right = _edges()
        for buf in (self.ttft, self.itl):
            buf.replace({"left": left, "right": right, "count": [0] * _NUM_BINS})

    @property
    def panel(self) -> pn.Column:
        return self._panel

    def render(self, record: StepRecord, delta: StepDelta) -> None:
        seconds = max(record.end_ns - record.start_ns, 1) / 1e9
        tokens = sum(record.scheduled.values())
        self.throughput.append(
            step=record.step, tokens_per_s=tokens / seconds, output_tokens_per_s=delta.num_output_tokens / seconds
        )
        self.kv.append(step=record.step, used=record.kv.used, cached_free=record.kv.cached_free, total=record.kv.total)
        if not self.kv_figure.title.text.endswith(f"of {record.kv.total} blocks"):
            self.kv_figure.title.text = f"KV cache usage, of {record.kv.total} blocks"
        for buf, values in ((self.ttft, delta.ttfts_ms), (self.itl, delta.itls_ms)):
            for ms in values:
                index = latency_bin(ms)
                buf.set(index, count=buf.get(index, "count") + 1)
        totals = self._totals
        for key, value in (
            ("steps", 1),
            ("tokens", tokens),
            ("output", delta.num_output_tokens),
            ("seconds", seconds),
            ("ttft_ms", sum(delta.ttfts_ms)),
            ("ttfts", len(delta.ttfts_ms)),
            ("itl_ms", sum(delta.itls_ms)),
            ("itls", len(delta.itls_ms)),
        ):
            totals[key] += value
        totals["finished"] += len(delta.finished)
        totals["requests"] += len(delta.added)

    def flush(self) -> None:
        super().flush()
        self.summary.object = self._summary()

    def _summary(self) -> str:
        t = self._totals
        if not t["steps"]:
            return "no step yet"
        parts = [
            f"{t['steps']} steps",
            f"{t['tokens'] / t['seconds']:.0f} tokens/s in steps",
            f"{t['output'] / t['seconds']:.0f} output tokens/s",
            f"{t['finished']}/{t['requests']} requests finished",
        ]
        if t["ttfts"]:
            parts.append(f"mean TTFT {t['ttft_ms'] / t['ttfts']:.1f} ms")
        if t["itls"]:
            parts.append(f"mean ITL {t['itl_ms'] / t['itls']:.1f} ms")
        return " · ".join(parts)

    def reset(self) -> None:
        super().reset()
        self._clear_histograms()
        self._totals = dict.fromkeys(_TOTALS, 0)
        self.summary.object = "no step yet"
