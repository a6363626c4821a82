"""KV cache events in vLLM 0.33's wire format (engine/distributed/kv_events.py): the config and its errors, the
encoding, vLLM's recorded bytes (tests/fidelity/golden/kv_events.json, written by vLLM's own scheduler and publisher in
`make fidelity`) read and written back, this engine's events on the same workload equal to vLLM's, and a live engine
publishing over ZeroMQ: every block it caches and evicts, in order, and the replay socket. No vLLM needed."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import msgspec
import pytest
import zmq

from engine import LLMEngine, SamplingParams
from engine.config import EngineConfig, KVEventsConfig
from engine.core.block_hash import hash_hex, sha256_hash
from engine.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
    offset_endpoint_port,
    to_external_block_hash,
)
from engine.entrypoints.dp_client import DPLBClient
from engine.events import KVEvicted
from tests.distributed.helpers import RecordingPublisher, engine_batches, fields_but_ts, join, probe
from tests.fidelity.vllm_kv_events import batch_fields
from tests.net import free_port
from workbench.kv_events import KVEventSubscriber, decode_message

GOLDEN = Path(__file__).resolve().parents[1] / "fidelity" / "golden" / "kv_events.json"
LOOPBACK = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0"}


def _publisher_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kv-events-publisher"]


# ---- the config ---------------------------------------------------------------------------------------------------
def test_the_config_has_vllms_keys_in_vllms_order():
    # vllm/config/kv_events.py, 0.33.0
    vllm_keys = ["enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "buffer_steps", "hwm"]
    vllm_keys += ["max_queue_size", "topic"]
    assert list(KVEventsConfig.__dataclass_fields__) == vllm_keys
    assert KVEventsConfig.from_dict({"enable_kv_cache_events": True}).publisher == "zmq"  # vLLM's __post_init__
    assert KVEventsConfig.from_dict({}).publisher == "null"
    assert KVEventsConfig().endpoint == "tcp://127.0.0.1:5557"  # loopback unless told otherwise


@pytest.mark.parametrize(
    "kv_events_config, error, field",
    [
        ({"endpoint": "127.0.0.1:5557"}, ValueError, "kv_events_config.endpoint"),
        ({"endpoint": "tcp://127.0.0.1:65536"}, ValueError, "kv_events_config.endpoint"),
        ({"endpoint": "udp://127.0.0.1:5557"}, ValueError, "kv_events_config.endpoint"),
        ({"endpoint": 5557}, TypeError, "kv_events_config.endpoint"),
        ({"replay_endpoint": "tcp://127.0.0.1"}, ValueError, "kv_events_config.replay_endpoint"),
        ({"replay_endpoint": "tcp://127.0.0.1:5557"}, ValueError, "kv_events_config.replay_endpoint"),
        ({"publisher": "kafka"}, ValueError, "kv_events_config.publisher"),
        ({"enable_kv_cache_events": "yes"}, TypeError, "kv_events_config.enable_kv_cache_events"),
        ({"buffer_steps": -1}, ValueError, "kv_events_config.buffer_steps"),
        ({"hwm": 1.5}, TypeError, "kv_events_config.hwm"),
        ({"topic": b"kv"}, TypeError, "kv_events_config.topic"),
        ({"endpoints": "tcp://127.0.0.1:1"}, ValueError, "kv_events_config.endpoints"),
        ("tcp://127.0.0.1:5557", TypeError, "kv_events_config"),
    ],
)
def test_a_bad_config_is_refused_naming_the_field(kv_events_config, error, field):
    with pytest.raises(error, match=field):
        EngineConfig(kv_events_config=kv_events_config)


def test_each_data_parallel_rank_needs_a_port_of_its_own():
    with pytest.raises(ValueError, match=r"kv_events_config.endpoint: port 65535 \+ 1"):
        EngineConfig(kv_events_config={"endpoint": "tcp://127.0.0.1:65535"}, data_parallel_size=2)
    with pytest.raises(ValueError, match="kv_events_config.replay_endpoint: port 65535 \\+ 2"):
        EngineConfig(kv_events_config={"replay_endpoint": "tcp://127.0.0.1:65535"}, data_parallel_rank=2)
    with pytest.raises(ValueError, match="kv_events_config.endpoint: an ipc://"):
        EngineConfig(kv_events_config={"endpoint": "ipc:///tmp/kv"}, data_parallel_size=2)
    with pytest.raises(ValueError, match="data_parallel_rank"):
        EngineConfig(data_parallel_rank=-1)
    with pytest.raises(ValueError, match="data_parallel_rank"):
        EngineConfig(data_parallel_rank=1, data_parallel_size=2)


def test_endpoints_are_offset_per_rank_as_vllm_offsets_them():
    assert offset_endpoint_port("tcp://127.0.0.1:5557", 0) == "tcp://127.0.0.1:5557"
    assert offset_endpoint_port("tcp://127.0.0.1:5557", 3) == "tcp://127.0.0.1:5560"
    assert offset_endpoint_port("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert offset_endpoint_port("tcp://127.0.0.1:0", 2) == "tcp://127.0.0.1:0"  # the OS picks each
    assert offset_endpoint_port("inproc://kv", 2) == "inproc://kv_dp2"
    assert offset_endpoint_port(None, 2) is None


def test_the_front_end_gives_each_replica_its_rank():
    config = EngineConfig(data_parallel_size=3, kv_events_config=LOOPBACK)
    specs = DPLBClient(config)._instance_specs()
    assert [spec[2]["config"].data_parallel_rank for spec in specs] == [0, 1, 2]


# ---- the encoding -------------------------------------------------------------------------------------------------
def test_the_encoding_is_vllms_array_batch_of_tagged_maps_without_defaults():
    stored = BlockStored(
        block_hashes=[1, 2],
        parent_block_hash=None,
        token_ids=[5, 6],
        block_size=1,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=0,
    )
    batch = KVEventBatch(ts=1.5, events=[stored, BlockRemoved(block_hashes=[b"\x01"], medium=None), AllBlocksCleared()])
    plain = msgspec.msgpack.decode(msgspec.msgpack.encode(batch))
    assert plain[0] == 1.5 and plain[2] is None  # [ts, events, data_parallel_rank]: an array keeps every field
    assert list(plain[1][0].items()) == [
        ("type", "BlockStored"),
        ("block_hashes", [1, 2]),
        ("parent_block_hash", None),  # no default: always sent
        ("token_ids", [5, 6]),
        ("block_size", 1),
        ("lora_id", None),
        ("medium", "GPU"),
        ("lora_name", None),
        ("group_idx", 0),
    ]
    assert plain[1][1:] == [
        {"type": "BlockRemoved", "block_hashes": [b"\x01"], "medium": None},
        {"type": "AllBlocksCleared"},
    ]


def test_block_hashes_go_out_as_vllm_converts_them(monkeypatch):
    digest = bytes(range(32))
    assert to_external_block_hash(digest) == int.from_bytes(digest[-8:], "big")  # the digest's last 8 bytes
    assert to_external_block_hash(digest, as_int=False) == digest
    assert to_external_block_hash(-1) == 2**64 - 1  # the "builtin" algorithm's int, as 64 bits unsigned
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    engine = _scripted_engine({"enable_kv_cache_events": True, "publisher": "null"})
    recorder = engine.kv_event_publisher = RecordingPublisher()
    engine.add_request(list(range(3, 12)), SamplingParams(max_tokens=1), request_id="a")
    engine.step()
    ((stored,),) = [batch.events for batch in recorder.batches]
    first = sha256_hash(None, [3, 4, 5, 6], None)
    assert isinstance(stored, BlockStored) and stored.block_hashes == [first, sha256_hash(first, [7, 8, 9, 10], None)]
    engine.close()


# ---- vLLM's recorded bytes ----------------------------------------------------------------------------------------
def _golden() -> dict:
    return json.loads(GOLDEN.read_text(encoding="utf-8"))


def test_vllms_recorded_bytes_are_read_and_written_back_unchanged():
    doc = _golden()
    assert doc["vllm_version"] == "0.33.0"
    encoder = msgspec.msgpack.Encoder()
    for message, fields in zip([*doc["messages"], doc["crafted"]], doc["fields"], strict=True):
        payload = bytes.fromhex(message["payload"])
        decoded = decode_message([message["topic"].encode(), message["seq"].to_bytes(8, "big"), payload])
        assert decoded.seq == message["seq"] and decoded.topic == ""
        assert batch_fields(decoded.batch) == fields  # field for field, as vLLM's classes read them
        assert encoder.encode(decoded.batch) == payload  # byte for byte


def test_the_engine_publishes_what_vllm_published_on_the_same_workload():
    doc = _golden()
    ours = [fields_but_ts(b) for b in engine_batches(doc["workload"])]
    theirs = [{k: v for k, v in fields.items() if k != "ts"} for fields in doc["fields"][:-1]]
    assert ours == theirs
    kinds = {e["type"] for fields in theirs for e in fields["events"]}
    assert kinds == {"BlockStored", "BlockRemoved"}  # the workload covers both (AllBlocksCleared: the crafted batch)


# ---- a live engine ------------------------------------------------------------------------------------------------
def _scripted_engine(kv_events_config: dict, **kwargs) -> LLMEngine:
    script = {rid: list(range(200, 220)) for rid in ("a", "b", "c", "d")}
    return LLMEngine(
        executor="scripted",
        token_script=script,
        num_kv_blocks=10,
        block_size=4,
        max_model_len=64,
        kv_events_config=kv_events_config,
        **kwargs,
    )


def _expected_events(records, hashes: dict[str, int]) -> list[tuple]:
    """What the StepRecords say was cached and evicted, as (kind, vLLM's hash), in order."""
    kinds = {"kv.cached": "BlockStored", "kv.evicted": "BlockRemoved"}
    return [(kinds[e.kind], hashes[e.block_hash]) for r in records for e in r.events if e.kind in kinds]


def _published_events(messages) -> list[tuple]:
    return [
        (type(e).__name__, h)
        for m in messages
        for e in m.batch.events
        if not isinstance(e, AllBlocksCleared)
        for h in e.block_hashes
    ]


def test_a_subscriber_receives_every_block_cached_and_evicted_in_order_and_the_replay_answers():
    engine = _scripted_engine(LOOPBACK)
    resolved = engine.kv_event_publisher.get_publisher_config()
    assert resolved.endpoint.startswith("tcp://127.0.0.1:") and not resolved.endpoint.endswith(":0")
    prompts = {"a": list(range(3, 14)), "b": list(range(3, 11)) + [50, 51, 52], "c": list(range(60, 90)), "d": [7] * 9}
    # vLLM's hashes of every block these prompts and scripts can fill, by the hex the StepRecords show
    hashes: dict[str, int] = {}
    for prompt in prompts.values():
        tokens, parent = prompt + list(range(200, 220)), None
        for i in range(0, len(tokens) - 3, 4):
            parent = sha256_hash(parent, tokens[i : i + 4], None)
            hashes[hash_hex(parent)] = to_external_block_hash(parent)
    with KVEventSubscriber(resolved.endpoint, resolved.replay_endpoint) as sub:
        probes = []

        def send_probe() -> None:
            engine.kv_event_publisher.publish(probe())
            probes.append(probe)

        first = join(send_probe, sub.recv)
        records = []
        for rid, prompt in prompts.items():  # one after the other: c's long prompt evicts a's and b's blocks
            engine.add_request(prompt, SamplingParams(max_tokens=6), request_id=rid)
            records += engine.run()
        assert engine.reset_prefix_cache()
        reset_step = engine.step()  # the reset's AllBlocksCleared goes out with the next step
        batches_expected = sum(1 for r in records if any(e.kind in ("kv.cached", "kv.evicted") for e in r.events))
        last_seq = len(probes) + batches_expected  # the reset step's batch is the last
        live = []
        while not live or live[-1].seq < last_seq:
            message = sub.recv(timeout_s=10.0)
            assert message is not None, f"live: nothing after {live[-1].seq if live else first.seq}"
            if message.seq >= len(probes):
                live.append(message)
        assert [m.seq for m in live] == list(range(len(probes), last_seq + 1)) and sub.missed == 0
        expected = _expected_events(records, hashes)
        assert any(kind == "BlockRemoved" for kind, _ in expected)
        assert _published_events(live[:-1]) == expected
        # the reset: one AllBlocksCleared for the lot, where the step's record shows each block's eviction
        assert live[-1].batch.events == [AllBlocksCleared()] and reset_step.of_type(KVEvicted)
        assert all(m.batch.data_parallel_rank == 0 and m.topic == "" for m in live)
        assert [m.batch.ts for m in live] == sorted(m.batch.ts for m in live)
        # the replay: from any sequence number, what the publisher holds, byte for byte what went out live
        replayed = sub.replay(len(probes) + 2)
        assert [m.seq for m in replayed] == [m.seq for m in live[2:]]
        assert [batch_fields(m.batch) for m in replayed] == [batch_fields(m.batch) for m in live[2:]]
        assert [m.seq for m in sub.replay(0)] == list(range(last_seq + 1))
        assert sub.replay(last_seq + 1) == []
    engine.close()
    assert not _publisher_threads()


def test_a_rank_publishes_on_its_own_port_and_says_its_rank():
    port = free_port(count=2)
    engine = _scripted_engine(
        {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{port}"}, data_parallel_rank=1
    )
    try:
        assert engine.kv_event_publisher.get_publisher_config().endpoint == f"tcp://127.0.0.1:{port + 1}"
        with KVEventSubscriber(f"tcp://127.0.0.1:{port + 1}") as sub:
            message = join(lambda: engine.kv_event_publisher.publish(probe()), sub.recv)
            assert message.batch.data_parallel_rank == 1
    finally:
        engine.close()


def test_each_data_parallel_replica_publishes_on_its_own_ports_with_its_rank(tiny_model_path):
    from engine import LLM

    port = free_port(count=4)  # two replicas' publishers, then their replay sockets
    replay_port = port + 2
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{port}"}
    config["replay_endpoint"] = f"tcp://127.0.0.1:{replay_port}"
    prompts = [[1000 + 7 * i + j for j in range(40)] for i in range(4)]  # a burst spreads over both replicas
    with LLM(
        model="tiny-llama",
        data_parallel_size=2,
        block_size=16,
        num_kv_blocks=64,
        max_model_len=256,
        kv_events_config=config,
    ) as llm:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
        for rank in (0, 1):
            with KVEventSubscriber(f"tcp://127.0.0.1:{port + rank}", f"tcp://127.0.0.1:{replay_port + rank}") as sub:
                messages = sub.replay(0, timeout_s=30.0)
            assert messages and {m.batch.data_parallel_rank for m in messages} == {rank}
            stored = [e for m in messages for e in m.batch.events if isinstance(e, BlockStored)]
            assert {tuple(e.token_ids[:16]) for e in stored} <= {tuple(p[:16]) for p in prompts}
    # closed with the replicas: nobody listens on the ports again. SO_REUSEADDR, as ZMQ binds: a connection the
    # publisher closed first leaves its side in TIME_WAIT on the port, which is no listener
    for p in (port, port + 1, replay_port, replay_port + 1):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", p))
            s.listen()


def test_every_message_carries_the_topic_a_subscriber_filters_on():
    engine = _scripted_engine({**LOOPBACK, "topic": "kv@node-1"})
    resolved = engine.kv_event_publisher.get_publisher_config()
    with KVEventSubscriber(resolved.endpoint, resolved.replay_endpoint, topic="kv@") as sub:
        message = join(lambda: engine.kv_event_publisher.publish(probe()), sub.recv)
        assert message.topic == "kv@node-1"
        engine.add_request(list(range(3, 12)), SamplingParams(max_tokens=1), request_id="a")
        engine.step()
        assert sub.recv(timeout_s=10.0).topic == "kv@node-1"
        assert [m.topic for m in sub.replay(0)][-1] == "kv@node-1"
    engine.close()


# ---- errors and closing -------------------------------------------------------------------------------------------
def test_an_endpoint_in_use_is_refused_naming_the_field_and_nothing_is_left_open():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for field, config in (
            ("endpoint", {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{port}"}),
            ("replay_endpoint", {**LOOPBACK, "replay_endpoint": f"tcp://127.0.0.1:{port}"}),
        ):
            with pytest.raises(ValueError, match=f"kv_events_config.{field}: cannot bind 'tcp://127.0.0.1:{port}'"):
                _scripted_engine(config)
    assert not _publisher_threads()


def test_closing_the_engine_ends_the_thread_and_frees_the_ports():
    port, replay_port = free_port(), free_port()
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{port}"}
    config["replay_endpoint"] = f"tcp://127.0.0.1:{replay_port}"
    for _ in range(2):  # the second engine binds the same ports: the first closed its sockets
        engine = _scripted_engine(config)
        engine.add_request(list(range(3, 12)), SamplingParams(max_tokens=2), request_id="a")
        engine.run()
        engine.close()
        engine.close()  # idempotent
        assert not _publisher_threads()
    with pytest.raises(RuntimeError, match="closed"):
        engine.kv_event_publisher.publish(probe())


def test_events_off_or_the_null_publisher_publish_nothing():
    for config in (None, {"enable_kv_cache_events": False}, {"enable_kv_cache_events": True, "publisher": "null"}):
        engine = _scripted_engine(config)
        engine.add_request(list(range(3, 12)), SamplingParams(max_tokens=2), request_id="a")
        engine.run()
        assert not _publisher_threads()
        assert not isinstance(engine.kv_event_publisher, ZmqEventPublisher)
        engine.close()


def test_a_malformed_replay_request_is_ignored_and_the_next_is_answered():
    engine = _scripted_engine(LOOPBACK)
    replay_endpoint = engine.kv_event_publisher.get_publisher_config().replay_endpoint
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(replay_endpoint)
    try:
        sock.send_multipart([b"", b"not 8 bytes"])
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        assert sock.poll(10_000)
        assert sock.recv_multipart() == [b"", b"", ZmqEventPublisher.END_SEQ, b""]  # nothing published yet
    finally:
        sock.close(linger=0)
        engine.close()
