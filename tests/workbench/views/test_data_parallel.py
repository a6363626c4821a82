"""Data parallelism in the Parallelism tab: per-replica load and routing decisions from a DP front end's records
(dp.load, dp.routed, dp.replica_dead), headless; the same records through a trace and the replay draw the same;
and a real run, `workbench run --data-parallel-size 2 --trace` on tiny-llama, writes the front end's records (every
request added, routed with each replica's score, finished with one engine's greedy text), which replay."""

from __future__ import annotations

import json

import pytest
from bokeh.document import Document

from engine import SamplingParams, StepRecord
from engine.events import DPLoad, DPReplicaDead, DPRouted, KVUsage
from workbench.app import Replay
from workbench.cli import main
from workbench.trace import read_trace, write_trace
from workbench.views import Dashboard, ParallelView
from workbench.views.parallel import REPLICAS

T0 = 1_700_000_000_000_000_000


def _record(step: int, events: list) -> StepRecord:
    return StepRecord(
        step, T0 + step * 10**8, T0 + step * 10**8 + 1000, {}, {}, 0, 0, KVUsage(62, 0, 0, 62), {}, events
    )


def _routed(step: int, rid: str, chosen: int, scores: tuple, waiting: tuple, running: tuple) -> DPRouted:
    return DPRouted(
        step=step,
        request_id=rid,
        replica=f"dp-{chosen}",
        replica_index=chosen,
        rule="load",
        scores=scores,
        waiting=waiting,
        running=running,
        prefix_hit_blocks=(0, 0),
        alive=(True, True),
        time_ns=T0 + step * 10**8,
    )


def _load(step: int, k: int, waiting: int, running: int, alive: bool = True) -> DPLoad:
    return DPLoad(
        step=step,
        replica=f"dp-{k}",
        replica_index=k,
        waiting=waiting,
        running=running,
        kv_used=3 * running,
        kv_total=31,
        alive=alive,
        time_ns=T0 + step * 10**8 + 500,
    )


RECORDS = [
    _record(1, [_routed(1, "a", 0, (0, 0), (0, 0), (0, 0)), _load(1, 0, 1, 0), _load(1, 1, 0, 0)]),
    _record(2, [_routed(2, "b", 1, (1, 0), (0, 0), (1, 0)), _load(2, 0, 0, 1), _load(2, 1, 0, 1)]),
    _record(
        3,
        [
            _routed(3, "c", 0, (1, 5), (0, 1), (1, 1)),
            DPReplicaDead(
                step=3,
                replica="dp-1",
                replica_index=1,
                error="dp-1: the process is gone (exit code -9)",
                failed_request_ids=("b",),
                time_ns=T0 + 3 * 10**8,
            ),
            _load(3, 1, 0, 1, alive=False),
        ],
    ),
]


def _drawn(view: ParallelView) -> tuple[list, list]:
    loads, routes = view.dp.loads.source.data, view.dp.routes.source.data
    return (
        list(zip(loads["replica"], loads["what"], loads["count"], loads["t"])),
        list(zip(routes["request_id"], routes["replica"], routes["scores"], routes["waiting"], routes["running"])),
    )


def test_loads_and_routing_decisions_equal_the_events() -> None:
    view = ParallelView()
    view.panel.get_root(Document())
    assert not view.dp.panel.visible
    view.extend(RECORDS)
    loads, routes = _drawn(view)
    assert routes == [
        ("a", "dp-0", "0 · 0", "0 · 0", "0 · 0"),
        ("b", "dp-1", "1 · 0", "0 · 0", "1 · 0"),
        ("c", "dp-0", "1 · 5", "0 · 1", "1 · 1"),
    ]
    events = [e for r in RECORDS for e in r.of_kind("dp.load")]
    assert loads == [
        (e.replica, what, getattr(e, what), (e.time_ns - RECORDS[0].events[0].time_ns) / 1e9)
        for e in events
        for what in ("waiting", "running")
    ]
    par = view.state.parallel
    assert par.data_parallel_size == 2 and [d.request_id for d in par.routes] == ["a", "b", "c"]
    assert par.dead == {"dp-1": "dp-1: the process is gone (exit code -9)"}
    assert view.dp.panel.visible and view.empty.is_empty and view.empty.message.object == REPLICAS
    summary = view.dp.summary.object
    assert "data_parallel_size=2" in summary and "3 requests routed (dp-0 2, dp-1 1)" in summary
    assert "dp-1 died" in summary and "exit code -9" in summary
    view.reset()
    assert not view.dp.panel.visible and view.dp.routes.source.data["request_id"] == [] and view.dp.origin_ns is None


def test_a_trace_of_the_front_end_round_trips_and_replays_the_same(tmp_path) -> None:
    path = tmp_path / "dp.jsonl"
    write_trace(path, {"schema_version": 1, "config": {"data_parallel_size": 2}, "snapshot": None}, RECORDS)
    trace = read_trace(path)
    assert [r.to_dict() for r in trace.records] == [r.to_dict() for r in RECORDS] and trace.snapshot is None
    assert trace.records[0].events[0] == RECORDS[0].events[0]  # typed back: tuples, not lists
    live = Dashboard()
    live.extend(RECORDS)
    replay = Replay(trace)
    replay.layout.get_root(Document())
    for name in ("loads", "routes"):
        assert getattr(replay.dashboard.parallel.dp, name).source.data == getattr(live.parallel.dp, name).source.data
    replay.slider.value = 1  # back to the first record: its decision alone
    assert replay.dashboard.parallel.dp.routes.source.data["request_id"] == ["a"]


@pytest.mark.slow
def test_workbench_run_with_data_parallelism_traces_the_front_end(tmp_path, capsys) -> None:
    from engine import LLM

    prompts = ["Hello there", "The capital of France is", "One, two, three,", "Paged attention stores"]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    trace_path = tmp_path / "dp.jsonl"
    assert (
        main(
            [
                "run",
                "--prompts",
                str(tmp_path / "prompts.txt"),
                "--trace",
                str(trace_path),
                "--model",
                "tiny-llama",
                "--num-kv-blocks",
                "64",
                "--data-parallel-size",
                "2",
                "--max-tokens",
                "6",
                "--temperature",
                "0",
                "--ignore-eos",
            ]
        )
        == 0
    )
    with LLM(model="tiny-llama", num_kv_blocks=64) as one:
        expected = one.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert [json.loads(line.split(": ", 1)[1]) for line in lines] == [o.text for o in expected]
    trace = read_trace(trace_path)
    assert trace.header["config"]["data_parallel_size"] == 2
    assert trace.snapshot.step == 0 and trace.snapshot.requests == [] and trace.snapshot.blocks == []  # added next
    events = [e for r in trace.records for e in r.events]
    routed = [e for e in events if e.kind == "dp.routed"]
    assert sorted(e.request_id for e in routed) == sorted(e.request_id for e in events if e.kind == "request.added")
    assert {e.replica for e in routed} == {"dp-0", "dp-1"} and len(routed) == len(prompts)
    for e in routed:  # the choice is the least score, ties to the lowest index
        assert e.scores == tuple(w * 4 + r for w, r in zip(e.waiting, e.running))
        assert e.replica_index == min(range(2), key=lambda k: (e.scores[k], k))
    finished = {e.request_id: e for e in events if e.kind == "request.finished"}
    assert set(finished) == {e.request_id for e in routed} and all(e.num_output_tokens == 6 for e in finished.values())
    assert {e.replica for e in events if e.kind == "dp.load"} == {"dp-0", "dp-1"}
    replay = Replay(trace)
    replay.layout.get_root(Document())
    drawn = replay.dashboard.parallel.dp.routes.source.data
    assert list(zip(drawn["request_id"], drawn["replica"])) == [(e.request_id, e.replica) for e in routed]
    board = replay.dashboard  # the views of one engine's steps or blocks say they are per replica
    assert board.data_parallel_size == 2 and board.notices[board.kv_blocks].visible
    assert not board.kv_blocks.panel.visible and "per replica" in board.notices[board.timeline].object
    replay.slider.value = 1  # redrawn from the first record: still a data-parallel trace
    assert board.notices[board.kv_blocks].visible and not board.kv_blocks.panel.visible
