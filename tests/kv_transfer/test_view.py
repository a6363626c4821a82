"""The KV-transfer view over synthetic records from two instances; the transfer timeline over a real
asynchronous prefill -> decode run."""

from __future__ import annotations

from bokeh.document import Document

from engine import LLMEngine
from engine.events import KVTransferFail, KVTransferLoad, KVTransferSave, KVUsage, StepRecord
from tests.kv_transfer.test_async import gate
from tests.kv_transfer.test_connectors import GREEDY, KW, PREFILL, assert_no_leaks, events
from workbench.views.kv_transfer import (
    HELD,
    LOADING,
    RUNNING,
    WAITING,
    KVTransferView,
    transfer_timeline,
    transfer_timeline_figure,
)


def _record(step: int, end_ns: int, events: list) -> StepRecord:
    return StepRecord(
        step=step,
        start_ns=end_ns - 1000,
        end_ns=end_ns,
        scheduled={},
        phases={},
        num_waiting=0,
        num_running=0,
        kv=KVUsage(8, 0, 0, 8),
        timing={},
        events=events,
    )


def test_view_accumulates_bytes_per_instance_and_lists_failures() -> None:
    view = KVTransferView()
    view.panel.get_root(Document())
    assert view.empty.is_empty
    common = dict(connector="SharedStorageConnector", key="k", num_blocks=2, num_tokens=20, ms=2.0, mb_per_s=1.0)
    view.extend(
        [
            _record(
                1,
                1_000_000_000,
                [KVTransferSave(1, request_id="a", instance="prefill-0", num_bytes=2_000_000, **common)],
            ),
            _record(
                1,
                1_500_000_000,
                [
                    KVTransferLoad(
                        1, request_id="a", instance="decode-0", num_bytes=2_000_000, remote_request_id="a", **common
                    ),
                    KVTransferFail(
                        1,
                        request_id="b",
                        instance="decode-0",
                        connector="RedisConnector",
                        failure="timeout",
                        policy_action="recompute",
                        num_recomputed_tokens=31,
                    ),
                ],
            ),
            _record(
                2,
                2_000_000_000,
                [KVTransferSave(2, request_id="c", instance="prefill-0", num_bytes=1_000_000, **common)],
            ),
        ]
    )
    assert not view.empty.is_empty
    data = view.points.source.data
    assert data["mb"] == [2.0, 2.0, 2.0, 3.0]  # per instance: the failure moves nothing
    assert data["t"][-1] > data["t"][0]
    rows = view.rows.source.data
    assert rows["kind"] == ["save", "load", "fail", "save"]
    assert rows["failure"][2] == "timeout" and rows["num_recomputed_tokens"][2] == 31
    view.reset()
    assert view.empty.is_empty and view.points.source.data["mb"] == []


def test_the_transfer_timeline_of_an_async_run(kv_config) -> None:
    """Both sides' records of a real run with asynchronous transfers, each held in flight by a gate: the
    prefill side holds the prompt's blocks past the request's end until the save is collected; the decode side
    parks the request with its blocks allocated (WAITING_FOR_REMOTE_KVS) until the load is collected, and only
    then schedules it."""
    producer = LLMEngine(**KW, kv_transfer_config=kv_config("kv_producer", async_transfers=True))
    consumer = LLMEngine(**KW, kv_transfer_config=kv_config("kv_consumer", async_transfers=True))
    prompt = "A timeline of one transfer: saved on one side, loaded on the other, then decoded there."
    prefill, decode = [], []
    with gate(producer):
        pid = producer.add_request(prompt, PREFILL, kv_transfer_params={"do_remote_decode": True})
        prefill += [producer.step() for _ in range(2)]  # the save waits behind the gate: the blocks stay held
    while producer.has_unfinished_requests():
        prefill.append(producer.step())
    params = producer.pop_output(pid).kv_transfer_params
    with gate(consumer):
        cid = consumer.add_request(prompt, GREEDY, kv_transfer_params=params)
        decode += [consumer.step() for _ in range(2)]  # the load waits behind the gate: the request is parked
    while consumer.has_unfinished_requests():
        decode.append(consumer.step())
    consumer.pop_output(cid)
    assert_no_leaks(producer, consumer)

    timeline = transfer_timeline({"prefill": prefill, "decode": decode})
    num_blocks = events(prefill, "kv_transfer.save")[0].num_blocks
    run, held = timeline.span("prefill", pid, RUNNING), timeline.span("prefill", pid, HELD)
    save = timeline.mark("prefill", pid, "save")
    assert (run.first_step, run.last_step) == (1, 1) and held.first_step == 1 and held.start_ns == run.end_ns
    # held from the request's end to the step that collected the save, which is where the blocks were freed
    assert held.last_step == save.step >= 3 and held.end_ns == save.t_ns and held.num_blocks == num_blocks
    assert events([prefill[held.last_step - 1]], "kv.freed")[0].request_id == pid
    assert timeline.span("prefill", pid, LOADING) is None

    wait, loading = timeline.span("decode", cid, WAITING), timeline.span("decode", cid, LOADING)
    running, load = timeline.span("decode", cid, RUNNING), timeline.mark("decode", cid, "load")
    assert wait.end_ns == loading.start_ns and loading.end_ns == load.t_ns <= running.start_ns
    assert loading.first_step == 1 and loading.last_step == load.step >= 3 and running.first_step >= load.step
    assert loading.num_blocks == running.num_blocks >= num_blocks
    first = next(r for r in decode if cid in r.scheduled)
    assert first.step == running.first_step and first.scheduled[cid] == 1  # only the prompt's last token
    assert all(not r.scheduled for r in decode[: load.step - 1])
    assert timeline.span("decode", cid, HELD) is None  # nothing saves on the decode side

    fig = transfer_timeline_figure(timeline)
    bars = fig.renderers[0].data_source.data
    assert sorted(zip(bars["request_id"], bars["state"])) == sorted(
        [(pid, WAITING), (pid, RUNNING), (pid, HELD), (cid, WAITING), (cid, LOADING), (cid, RUNNING)]
    )
