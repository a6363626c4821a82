"""The engine core process (vLLM's `vllm/v1/engine/core.py`, `EngineCoreProc`): one LLMEngine in a spawned process
that takes requests between its steps and steps while it holds work. The router on the other end of its pipe is
core_client.py's `EngineProcs`.

Its first message, once its engine is built, says what the router cannot know alone (the model's folder,
max_model_len, the KV cache's size); a failure to build is one "error" message instead. After a step that changed
anything the router reads (tokens, finished outputs, its queue lengths, cached or evicted blocks) it sends one "step"
message: the step's end (time.time(), comparable across processes on one machine), each request's new tokens and
text, finished outputs, how many waiting and running requests it holds after the step, its KV blocks in use, how many
"add" messages it has taken so far, and the hashes of the blocks it cached and evicted. While it holds work it sends
at least one every HEARTBEAT_S, so that the router can tell a silent process from a busy one. It takes "add",
"abort", "records" and "stop" messages, and answers an add it refuses with "rejected".
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from engine.events import KVCached, KVEvicted, RequestFinished, RequestTokens
from engine.outputs import RequestOutput

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

HEARTBEAT_S = 1.0  # a worker holding work sends at least this often (between steps)


class _WorkerState:
    """What a worker tracks besides its engine: its records, the adds it took, each child's parent (n > 1) and
    what it last told the router of its queues."""

    def __init__(self, max_records: int) -> None:
        self.records: deque = deque(maxlen=max_records)
        self.num_added = 0
        self.children: dict[str, tuple[str, set[str]]] = {}  # child id -> (parent id, its unfinished children)
        self.last_counts: tuple = (0, 0, 0, None)
        self.last_sent = 0.0  # time.monotonic() of its last step message


def run_engine_core(conn: Connection, engine_kwargs: dict, max_records: int, torch_threads: int) -> None:
    """One instance's process: take requests between steps, step while there is work, send what each step changed
    back."""
    import torch

    torch.set_num_threads(torch_threads)  # instances on one machine share its cores: do not oversubscribe them
    from engine.llm_engine import LLMEngine

    try:
        engine = LLMEngine(**engine_kwargs)
    except Exception as exc:  # the router reports it, naming the instance
        conn.send(("error", repr(exc)))
        return
    conn.send(
        (
            "ready",
            {
                "model_path": str(engine.model_path),
                "max_model_len": engine.config.max_model_len,
                "num_kv_blocks": engine.num_kv_blocks,
            },
        )
    )
    try:
        _run_busy_loop(conn, engine, _WorkerState(max_records))
    except (BrokenPipeError, ConnectionResetError):  # the router's process died while this one was stepping
        pass
    finally:
        engine.close()  # its KV events publisher's sockets (and ports) go with the instance


def _run_busy_loop(conn: Connection, engine: LLMEngine, state: _WorkerState) -> None:
    """Take messages while idle or when there are some, step while holding work; return when told to stop."""
    while True:
        while not engine.has_unfinished_requests() or conn.poll():
            if not engine.has_unfinished_requests():  # idle: what the router counts must be current (an add it
                _report(conn, engine, state, time.time())  # refused, an abort) before waiting for the next message
            if not _take(conn, engine, state):
                return
        record = engine.step()
        state.records.append(record)
        tokens = [(e.request_id, e.token_ids, e.text, e.text_offset) for e in record.of_type(RequestTokens)]
        outputs = [out for e in record.of_type(RequestFinished) for out in _finished(engine, state, e.request_id)]
        kv = [(e.kind, e.block_hash) for e in record.events if isinstance(e, (KVCached, KVEvicted))]
        _report(conn, engine, state, record.end_ns / 1e9, tokens, outputs, kv)


def _report(
    conn: Connection,
    engine: LLMEngine,
    state: _WorkerState,
    t: float,
    tokens: Sequence[tuple] = (),
    outputs: Sequence[RequestOutput] = (),
    kv: Sequence[tuple] = (),
) -> None:
    """Send a step's tokens, outputs and block events, with the queue counts after it; nothing when there is
    nothing new, except a heartbeat every HEARTBEAT_S while it holds work (steps that change nothing, waiting for
    a KV load say): the router declares an instance that owes it answers dead after a silence (reply_timeout_s)."""
    counts = (
        engine.scheduler.num_waiting,
        engine.scheduler.num_running,
        state.num_added,
        engine.kv_cache_manager.usage(),
    )
    now = time.monotonic()
    beat = engine.has_unfinished_requests() and now - state.last_sent >= HEARTBEAT_S
    if tokens or outputs or kv or counts != state.last_counts or beat:
        state.last_counts, state.last_sent = counts, now
        conn.send(
            (
                "step",
                {
                    "time": t,
                    "tokens": list(tokens),
                    "outputs": list(outputs),
                    "kv": list(kv),
                    "num_waiting": counts[0],
                    "num_running": counts[1],
                    "num_added": counts[2],
                    "kv_usage": counts[3],
                    "stepped": bool(state.records),
                },
            )
        )


def _finished(engine: LLMEngine, state: _WorkerState, rid: str) -> list[RequestOutput]:
    """The output to send for a finished request id: itself, or its parent's once its last child finished."""
    if rid not in state.children:
        return [engine.pop_output(rid)]
    parent, left = state.children.pop(rid)
    left.discard(rid)
    return [] if left else [engine.pop_output(parent)]


def _take(conn: Connection, engine: LLMEngine, state: _WorkerState) -> bool:
    """Act on one message from the router; False when told to stop or when the router is gone (its process died:
    the pipe's other end closed)."""
    try:
        msg = conn.recv()
    except (EOFError, OSError):
        return False
    if msg[0] == "stop":
        return False
    if msg[0] == "records":
        conn.send(("records", list(state.records)))
    elif msg[0] == "abort":  # its finished event goes out with the next step's; the router has forgotten it
        engine.abort(msg[1])
    else:  # ("add", request_id, prompt, params, kv_transfer_params, priority, cache_salt)
        _, rid, prompt, params, kv_params, priority, cache_salt = msg
        state.num_added += 1
        try:
            engine.add_request(
                prompt, params, request_id=rid, priority=priority, cache_salt=cache_salt, kv_transfer_params=kv_params
            )
        except (ValueError, TypeError) as exc:
            conn.send(("rejected", (rid, str(exc))))
            return True
        children = engine.child_ids(rid)
        if children != [rid]:
            left = set(children)
            state.children.update({child: (rid, left) for child in children})
    return True
