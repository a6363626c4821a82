"""The Parallelism tab over a real TP=2 run of tiny-llama: each rank's compute, communication and sampling bars and
each step's collective bytes equal the parallel.step events; a trace written by TraceWriter and replayed
(the Replay `workbench replay` serves) draws the same; an unsharded engine is named as such, not drawn empty."""

from __future__ import annotations

import pytest
from bokeh.document import Document

from engine import LLMEngine, SamplingParams, StepRecord
from workbench.app import Replay
from workbench.trace import TraceWriter, read_trace
from workbench.views import Dashboard, ParallelView
from workbench.views.parallel import UNSHARDED, WAITING

PROMPTS = [[1, 504, 3458, 282, 4649, 314], list(range(20, 41))]


@pytest.fixture(scope="module")
def traced(tmp_path_factory) -> tuple[list[StepRecord], str]:
    path = tmp_path_factory.mktemp("trace") / "tp2.jsonl"
    with (
        LLMEngine(
            model="tiny-llama", num_kv_blocks=32, block_size=4, max_num_batched_tokens=16, tensor_parallel_size=2
        ) as engine,
        TraceWriter(path, engine) as writer,
    ):
        engine.subscribe(writer)
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        records = engine.run([engine.add_request(p, params) for p in PROMPTS])
    return records, str(path)


def _expected(records: list[StepRecord]) -> tuple[list[tuple], list[tuple]]:
    """(step, rank, part, ms) per bar piece and (step, kind, bytes) per collective, straight from the events."""
    segments, transfers = [], []
    for record in records:
        (event,) = record.of_kind("parallel.step")
        for rank in event.ranks:
            comm = sum(c["ms"] for c in rank["collectives"].values())
            segments += [
                (record.step, rank["rank"], "compute", rank["forward_ms"] - comm),
                (record.step, rank["rank"], "communication", comm),
                (record.step, rank["rank"], "sample", rank["sample_ms"]),
            ]
        transfers += [(record.step, kind, c["bytes"]) for kind, c in sorted(event.ranks[0]["collectives"].items())]
    return segments, transfers


def _drawn(view: ParallelView) -> tuple[list[tuple], list[tuple]]:
    seg, tr = view.segments.source.data, view.transfers.source.data
    return (
        list(zip(seg["step"], seg["rank"], seg["part"], seg["ms"])),
        [(s, k, round(kb * 1e3)) for s, k, kb in zip(tr["step"], tr["kind"], tr["kb"])],
    )


@pytest.mark.slow
def test_bars_equal_every_ranks_events(traced) -> None:
    records, _ = traced
    view = ParallelView()
    view.panel.get_root(Document())
    assert view.empty.is_empty and view.empty.message.object == WAITING
    view.extend(records)
    segments, transfers = _expected(records)
    drawn_segments, drawn_transfers = _drawn(view)
    assert [s[:3] for s in drawn_segments] == [s[:3] for s in segments]
    assert [s[3] for s in drawn_segments] == pytest.approx([max(s[3], 0.0) for s in segments])
    assert drawn_transfers == transfers and not view.empty.is_empty
    # a step's pieces stack: each rank's bar is its forward plus its sampling
    tops = view.segments.source.data["top"]
    for record, i in zip(records, range(0, len(tops), 6)):
        ranks = record.of_kind("parallel.step")[0].ranks
        assert [tops[i + 2], tops[i + 5]] == pytest.approx([r["forward_ms"] + r["sample_ms"] for r in ranks])
    par = view.state.parallel
    tokens = sum(sum(r.scheduled.values()) for r in records)
    reduced = sum(b for s, k, b in transfers if k == "all_reduce")
    assert par.tensor_parallel_size == 2 and par.num_tokens == tokens and par.bytes["all_reduce"] == reduced
    assert reduced == (1 + 2 * 4) * tokens * 64 * 4  # the embedding's, then o_proj's and down_proj's per layer
    assert f"{reduced / 1e6:.2f} MB all-reduced per rank" in view.summary.object
    view.reset()
    assert view.empty.is_empty and view.segments.source.data["x"] == [] and view.summary.object == ""


@pytest.mark.slow
def test_a_replayed_trace_draws_what_the_live_run_drew(traced) -> None:
    records, path = traced
    live = Dashboard()
    live.extend(records)
    replay = Replay(read_trace(path))  # what `workbench replay` serves
    replay.layout.get_root(Document())
    assert "Parallelism" in list(replay.layout[2]._names)
    assert replay.dashboard.parallel.segments.source.data == live.parallel.segments.source.data
    assert replay.dashboard.parallel.transfers.source.data == live.parallel.transfers.source.data
    replay.slider.value = 1  # back to the first record: only its bars
    assert set(replay.dashboard.parallel.segments.source.data["step"]) == {records[0].step}


def test_an_unsharded_engine_is_named_not_drawn_empty() -> None:
    engine = LLMEngine(model="tiny-llama", num_kv_blocks=32, seed=0)
    engine.add_request("Hello there", SamplingParams(temperature=0.0, max_tokens=2))
    view = ParallelView()
    view.panel.get_root(Document())
    view.extend(engine.run())
    assert view.empty.is_empty and view.empty.message.object == UNSHARDED
    assert view.segments.source.data["x"] == [] and view.state.parallel.tensor_parallel_size == 1
    view.reset()
    assert view.empty.message.object == WAITING
