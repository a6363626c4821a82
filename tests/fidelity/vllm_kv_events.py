"""vLLM's side of the KV events check: vLLM 0.33.0's own classes against this engine's KV event stream, both ways
(tests/fidelity/test_kv_events_vllm.py), and the golden bytes `make test` reads (tests/distributed/test_kv_events.py).

Run the commands with the reference venv's python (`make vllm-ref` builds .venv-vllm):

    vllm_kv_events.py record OUT.json                    vLLM's scheduler and publisher on WORKLOAD: the exact bytes
    vllm_kv_events.py decode ENDPOINT REPLAY_ENDPOINT    vLLM's decoder reads a publisher's stream, live and replayed
    vllm_kv_events.py publish ENDPOINT REPLAY_ENDPOINT   vLLM's scheduler and publisher on WORKLOAD, live
    vllm_kv_events.py attach ENDPOINT REPLAY_ENDPOINT    the same, then what its block pool holds, then known_batches

Live, ZeroMQ drops what a PUB socket sends before a subscription has reached it, so the two processes agree first
over stdin/stdout, one JSON object a line: the publishing side sends probe batches (one AllBlocksCleared) until the
subscribing side says it has received one. The module's top imports nothing of vLLM nor of the workbench, so the
workbench's tests share WORKLOAD and batch_fields with it.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
from typing import Any

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # vLLM's end-of-replay marker
TIMEOUT_S = 120.0  # what any one wait of this script may take, on a loaded machine (vLLM's import alone is 10-15 s)


def _request(rid: str, prompt: list[int], outputs: list[int], arrival_step: int, cache_salt: str | None = None):
    return {
        "request_id": rid,
        "prompt_token_ids": prompt,
        "max_tokens": len(outputs),
        "min_tokens": 0,
        "ignore_eos": False,
        "stop_token_ids": [],
        "priority": 0,
        "cache_salt": cache_salt,
        "arrival_step": arrival_step,
        "output_token_ids": outputs,
    }


# The workload of the golden batches (the fidelity harness's format, workbench/fidelity/workload.py): blocks stored
# in runs (a prefill, then each block that decode fills), a prefix hit whose new blocks name their parent, a cache
# salt (the first block's extra key), and a long prompt that evicts cached blocks (no preemption: vLLM keeps the
# hashes of blocks preempted before they were computed, this engine drops them, docs/FIDELITY.md).
WORKLOAD: dict[str, Any] = {
    "name": "kv-events",
    "group": "kv-events",
    "seed": 0,
    "config": {
        "block_size": 4,
        "num_blocks": 12,
        "max_num_batched_tokens": 32,
        "max_num_seqs": 4,
        "max_model_len": 48,
        "enable_chunked_prefill": True,
        "enable_prefix_caching": True,
        "long_prefill_token_threshold": 0,
        "scheduling_policy": "fcfs",
        "prefix_caching_hash_algo": "sha256",
        "async_scheduling": False,
    },
    "eos_token_id": 2,
    "requests": [
        _request("r0", list(range(3, 13)), list(range(20, 26)), 0),
        _request("r1", [*range(3, 11), 30, 31, 32, 33], [34, 35, 36, 37], 1),
        _request("r2", list(range(40, 49)), [50, 51, 52], 1, cache_salt="a"),
        _request("r3", list(range(100, 136)), [140, 141], 12),
    ],
    "aborts": {},
    "max_steps": 200,
}


def batch_fields(batch: Any) -> dict[str, Any]:
    """A KVEventBatch (vLLM's or the engine's) as JSON data, field by field in declaration order, each event with its
    class name: what the two sides compare. Bytes become {"bytes": hex}, tuples lists."""

    def value(v: Any) -> Any:
        if isinstance(v, bytes):
            return {"bytes": v.hex()}
        if isinstance(v, (list, tuple)):
            return [value(x) for x in v]
        return v

    events = [
        {"type": type(e).__name__, **{f: value(getattr(e, f)) for f in e.__struct_fields__}} for e in batch.events
    ]
    return {"ts": batch.ts, "events": events, "data_parallel_rank": batch.data_parallel_rank}


def _say(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def _stdin_line(timeout_s: float) -> dict[str, Any] | None:
    """The next line the other side wrote, or None if none came within `timeout_s`."""
    if not select.select([sys.stdin], [], [], timeout_s)[0]:
        return None
    line = sys.stdin.readline()
    if not line:
        raise SystemExit("the other side closed stdin")
    return json.loads(line)


def _vllm_publisher_class(sync: bool):
    """vLLM's ZmqEventPublisher, each batch stamped with its sequence number instead of the wall clock (so a
    recording is the same on every run) and kept as published; with `sync`, it sends probe batches once bound until
    the subscriber says it joined."""
    from vllm.distributed.kv_events import AllBlocksCleared, KVEventBatch, ZmqEventPublisher

    class Publisher(ZmqEventPublisher):
        last: Publisher | None = None

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            Publisher.last = self
            self.published: list[Any] = []
            if sync:
                _say({"ready": True})
                deadline = time.monotonic() + TIMEOUT_S
                while _stdin_line(0.05) is None:
                    if time.monotonic() > deadline:
                        raise SystemExit("no subscriber joined")
                    self.publish(KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))

        def publish(self, events: Any) -> None:
            events.ts = float(len(self.published))
            super().publish(events)
            self.published.append(events)

    return Publisher


def crafted_batch(kv: Any) -> Any:
    """A batch with every field set, bytes hashes among them, of the classes of `kv` (vLLM's kv_events module or the
    engine's, which declares the same): what this engine's scheduler never sends (LoRA, other media, groups, sliding
    windows, locality, lookahead), read all the same."""
    stored = kv.BlockStored(
        block_hashes=[1, 2**64 - 1],
        parent_block_hash=7,
        token_ids=list(range(8)),
        block_size=4,
        lora_id=3,
        medium="CPU",
        lora_name="adapter",
        extra_keys=[("salt", ["mm-hash", 0]), None],
        group_idx=1,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=128,
        locality="LOCAL",
        ownership="tier-1",
        session_id="session",
        lookahead_token_ids=[[8], [9]],
    )
    removed = kv.BlockRemoved(block_hashes=[b"\x01" * 32], medium="GPU", group_idx=1, locality="REMOTE", ownership="x")
    return kv.KVEventBatch(ts=0.5, events=[stored, removed, kv.AllBlocksCleared()], data_parallel_rank=3)


def _run_vllm(endpoint: str, replay_endpoint: str, sync: bool, crafted: bool = True) -> Any:
    """WORKLOAD through vLLM's scheduler (tests/fidelity/vllm_driver.py) publishing with its own publisher, then
    (with `crafted`) the crafted batch; returns the publisher, still open."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import vllm_driver  # first: it sets vLLM's environment (offline, its cache, its log level) before vLLM loads
    from vllm.distributed import kv_events
    from vllm.distributed.kv_events import EventPublisherFactory

    publisher_class = _vllm_publisher_class(sync)
    # the factory's "zmq" entry, replaced: vLLM's register_publisher refuses a name it has, and its config only "zmq"
    EventPublisherFactory._registry["zmq"] = publisher_class
    vllm_driver._write_model_config(WORKLOAD["eos_token_id"])
    config = {"enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": replay_endpoint}
    vllm_driver.run_workload(WORKLOAD, config)
    publisher = publisher_class.last
    if crafted:
        publisher.publish(crafted_batch(kv_events))
    return publisher


def _replay(sock: Any, start_seq: int) -> list[list[bytes]]:
    """Ask a replay socket (a DEALER connected to it) for everything from `start_seq`: each (topic, seq, payload)."""
    sock.send_multipart((b"", start_seq.to_bytes(8, "big")))
    frames_list = []
    while sock.poll(int(TIMEOUT_S * 1000)):
        _, topic, seq, payload = sock.recv_multipart()
        if seq == END_SEQ:
            return frames_list
        frames_list.append([topic, seq, payload])
    raise SystemExit("no end of replay")


def record(out_path: str) -> None:
    import msgspec
    import vllm
    import zmq

    publisher = _run_vllm("inproc://kv-events-golden", "inproc://kv-events-golden-replay", sync=False)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect("inproc://kv-events-golden-replay")
    frames_list: list[list[bytes]] = []
    deadline = time.monotonic() + TIMEOUT_S
    while len(frames_list) < len(publisher.published):  # its thread sends what is queued, then buffers it
        if time.monotonic() > deadline:
            raise SystemExit(f"replay: {len(frames_list)} of {len(publisher.published)} batches")
        frames_list = _replay(sock, 0)
    sock.close(linger=0)
    publisher.shutdown()
    messages = [{"topic": t.decode(), "seq": int.from_bytes(s, "big"), "payload": p.hex()} for t, s, p in frames_list]
    doc = {
        "vllm_version": vllm.__version__,
        "command": "make fidelity (tests/fidelity/vllm_kv_events.py record)",
        "workload": WORKLOAD,
        "messages": messages[:-1],
        "crafted": messages[-1],
        "fields": [batch_fields(b) for b in publisher.published],
    }
    assert msgspec.msgpack.encode(publisher.published[-1]) == bytes.fromhex(messages[-1]["payload"])
    with open(out_path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def publish(endpoint: str, replay_endpoint: str) -> None:
    publisher = _run_vllm(endpoint, replay_endpoint, sync=True)
    _say({"published": [batch_fields(b) for b in publisher.published]})
    _stdin_line(TIMEOUT_S)  # the subscriber's "done": the replay socket answers until then
    publisher.shutdown()


def decode(endpoint: str, replay_endpoint: str) -> None:
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    decoder, encoder = msgspec.msgpack.Decoder(KVEventBatch), msgspec.msgpack.Encoder()

    def read(frames: list[bytes]) -> dict[str, Any]:
        topic, seq, payload = frames
        batch = decoder.decode(payload)
        return {
            "topic": topic.decode(),
            "seq": int.from_bytes(seq, "big"),
            "fields": batch_fields(batch),
            "reencoded_equal": encoder.encode(batch) == payload,
        }

    ctx = zmq.Context.instance()
    sub, replay = ctx.socket(zmq.SUB), ctx.socket(zmq.DEALER)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    replay.connect(replay_endpoint)
    _say({"subscribed": True})
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    poller.register(sys.stdin.fileno(), zmq.POLLIN)
    live: list[dict[str, Any]] = []
    last_seq = None
    deadline = time.monotonic() + TIMEOUT_S
    while last_seq is None or not live or live[-1]["seq"] < last_seq:
        if time.monotonic() > deadline:
            raise SystemExit(f"live: stopped at {live[-1]['seq'] if live else None}, expected up to {last_seq}")
        ready = dict(poller.poll(1000))
        if sub in ready:
            live.append(read(sub.recv_multipart()))
            if len(live) == 1:
                _say({"joined": live[0]["seq"]})
        if sys.stdin.fileno() in ready:
            last_seq = json.loads(sys.stdin.readline())["last_seq"]
    _say({"live": live, "replay": [read(frames) for frames in _replay(replay, 0)]})
    sub.close(linger=0)
    replay.close(linger=0)


def known_batches(kv: Any) -> list[list[Any]]:
    """Two runs of batches of the classes of `kv` whose effect on a cache is known (the attached state's check,
    tests/fidelity/test_kv_events_vllm.py): 11-12-13 stored with a second copy of 11, 14 after 12, then 12 removed;
    then a reset, and 21-22-23 and a bytes hash stored."""

    def stored(hashes: list[Any], parent: Any) -> Any:
        tokens = list(range(100, 100 + 4 * len(hashes)))
        return kv.BlockStored(hashes, parent, tokens, 4, None, "GPU", None)

    first = [
        kv.KVEventBatch(ts=0.0, events=[stored([11, 12, 13], None), stored([11], None)]),
        kv.KVEventBatch(ts=0.0, events=[stored([14], 12), kv.BlockRemoved([12], "GPU")]),
    ]
    second = [
        kv.KVEventBatch(ts=0.0, events=[kv.AllBlocksCleared(), stored([21, 22], None)]),
        kv.KVEventBatch(ts=0.0, events=[stored([23], 22), stored([b"\x01" * 32], None)]),
    ]
    return [first, second]


def _external(block_hash: Any) -> Any:
    return {"bytes": block_hash.hex()} if isinstance(block_hash, bytes) else block_hash


def attach(endpoint: str, replay_endpoint: str) -> None:
    """WORKLOAD through vLLM's scheduler and publisher; then says what its block pool's prefix cache holds (each
    hash as events carry it, and its copies) and, each time it is asked, publishes the next run of known_batches."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import vllm_driver

    schedulers: list[Any] = []
    make_scheduler = vllm_driver.make_scheduler

    def keep(*args: Any, **kwargs: Any) -> Any:
        schedulers.append(make_scheduler(*args, **kwargs))
        return schedulers[-1]

    vllm_driver.make_scheduler = keep  # run_workload builds its scheduler through the module: this one is kept
    publisher = _run_vllm(endpoint, replay_endpoint, sync=False, crafted=False)
    from vllm.distributed import kv_events
    from vllm.v1.core.kv_cache_utils import get_block_hash, maybe_convert_block_hash

    cache = schedulers[0].kv_cache_manager.block_pool.cached_block_hash_to_block._cache
    held = [
        [_external(maybe_convert_block_hash(get_block_hash(key))), len(blocks) if isinstance(blocks, dict) else 1]
        for key, blocks in cache.items()
    ]
    _say({"published": len(publisher.published), "cache": held})
    for batches in known_batches(kv_events):
        if _stdin_line(TIMEOUT_S) is None:
            raise SystemExit("not asked for the known batches")
        for batch in batches:
            publisher.publish(batch)
        _say({"published": len(publisher.published)})
    _stdin_line(TIMEOUT_S)  # "done": the replay socket answers until then
    publisher.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries the JSON lines
    command, *args = sys.argv[1:]
    {"record": record, "decode": decode, "publish": publish, "attach": attach}[command](*args)
