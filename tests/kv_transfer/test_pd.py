"""PDCluster: prefill and decode engines in separate processes behind a router, over both stores."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.kv_transfer import PDCluster

KW = dict(block_size=16, num_kv_blocks=64, max_model_len=512)
PROMPTS = ["The capital of France is a city of light, of river banks and of long avenues where",
           "Once upon a time", [1000 + 3 * i for i in range(40)]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0)


@pytest.fixture(scope="module", params=["shared_storage", "redis"])
def cluster(request):
    if request.param == "redis":
        request.getfixturevalue("redis_server")  # skips where redis-server is missing
    with PDCluster(model="tiny-llama", connector=request.param, num_prefill=1, num_decode=1, **KW) as c:
        yield c


def test_cluster_outputs_equal_a_single_engine(cluster) -> None:
    want = LLM(model="tiny-llama", **KW).generate(PROMPTS, GREEDY, use_tqdm=False)
    outs = cluster.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [w.token_ids for w in want]
    for o, w in zip(outs, want):
        assert all(abs(a[t] - b[t]) < 1e-4 for a, b in zip(o.logprobs, w.logprobs) for t in a)
    records = cluster.records()
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

    records = cluster.records()
    rows = {r["instance"]: r for r in transfer_summary(records)}
    assert rows["prefill-0"]["saves"] == rows["decode-0"]["loads"] == len(PROMPTS)
    assert rows["prefill-0"]["MB"] == rows["decode-0"]["MB"] > 0
    traces = [read_trace(p) for p in write_traces(str(tmp_path), "tiny-llama", records)]
    flows = [e for e in chrome_trace(traces)["traceEvents"] if e["ph"] in "stf" and e.get("cat") == "kv_transfer"]
    assert {e["pid"] for e in flows if e["ph"] == "s"} != {e["pid"] for e in flows if e["ph"] == "f"}
    args = build_parser().parse_args(["pd", "--prefill", "2", "--decode", "1", "--connector", "redis"])
    assert (args.prefill, args.decode, args.connector) == (2, 1, "redis")


def test_a_killed_decode_process_is_named_and_the_cluster_closes(cluster) -> None:
    # runs last on this module's cluster: it kills a part of it
    decode = next(i for i in cluster.instances if i.role == "decode")
    prefill = next(i for i in cluster.instances if i.role == "prefill")
    decode.process.kill()
    decode.process.join()
    with pytest.raises(RuntimeError, match="decode-0"):
        cluster.generate(["Once upon a time"], GREEDY)
    cluster.close()
    assert not prefill.process.is_alive() and cluster.instances == []


def test_bad_cluster_arguments_name_the_field() -> None:
    with pytest.raises(ValueError, match="connector"):
        PDCluster(model="tiny-llama", connector="nixl")
    with pytest.raises(ValueError, match="num_decode"):
        PDCluster(model="tiny-llama", num_decode=0)
