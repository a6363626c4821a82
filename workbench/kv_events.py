"""Reading KV cache events in vLLM's wire format, from this engine's publisher (engine/distributed/kv_events.py) or a
vLLM server started with --kv-events-config: each message decoded into the engine's own typed objects
(KVEventBatch of BlockStored, BlockRemoved, AllBlocksCleared), in sequence order, with missed batches asked of the
replay socket.

    with KVEventSubscriber("tcp://127.0.0.1:5557", replay_endpoint="tcp://127.0.0.1:5558") as sub:
        history = sub.replay(0)              # what the publisher still holds
        message = sub.recv(timeout_s=1.0)    # the next batch, or None
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import zmq

from engine.distributed.kv_events import KVEventBatch, ZmqEventPublisher

_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


@dataclass(frozen=True)
class SequenceGap:
    """Batches start..end-1 that did not come live (dropped at the high-water mark, lost to a reconnection):
    `replayed` of them were read from the replay socket instead, the others are lost for good."""

    start: int
    end: int
    replayed: int


@dataclass(frozen=True)
class KVEventMessage:
    """One published batch: its sequence number, its topic and the batch."""

    seq: int
    topic: str
    batch: KVEventBatch


def decode_message(frames: Sequence[bytes]) -> KVEventMessage:
    """A message as the publisher sends it, (topic, sequence number as 8 bytes big-endian, msgpack payload), decoded;
    anything else raises ValueError saying what is wrong."""
    if len(frames) != 3:
        raise ValueError(f"kv events: expected 3 frames (topic, sequence, payload), got {len(frames)}")
    topic, seq, payload = frames
    if len(seq) != 8:
        raise ValueError(f"kv events: the sequence number must be 8 bytes, got {len(seq)}")
    try:
        batch = _DECODER.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"kv events: the payload is not a KVEventBatch ({exc})") from None
    return KVEventMessage(int.from_bytes(seq, "big"), topic.decode("utf-8"), batch)


class KVEventSubscriber:
    """Owns a SUB socket connected to a publisher's endpoint and, where `replay_endpoint` is given, a DEALER socket
    on its replay endpoint; hands out the batches in sequence order (`recv`), filling a gap in the sequence from
    the replay socket and counting in `missed` what the replay no longer holds (each gap kept in `gaps`). Use from
    one thread; `close()` (or `with`) closes both sockets."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "") -> None:
        for name, value in (("endpoint", endpoint), ("replay_endpoint", replay_endpoint), ("topic", topic)):
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{name}: expected str, got {type(value).__name__}")
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay_endpoint, topic
        # the process's context, as the publisher's: an inproc:// endpoint in this process is reachable
        self._ctx: zmq.Context[zmq.Socket] = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        try:
            self._sub.connect(endpoint)
        except zmq.ZMQError as exc:
            self._sub.close(linger=0)
            raise ValueError(f"endpoint: cannot connect to {endpoint!r} ({exc})") from None
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        self._replay: zmq.Socket | None = None
        self.last_seq = -1  # the last sequence number handed out
        self.missed = 0  # batches lost for good: neither received nor replayed
        self.gaps: list[SequenceGap] = []  # every gap in the live sequence, in order
        self._pending: deque[KVEventMessage] = deque()

    def recv(self, timeout_s: float) -> KVEventMessage | None:
        """The next batch, or None if none came within `timeout_s` seconds. After the first, batches come in
        sequence: those the SUB socket missed (dropped at the high-water mark, or lost to a reconnection) are asked
        of the replay socket first. A sequence that starts again (a restarted publisher) is followed."""
        if not self._pending:
            if not self._sub.poll(round(timeout_s * 1000)):
                return None
            message = decode_message(self._sub.recv_multipart())
            first_missing = self.last_seq + 1
            if self.last_seq >= 0 and message.seq > first_missing:
                self._fill_gap(first_missing, message.seq)
            self._pending.append(message)
        message = self._pending.popleft()
        self.last_seq = message.seq
        return message

    def _fill_gap(self, start: int, end: int) -> None:
        found = [m for m in self.replay(start) if m.seq < end] if self.replay_endpoint is not None else []
        self.missed += end - start - len(found)
        self.gaps.append(SequenceGap(start, end, len(found)))
        self._pending.extend(found)

    def replay(self, start_seq: int, timeout_s: float = 5.0) -> list[KVEventMessage]:
        """Every batch the publisher still holds from `start_seq` on, in order, as vLLM's replay socket answers:
        one request, the batches, then its end marker. TimeoutError if the end marker does not come within
        `timeout_s` seconds (the socket is then made anew, so that a late answer cannot be read as the next's)."""
        if self.replay_endpoint is None:
            raise ValueError("replay_endpoint: this subscriber was given none")
        if isinstance(start_seq, bool) or not isinstance(start_seq, int) or start_seq < 0:
            raise ValueError(f"start_seq: expected an int >= 0, got {start_seq!r}")
        sock = self._replay_socket()
        sock.send_multipart((b"", start_seq.to_bytes(8, "big")))
        deadline = time.monotonic() + timeout_s
        messages: list[KVEventMessage] = []
        while sock.poll(max(0, round((deadline - time.monotonic()) * 1000))):
            _, *frames = sock.recv_multipart()  # the DEALER keeps the ROUTER's empty delimiter
            if len(frames) == 3 and frames[1] == ZmqEventPublisher.END_SEQ and not frames[2]:
                return messages
            messages.append(decode_message(frames))
        self._replay = None
        sock.close(linger=0)
        raise TimeoutError(f"replay_endpoint: no end of replay from {self.replay_endpoint!r} within {timeout_s} s")

    def _replay_socket(self) -> zmq.Socket:
        if self._replay is None:
            assert self.replay_endpoint is not None
            sock = self._ctx.socket(zmq.DEALER)
            try:
                sock.connect(self.replay_endpoint)
            except zmq.ZMQError as exc:
                sock.close(linger=0)
                raise ValueError(f"replay_endpoint: cannot connect to {self.replay_endpoint!r} ({exc})") from None
            self._replay = sock
        return self._replay

    def close(self) -> None:
        """Close the sockets; idempotent."""
        self._sub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
            self._replay = None

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
