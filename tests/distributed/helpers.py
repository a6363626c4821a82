"""For the KV events tests: this engine's batches on a workload, probes that tell when a subscriber has joined, and
batches compared field by field (tests/fidelity/vllm_kv_events.py's batch_fields, shared with vLLM's side)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from engine.distributed.kv_events import AllBlocksCleared, EventBatch, EventPublisher, KVEventBatch
from tests.fidelity.vllm_kv_events import batch_fields
from workbench.fidelity.engine_side import make_engine, trace_steps

T = TypeVar("T")


class RecordingPublisher(EventPublisher):
    """Keeps what the engine publishes, stamped with its rank as the ZeroMQ publisher stamps it."""

    def __init__(self) -> None:
        super().__init__(0)
        self.batches: list[EventBatch] = []

    def publish(self, batch: EventBatch) -> None:
        batch.data_parallel_rank = self.data_parallel_rank
        self.batches.append(batch)

    def shutdown(self) -> None:
        return


def engine_batches(workload: dict[str, Any]) -> list[EventBatch]:
    """The batches this engine publishes on a workload of the fidelity harness's format."""
    engine = make_engine(workload, {"enable_kv_cache_events": True, "publisher": "null"})
    recorder = engine.kv_event_publisher = RecordingPublisher()
    for _ in trace_steps(workload, engine):
        pass
    engine.close()
    return recorder.batches


def fields_but_ts(batch: Any) -> dict[str, Any]:
    """batch_fields without the time stamp (each side's clock)."""
    fields = batch_fields(batch)
    del fields["ts"]
    return fields


def probe() -> KVEventBatch:
    """What a publisher sends until a subscriber has joined: ZeroMQ drops what is sent before a subscription
    arrives, and no socket says when one has."""
    return KVEventBatch(ts=0.0, events=[AllBlocksCleared()])


def join(send_probe: Callable[[], None], joined: Callable[[float], T | None], timeout_s: float = 60.0) -> T:
    """Send probes until `joined(wait_s)` (which waits at most wait_s) says the subscriber received one; returns what
    it said. Fails after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        send_probe()
        answer = joined(0.1)
        if answer is not None:
            return answer
    raise TimeoutError(f"no subscriber joined within {timeout_s} s")
