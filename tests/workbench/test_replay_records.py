"""Replay.from_records: the dashboards over StepRecords held in memory, as a notebook shows each P/D instance."""

from __future__ import annotations

import pytest
from bokeh.document import Document

from engine import LLMEngine, SamplingParams
from workbench.app import Replay
from workbench.trace import Trace
from workbench.views import Dashboard


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> list:
    """A kv_both tiny-llama engine saves a prompt's KV, then loads it back for the same prompt."""
    store = tmp_path_factory.mktemp("kv")
    engine = LLMEngine(
        model="tiny-llama",
        block_size=16,
        num_kv_blocks=32,
        max_model_len=256,
        enable_prefix_caching=False,
        kv_transfer_config={
            "kv_connector": "SharedStorageConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(store)},
        },
    )
    out: list = []

    def run(max_tokens: int, kv_params: dict) -> dict | None:
        rid = engine.add_request(
            list(range(100, 140)), SamplingParams(temperature=0.0, max_tokens=max_tokens), kv_transfer_params=kv_params
        )
        while engine.has_unfinished_requests():
            out.append(engine.step())
        return engine.pop_output(rid).kv_transfer_params

    run(4, run(1, {"do_remote_decode": True}))
    kinds = [e.kind for r in out for e in r.events if e.kind.startswith("kv_transfer.")]
    assert kinds == ["kv_transfer.save", "kv_transfer.load"], kinds
    return out


def test_replay_from_records_shows_every_record_under_its_title(records) -> None:
    replay = Replay.from_records(records, "decode-0")
    replay.layout.get_root(Document())
    assert replay.layout[0].object == "## decode-0"
    assert replay.slider.end == len(records) and replay.step_text.object == f"step {records[-1].step}"
    fresh = Dashboard(None, records[0].kv.total)
    fresh.extend(records)
    assert replay.dashboard.timeline.segments.source.data == fresh.timeline.segments.source.data
    assert replay.dashboard.kv_transfer.rows.source.data["kind"] == ["save", "load"]
    replay.slider.value = 1
    assert replay.dashboard.kv_transfer.rows.source.data["kind"] == ["save"]


def test_replay_from_no_records_is_empty_and_a_trace_keeps_its_heading() -> None:
    replay = Replay.from_records([], "prefill-0")
    assert replay.slider.disabled and replay.step_text.object == "step 0"
    assert replay.dashboard.kv_transfer.empty.is_empty
    traced = Replay(Trace({"model": {"name": "tiny-llama"}, "created": "today"}, []))
    assert traced.layout[0].object == "## Replay · `tiny-llama` · 0 steps · recorded today"
