"""The Chrome trace export: structurally valid Trace Event Format (required fields per phase, slices nest on each
track, async spans pair up, flows bind to slices), and the spans, counters and arrows it should hold."""

import json
from collections import defaultdict
from dataclasses import dataclass
from numbers import Real

import pytest

from engine.events import (
    KVUsage,
    RequestAdded,
    RequestFinished,
    RequestPreempted,
    RequestScheduled,
    RequestTokens,
    StepRecord,
    StepTiming,
)
from workbench.perfetto import STAGES, chrome_trace, export_chrome_trace
from workbench.trace import Trace

EPS_US = 0.002  # ts and dur are rounded to the nanosecond separately
_REQUIRED = {
    "X": ("ts", "dur", "pid", "tid", "name"),
    "b": ("id", "cat", "name", "ts", "pid"),
    "e": ("id", "cat", "name", "ts", "pid"),
    "C": ("name", "ts", "pid", "args"),
    "s": ("id", "cat", "name", "ts", "pid", "tid"),
    "t": ("id", "cat", "name", "ts", "pid", "tid"),
    "f": ("id", "cat", "name", "ts", "pid", "tid"),
    "M": ("name", "pid", "args"),
}


def _check_fields(e: dict) -> None:
    assert e.get("ph") in _REQUIRED, f"unknown phase in {e}"
    missing = [k for k in _REQUIRED[e["ph"]] if k not in e]
    assert not missing, f"{e['ph']} event lacks {missing}: {e}"
    if "ts" in e:
        assert isinstance(e["ts"], Real) and not isinstance(e["ts"], bool)
    if e["ph"] == "X":
        assert e["dur"] >= 0
    if e["ph"] == "C":
        values = e["args"].values()
        assert values and all(isinstance(v, Real) and not isinstance(v, bool) for v in values), f"args: {e}"
    if e["ph"] in "stf":
        assert isinstance(e["id"], int), "Perfetto reads v1 flow ids as numbers"


def _check_slices_nest(slices: list[dict]) -> None:
    stack: list[float] = []  # ends of the open enclosing slices
    last_ts = float("-inf")
    for s in slices:
        assert s["ts"] >= last_ts, f"slices out of order: {s}"
        last_ts, end = s["ts"], s["ts"] + s["dur"]
        while stack and stack[-1] <= s["ts"] + EPS_US:
            stack.pop()
        assert not stack or end <= stack[-1] + EPS_US, f"partial overlap: {s}"
        stack.append(end)


def _check_async_pairs(events: list[dict]) -> None:
    stack: list[str] = []
    last_ts = float("-inf")
    for e in events:
        assert e["ts"] >= last_ts, f"async events out of order: {e}"
        last_ts = e["ts"]
        if e["ph"] == "b":
            stack.append(e["name"])
        else:
            assert stack and stack.pop() == e["name"], f"'e' closes no matching 'b': {e}"
    assert not stack, f"'b' without 'e': {stack}"


def _encloses(slices: list[dict], ts: float) -> bool:
    return any(s["ts"] - EPS_US <= ts <= s["ts"] + s["dur"] + EPS_US for s in slices)


def _check_flow(events: list[dict], slices: dict) -> None:
    assert [e["ph"] for e in events] == ["s"] + ["t"] * (len(events) - 2) + ["f"]
    assert len({(e["cat"], e["name"]) for e in events}) == 1
    assert [e["ts"] for e in events] == sorted(e["ts"] for e in events), f"flow out of order: {events}"
    for e in events:
        assert e["ph"] == "s" or e.get("bp") == "e"
        assert _encloses(slices[e["pid"], e["tid"]], e["ts"]), f"flow event binds to no slice: {e}"


def check_chrome_trace(result: dict) -> dict:
    """Assert `result` is a well-formed Chrome trace; return its events grouped by track for further checks."""
    json.dumps(result)
    assert result["displayTimeUnit"] in ("ms", "ns")
    slices, asyncs, counters, flows = defaultdict(list), defaultdict(list), defaultdict(list), defaultdict(list)
    for e in result["traceEvents"]:
        _check_fields(e)
        if e["ph"] == "X":
            slices[e["pid"], e["tid"]].append(e)
        elif e["ph"] in "be":
            asyncs[e["pid"], e["cat"], e["id"]].append(e)
        elif e["ph"] == "C":
            counters[e["pid"], e["name"]].append(e)
        elif e["ph"] in "stf":
            flows[e["id"]].append(e)
    for track in slices.values():
        _check_slices_nest(track)
    for track in asyncs.values():
        _check_async_pairs(track)
    for track in counters.values():
        assert [c["ts"] for c in track] == sorted(c["ts"] for c in track), f"counter out of order: {track}"
    for flow in flows.values():
        _check_flow(flow, slices)
    return {"slices": slices, "asyncs": asyncs, "counters": counters, "flows": flows}


def _phase_spans(asyncs: dict, pid: int, rid: str) -> list[str]:
    events = asyncs[pid, "request", f"{pid}:{rid}"]
    return [e["name"] for e in events if e["ph"] == "b" and not e["name"].startswith("request ")]


# ---- synthetic traces: exact control over what happened -----------------------------------------------
MS = 1_000_000
T0 = 1_700_000_000_000_000_000


def _record(
    step: int,
    events: list,
    scheduled: dict | None = None,
    phases: dict | None = None,
    running: int = 1,
    waiting: int = 0,
) -> StepRecord:
    start = T0 + step * 10 * MS
    timing = {"schedule": 1.0, "forward": 5.0, "sample": 1.0, "update": 1.0, "total": 8.0}
    events = events + [StepTiming(step=step, schedule_ms=1.0, forward_ms=5.0, sample_ms=1.0, total_ms=8.0)]
    return StepRecord(
        step,
        start,
        start + 9 * MS,
        scheduled or {},
        phases or {},
        waiting,
        running,
        KVUsage(total=16, used=4, cached_free=2, free=10),
        timing,
        events,
    )


def _added(step: int, rid: str) -> RequestAdded:
    return RequestAdded(
        step=step,
        request_id=rid,
        num_prompt_tokens=20,
        max_tokens=4,
        priority=0,
        arrival_ns=T0 + step * 10 * MS - 3 * MS,
        prompt="hi",
    )


def _scheduled(step: int, rid: str, phase: str, n: int) -> RequestScheduled:
    return RequestScheduled(step=step, request_id=rid, num_tokens=n, phase=phase, num_computed_tokens=0)


def _tokens(step: int, rid: str) -> RequestTokens:
    return RequestTokens(step=step, request_id=rid, token_ids=(5,), text="x", text_offset=0, num_output_tokens=1)


def _preemption_trace() -> Trace:
    """a: chunked prefill, decode, preempted, recomputed, decode, finished. b: never finishes."""
    return Trace(
        {"schema_version": 1, "model": {"name": "synthetic"}},
        [
            _record(1, [_added(1, "a"), _scheduled(1, "a", "chunk", 12)], {"a": 12}, {"a": "chunk"}),
            _record(2, [_scheduled(2, "a", "chunk", 8), _tokens(2, "a")], {"a": 8}, {"a": "chunk"}),
            _record(
                3,
                [
                    _added(3, "b"),
                    _scheduled(3, "a", "decode", 1),
                    _tokens(3, "a"),
                    _scheduled(3, "b", "prefill", 4),
                    _tokens(3, "b"),
                ],
                {"a": 1, "b": 4},
                {"a": "decode", "b": "prefill"},
            ),
            _record(
                4,
                [
                    RequestPreempted(step=4, request_id="a", num_computed_tokens=22, num_freed_blocks=2),
                    _scheduled(4, "b", "decode", 1),
                    _tokens(4, "b"),
                ],
                {"b": 1},
                {"b": "decode"},
                waiting=1,
            ),
            _record(5, [_scheduled(5, "a", "prefill", 22), _tokens(5, "a")], {"a": 22}, {"a": "prefill"}),
            _record(
                6,
                [
                    _scheduled(6, "a", "decode", 1),
                    RequestFinished(step=6, request_id="a", reason="length", num_output_tokens=4),
                    _tokens(6, "a"),
                ],
                {"a": 1},
                {"a": "decode"},
            ),
        ],
    )


def test_every_step_is_a_slice_with_its_stages_nested():
    trace = _preemption_trace()
    groups = check_chrome_trace(chrome_trace(trace))
    engine = groups["slices"][1, 1]
    steps = [s for s in engine if s["cat"] == "step"]
    assert [s["name"] for s in steps] == [f"step {r.step}" for r in trace.records]
    assert steps[0]["dur"] == pytest.approx(9000) and steps[1]["ts"] - steps[0]["ts"] == pytest.approx(10_000)
    stages = [s for s in engine if s["cat"] == "stage"]
    assert [s["name"] for s in stages] == list(STAGES) * len(trace.records)
    assert [s["dur"] for s in stages[:4]] == pytest.approx([1000, 5000, 1000, 1000])


def test_request_tracks_go_queued_prefill_decode_and_back_to_queued_when_preempted():
    groups = check_chrome_trace(chrome_trace(_preemption_trace()))
    asyncs = groups["asyncs"]
    assert _phase_spans(asyncs, 1, "a") == ["queued", "prefill", "decode", "queued", "prefill", "decode"]
    a = asyncs[1, "request", "1:a"]
    assert a[0]["name"] == "request a" and a[0]["args"]["num_prompt_tokens"] == 20
    assert a[-1]["args"]["reason"] == "length"
    # times from the first arrival (3 ms before step 1): queued until the step that scheduled it
    assert [e["ts"] for e in a[:2]] == [0.0, 0.0]
    queued_end = next(e for e in a if e["ph"] == "e" and e["name"] == "queued")
    assert queued_end["ts"] == pytest.approx(3000)
    b = asyncs[1, "request", "1:b"]
    assert _phase_spans(asyncs, 1, "b") == ["queued", "prefill", "decode"]
    assert b[-1]["args"] == {"unfinished": True} and b[-1]["ts"] == pytest.approx(62_000)  # the end of step 6


def test_counters_for_kv_queues_and_tokens_per_step():
    trace = _preemption_trace()
    counters = check_chrome_trace(chrome_trace(trace))["counters"]
    assert {name for _, name in counters} == {"KV blocks", "queues", "tokens per step"}
    assert all(len(track) == len(trace.records) for track in counters.values())
    assert counters[1, "KV blocks"][0]["args"] == {"used": 4, "cached_free": 2, "free": 10}
    assert counters[1, "queues"][3]["args"] == {"waiting": 1, "running": 1}
    assert counters[1, "tokens per step"][2]["args"] == {"prefill": 4, "chunk": 0, "decode": 1, "verify": 0}


@dataclass(frozen=True)
class _Transfer:
    """A kv_transfer event with the payload DESIGN.md names (the engine has no such class yet)."""

    step: int
    kind: str
    request_id: str
    connector: str
    block_ids: tuple
    num_bytes: int
    ms: float

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "step": self.step,
            "request_id": self.request_id,
            "connector": self.connector,
            "block_ids": list(self.block_ids),
            "num_bytes": self.num_bytes,
            "ms": self.ms,
        }


def _pd_traces() -> tuple[Trace, Trace]:
    """A prefill instance saves r's KV in its step 1; a decode instance loads it in its step 2 and decodes."""
    prefill = Trace(
        {"schema_version": 1, "model": {"name": "synthetic"}, "instance": "prefill"},
        [
            _record(
                1,
                [
                    _added(1, "r"),
                    _scheduled(1, "r", "prefill", 20),
                    _tokens(1, "r"),
                    _Transfer(1, "kv_transfer.save", "r", "shared_storage", (1, 2), 4096, 2.5),
                    RequestFinished(step=1, request_id="r", reason="length", num_output_tokens=1),
                ],
                {"r": 20},
                {"r": "prefill"},
            ),
        ],
    )
    decode = Trace(
        {"schema_version": 1, "model": {"name": "synthetic"}, "instance": "decode"},
        [
            _record(
                2,
                [
                    _added(2, "r"),
                    _Transfer(2, "kv_transfer.load", "r", "shared_storage", (3, 4), 4096, 1.5),
                    _scheduled(2, "r", "decode", 1),
                    _tokens(2, "r"),
                ],
                {"r": 1},
                {"r": "decode"},
            ),
            _record(
                3,
                [
                    _scheduled(3, "r", "decode", 1),
                    _tokens(3, "r"),
                    RequestFinished(step=3, request_id="r", reason="length", num_output_tokens=3),
                ],
                {"r": 1},
                {"r": "decode"},
            ),
        ],
    )
    return prefill, decode


def test_a_flow_arrow_follows_kv_from_prefill_through_save_and_load_to_decode():
    prefill, decode = _pd_traces()
    result = chrome_trace([prefill, decode])
    groups = check_chrome_trace(result)
    names = {e["pid"]: e["args"]["name"] for e in result["traceEvents"] if e["name"] == "process_name"}
    assert names == {1: "prefill (synthetic)", 2: "decode (synthetic)"}
    (flow,) = groups["flows"].values()
    assert [(e["ph"], e["pid"], e["tid"]) for e in flow] == [("s", 1, 1), ("t", 1, 2), ("t", 2, 2), ("f", 2, 1)]
    save, load = groups["slices"][1, 2], groups["slices"][2, 2]
    assert [s["name"] for s in save + load] == ["kv_transfer.save", "kv_transfer.load"]
    assert save[0]["dur"] == pytest.approx(2500) and save[0]["args"]["num_bytes"] == 4096
    # one wall clock: the decode instance's step 2 starts 10 ms after the prefill instance's step 1
    steps = {pid: groups["slices"][pid, 1][0]["ts"] for pid in (1, 2)}
    assert steps[2] - steps[1] == pytest.approx(10_000)
    # save after the prefill step's forward pass; load before the decode step's
    assert save[0]["ts"] == pytest.approx(steps[1] + 6000) and load[0]["ts"] == pytest.approx(steps[2] + 1000)


def test_a_save_without_its_load_still_draws_an_arrow_to_the_save():
    prefill, _ = _pd_traces()
    (flow,) = check_chrome_trace(chrome_trace(prefill))["flows"].values()
    assert [(e["ph"], e["tid"]) for e in flow] == [("s", 1), ("f", 2)]


def test_no_transfers_no_flows_and_no_transfer_thread():
    result = chrome_trace(_preemption_trace())
    groups = check_chrome_trace(result)
    assert not groups["flows"] and (1, 2) not in groups["slices"]
    assert {e["args"]["name"] for e in result["traceEvents"] if e["name"] == "thread_name"} == {"engine"}


def _first(events: list[dict], **match) -> dict:
    return next(e for e in events if all(e.get(k) == v for k, v in match.items()))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda ev: _first(ev, cat="stage").update(dur=1e9), "partial overlap"),
        (lambda ev: ev.remove([e for e in ev if e["ph"] == "e"][-1]), "'b' without 'e'"),
        (lambda ev: _first(ev, cat="step").pop("dur"), "lacks"),
        (lambda ev: _first(ev, ph="C").update(args={"used": "many"}), "args"),
        (lambda ev: _first(ev, ph="t").update(ts=_first(ev, name="kv_transfer.save")["ts"] - 1), "binds to no slice"),
        (lambda ev: _first(ev, ph="f").update(ts=0.0), "flow out of order"),
    ],
)
def test_the_checker_catches_what_it_should(mutate, message):
    bad = json.loads(json.dumps(chrome_trace(list(_pd_traces()))))
    check_chrome_trace(bad)
    mutate(bad["traceEvents"])
    with pytest.raises(AssertionError, match=message):
        check_chrome_trace(bad)


def test_export_writes_the_json_it_returns(tmp_path):
    out = tmp_path / "trace.json"
    result = export_chrome_trace(_preemption_trace(), out)
    assert json.loads(out.read_text()) == result
