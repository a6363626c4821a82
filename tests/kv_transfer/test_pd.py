"""PDCluster: prefill and decode engines in separate processes behind a router, over both stores: outputs equal a
single engine's, tokens stream from the decode instance, and a process that dies fails only its own requests."""

from __future__ import annotations

import os
import signal

import pytest

from engine import LLM, PDCluster, SamplingParams

KW = dict(block_size=16, num_kv_blocks=64, max_model_len=512)
PROMPTS = [
    "The capital of France is a city of light, of river banks and of long avenues where",
    "Once upon a time",
    [1000 + 3 * i for i in range(40)],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0)


@pytest.fixture(scope="module")
def want():
    return LLM(model="tiny-llama", **KW).generate(PROMPTS, GREEDY, use_tqdm=False)


CONNECTORS = ["shared_storage", "redis", "shared_storage-async"]


def _one_prefill_one_decode(request):
    connector, _, mode = request.param.partition("-")
    if connector == "redis":
        request.getfixturevalue("redis_server")  # skips where redis-server is missing
    # async: loads park decode requests in WAITING_FOR_REMOTE_KVS, saves hold prefill blocks until stored
    extra = {"async_transfers": True} if mode == "async" else None
    with PDCluster(
        model="tiny-llama", connector=connector, num_prefill=1, num_decode=1, kv_connector_extra_config=extra, **KW
    ) as c:
        yield c


# A test that kills a part of a cluster gets one of its own: under `--dist worksteal` a worker may run a module's
# tests in another order than they are written, so no test may count on running last on a shared cluster.
@pytest.fixture(scope="module", params=CONNECTORS)
def cluster(request):
    yield from _one_prefill_one_decode(request)


@pytest.fixture(params=CONNECTORS)
def own_cluster(request):
    yield from _one_prefill_one_decode(request)


@pytest.fixture
def two_prefills():
    """For the prefill failures (the router's, whatever the store): each test kills one of the prefill processes."""
    with PDCluster(model="tiny-llama", connector="shared_storage", num_prefill=2, num_decode=1, **KW) as c:
        yield c


def _collect(deltas) -> dict[str, list]:
    by_request: dict[str, list] = {}
    for delta in deltas:
        by_request.setdefault(delta.request_id, []).append(delta)
    return by_request


def _records_of(cluster, run):
    """The records of the steps `run()` took on each instance (the module's cluster has served other tests before)."""
    before = {name: len(recs) for name, recs in cluster.records().items()}
    result = run()
    return result, {name: recs[before.get(name, 0) :] for name, recs in cluster.records().items()}


def test_cluster_outputs_equal_a_single_engine(cluster, want) -> None:
    outs, records = _records_of(cluster, lambda: cluster.generate(PROMPTS, GREEDY))
    assert [o.token_ids for o in outs] == [w.token_ids for w in want]
    for o, w in zip(outs, want):
        assert all(abs(a[t] - b[t]) < 1e-4 for a, b in zip(o.logprobs, w.logprobs) for t in a)
    assert set(records) == {"prefill-0", "decode-0"}
    saves = [e for r in records["prefill-0"] for e in r.of_kind("kv_transfer.save")]
    loads = [e for r in records["decode-0"] for e in r.of_kind("kv_transfer.load")]
    assert {e.request_id for e in saves} == {e.remote_request_id for e in loads} == {o.request_id for o in outs}
    assert all(e.instance == "decode-0" and e.num_bytes > 0 for e in loads)
    # the decode side computed only each prompt's last token before decoding
    first = {}
    for r in records["decode-0"]:
        for rid, n in r.scheduled.items():
            first.setdefault(rid, n)
    assert set(first.values()) == {1}
    assert records["prefill-0"][-1].kv.used == 0 and records["decode-0"][-1].kv.used == 0


def test_instance_traces_export_with_flow_arrows_between_instances(cluster, tmp_path) -> None:
    from workbench.bench.pd import transfer_summary, write_traces
    from workbench.cli import build_parser
    from workbench.perfetto import chrome_trace
    from workbench.trace import read_trace

    # prompts no other test sends: a store drops a second copy of a key, and its save then moves no bytes
    traced = ["Traced from one instance to the other", [2000 + 5 * i for i in range(30)]]
    _, records = _records_of(cluster, lambda: cluster.generate(traced, GREEDY))
    rows = {r["instance"]: r for r in transfer_summary(records)}
    assert rows["prefill-0"]["saves"] == rows["decode-0"]["loads"] == len(traced)
    assert rows["prefill-0"]["MB"] == rows["decode-0"]["MB"] > 0
    traces = [read_trace(p) for p in write_traces(str(tmp_path), "tiny-llama", records)]
    flows = [e for e in chrome_trace(traces)["traceEvents"] if e["ph"] in "stf" and e.get("cat") == "kv_transfer"]
    # every arrow joins the two instances' tracks (in either direction: an asynchronous save is reported in a later
    # step of the prefill instance, which may come after the decode instance's load)
    by_flow: dict[int, set] = {}
    for e in flows:
        by_flow.setdefault(e["id"], set()).add(e["pid"])
    assert len(by_flow) == len(traced) and all(len(pids) == 2 for pids in by_flow.values())
    args = build_parser().parse_args(["pd", "--prefill", "2", "--decode", "1", "--connector", "redis"])
    assert (args.prefill, args.decode, args.connector) == (2, 1, "redis")


def test_streamed_tokens_are_the_outputs_tokens_from_the_decode_instance(cluster, want) -> None:
    by_request = _collect(cluster.generate_stream(PROMPTS, GREEDY))
    assert len(by_request) == len(PROMPTS) and not cluster.has_unfinished_requests()
    for rid, w in zip(sorted(by_request, key=lambda r: int(r.split("-")[1])), want):
        deltas, out = by_request[rid], cluster.pop_output(rid)
        streamed = [t for d in deltas for t in d.token_ids]
        assert streamed == out.token_ids == w.token_ids  # no duplicate first token, no gap
        text = ""
        for d in deltas:
            text = text[: d.text_offset] + d.text
        assert text == out.text == w.text
        assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
        assert deltas[-1].finish_reason == "length" and {d.instance for d in deltas} == {"decode-0"}
        assert [d.time for d in deltas] == sorted(d.time for d in deltas)
    with pytest.raises(ValueError, match="unknown"):
        cluster.pop_output(rid)


def test_submit_and_stream_with_a_timeout(cluster, want) -> None:
    rid = cluster.submit(PROMPTS[1], GREEDY, request_id="mine")
    with pytest.raises(ValueError, match="request_id"):
        cluster.submit(PROMPTS[1], GREEDY, request_id="mine")
    with pytest.raises(TypeError, match="params"):
        cluster.submit(PROMPTS[1], {"max_tokens": 8})
    early = list(cluster.stream(timeout=0.0))  # ends at once unless something is already back: nothing is lost
    tokens = [t for d in early + list(cluster.stream()) for t in d.token_ids]
    assert tokens == cluster.pop_output(rid).token_ids == want[1].token_ids


def test_bad_input_raises_naming_the_field_and_the_cluster_goes_on(cluster, want) -> None:
    with pytest.raises(ValueError, match="prompt: 600 tokens"):
        cluster.generate([[1000] * 600, PROMPTS[1]], GREEDY)
    assert not cluster.has_unfinished_requests()
    assert cluster.generate(PROMPTS[1], GREEDY)[0].token_ids == want[1].token_ids


def test_a_decode_process_killed_holding_a_request_fails_it_by_name(own_cluster) -> None:
    cluster = own_cluster
    decode = next(i for i in cluster.instances if i.role == "decode")
    prefill = next(i for i in cluster.instances if i.role == "prefill")
    stopped = []

    def stop(rid, engine_id, out):  # the request goes to the decode instance right after this
        os.kill(decode.process.pid, signal.SIGSTOP)
        stopped.append(rid)

    cluster.on_prefilled = stop
    try:
        rid = cluster.submit("Once upon a time", GREEDY)
        for _ in range(60):
            assert list(cluster.stream(timeout=1.0)) == []  # the stopped decode instance holds it, silent
            if stopped:
                break
    finally:
        cluster.on_prefilled = None
    assert stopped == [rid]
    decode.process.kill()
    (delta,) = list(cluster.stream(timeout=30))
    out = cluster.pop_output(rid)
    assert delta.finished and delta.finish_reason == out.finish_reason == "error" and delta.instance == "decode-0"
    assert "decode-0" in out.error and "gone" in out.error and out.token_ids == []
    assert cluster.records()["prefill-0"][-1].kv.used == 0  # no block held on the prefill side
    (late,) = cluster.generate(["Once upon a time"], GREEDY)  # no decode instance is left
    assert late.finish_reason == "error" and "no live decode instance" in late.error
    cluster.close()
    assert not prefill.process.is_alive() and cluster.instances == []


def test_a_prefill_killed_before_answering_fails_its_requests_only(two_prefills, want) -> None:
    p0, p1 = (i for i in two_prefills.instances if i.role == "prefill")
    os.kill(p1.process.pid, signal.SIGSTOP)  # it never answers
    # prefill-0 paused too until both are routed: a prefill answered between the two submits would leave it the least
    # loaded again, and the second request would follow the first there
    os.kill(p0.process.pid, signal.SIGSTOP)
    ok = two_prefills.submit(PROMPTS[0], GREEDY)  # the least loaded: prefill-0, then prefill-1
    lost = two_prefills.submit(PROMPTS[1], GREEDY)
    os.kill(p0.process.pid, signal.SIGCONT)
    p1.process.kill()
    by_request = _collect(two_prefills.stream(timeout=60))
    assert (
        [t for d in by_request[ok] for t in d.token_ids] == two_prefills.pop_output(ok).token_ids == want[0].token_ids
    )
    failed = two_prefills.pop_output(lost)
    assert by_request[lost][-1].finish_reason == failed.finish_reason == "error"
    assert "prefill-1" in failed.error and by_request[lost][-1].instance == "prefill-1"
    assert failed.token_ids == [] and not p1.alive and p0.alive
    records = two_prefills.records()
    assert set(records) == {"prefill-0", "decode-0"} and records["decode-0"][-1].kv.used == 0
    assert two_prefills.generate(PROMPTS[1], GREEDY)[0].token_ids == want[1].token_ids  # through prefill-0


def test_a_prefill_killed_after_answering_still_decodes_from_the_store(two_prefills, want) -> None:
    killed = []

    def kill(rid, engine_id, out):  # after the answer, before the decode instance has the request
        inst = next(i for i in two_prefills.instances if i.engine_id == engine_id)
        inst.process.kill()
        inst.process.join()
        killed.append((rid, engine_id, out.kv_transfer_params))

    two_prefills.on_prefilled = kill
    try:
        (out,) = two_prefills.generate([PROMPTS[2]], GREEDY)
    finally:
        two_prefills.on_prefilled = None
    assert out.token_ids == want[2].token_ids and killed[0][1] == "prefill-0" and killed[0][2]["do_remote_prefill"]
    records = two_prefills.records()
    assert set(records) == {"prefill-1", "decode-0"}
    events = [e for r in records["decode-0"] for e in r.events if getattr(e, "request_id", None) == out.request_id]
    assert [e.kind for e in events if e.kind.startswith("kv_transfer.")] == ["kv_transfer.load"]
    assert records["decode-0"][-1].kv.used == 0
    assert two_prefills.generate(PROMPTS[1], GREEDY)[0].token_ids == want[1].token_ids  # through prefill-1
    p1 = next(i for i in two_prefills.instances if i.engine_id == "prefill-1")
    p1.process.kill()
    p1.process.join()
    (late,) = two_prefills.generate(["Once upon a time"], GREEDY)
    assert late.finish_reason == "error" and "no live prefill instance" in late.error


def test_bad_cluster_arguments_name_the_field() -> None:
    with pytest.raises(ValueError, match="connector"):
        PDCluster(model="tiny-llama", connector="nixl")
    with pytest.raises(ValueError, match="num_decode"):
        PDCluster(model="tiny-llama", num_decode=0)
    with pytest.raises(ValueError, match="torch_threads"):
        PDCluster(model="tiny-llama", torch_threads=0)
