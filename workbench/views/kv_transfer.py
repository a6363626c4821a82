"""KV transfers between instances (disaggregated prefill/decode): bytes moved over time by each instance, and
one row per transfer (save, load or failure). Fed with the records of one instance or of several (a
PDCluster's `records()`); empty until the first kv_transfer.* event."""
from __future__ import annotations

import panel as pn
from bokeh.models import DataTable, HoverTool, NumberFormatter, TableColumn

from engine.events import StepRecord
from workbench.state import EngineState, StepDelta, Transfer
from workbench.views.base import View, new_figure
from workbench.views.empty import EmptyState

KIND_COLORS = {"kv_transfer.save": "#1f77b4", "kv_transfer.load": "#2ca02c", "kv_transfer.fail": "#d62728"}


class KVTransferView(View):
    """Owns the KV-transfer view: cumulative MB moved per instance against wall-clock seconds (from the first
    transfer), and a table of every transfer with its request, instance, tokens, bytes, ms, MB/s and, for a
    failure, its type, the policy's action and the tokens recomputed; all from the state's `kv_transfer`."""

    title = "KV transfer"

    def __init__(self, state: EngineState | None = None) -> None:
        super().__init__(state)
        self.points = self.buffer(["t", "mb", "instance", "kind", "request_id", "color"], name="kv_transfer_bytes")
        self.rows = self.buffer(["request_id", "instance", "kind", "num_tokens", "mb", "ms", "mb_per_s",
                                 "failure", "policy_action", "num_recomputed_tokens"], name="kv_transfers")
        content = pn.Column(pn.pane.Bokeh(self._figure()), pn.pane.Bokeh(self._table()), sizing_mode="stretch_width")
        self.empty = EmptyState("No KV transfer yet: this view fills in when an instance with a kv_transfer_config "
                                "saves or loads KV (see engine.kv_transfer.PDCluster).", content)

    def _figure(self):
        fig = new_figure("KV moved per instance (MB, cumulative)", x_axis_label="seconds", y_axis_label="MB")
        dots = fig.scatter(x="t", y="mb", source=self.points.source, color="color", size=7)
        fig.add_tools(HoverTool(renderers=[dots], tooltips=[
            ("request", "@request_id"), ("instance", "@instance"), ("event", "@kind"), ("MB so far", "@mb")]))
        return fig

    def _table(self) -> DataTable:
        number = NumberFormatter(format="0.00")
        return DataTable(source=self.rows.source, height=180, index_position=None, sizing_mode="stretch_width",
                         columns=[TableColumn(field="request_id", title="request"),
                                  TableColumn(field="instance", title="instance"),
                                  TableColumn(field="kind", title="event"),
                                  TableColumn(field="num_tokens", title="tokens"),
                                  TableColumn(field="mb", title="MB", formatter=number),
                                  TableColumn(field="ms", title="ms", formatter=number),
                                  TableColumn(field="mb_per_s", title="MB/s", formatter=number),
                                  TableColumn(field="failure", title="failure"),
                                  TableColumn(field="policy_action", title="action"),
                                  TableColumn(field="num_recomputed_tokens", title="recomputed")])

    @property
    def panel(self) -> pn.Column:
        return self.empty.panel

    def render(self, record: StepRecord, delta: StepDelta) -> None:
        for transfer in delta.transfers:
            self._transfer(transfer)
        if delta.transfers:
            self.empty.fill()

    def _transfer(self, t: Transfer) -> None:
        self.points.append(t=(t.end_ns - self.state.kv_transfer.origin_ns) / 1e9, mb=t.instance_mb,
                           instance=t.instance, kind=t.kind, request_id=t.request_id, color=KIND_COLORS[t.kind])
        self.rows.append(request_id=t.request_id, instance=t.instance, kind=t.kind.split(".")[1],
                         num_tokens=t.num_tokens, mb=t.mb, ms=t.ms, mb_per_s=t.mb_per_s, failure=t.failure,
                         policy_action=t.policy_action, num_recomputed_tokens=t.num_recomputed_tokens)

    def reset(self) -> None:
        super().reset()
        self.empty.clear()
