"""The KV-transfer view over synthetic records from two instances."""
from __future__ import annotations

from bokeh.document import Document

from engine.events import KVTransferFail, KVTransferLoad, KVTransferSave, KVUsage, StepRecord
from workbench.views.kv_transfer import KVTransferView


def _record(step: int, end_ns: int, events: list) -> StepRecord:
    return StepRecord(step=step, start_ns=end_ns - 1000, end_ns=end_ns, scheduled={}, phases={}, num_waiting=0,
                      num_running=0, kv=KVUsage(8, 0, 0, 8), timing={}, events=events)


def test_view_accumulates_bytes_per_instance_and_lists_failures() -> None:
    view = KVTransferView()
    view.panel.get_root(Document())
    assert view.empty.is_empty
    common = dict(connector="SharedStorageConnector", key="k", num_blocks=2, num_tokens=20, ms=2.0, mb_per_s=1.0)
    view.extend([
        _record(1, 1_000_000_000, [KVTransferSave(1, request_id="a", instance="prefill-0", num_bytes=2_000_000,
                                                  **common)]),
        _record(1, 1_500_000_000, [KVTransferLoad(1, request_id="a", instance="decode-0", num_bytes=2_000_000,
                                                  remote_request_id="a", **common),
                                   KVTransferFail(1, request_id="b", instance="decode-0", connector="RedisConnector",
                                                  failure="timeout", policy_action="recompute",
                                                  num_recomputed_tokens=31)]),
        _record(2, 2_000_000_000, [KVTransferSave(2, request_id="c", instance="prefill-0", num_bytes=1_000_000,
                                                  **common)]),
    ])
    assert not view.empty.is_empty
    data = view.points.source.data
    assert data["mb"] == [2.0, 2.0, 2.0, 3.0]  # per instance: the failure moves nothing
    assert data["t"][-1] > data["t"][0]
    rows = view.rows.source.data
    assert rows["kind"] == ["save", "load", "fail", "save"]
    assert rows["failure"][2] == "timeout" and rows["num_recomputed_tokens"][2] == 31
    view.reset()
    assert view.empty.is_empty and view.points.source.data["mb"] == []
