"""The client side of engine processes (vLLM's `vllm/v1/engine/core_client.py`): a router that starts engine core
processes (core.py), routes requests to them and streams what they send back. What PDCluster (disaggregated
prefill/decode) and DPLBClient (data parallelism) share.

The router turns each process's step messages (core.py says what they hold) into TokenDeltas; `stream()` and
`generate_stream()` yield them, `generate()` waits for outputs.

A subclass says which instances to start (`_instance_specs`), where a new request goes (`_route`), and what a
finished output means (`_on_output`: the end of the request, or one more hop). When an instance's process dies,
every request it holds finishes with finish_reason "error" and an error naming the instance; later requests go to
the live instances. `close()`, the context manager and an atexit hook stop every process.

No wait on an instance is unbounded (vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S): an instance that owes the router an
answer (it holds requests, so it steps and reports; an add it has not acknowledged; a `records()` reply) and sends
nothing for `reply_timeout_s` seconds (before its first step, which loads what the engine loads lazily, for as long
as its start may take: `start_timeout_s`), or whose pipe stays full that long, is declared dead as if its process had
died (a hung or stopped process: it is killed and reaped, its requests fail with an error naming it, the router
sends it nothing more), and the others keep serving. Messages are written and read with that bound too
(`_send_within`, `_recv_within`): a stopped process cannot block the router half-way through one.
"""

from __future__ import annotations

import atexit
import itertools
import multiprocessing as mp
import os
import pickle
import select
import struct
import time
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from engine.entrypoints.core import run_engine_core
from engine.events import KVUsage
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

Prompt = str | Sequence[int]


def batch_prompts(
    prompts, params: SamplingParams | Sequence[SamplingParams] | None
) -> list[tuple[str | list[int], SamplingParams]]:
    """One prompt (text or token ids) or a list of them, with one SamplingParams for all or one per prompt, as
    (prompt, params) pairs: what LLM.generate and the routers' generate take."""
    if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    prompts = list(prompts)
    if params is None or isinstance(params, SamplingParams):
        params = [params or SamplingParams()] * len(prompts)
    elif len(params) != len(prompts):
        raise ValueError(f"params: {len(params)} given for {len(prompts)} prompts")
    return list(zip(prompts, params))


# ---- what the router keeps -----------------------------------------------------------------------
@dataclass(eq=False)  # compared and hashed by identity: one per process
class Instance:
    """One engine process as the router sees it: its role, id, pipe, how many requests it holds, whether its
    process is still there, what its engine said once built (`info`: model_path, max_model_len, num_kv_blocks), and
    what it last reported: waiting and running requests and KV blocks after its last step, and the adds it had taken
    by then (`num_sent - num_added` are on their way to it)."""

    role: str
    engine_id: str
    process: mp.Process
    conn: Connection
    load: int = 0
    alive: bool = True
    num_sent: int = 0
    num_added: int = 0
    num_waiting: int = 0
    num_running: int = 0
    kv_usage: KVUsage | None = None
    info: dict = field(default_factory=dict)
    deadline: float | None = None  # time.monotonic() by which it must send something (None: it owes nothing)
    stepped: bool = False  # it has run a step (its first loads what it loads lazily: the CPU kernels, say)
    owes_records: bool = False  # asked by records(), not answered yet
    timed_out: str | None = None  # why the router gave up on it, when it did


@dataclass(frozen=True)
class TokenDelta:
    """What one engine step added to one request, as the router streams it: the new token ids and the text they
    added (the request's text is now text_so_far[:text_offset] + text: a stop string can trim text streamed
    before), whether the request finished (why, and the error if it failed), the instance that produced it, and
    when (the end of that step, time.time() seconds)."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    text_offset: int
    finished: bool
    finish_reason: str | None
    instance: str
    time: float
    error: str | None = None


@dataclass(eq=False)
class _Route:
    """One request in flight: its prompt and params, where it is (its stage, which instance), and what it has
    streamed so far."""

    prompt: Prompt
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    instance: Instance | None = None  # None between instances
    stage: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    arrival_ns: int = field(default_factory=time.time_ns)


class ReplyTimeout(Exception):
    """A message could not be written to, or read from, an instance's pipe within the router's bound."""


def _send_within(conn: Connection, msg: Any, timeout: float) -> None:
    """`conn.send(msg)` (the same bytes: a 4-byte big-endian length, then the pickle) that gives up after `timeout`
    seconds of a full pipe (raises ReplyTimeout: what was written of it is then garbage, so the instance must be
    declared dead) instead of blocking for as long as the reader is stopped. OSError: the reader is gone."""
    data = pickle.dumps(msg, protocol=pickle.DEFAULT_PROTOCOL)
    _write_within(conn, struct.pack("!i", len(data)) + data, timeout)


def _write_within(conn: Connection, buf: bytes, timeout: float) -> None:
    fd, view = conn.fileno(), memoryview(buf)
    deadline = time.monotonic() + timeout
    os.set_blocking(fd, False)
    try:
        while view:
            try:
                view = view[os.write(fd, view) :]
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ReplyTimeout(f"the pipe stayed full for {timeout} s") from None
                select.select([], [fd], [], left)
    finally:
        os.set_blocking(fd, True)


def _recv_within(conn: Connection, timeout: float) -> Any:
    """`conn.recv()` once `wait` said the pipe is readable, that gives up (ReplyTimeout) when the rest of the
    message does not come within `timeout` seconds (a writer stopped half-way). EOFError: the writer is gone."""
    fd = conn.fileno()
    deadline = time.monotonic() + timeout
    os.set_blocking(fd, False)
    try:

        def read(n: int) -> bytes:
            chunks, left = [], n
            while left:
                try:
                    chunk = os.read(fd, left)
                except BlockingIOError:
                    wait_s = deadline - time.monotonic()
                    if wait_s <= 0:
                        raise ReplyTimeout(f"half a message, then nothing for {timeout} s") from None
                    select.select([fd], [], [], wait_s)
                    continue
                if not chunk:
                    raise EOFError
                chunks.append(chunk)
                left -= len(chunk)
            return b"".join(chunks)

        (size,) = struct.unpack("!i", read(4))
        if size == -1:  # a message over 2 GiB: an 8-byte length follows (as Connection writes it)
            (size,) = struct.unpack("!Q", read(8))
        return pickle.loads(read(size))
    finally:
        os.set_blocking(fd, True)


def check_count(name: str, n: Any) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{name}: must be an int >= 1, got {n!r}")


_LIVE: weakref.WeakSet[EngineProcs] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Reap what a caller forgot to close, before the interpreter ends."""
    for group in list(_LIVE):
        group.close()


class EngineProcs:
    """Engine processes and the router's state: the requests in flight, the deltas not yet streamed and the
    outputs not yet taken. Use as a context manager (or call `close()`). `torch_threads` is each process's torch
    thread count (default: the machine's cores shared out among the processes). `reply_timeout_s`: how long an
    instance that owes an answer may stay silent before it is declared dead (see the module's docstring)."""

    id_prefix = "req"
    timeout_name = "reply_timeout_s"  # what errors call the bound: the setting a user changes

    def __init__(
        self,
        start_timeout_s: float,
        max_records: int,
        torch_threads: int | None,
        num_procs: int,
        reply_timeout_s: float = 60.0,
    ) -> None:
        if isinstance(reply_timeout_s, bool) or not isinstance(reply_timeout_s, (int, float)) or reply_timeout_s <= 0:
            raise ValueError(f"reply_timeout_s: must be a number of seconds > 0, got {reply_timeout_s!r}")
        self.reply_timeout_s = float(reply_timeout_s)
        if torch_threads is not None and (
            isinstance(torch_threads, bool) or not isinstance(torch_threads, int) or torch_threads < 1
        ):
            raise ValueError(f"torch_threads: must be an int >= 1 or None, got {torch_threads!r}")
        self.start_timeout_s, self.max_records = start_timeout_s, max_records
        self.torch_threads = torch_threads or max(1, (os.cpu_count() or 1) // num_procs)
        self.instances: list[Instance] = []
        self._cleanup: list = []
        self._ids = itertools.count()
        self._routes: dict[str, _Route] = {}
        self._deltas: deque[TokenDelta] = deque()
        self._outputs: dict[str, RequestOutput] = {}
        self._rejected: set[str] = set()  # finished outputs that are an instance's refusal of bad input
        self._records: dict[str, list] = {}  # replies to records(), by engine id

    # ---- what a subclass says ------------------------------------------------------------------
    def _prepare(self) -> None:
        """Before any process starts (a store to share, ...)."""

    def _instance_specs(self) -> list[tuple[str, str, dict]]:
        """(role, engine_id, LLMEngine keyword arguments) of each process to start."""
        raise NotImplementedError

    def _route(self, rid: str, route: _Route) -> None:
        """Send a new request to an instance (`_send_to`), or fail it (`_fail`)."""
        raise NotImplementedError

    def _streams(self, route: _Route) -> bool:
        """Whether the tokens of a request at its current stage go to the user."""
        return True

    def _on_output(self, inst: Instance, rid: str, route: _Route, output: RequestOutput, t: float) -> None:
        """A request's instance finished it (without streaming a last token): by default, the end."""
        self._deltas.append(
            TokenDelta(rid, (), "", len(route.text), True, output.finish_reason, inst.engine_id, t, output.error)
        )
        self._finish(rid, output)

    def _on_report(self, inst: Instance, kv: list[tuple[str, str]]) -> None:
        """An instance's step message arrived (its queue counts are already read); `kv` are its (kind, hash)
        block events."""

    def _on_death(self, inst: Instance, error: str, failed: list[str]) -> None:
        """An instance's process is gone; `failed` are the requests it held (already finished with the error)."""

    # ---- life cycle ----------------------------------------------------------------------------
    def __enter__(self):
        try:
            self._prepare()
            ctx = mp.get_context("spawn")  # fork would copy torch's threads and locks
            for role, engine_id, kwargs in self._instance_specs():
                self.instances.append(self._spawn(ctx, role, engine_id, kwargs))
            _LIVE.add(self)
            for inst in self.instances:
                self._await_ready(inst)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _spawn(self, ctx, role: str, engine_id: str, kwargs: dict) -> Instance:
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=run_engine_core,
            args=(child, kwargs, self.max_records, self.torch_threads),
            name=engine_id,
            daemon=True,
        )
        proc.start()
        child.close()  # the parent's copy of the child's end: without closing it, a dead child gives no EOF
        return Instance(role, engine_id, proc, parent)

    def _await_ready(self, inst: Instance) -> None:
        if not inst.conn.poll(self.start_timeout_s):
            raise TimeoutError(f"{inst.engine_id}: no engine after {self.start_timeout_s} s")
        try:
            kind, detail = _recv_within(inst.conn, self.start_timeout_s)
        except ReplyTimeout as exc:
            raise TimeoutError(f"{inst.engine_id}: {exc}") from None
        except (OSError, EOFError):
            kind, detail = "error", f"the process is gone (exit code {inst.process.exitcode})"
        if kind != "ready":
            raise RuntimeError(f"{inst.engine_id}: the engine failed to start: {detail}")
        inst.info = detail

    def close(self) -> None:
        """Stop every process (politely, then by force), then what `_prepare` made. Requests in flight are
        dropped. Idempotent."""
        _LIVE.discard(self)
        for inst in self.instances:
            if not inst.alive:
                continue
            try:
                _send_within(inst.conn, ("stop",), min(self.reply_timeout_s, 5.0))
            except (OSError, EOFError, ReplyTimeout):
                inst.process.kill()  # a stopped process reads nothing: stop it by force
        for inst in self.instances:
            inst.process.join(timeout=10)
            if inst.process.is_alive():
                inst.process.kill()
                inst.process.join()
            inst.conn.close()
        self.instances = []
        self._routes.clear()
        while self._cleanup:
            self._cleanup.pop()()

    def pids(self) -> dict[str, int]:
        """Each instance's process id, by engine id (dead ones included until close)."""
        return {inst.engine_id: inst.process.pid for inst in self.instances if inst.process.pid is not None}

    # ---- requests ------------------------------------------------------------------------------
    def submit(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> str:
        """Route a request to an instance and return its id at once; its deltas come from `stream()`, its output
        from `pop_output()`. Types are checked here; lengths, priority and cache_salt by the instance (a rejected
        request finishes with finish_reason "error" and the instance's message)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params: expected SamplingParams, got {type(params).__name__}")
        if not isinstance(prompt, (str, Sequence)):
            raise TypeError(f"prompt: expected str or list of token ids, got {type(prompt).__name__}")
        rid = f"{self.id_prefix}-{next(self._ids)}" if request_id is None else str(request_id)
        if rid in self._routes or rid in self._outputs:
            raise ValueError(f"request_id: {rid!r} is already in use")
        prompt = prompt if isinstance(prompt, str) else list(prompt)
        while self._pump(0):  # take what the workers sent first: a worker blocked on a full pipe reads nothing
            pass
        self._routes[rid] = route = _Route(prompt, params, priority, cache_salt)
        self._route(rid, route)
        return rid

    def abort(self, request_id: str) -> None:
        """Drop a request in flight (its instance frees its blocks); unknown or finished ids are ignored."""
        route = self._routes.pop(request_id, None)
        if route is not None and route.instance is not None:
            route.instance.load -= 1
            if not self._try_send(route.instance, ("abort", request_id)):
                self._instance_died(route.instance)

    def has_unfinished_requests(self) -> bool:
        return bool(self._routes)

    def pop_output(self, request_id: str) -> RequestOutput:
        """The output of a finished request; the router forgets it."""
        if request_id not in self._outputs:
            state = "has not finished" if request_id in self._routes else "is unknown (or was taken)"
            raise ValueError(f"request_id: {request_id!r} {state}")
        self._rejected.discard(request_id)
        return self._outputs.pop(request_id)

    def stream(self, timeout: float | None = None) -> Iterator[TokenDelta]:
        """TokenDeltas of every submitted request, in arrival order, until none is in flight; with `timeout`
        (seconds), the iterator also ends when no delta came for that long."""
        return self._stream(None, timeout)

    def generate_stream(
        self, prompts: Sequence[Prompt] | Prompt, params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> Iterator[TokenDelta]:
        """Submit every prompt, then yield their TokenDeltas until all have finished (deltas of other requests
        wait for `stream()`). Their outputs wait in `pop_output()`."""
        rids = self._submit_all(prompts, params)
        return self._stream(set(rids), None)

    def generate(
        self, prompts: Sequence[Prompt] | Prompt, params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order. A prompt an instance rejects raises its
        ValueError (naming the field), and the others are aborted."""
        rids = self._submit_all(prompts, params)
        try:
            for delta in self._stream(set(rids), None):
                if delta.finished and delta.request_id in self._rejected:
                    raise ValueError(delta.error)
        except BaseException:
            self._drop(rids)
            raise
        return [self.pop_output(rid) for rid in rids]

    def _drop(self, rids: list[str]) -> None:
        for rid in rids:
            self.abort(rid)
            self._outputs.pop(rid, None)
            self._rejected.discard(rid)

    def _submit_all(self, prompts, params) -> list[str]:
        rids: list[str] = []
        pairs = batch_prompts(prompts, params)
        try:
            for prompt, p in pairs:
                rids.append(self.submit(prompt, p))
        except (TypeError, ValueError):
            self._drop(rids)
            raise
        return rids

    # ---- routing -------------------------------------------------------------------------------
    def _send_to(
        self, inst: Instance, rid: str, route: _Route, stage: str, params: SamplingParams, kv_params: dict | None
    ) -> None:
        """Hand the request to `inst` at `stage`; a broken pipe is the instance's death (which fails it)."""
        route.instance, route.stage = inst, stage
        inst.load += 1
        inst.num_sent += 1
        if not self._try_send(inst, ("add", rid, route.prompt, params, kv_params, route.priority, route.cache_salt)):
            self._instance_died(inst)

    def _try_send(self, inst: Instance, msg: tuple) -> bool:
        """Send within `reply_timeout_s`; False when the instance is dead, gone, or its pipe stayed full (a stopped
        process: the caller declares it dead). A message that asks for an answer starts its silence clock."""
        if not inst.alive:
            return False
        try:
            _send_within(inst.conn, msg, self.reply_timeout_s)
        except ReplyTimeout:
            inst.timed_out = f"its pipe stayed full for {self.reply_timeout_s} s ({self.timeout_name})"
            return False
        except (OSError, EOFError):
            return False
        if msg[0] in ("add", "records") and inst.deadline is None:
            inst.deadline = time.monotonic() + self._patience(inst)
        return True

    def _patience(self, inst: Instance) -> float:
        """How long `inst` may stay silent while it owes an answer: reply_timeout_s, or until it has run its first
        step (which loads, or builds once per machine, what the engine loads lazily) start_timeout_s, as its start."""
        return self.reply_timeout_s if inst.stepped else max(self.reply_timeout_s, self.start_timeout_s)

    def _owes(self, inst: Instance) -> bool:
        """Whether the instance owes the router a message: it holds requests (it steps, and reports each step), has
        adds it did not acknowledge, or a records() reply."""
        return inst.load > 0 or inst.num_added < inst.num_sent or inst.owes_records

    def _heard(self, inst: Instance) -> None:
        """A message came from `inst`: its silence clock restarts while it still owes something."""
        inst.deadline = time.monotonic() + self._patience(inst) if self._owes(inst) else None

    def _check_deadlines(self) -> None:
        """Declare dead every live instance that owed an answer and sent nothing for reply_timeout_s."""
        now = time.monotonic()
        for inst in self.instances:
            if inst.alive and inst.deadline is not None and now >= inst.deadline:
                waited = (
                    f"{self.reply_timeout_s} s ({self.timeout_name})"
                    if inst.stepped
                    else f"{self._patience(inst)} s (start_timeout_s: before its first step)"
                )
                inst.timed_out = f"no answer for {waited}: hung or stopped"
                self._instance_died(inst)

    def _stream(self, rids: set[str] | None, timeout: float | None) -> Iterator[TokenDelta]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            delta = self._next_delta(rids)
            if delta is not None:
                yield delta
                deadline = None if timeout is None else time.monotonic() + timeout
                continue
            if not any(rids is None or rid in rids for rid in self._routes):
                return
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._pump(left) and deadline is not None and time.monotonic() >= deadline:
                return

    def _next_delta(self, rids: set[str] | None) -> TokenDelta | None:
        if rids is None:
            return self._deltas.popleft() if self._deltas else None
        for i, delta in enumerate(self._deltas):
            if delta.request_id in rids:
                del self._deltas[i]
                return delta
        return None

    def _pump(self, timeout: float | None) -> bool:
        """Wait up to `timeout` (None: until a message comes or an instance that owes one misses its deadline) for
        messages from the live instances and act on one from each; False if none came."""
        self._check_deadlines()
        live = [i for i in self.instances if i.alive]
        deadlines = [i.deadline for i in live if i.deadline is not None]
        bound = timeout
        if deadlines:  # wake up in time to declare a silent instance dead
            until = max(0.0, min(deadlines) - time.monotonic())
            bound = until if bound is None else min(bound, until)
        ready = wait([i.conn for i in live], bound) if live else []
        for conn in ready:
            inst = next(i for i in live if i.conn is conn)
            if not inst.alive:  # declared dead meanwhile
                continue
            try:
                kind, payload = _recv_within(inst.conn, self.reply_timeout_s)
            except ReplyTimeout as exc:
                inst.timed_out = str(exc)
                self._instance_died(inst)
                continue
            except (OSError, EOFError):
                self._instance_died(inst)
                continue
            self._on_message(inst, kind, payload)
            if inst.alive:
                self._heard(inst)
        self._check_deadlines()
        return bool(ready)

    def _on_message(self, inst: Instance, kind: str, payload: Any) -> None:
        if kind == "step":
            self._on_step(inst, payload)
        elif kind == "rejected":
            rid, error = payload
            if self._holds(inst, rid):
                self._rejected.add(rid)
                self._fail(rid, error, inst.engine_id)
        elif kind == "records":
            inst.owes_records = False
            self._records[inst.engine_id] = payload

    def _holds(self, inst: Instance, rid: str) -> bool:
        route = self._routes.get(rid)
        return route is not None and route.instance is inst

    def _on_step(self, inst: Instance, msg: dict) -> None:
        inst.num_waiting, inst.num_running, inst.num_added = msg["num_waiting"], msg["num_running"], msg["num_added"]
        inst.stepped = msg["stepped"]
        inst.kv_usage = msg["kv_usage"]
        self._on_report(inst, msg["kv"])
        t = msg["time"]
        done = {o.request_id: o for o in msg["outputs"] if self._holds(inst, o.request_id)}
        for rid, token_ids, text, offset in msg["tokens"]:
            route = self._routes.get(rid)
            if route is None or route.instance is not inst or not self._streams(route):
                continue
            route.token_ids += token_ids
            route.text = route.text[:offset] + text
            out = done.pop(rid, None)
            self._deltas.append(
                TokenDelta(
                    rid,
                    tuple(token_ids),
                    text,
                    offset,
                    out is not None,
                    out.finish_reason if out else None,
                    inst.engine_id,
                    t,
                    out.error if out else None,
                )
            )
            if out is not None:
                self._finish(rid, out)
        for rid, out in done.items():
            self._on_output(inst, rid, self._routes[rid], out, t)

    def _finish(self, rid: str, output: RequestOutput) -> None:
        route = self._routes.pop(rid)
        if route.instance is not None:
            route.instance.load -= 1
        self._outputs[rid] = output

    def _fail(self, rid: str, error: str, where: str) -> None:
        """Finish a request in flight with finish_reason "error": its output holds what it streamed so far."""
        route = self._routes[rid]
        prompt_ids = [] if isinstance(route.prompt, str) else list(route.prompt)  # text: tokenized by instances
        output = RequestOutput(rid, prompt_ids, list(route.token_ids), route.text, "error", error=error)
        self._deltas.append(TokenDelta(rid, (), "", len(route.text), True, "error", where, time.time(), error))
        self._finish(rid, output)

    def _instance_died(self, inst: Instance) -> None:
        """The instance is dead to the router: its process is reaped (killed first if it timed out, or if it does
        not end within 5 s), its requests fail naming it, and nothing more goes to it."""
        if not inst.alive:
            return
        inst.alive = False
        inst.deadline = None
        if inst.timed_out is None:
            inst.process.join(timeout=5)
        if inst.process.is_alive():  # hung or stopped (SIGKILL ends a stopped process too)
            inst.process.kill()
            inst.process.join(timeout=5)
        if inst.timed_out is not None:
            error = f"{inst.engine_id}: {inst.timed_out}; the process was killed"
        else:
            error = f"{inst.engine_id}: the process is gone (exit code {inst.process.exitcode})"
        failed = [rid for rid, route in self._routes.items() if route.instance is inst]
        for rid in failed:
            self._fail(rid, error, inst.engine_id)
        self._on_death(inst, error, failed)

    def records(self) -> dict[str, list]:
        """Each live instance's StepRecords so far, by engine id, for the dashboards (a dead process's records
        went with it). Messages that arrive meanwhile are handled as usual."""
        asked = []
        for inst in self.instances:
            if not inst.alive:
                continue
            if self._try_send(inst, ("records",)):
                inst.owes_records = True
                asked.append(inst)
            else:
                self._instance_died(inst)
        self._records = {}
        while any(i.alive and i.engine_id not in self._records for i in asked):
            self._pump(None)  # bounded: an instance that does not answer within reply_timeout_s is declared dead
        return {i.engine_id: self._records.pop(i.engine_id) for i in asked if i.engine_id in self._records}
