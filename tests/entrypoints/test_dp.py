"""Data parallelism: LLM(data_parallel_size=2) runs two engine replicas in processes behind a front end. Outputs
equal a single engine's; routing follows vLLM's score (waiting * 4 + running) exactly, or the cached prefix; a
killed replica fails only its own requests, a stopped (hung) one too once data_parallel_replica_timeout_s has passed,
and closing leaves no process behind.

One LLM serves the module (a replica's start-up takes seconds on two cores); the kill test runs last. Replicas are
frozen with SIGSTOP where a test needs their reported counts to hold still."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import pytest

from engine import LLM, EngineConfig, SamplingParams
from engine.events import Event

KW = dict(block_size=16, num_kv_blocks=64, max_model_len=512)
PROMPTS = [
    "The capital of France is a city of light, of river banks and of long avenues where",
    "Once upon a time",
    [1000 + 3 * i for i in range(40)],
    "Hello there, my friend",
    [7, 8, 9, 10] * 9,
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0)
LONG = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)


@pytest.fixture(scope="module")
def want():
    with LLM(model="tiny-llama", **KW) as llm:
        return llm.generate(PROMPTS, GREEDY, use_tqdm=False)


@pytest.fixture(scope="module")
def llm():
    with LLM(model="tiny-llama", data_parallel_size=2, **KW) as llm:
        yield llm


def _routed(client, since: int = 0) -> list:
    return [e for e in client.routing_events()[since:] if e.kind == "dp.routed"]


def _run_all(client, timeout: float = 120) -> dict:
    """Stream until nothing is in flight; each request's deltas."""
    out: dict[str, list] = {}
    deadline = time.monotonic() + timeout
    while client.has_unfinished_requests():
        assert time.monotonic() < deadline, "requests did not finish"
        for delta in client.stream(timeout=5):
            out.setdefault(delta.request_id, []).append(delta)
    return out


def test_bad_data_parallel_size_is_refused_naming_the_field() -> None:
    for bad, exc in ((0, ValueError), (-1, ValueError), ("2", TypeError), (True, TypeError), (1.5, TypeError)):
        with pytest.raises(exc, match="data_parallel_size"):
            EngineConfig(model="tiny-llama", data_parallel_size=bad)
    with pytest.raises(ValueError, match="data_parallel_size.*tensor_parallel_size"):
        EngineConfig(model="tiny-llama", data_parallel_size=2, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="data_parallel_size.*kv_transfer_config"):
        EngineConfig(
            model="tiny-llama",
            data_parallel_size=2,
            kv_transfer_config={"kv_connector": "SharedStorageConnector", "kv_role": "kv_both"},
        )
    with pytest.raises(ValueError, match="data_parallel_routing"):
        EngineConfig(model="tiny-llama", data_parallel_size=2, data_parallel_routing="random")
    with pytest.raises(ValueError, match="data_parallel_routing.*enable_prefix_caching"):
        EngineConfig(
            model="tiny-llama", data_parallel_size=2, data_parallel_routing="prefix", enable_prefix_caching=False
        )
    with pytest.raises(ValueError, match="data_parallel_size"):
        LLM(model="tiny-llama", data_parallel_size=0)  # refused before any process starts


def test_dp2_outputs_equal_a_single_engine(llm, want) -> None:
    client = llm.engine
    first = len(client.routing_events())
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [w.token_ids for w in want]
    for o, w in zip(outs, want):
        assert all(abs(a[t] - b[t]) < 1e-4 for a, b in zip(o.logprobs, w.logprobs) for t in a)
    routed = _routed(client, first)
    assert [e.request_id for e in routed] == [o.request_id for o in outs]
    assert {e.replica for e in routed} == {"dp-0", "dp-1"}  # a burst spreads before any replica reported
    records = client.records()
    assert set(records) == {"dp-0", "dp-1"}
    added = {name: {e.request_id for r in recs for e in r.of_kind("request.added")} for name, recs in records.items()}
    for e in routed:  # each request ran on the replica the front end chose, and only there
        assert e.request_id in added[e.replica]
        assert all(e.request_id not in ids for name, ids in added.items() if name != e.replica)
    assert all(recs[-1].kv.used == 0 for recs in records.values())
    again = Event.from_dict(json.loads(json.dumps(routed[0].to_dict())))
    assert again == routed[0] and again.kind == "dp.routed"


def test_routing_follows_the_score_exactly(llm) -> None:
    client = llm.engine
    dp0, dp1 = client.instances
    first = len(client.routing_events())
    a = client.submit("Once upon a time", LONG)
    for delta in client.stream(timeout=30):  # dp-0 has reported A running
        if delta.request_id == a and delta.token_ids:
            break
    os.kill(dp0.process.pid, signal.SIGSTOP)  # its last report (waiting 0, running 1) holds now
    os.kill(dp1.process.pid, signal.SIGSTOP)  # idle: (0, 0); what is sent to it stays unread, counted as waiting
    try:
        list(client.stream(timeout=0.5))  # reports already sent are read
        rids = [client.submit(p, GREEDY) for p in PROMPTS[:4]]
    finally:
        os.kill(dp0.process.pid, signal.SIGCONT)
        os.kill(dp1.process.pid, signal.SIGCONT)
    routed = _routed(client, first)
    assert [e.request_id for e in routed] == [a, *rids]
    got = [(e.replica, e.scores, e.waiting, e.running) for e in routed]
    assert got == [
        ("dp-0", (0, 0), (0, 0), (0, 0)),  # a tie goes to the lowest index
        ("dp-1", (1, 0), (0, 0), (1, 0)),  # dp-0 runs A
        ("dp-0", (1, 4), (0, 1), (1, 0)),  # the request sent to dp-1 counts as waiting: 4
        ("dp-1", (5, 4), (1, 1), (1, 0)),
        ("dp-0", (5, 8), (1, 2), (1, 0)),
    ]
    assert all(e.rule == "load" and e.alive == (True, True) for e in routed)
    deltas = _run_all(client)
    assert {rid: d[-1].finish_reason for rid, d in deltas.items()} == {a: "length", **{r: "length" for r in rids}}
    assert [len(client.pop_output(r).token_ids) for r in [a, *rids]] == [120, 8, 8, 8, 8]


def test_prefix_routing_sends_a_shared_prefix_to_the_replica_that_caches_it(llm) -> None:
    client = llm.engine
    shared = [2000 + i for i in range(48)]  # three full blocks
    client.routing = "prefix"
    try:
        first = len(client.routing_events())
        filler = client.submit([3000 + i for i in range(20)], GREEDY)  # a tie: dp-0
        holder = client.submit(shared + [5, 6, 7], GREEDY)  # dp-0 now has work: dp-1
        _run_all(client)
        assert not client.has_unfinished_requests()
        # both idle: by the score this would be a tie (dp-0); dp-1 caches its first three blocks
        follower = client.submit(shared + [9, 9, 9, 9, 9], GREEDY)
        _run_all(client)
        for rid in (filler, holder, follower):
            assert client.pop_output(rid).finish_reason == "length"
    finally:
        client.routing = "load"
    routed = _routed(client, first)
    assert [(e.request_id, e.replica) for e in routed] == [(filler, "dp-0"), (holder, "dp-1"), (follower, "dp-1")]
    assert routed[2].rule == "prefix" and routed[2].prefix_hit_blocks == (0, 3) and routed[2].scores == (0, 0)
    lookups = [e for r in client.records()["dp-1"] for e in r.of_kind("prefix.lookup") if e.request_id == follower]
    assert lookups and lookups[0].num_hit_tokens == 48  # the replica found them cached


@contextlib.contextmanager
def _dp1_stopped():
    """DP 2 with a short replica timeout (3 s), each replica past its first step (seconds on a loaded 2-core
    machine: the timeout bounds a step, and a test's must not be the slow first one), the front end's tokenizer
    loaded, then dp-1 stopped (SIGSTOP: its pipe open, it answers nothing). Yields (client, timeout); afterwards
    dp-1 is let go if still there, the LLM closed, and no replica process may be left, not even a zombie."""
    timeout = 3.0
    llm = LLM(model="tiny-llama", data_parallel_size=2, data_parallel_replica_timeout_s=timeout, **KW)
    client = llm.engine
    dp1 = client.instances[1]
    pids = list(client.pids().values())
    try:
        llm.generate(PROMPTS[:2], GREEDY)  # a burst: one on each replica
        assert {e.replica for e in _routed(client)} == {"dp-0", "dp-1"}
        _ = client.tokenizer  # add_request's event reads it: loaded before any timing
        os.kill(dp1.process.pid, signal.SIGSTOP)
        yield client, timeout
    finally:
        if dp1.process.is_alive():
            os.kill(dp1.process.pid, signal.SIGCONT)
        llm.close()
    assert not [pid for pid in pids if os.path.exists(f"/proc/{pid}")]


def test_a_stopped_replica_is_declared_dead_within_the_timeout(want) -> None:
    """A hung replica blocks no wait of the front end for longer than data_parallel_replica_timeout_s: its requests
    fail naming it, the other replica's finish with a single engine's tokens, new requests go to the live one only,
    and close leaves no process."""
    with _dp1_stopped() as (client, timeout):
        dp1 = client.instances[1]
        start = time.monotonic()
        first = len(client.routing_events())
        rids = [client.submit(p, GREEDY) for p in PROMPTS]  # a burst spreads over both before either reported
        on_dp1 = {e.request_id for e in _routed(client, first) if e.replica == "dp-1"}
        assert on_dp1 and len(on_dp1) < len(rids)
        deltas = _run_all(client, timeout=timeout + 30)  # stream() waits on both: bounded
        assert time.monotonic() - start < timeout + 10
        for rid, w in zip(rids, want):
            out = client.pop_output(rid)
            if rid in on_dp1:
                assert out.finish_reason == "error" and out.error.startswith("dp-1: no answer for 3.0 s ")
                assert "data_parallel_replica_timeout_s" in out.error and "killed" in out.error
                assert deltas[rid][-1].instance == "dp-1" and deltas[rid][-1].finish_reason == "error"
            else:
                assert out.token_ids == w.token_ids
        (dead,) = [e for e in client.routing_events() if e.kind == "dp.replica_dead"]
        assert dead.replica == "dp-1" and set(dead.failed_request_ids) == on_dp1
        assert not dp1.process.is_alive() and dp1.process.exitcode == -signal.SIGKILL  # killed and reaped
        later = len(client.routing_events())
        outs = client.generate(PROMPTS[:3], GREEDY)  # every later request goes to the live replica
        assert [o.token_ids for o in outs] == [w.token_ids for w in want[:3]]
        assert {(e.replica, e.alive) for e in _routed(client, later)} == {("dp-0", (True, False))}
        assert set(client.records()) == {"dp-0"}


def test_add_request_waits_for_a_stopped_replica_no_longer_than_the_timeout(want) -> None:
    """add_request (what AsyncLLM calls) waits for the replica's acknowledgement: a stopped replica's wait ends at
    the timeout with the replica dead and the request failed naming it; the next requests go to the live one."""
    with _dp1_stopped() as (client, timeout):
        since = len(client.routing_events())
        first = client.add_request(PROMPTS[0], LONG)  # a tie: dp-0, which takes it and runs it a while
        start = time.monotonic()
        second = client.add_request(PROMPTS[1], GREEDY)  # dp-0 holds one: dp-1, which answers nothing
        assert timeout - 0.5 < time.monotonic() - start < timeout + 5
        third = client.add_request(PROMPTS[2], GREEDY)
        assert [e.replica for e in _routed(client, since)] == ["dp-0", "dp-1", "dp-0"]
        _run_all(client, timeout=30)
        assert len(client.pop_output(first).token_ids) == 120
        assert client.pop_output(third).token_ids == want[2].token_ids
        out = client.pop_output(second)
        assert out.finish_reason == "error" and out.error.startswith("dp-1: ") and "killed" in out.error


@pytest.fixture
def own_llm():
    """For a test that kills a part of its LLM: under `--dist worksteal` a worker may run the module's tests in another
    order than they are written, so none may count on running last on the module's."""
    with LLM(model="tiny-llama", data_parallel_size=2, **KW) as llm:
        yield llm


def test_a_killed_replica_fails_only_its_requests_and_close_reaps_all(own_llm, want) -> None:
    llm = own_llm
    client = llm.engine
    dp0, dp1 = client.instances
    pids = list(client.pids().values())
    first = len(client.routing_events())
    os.kill(dp1.process.pid, signal.SIGSTOP)  # what it gets, it holds
    rids = [client.submit(p, GREEDY) for p in PROMPTS]
    on_dp1 = {e.request_id for e in _routed(client, first) if e.replica == "dp-1"}
    assert on_dp1 and len(on_dp1) < len(rids)
    dp1.process.kill()
    deltas = _run_all(client)
    for rid, w in zip(rids, want):
        out = client.pop_output(rid)
        if rid in on_dp1:
            assert out.finish_reason == "error" and "dp-1" in out.error and "gone" in out.error
            assert deltas[rid][-1].instance == "dp-1" and deltas[rid][-1].finish_reason == "error"
        else:
            assert out.token_ids == w.token_ids
    (dead,) = [e for e in client.routing_events() if e.kind == "dp.replica_dead"]
    assert dead.replica == "dp-1" and set(dead.failed_request_ids) == on_dp1
    later = len(client.routing_events())
    outs = llm.generate(PROMPTS[:3], GREEDY)  # every later request goes to the live replica
    assert [o.token_ids for o in outs] == [w.token_ids for w in want[:3]]
    assert {(e.replica, e.alive) for e in _routed(client, later)} == {("dp-0", (True, False))}
    assert set(client.records()) == {"dp-0"}
    llm.close()
    assert not [pid for pid in pids if os.path.exists(f"/proc/{pid}")]  # joined: not even a zombie
