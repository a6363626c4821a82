"""vLLM 0.33.0's own classes against this engine's KV event stream, both ways, live and replayed; vLLM's side runs in
its reference venv as a child process (tests/fidelity/vllm_kv_events.py, one JSON object a line each way):

- vLLM's KVEventBatch decoder reads every batch this engine publishes on a workload (and one with every field
  set), live and from the replay socket: field for field what the engine published, and byte for byte when vLLM
  encodes it again;
- this workbench's subscriber reads what vLLM's own scheduler and ZmqEventPublisher send on that workload, live and
  replayed, field for field; and vLLM's batches are this engine's on the same workload, time stamps aside.

Skipped, saying so, without .venv-vllm (`make vllm-ref` builds it); `make fidelity` runs it. The golden bytes that
keep `make test` free of vLLM: tests/distributed/test_kv_events.py."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from engine.distributed import kv_events
from engine.distributed.kv_events import EventBatch
from tests.distributed.helpers import engine_batches, fields_but_ts, join, probe
from tests.fidelity.vllm_kv_events import WORKLOAD, batch_fields, crafted_batch
from workbench.fidelity.command import DEFAULT_VLLM_PYTHON
from workbench.fidelity.engine_side import make_engine, trace_steps
from workbench.kv_events import KVEventSubscriber

SCRIPT = Path(__file__).with_name("vllm_kv_events.py")
TIMEOUT_S = 240.0  # vLLM's import and its model config's first build, on a loaded machine

pytestmark = pytest.mark.skipif(
    not DEFAULT_VLLM_PYTHON.exists(),
    reason=f"no vLLM reference venv at {DEFAULT_VLLM_PYTHON}: `make vllm-ref` builds it, `make fidelity` runs this",
)


class VLLMSide:
    """vLLM's side as a child process: JSON lines in on stdin, out on stdout (read by a thread, so that every wait
    is bounded); what it prints that is not JSON (vLLM's own messages) is skipped, its stderr kept for failures."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        self._stderr = (tmp_path / "vllm-side.stderr").open("w+")
        env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache")}
        self.proc = subprocess.Popen(
            [str(DEFAULT_VLLM_PYTHON), str(SCRIPT), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env=env,
        )
        self._lines: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self._lines.put(json.loads(line))

    def poll(self, timeout_s: float) -> dict[str, Any] | None:
        """Its next line, or None if none came within `timeout_s`; fails with its stderr if it has exited."""
        try:
            return self._lines.get(timeout=timeout_s)
        except queue.Empty:
            if self.proc.poll() is not None:
                self._stderr.seek(0)
                pytest.fail(f"vLLM's side exited with {self.proc.returncode}:\n{self._stderr.read()[-4000:]}")
            return None

    def read(self, key: str) -> dict[str, Any]:
        """Its next line, which must have `key`."""
        line = self.poll(TIMEOUT_S)
        assert line is not None, f"vLLM's side said nothing within {TIMEOUT_S} s (waiting for {key!r})"
        assert key in line, line
        return line

    def send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self._stderr.close()


@pytest.fixture
def engine():
    config = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0"}
    eng = make_engine(WORKLOAD, config)
    yield eng
    eng.close()


def test_vllms_decoder_reads_every_batch_the_engine_publishes(engine, tmp_path):
    publisher = engine.kv_event_publisher
    published: list[EventBatch] = []  # by sequence number: the engine's publisher numbers batches from 0
    send = publisher.publish

    def publish(batch: EventBatch) -> None:
        send(batch)
        published.append(batch)

    publisher.publish = publish
    resolved = publisher.get_publisher_config()
    vllm_side = VLLMSide(tmp_path, "decode", resolved.endpoint, resolved.replay_endpoint)
    try:
        assert vllm_side.read("subscribed")
        join(lambda: publisher.publish(probe()), vllm_side.poll, timeout_s=TIMEOUT_S)
        num_probes = len(published)
        for _ in trace_steps(WORKLOAD, engine):
            pass
        publisher.publish(crafted_batch(kv_events))
        vllm_side.send({"last_seq": len(published) - 1})
        result = vllm_side.read("live")
        live, replay = result["live"], result["replay"]
    finally:
        vllm_side.close()
    assert [m["seq"] for m in replay] == list(range(len(published)))
    assert live[0]["seq"] < num_probes  # live from a probe on: every batch of the workload went out live
    assert [m["seq"] for m in live] == list(range(live[0]["seq"], len(published)))
    for message in live + replay:
        assert message["topic"] == "" and message["reencoded_equal"], message
        assert message["fields"] == batch_fields(published[message["seq"]])  # in order of fields too (JSON's)
        assert list(message["fields"]["events"][0]) == list(batch_fields(published[message["seq"]])["events"][0])


def test_the_subscriber_reads_what_vllms_scheduler_and_publisher_send(tmp_path):
    endpoint, replay_endpoint = f"ipc://{tmp_path}/kv", f"ipc://{tmp_path}/kv-replay"  # vLLM binds ipc, not 127.0.0.1
    vllm_side = VLLMSide(tmp_path, "publish", endpoint, replay_endpoint)
    try:
        assert vllm_side.read("ready")
        with KVEventSubscriber(endpoint, replay_endpoint) as sub:
            first = sub.recv(timeout_s=TIMEOUT_S)  # vLLM's side sends probes until told it joined
            assert first is not None
            vllm_side.send({"joined": first.seq})
            published = vllm_side.read("published")["published"]  # vLLM's batches, field by field, by sequence number
            live = [first]
            while live[-1].seq < len(published) - 1:
                message = sub.recv(timeout_s=TIMEOUT_S)
                assert message is not None, f"live: nothing after {live[-1].seq}"
                live.append(message)
            replayed = sub.replay(0)
            vllm_side.send({"done": True})
    finally:
        vllm_side.close()
    assert [m.seq for m in replayed] == list(range(len(published))) and sub.missed == 0
    assert [m.seq for m in live] == list(range(first.seq, len(published)))
    for message in live + replayed:
        assert batch_fields(message.batch) == published[message.seq]
    # the workload's batches, between vLLM's probes and the crafted batch: this engine's on the same workload
    num_probes = next(i for i, fields in enumerate(published) if fields["events"] != [{"type": "AllBlocksCleared"}])
    theirs = [{k: v for k, v in fields.items() if k != "ts"} for fields in published[num_probes:-1]]
    assert theirs == [fields_but_ts(b) for b in engine_batches(WORKLOAD)]
    crafted = {k: v for k, v in published[-1].items() if k != "ts"}
    assert crafted == fields_but_ts(crafted_batch(kv_events))  # every field, read as vLLM set it


def _hash(value: Any) -> Any:
    """A hash as vLLM's side wrote it in JSON ({"bytes": hex} for a bytes one), as the workbench decodes it."""
    return bytes.fromhex(value["bytes"]) if isinstance(value, dict) else value


def test_attached_to_vllms_publisher_the_state_is_vllms_cache(tmp_path):
    """`workbench attach`'s state from a stream vLLM's own scheduler and ZmqEventPublisher send: after the workload
    (read from the replay, from batch 0) its hashes and copies are what vLLM's block pool holds; then, live, two runs
    of batches built with vLLM's classes whose effect is known (copies, a removal that cuts a chain, a reset, a bytes
    hash)."""
    from workbench.attach import CLEARED, HITTABLE, ORPHANED, REMOVED, Attachment

    endpoint, replay_endpoint = f"ipc://{tmp_path}/kv", f"ipc://{tmp_path}/kv-replay"
    vllm_side = VLLMSide(tmp_path, "attach", endpoint, replay_endpoint)
    try:
        said = vllm_side.read("cache")
        with Attachment(endpoint, replay=replay_endpoint, block_size=4, num_blocks=11) as attachment:
            state = attachment.state

            def reach(last: int) -> None:  # the publisher's thread sends what it was given: live, if not replayed
                deadline = time.monotonic() + TIMEOUT_S
                while state.last_seq < last:
                    assert time.monotonic() < deadline, f"live: batch {state.last_seq} of {last}"
                    time.sleep(0.01)

            reach(said["published"] - 1)
            assert state.notes == [] and state.num_batches == said["published"]
            held = {_hash(h): copies for h, copies in said["cache"]}
            assert held and state.resident() == held
            assert state.event_counts["BlockRemoved"] > 0  # the workload's long prompt evicts

            def next_run() -> None:
                vllm_side.send({"next": True})
                reach(vllm_side.read("published")["published"] - 1)

            next_run()
            resident = state.resident()
            assert {h: resident[h] for h in (11, 13, 14)} == {11: 2, 13: 1, 14: 1} and 12 not in resident
            hittable = state.hittable()
            assert [state.status(h, hittable) for h in (11, 12, 13, 14)] == [HITTABLE, REMOVED, ORPHANED, ORPHANED]
            next_run()
            assert state.resident() == {21: 1, 22: 1, 23: 1, b"\x01" * 32: 1}
            assert state.hittable() == {21, 22, 23, b"\x01" * 32} and state.children() == {21: 1, 22: 1}
            assert {state.status(h, set()) for h in (11, 13, 14)} == {CLEARED} and state.nodes[12].status == REMOVED
            assert [p.num_tokens for p in state.prefixes()] == [12, 4] and state.lost_batches == 0
            vllm_side.send({"done": True})
    finally:
        vllm_side.close()
