"""KV cache events in vLLM 0.33's wire format (vllm/distributed/kv_events.py), for what subscribes to vLLM's:
KV-aware routers (llm-d, NVIDIA Dynamo), LMCache, and the workbench's own subscriber (workbench/kv_events.py).

The block pool records a `BlockStored` for each run of blocks it enters into the prefix cache, a `BlockRemoved` for
each block hash it evicts and `AllBlocksCleared` when the prefix cache is reset; the engine takes them at the end of
each step and publishes them as one `KVEventBatch` (as vLLM's scheduler does in update_from_output).

On the wire, as vLLM: a ZeroMQ PUB socket sends multipart messages (topic, sequence number as 8 bytes big-endian,
msgpack payload). The payload is msgspec's encoding of the structs below, declared exactly as vLLM declares them
(a batch is an array [ts, events, data_parallel_rank]; each event a map tagged {"type": "BlockStored", ...} whose
fields at their default are left out), so vLLM's own decoder reads them and this module's reads vLLM's. A ROUTER
socket answers replays: a client sends a start sequence number (8 bytes big-endian) and receives every buffered
batch from it, then the end marker (an empty topic, sequence -1, an empty payload).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable
from dataclasses import replace
from itertools import count
from typing import Any

import msgspec
import zmq

from engine.config import KVEventsConfig
from engine.core.block_hash import BlockHash, extra_keys_for_block
from engine.request import Request

logger = logging.getLogger(__name__)

# vLLM's ExternalBlockHash: a block hash as events carry it (an int by default, the digest's bytes if asked)
ExternalBlockHash = bytes | int

# vLLM's media: its BlockPool reports its own KV cache as "GPU" whatever the device (offloading tiers say "CPU")
MEDIUM_GPU = "GPU"
# this engine's one KV cache group, as vLLM's KVCacheManager annotates a full-attention group's BlockStored
KV_CACHE_SPEC_KIND = "full_attention"


class EventBatch(
    msgspec.Struct,
    array_like=True,
    omit_defaults=True,
    gc=False,
):
    """A step's events: when they were published (s since the epoch, on the engine's clock), the events, and the
    data-parallel rank of the engine that published them (the publisher fills it in)."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(
    msgspec.Struct,
    omit_defaults=True,
    gc=False,
    tag=True,
):
    """Base class of the KV cache events: tagged by class name on the wire."""


class BlockStored(KVCacheEvent):
    """Blocks entered into the prefix cache, in order: their hashes, the hash of the block before the first (None
    at the start of a sequence), the tokens they hold, tokens per block, and the fields vLLM adds (LoRA, medium,
    extra hash keys per block, KV cache group and its kind); field order and defaults are vLLM 0.33's."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    """Block hashes the cache no longer holds (evicted or forgotten), with their medium and KV cache group."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The prefix cache was reset: every hash it held is gone."""


class KVEventBatch(EventBatch):
    """A step's KV cache events, as published."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared  # what a KVEventBatch holds


def use_int_block_hashes() -> bool:
    """vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES (default on): events carry each hash as an int, else as bytes."""
    return bool(int(os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")))


def to_external_block_hash(block_hash: bytes | int, as_int: bool = True) -> ExternalBlockHash:
    """A block hash as vLLM's events carry it (its maybe_convert_block_hash): the digest's last 8 bytes as an
    unsigned int, or the digest itself. The "builtin" algorithm's int hash is taken to 64 bits unsigned."""
    if isinstance(block_hash, int):
        return block_hash & 0xFFFF_FFFF_FFFF_FFFF
    if not as_int:
        return block_hash
    return int.from_bytes(block_hash, "big") & 0xFFFF_FFFF_FFFF_FFFF


def to_event_extra_keys(extra_keys: Iterable[tuple[Any, ...] | None]) -> list[tuple[Any, ...] | None] | None:
    """The per-block extra keys of a block hash as events carry them (vLLM's to_event_extra_keys): untagged, the
    cache salt as itself rather than ("cache_salt", salt); None for no blocks."""
    event_keys = [None if keys is None else tuple(key[1] for key in keys) for keys in extra_keys]
    return event_keys or None


class KVEventRecorder:
    """What a block pool with KV cache events on records between two takes, in vLLM's terms: owns the events not
    yet taken and how hashes go out (read once from the environment, as vLLM reads it at start)."""

    def __init__(self) -> None:
        self.events: list[KVEvent] = []
        self._int_hashes = use_int_block_hashes()

    def _external(self, block_hash: BlockHash) -> ExternalBlockHash:
        return to_external_block_hash(block_hash, self._int_hashes)

    def stored(
        self, request: Request, block_size: int, block_hashes: list[BlockHash], cached: list[int], start: int, end: int
    ) -> None:
        """Blocks start..end of a request entered the cache, those at `cached` now: one BlockStored with their
        hashes, the parent of the first of the run and the tokens of the whole run, as vLLM's
        BlockPool.cache_full_blocks sends it (its KVCacheManager adds the group's kind)."""
        self.events.append(
            BlockStored(
                block_hashes=[self._external(block_hashes[i]) for i in cached],
                parent_block_hash=self._external(block_hashes[start - 1]) if start else None,
                token_ids=request.all_token_ids[start * block_size : end * block_size],
                block_size=block_size,
                lora_id=None,
                medium=MEDIUM_GPU,
                lora_name=None,
                extra_keys=to_event_extra_keys(extra_keys_for_block(request, i) for i in cached),
                group_idx=0,
                kv_cache_spec_kind=KV_CACHE_SPEC_KIND,
            )
        )

    def removed(self, block_hash: BlockHash) -> None:
        """A hash left the cache: one BlockRemoved per hash, as vLLM's."""
        self.events.append(BlockRemoved(block_hashes=[self._external(block_hash)], medium=MEDIUM_GPU, group_idx=0))

    def cleared(self) -> None:
        """The prefix cache was reset: one AllBlocksCleared for the lot (no BlockRemoved per block), as vLLM's."""
        self.events.append(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        """The events recorded since the last take, oldest first."""
        events, self.events = self.events, []
        return events


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """vLLM's offset of an endpoint for a data-parallel rank: tcp port + rank (port 0 is left to the OS),
    inproc name + _dp{rank}; rank 0 unchanged. EngineConfig refuses what cannot be offset (ipc://)."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{data_parallel_rank}"
    base, _, port = endpoint.rpartition(":")
    return endpoint if int(port) == 0 else f"{base}:{int(port) + data_parallel_rank}"


class EventPublisher(ABC):
    """Publishes the engine's event batches, each stamped with the data-parallel rank of the engine that owns it."""

    def __init__(self, data_parallel_rank: int = 0) -> None:
        self.data_parallel_rank = data_parallel_rank

    @abstractmethod
    def publish(self, batch: EventBatch) -> None:
        """Send a batch, after every batch published before it."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop: nothing is sent after; idempotent."""

    def get_publisher_config(self) -> KVEventsConfig | None:
        """The configuration as resolved (endpoints offset for the rank, a port 0 as bound), or None."""
        return None


class NullEventPublisher(EventPublisher):
    """Publishes nothing (events off, or publisher "null")."""

    def publish(self, batch: EventBatch) -> None:
        return

    def shutdown(self) -> None:
        return


class ZmqEventPublisher(EventPublisher):
    """vLLM's ZmqEventPublisher: owns a PUB socket (and a ROUTER socket for replays where replay_endpoint is set),
    the last `buffer_steps` encoded batches for replay, the queue of batches not yet sent, and the thread that
    encodes and sends them and answers replays: after construction only that thread touches the sockets, and it
    closes them as it ends. The sockets are bound (or connected) here, so a bad endpoint fails the engine's
    construction, naming the field."""

    # vLLM's end-of-replay marker: sequence -1 as 8 signed big-endian bytes
    END_SEQ = (-1).to_bytes(8, "big", signed=True)
    SHUTDOWN_TIMEOUT_S = 5.0

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        super().__init__(data_parallel_rank)
        endpoint = offset_endpoint_port(config.endpoint, data_parallel_rank)
        replay_endpoint = offset_endpoint_port(config.replay_endpoint, data_parallel_rank)
        assert endpoint is not None  # KVEventsConfig always has one
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode("utf-8")
        # the process's shared context, as vLLM: an inproc:// endpoint is reachable by anyone in the process who
        # uses zmq.Context.instance(); this publisher closes its sockets, never the shared context
        ctx: zmq.Context[zmq.Socket] = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.set_hwm(config.hwm)
            endpoint = self._bind_or_connect(self._pub, endpoint, "endpoint")
            if replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                # a full replay and its end marker fit, however slow the client (vLLM's 2 * (buffer_steps + 1):
                # ZeroMQ frees room only every HWM / 2 messages read)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))
                replay_endpoint = self._bind(self._replay, replay_endpoint, "replay_endpoint")
        except BaseException:
            self._close_sockets()
            raise
        self._config = replace(config, publisher="zmq", endpoint=endpoint, replay_endpoint=replay_endpoint)
        # woken by publish() and shutdown() through a pipe the thread polls beside the replay socket: it sleeps
        # until there is something to do (vLLM's polls its queue every 0.1 s)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._seq = count()
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()

    # ---- set-up -------------------------------------------------------------------------------
    @staticmethod
    def _is_bind_endpoint(endpoint: str) -> bool:
        """vLLM binds a wildcard host, ipc:// and inproc:// and connects to anything else; a loopback host binds
        here too, so that the default endpoint serves this machine only."""
        if endpoint.startswith(("ipc://", "inproc://")):
            return True
        host = endpoint.removeprefix("tcp://").rpartition(":")[0]
        return host in ("*", "[::]", "localhost", "[::1]") or host.startswith("127.")

    def _bind_or_connect(self, sock: zmq.Socket, endpoint: str, name: str) -> str:
        if self._is_bind_endpoint(endpoint):
            return self._bind(sock, endpoint, name)
        sock.connect(endpoint)  # never fails: ZeroMQ connects (and reconnects) in the background
        return endpoint

    @staticmethod
    def _bind(sock: zmq.Socket, endpoint: str, name: str) -> str:
        """Bind; the endpoint as bound (a port 0 becomes the port the OS gave)."""
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            raise ValueError(f"kv_events_config.{name}: cannot bind {endpoint!r} ({exc})") from None
        bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return bound if endpoint.startswith("tcp://") else endpoint

    def get_publisher_config(self) -> KVEventsConfig:
        return self._config

    # ---- the engine's side ----------------------------------------------------------------------
    def publish(self, batch: EventBatch) -> None:
        """Queue a batch for the thread (waits while max_queue_size batches are queued, as vLLM's)."""
        if not self._running:
            raise RuntimeError("kv events publisher: closed")
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.data_parallel_rank
        self._queue.put(batch)
        self._wake()

    def shutdown(self) -> None:
        """Send what is queued, stop the thread (it closes the sockets); idempotent."""
        if not self._running:
            return
        self._running = False
        self._queue.put(None)
        self._wake()
        self._thread.join(self.SHUTDOWN_TIMEOUT_S)
        if self._thread.is_alive():  # cannot happen short of a bug: sends never block (PUB and ROUTER drop)
            logger.warning("kv events publisher: its thread did not end within %s s", self.SHUTDOWN_TIMEOUT_S)
            return
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:  # the pipe is full of wake-ups the thread has not read: it is awake anyway
            pass

    # ---- the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self._replay is not None and self._replay in ready:
                    self._serve_replay()
                if self._wake_r in ready:
                    os.read(self._wake_r, 4096)
                    if not self._send_queued(encoder):
                        return
        finally:
            self._close_sockets()

    def _send_queued(self, encoder: msgspec.msgpack.Encoder) -> bool:
        """Encode and send every queued batch, in order; False once the shutdown sentinel is reached."""
        while True:
            try:
                batch = self._queue.get_nowait()
            except queue.Empty:
                return True
            if batch is None:
                return False
            seq = next(self._seq)
            try:
                payload = encoder.encode(batch)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
            except Exception:  # as vLLM's: the thread goes on, a subscriber sees the gap in the sequence
                logger.exception("kv events publisher: could not send batch %d", seq)

    def _serve_replay(self) -> None:
        """One replay request: (client id, empty delimiter, start sequence) in, each buffered batch from the start
        sequence out (client id, empty, topic, sequence, payload), then the end marker."""
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("kv events publisher: a malformed replay request (%d frames) is ignored", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", self.END_SEQ, b""))

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)


def create_publisher(config: KVEventsConfig | None, data_parallel_rank: int = 0) -> EventPublisher:
    """vLLM's EventPublisherFactory.create: the null publisher unless events are on with publisher "zmq"."""
    if config is None or not config.enable_kv_cache_events or config.publisher == "null":
        return NullEventPublisher(data_parallel_rank)
    return ZmqEventPublisher(config, data_parallel_rank)
