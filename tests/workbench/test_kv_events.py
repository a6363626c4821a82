"""The workbench's KV events subscriber (workbench/kv_events.py) against this engine's publisher: messages decoded or
refused with what is wrong, batches handed out in sequence with a gap filled from the replay socket, what the replay
no longer holds counted, a replay that never ends bounded. (vLLM's publisher read by it: tests/fidelity.)"""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from engine.config import KVEventsConfig
from engine.distributed.kv_events import AllBlocksCleared, BlockRemoved, KVEventBatch, ZmqEventPublisher
from tests.distributed.helpers import join, probe
from tests.net import free_port
from workbench.kv_events import KVEventSubscriber, decode_message


def _batch(i: int) -> KVEventBatch:
    return KVEventBatch(ts=float(i), events=[BlockRemoved(block_hashes=[i], medium="GPU")])


@pytest.fixture
def publisher():
    pub = ZmqEventPublisher(
        KVEventsConfig.from_dict(
            {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0"}
        )
    )
    yield pub
    pub.shutdown()


@pytest.fixture
def subscriber(publisher):
    config = publisher.get_publisher_config()
    with KVEventSubscriber(config.endpoint, config.replay_endpoint) as sub:
        yield sub


def test_a_message_is_decoded_or_refused_saying_what_is_wrong():
    payload = msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=[AllBlocksCleared()], data_parallel_rank=2))
    message = decode_message([b"kv", (7).to_bytes(8, "big"), payload])
    assert (message.seq, message.topic, message.batch.data_parallel_rank) == (7, "kv", 2)
    assert message.batch.events == [AllBlocksCleared()]
    with pytest.raises(ValueError, match="expected 3 frames"):
        decode_message([b"kv", payload])
    with pytest.raises(ValueError, match="8 bytes"):
        decode_message([b"kv", b"\x07", payload])
    with pytest.raises(ValueError, match="not a KVEventBatch"):
        decode_message([b"kv", (7).to_bytes(8, "big"), msgspec.msgpack.encode({"ts": 1.0})])


def test_batches_come_in_sequence_and_a_gap_is_filled_from_the_replay(publisher, subscriber):
    joined = join(lambda: publisher.publish(probe()), subscriber.recv)
    # the probes so far, and three batches after them; then the subscriber is told it last saw an earlier one, as
    # a SUB socket that dropped some at its high-water mark would be
    first = joined.seq + 1
    while (message := subscriber.recv(timeout_s=0.2)) is not None:  # probes still in flight
        first = message.seq + 1
    for i in range(3):
        publisher.publish(_batch(i))
    assert [subscriber.recv(timeout_s=10.0).seq for _ in range(3)] == [first, first + 1, first + 2]
    publisher.publish(_batch(3))
    subscriber.last_seq = first - 1  # it "missed" the three
    got = [subscriber.recv(timeout_s=10.0) for _ in range(4)]
    assert [m.seq for m in got] == [first, first + 1, first + 2, first + 3]
    assert [m.batch.events[0].block_hashes for m in got] == [[0], [1], [2], [3]]
    assert subscriber.missed == 0 and subscriber.recv(timeout_s=0.05) is None


def test_what_the_replay_no_longer_holds_is_counted_as_missed():
    config = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0"}
    pub = ZmqEventPublisher(KVEventsConfig.from_dict({**config, "buffer_steps": 3}))
    resolved = pub.get_publisher_config()
    try:
        with KVEventSubscriber(resolved.endpoint, resolved.replay_endpoint) as sub:
            joined = join(lambda: pub.publish(probe()), sub.recv)
            while (message := sub.recv(timeout_s=0.2)) is not None:
                joined = message
            for i in range(5):
                pub.publish(_batch(i))
            received = [sub.recv(timeout_s=10.0) for _ in range(5)]
            # as if all five were missed: the buffer of 3 holds the last two and the batch that shows the gap
            sub.last_seq = joined.seq
            pub.publish(_batch(5))
            got = [sub.recv(timeout_s=10.0) for _ in range(3)]
            assert [m.seq for m in got] == [received[3].seq, received[4].seq, received[4].seq + 1]
            assert sub.missed == 3
    finally:
        pub.shutdown()


def test_a_replay_that_never_ends_is_bounded_and_the_next_starts_clean():
    port = free_port()
    with KVEventSubscriber(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{port}") as sub:
        silent = zmq.Context.instance().socket(zmq.ROUTER)  # takes the request and never answers
        silent.bind(f"tcp://127.0.0.1:{port}")
        try:
            start = time.monotonic()
            with pytest.raises(TimeoutError, match="replay_endpoint: no end of replay"):
                sub.replay(0, timeout_s=0.3)
            assert time.monotonic() - start < 5
        finally:
            silent.close(linger=0)
    with KVEventSubscriber("tcp://127.0.0.1:1") as sub, pytest.raises(ValueError, match="was given none"):
        sub.replay(0)


def test_bad_arguments_are_refused_naming_them():
    with pytest.raises(TypeError, match="endpoint"):
        KVEventSubscriber(5557)
    with pytest.raises(ValueError, match="endpoint: cannot connect"):
        KVEventSubscriber("nowhere")
    with (
        KVEventSubscriber("tcp://127.0.0.1:1", "tcp://127.0.0.1:2") as sub,
        pytest.raises(ValueError, match="start_seq"),
    ):
        sub.replay(-1)


def test_a_restarted_publisher_is_followed(publisher, subscriber):
    join(lambda: publisher.publish(probe()), subscriber.recv)
    while subscriber.recv(timeout_s=0.2) is not None:
        pass
    subscriber.last_seq = 10**6  # what it saw of the publisher before its restart
    publisher.publish(_batch(0))
    message = subscriber.recv(timeout_s=10.0)
    assert message is not None and message.seq < 10**6 and subscriber.last_seq == message.seq
