"""Disaggregated prefill/decode: prefill and decode engine instances in separate processes, and a router.

Routing. A request goes to the prefill instance holding the fewest requests, with max_tokens=1 and
do_remote_decode; that instance saves the prompt's KV to the store and answers with kv_transfer_params. The router
then sends the request, with its own sampling params and those kv_transfer_params, to the least loaded decode
instance, which loads the KV of all but the prompt's last token, computes that token and samples every output
token itself, as behind vLLM's disaggregated proxy: the prefill's one token is dropped. So the stream and the
output both come from the decode instance alone: no duplicate, no gap, and a sampled first token cannot disagree
with the tokens after it. Instances step on their own, so prefills of new requests run while others decode.

Streaming. After every step that gave tokens, a worker sends each request's new tokens and text, stamped with the
step's end (time.time(), comparable across processes on one machine); the router turns a decode instance's into
TokenDeltas. `stream()` and `generate_stream()` yield them; `generate()` waits for whole outputs.

Failures. When an instance's process dies, every request it holds finishes with finish_reason "error" and an
error naming the instance. Nothing is re-sent elsewhere: a decode instance may have streamed part of a request
already; submit it again to retry. Later requests go to the live instances of the role, or finish with an error
at once when none is left. KV a prefill instance saved stays in the store after it dies (the store is the
cluster's), so a request it answered still decodes with the same tokens.
"""
from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Iterator, Sequence

from engine.entrypoints.llm import batch_prompts
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

CONNECTOR_NAMES = {"shared_storage": "SharedStorageConnector", "redis": "RedisConnector"}
Prompt = str | Sequence[int]


# ---- the worker process --------------------------------------------------------------------------
def _worker(conn: Connection, engine_kwargs: dict, max_records: int, torch_threads: int) -> None:
    """One instance's process: take requests between steps, step while there is work, send each step's tokens
    and finished outputs back."""
    import torch

    torch.set_num_threads(torch_threads)  # instances on one machine share its cores: do not oversubscribe them
    from engine.llm_engine import LLMEngine

    try:
        engine = LLMEngine(**engine_kwargs)
    except Exception as exc:  # the router reports it, naming the instance
        conn.send(("error", repr(exc)))
        return
    conn.send(("ready", None))
    records: deque = deque(maxlen=max_records)
    while True:
        while not engine.has_unfinished_requests() or conn.poll():
            if not _take(conn, engine, records):
                return
        record = engine.step()
        records.append(record)
        tokens = [(e.request_id, e.token_ids, e.text, e.text_offset) for e in record.of_kind("request.tokens")]
        outputs = [engine.pop_output(e.request_id) for e in record.of_kind("request.finished")]
        if tokens or outputs:
            conn.send(("step", (record.end_ns / 1e9, tokens, outputs)))


def _take(conn: Connection, engine, records: deque) -> bool:
    """Act on one message from the router; False when told to stop."""
    msg = conn.recv()
    if msg[0] == "stop":
        return False
    if msg[0] == "records":
        conn.send(("records", list(records)))
    elif msg[0] == "abort":  # its finished event goes out with the next step's; the router has forgotten it
        engine.abort(msg[1])
    else:  # ("add", request_id, prompt, params, kv_transfer_params)
        _, rid, prompt, params, kv_params = msg
        try:
            engine.add_request(prompt, params, request_id=rid, kv_transfer_params=kv_params)
        except (ValueError, TypeError) as exc:
            conn.send(("rejected", (rid, str(exc))))
    return True


# ---- what the router keeps -----------------------------------------------------------------------
@dataclass(eq=False)  # compared and hashed by identity: one per process
class Instance:
    """One engine process as the router sees it: its role, id, pipe, how many requests it holds, and whether
    its process is still there."""

    role: str
    engine_id: str
    process: mp.Process
    conn: Connection
    load: int = 0
    alive: bool = True


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
    """One request in flight: its prompt and params, where it is (prefill or decode stage, which instance), and
    what it has streamed so far."""

    prompt: Prompt
    params: SamplingParams
    instance: Instance | None = None  # None between instances
    stage: str = "prefill"
    token_ids: list[int] = field(default_factory=list)
    text: str = ""


class PDCluster:
    """Owns the store (a temporary folder, or a private redis-server), the prefill and decode processes, and the
    router between them: the requests in flight, the deltas not yet streamed and the outputs not yet taken.

    Use as a context manager. `submit` + `stream`, or `generate_stream`, yield TokenDeltas as decode steps produce
    them; `generate` returns RequestOutputs in prompt order. `torch_threads` is each process's torch thread count
    (default: the machine's cores shared out among the processes). `on_prefilled(request_id, engine_id, output)`,
    if set (here or later as an attribute), is called after a prefill instance answered and before the request
    goes to a decode instance: to watch transfers, or to break a process right there in a failure test."""

    def __init__(self, model: str = "smollm2-135m", connector: str = "shared_storage", num_prefill: int = 1,
                 num_decode: int = 1, kv_connector_extra_config: dict | None = None,
                 kv_load_failure_policy: str = "recompute", start_timeout_s: float = 300.0,
                 max_records: int = 100_000, torch_threads: int | None = None,
                 on_prefilled: Callable[[str, str, RequestOutput], None] | None = None,
                 **engine_kwargs: Any) -> None:
        if connector not in CONNECTOR_NAMES:
            raise ValueError(f"connector: must be one of {sorted(CONNECTOR_NAMES)}, got {connector!r}")
        for name, n in (("num_prefill", num_prefill), ("num_decode", num_decode)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{name}: must be an int >= 1, got {n!r}")
        if torch_threads is not None and (isinstance(torch_threads, bool) or not isinstance(torch_threads, int)
                                          or torch_threads < 1):
            raise ValueError(f"torch_threads: must be an int >= 1 or None, got {torch_threads!r}")
        self.model, self.connector, self.engine_kwargs = model, connector, engine_kwargs
        self.num_prefill, self.num_decode = num_prefill, num_decode
        self.extra = dict(kv_connector_extra_config or {})
        self.policy = kv_load_failure_policy
        self.start_timeout_s, self.max_records = start_timeout_s, max_records
        self.torch_threads = torch_threads or max(1, (os.cpu_count() or 1) // (num_prefill + num_decode))
        self.on_prefilled = on_prefilled
        self.instances: list[Instance] = []
        self._cleanup: list = []
        self._ids = itertools.count()
        self._routes: dict[str, _Route] = {}
        self._deltas: deque[TokenDelta] = deque()
        self._outputs: dict[str, RequestOutput] = {}
        self._rejected: set[str] = set()  # finished outputs that are an instance's refusal of bad input
        self._records: dict[str, list] = {}  # replies to records(), by engine id

    # ---- life cycle ----------------------------------------------------------------------------
    def __enter__(self) -> "PDCluster":
        try:
            self._start_store()
            ctx = mp.get_context("spawn")  # fork would copy torch's threads and locks
            for role, count in (("prefill", self.num_prefill), ("decode", self.num_decode)):
                for i in range(count):
                    self.instances.append(self._spawn(ctx, role, f"{role}-{i}"))
            for inst in self.instances:
                self._await_ready(inst)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start_store(self) -> None:
        if self.connector == "shared_storage" and "shared_storage_path" not in self.extra:
            tmp = tempfile.TemporaryDirectory(prefix="pd-kv-")
            self._cleanup.append(tmp.cleanup)
            self.extra["shared_storage_path"] = tmp.name
        elif self.connector == "redis" and "url" not in self.extra:
            from engine.kv_transfer.redis_server import RedisServer

            server = RedisServer().start()
            self._cleanup.append(server.stop)
            self.extra["url"] = server.url

    def _spawn(self, ctx, role: str, engine_id: str) -> Instance:
        kv = {"kv_connector": CONNECTOR_NAMES[self.connector], "engine_id": engine_id,
              "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
              "kv_connector_extra_config": self.extra, "kv_load_failure_policy": self.policy}
        parent, child = ctx.Pipe()
        kwargs = {"model": self.model, **self.engine_kwargs, "kv_transfer_config": kv}
        proc = ctx.Process(target=_worker, args=(child, kwargs, self.max_records, self.torch_threads),
                           name=engine_id, daemon=True)
        proc.start()
        child.close()  # the parent's copy of the child's end: without closing it, a dead child gives no EOF
        return Instance(role, engine_id, proc, parent)

    def _await_ready(self, inst: Instance) -> None:
        if not inst.conn.poll(self.start_timeout_s):
            raise TimeoutError(f"{inst.engine_id}: no engine after {self.start_timeout_s} s")
        try:
            kind, detail = inst.conn.recv()
        except (OSError, EOFError):
            kind, detail = "error", f"the process is gone (exit code {inst.process.exitcode})"
        if kind != "ready":
            raise RuntimeError(f"{inst.engine_id}: the engine failed to start: {detail}")

    def close(self) -> None:
        """Stop every process (politely, then by force), then the store. Requests in flight are dropped."""
        for inst in self.instances:
            try:
                inst.conn.send(("stop",))
            except (OSError, EOFError):
                pass
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

    # ---- requests ------------------------------------------------------------------------------
    def submit(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Send a request to a prefill instance and return its id at once; its deltas come from `stream()`, its
        output from `pop_output()`. Types are checked here; lengths by the instance (a rejected request
        finishes with finish_reason "error" and the instance's message)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params: expected SamplingParams, got {type(params).__name__}")
        if not isinstance(prompt, (str, Sequence)):
            raise TypeError(f"prompt: expected str or list of token ids, got {type(prompt).__name__}")
        rid = f"pd-{next(self._ids)}" if request_id is None else str(request_id)
        if rid in self._routes or rid in self._outputs:
            raise ValueError(f"request_id: {rid!r} is already in use")
        prompt = prompt if isinstance(prompt, str) else list(prompt)
        while self._pump(0):  # take what the workers sent first: a worker blocked on a full pipe reads nothing
            pass
        self._routes[rid] = route = _Route(prompt, params)
        self._forward(rid, route, "prefill", replace(params, max_tokens=1, min_tokens=0), {"do_remote_decode": True})
        return rid

    def abort(self, request_id: str) -> None:
        """Drop a request in flight (its instance frees its blocks); unknown or finished ids are ignored."""
        route = self._routes.pop(request_id, None)
        if route is not None and route.instance is not None:
            route.instance.load -= 1
            self._try_send(route.instance, ("abort", request_id))

    def has_unfinished_requests(self) -> bool:
        return bool(self._routes)

    def pop_output(self, request_id: str) -> RequestOutput:
        """The output of a finished request; the cluster forgets it."""
        if request_id not in self._outputs:
            state = "has not finished" if request_id in self._routes else "is unknown (or was taken)"
            raise ValueError(f"request_id: {request_id!r} {state}")
        self._rejected.discard(request_id)
        return self._outputs.pop(request_id)

    def stream(self, timeout: float | None = None) -> Iterator[TokenDelta]:
        """TokenDeltas of every submitted request, in arrival order, until none is in flight; with `timeout`
        (seconds), the iterator also ends when no delta came for that long."""
        return self._stream(None, timeout)

    def generate_stream(self, prompts: Sequence[Prompt] | Prompt,
                        params: SamplingParams | Sequence[SamplingParams] | None = None) -> Iterator[TokenDelta]:
        """Submit every prompt, then yield their TokenDeltas until all have finished (deltas of other requests
        wait for `stream()`). Their outputs wait in `pop_output()`."""
        rids = self._submit_all(prompts, params)
        return self._stream(set(rids), None)

    def generate(self, prompts: Sequence[Prompt] | Prompt,
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run every prompt through a prefill instance, then a decode instance; outputs in prompt order.
        A prompt an instance rejects raises its ValueError (naming the field), and the others are aborted."""
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
    def _forward(self, rid: str, route: _Route, role: str, params: SamplingParams, kv_params: dict | None) -> None:
        """Hand the request to the least loaded live instance of `role`; with none left, finish it with an error."""
        live = [i for i in self.instances if i.role == role and i.alive]
        if not live:
            gone = ", ".join(i.engine_id for i in self.instances if i.role == role)
            self._fail(rid, f"no live {role} instance: {gone or 'none'} gone", "router")
            return
        inst = min(live, key=lambda i: i.load)
        route.instance, route.stage = inst, role
        inst.load += 1
        if not self._try_send(inst, ("add", rid, route.prompt, params, kv_params)):
            self._instance_died(inst)

    @staticmethod
    def _try_send(inst: Instance, msg: tuple) -> bool:
        if not inst.alive:
            return False
        try:
            inst.conn.send(msg)
        except (OSError, EOFError):
            return False
        return True

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
            if not self._pump(left) and left is not None and time.monotonic() >= deadline:
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
        """Wait up to `timeout` for messages from the live instances and act on one from each; False if none came."""
        live = [i for i in self.instances if i.alive]
        ready = wait([i.conn for i in live], timeout) if live else []
        for conn in ready:
            inst = next(i for i in live if i.conn is conn)
            try:
                kind, payload = conn.recv()
            except (OSError, EOFError):
                self._instance_died(inst)
                continue
            if kind == "step":
                self._on_step(inst, *payload)
            elif kind == "rejected":
                rid, error = payload
                if self._holds(inst, rid):
                    self._rejected.add(rid)
                    self._fail(rid, error, inst.engine_id)
            elif kind == "records":
                self._records[inst.engine_id] = payload
        return bool(ready)

    def _holds(self, inst: Instance, rid: str) -> bool:
        route = self._routes.get(rid)
        return route is not None and route.instance is inst

    def _on_step(self, inst: Instance, t: float, tokens: list[tuple], outputs: list[RequestOutput]) -> None:
        done = {o.request_id: o for o in outputs if self._holds(inst, o.request_id)}
        for rid, token_ids, text, offset in tokens:
            route = self._routes.get(rid)
            if route is None or route.instance is not inst or route.stage != "decode":
                continue  # a prefill's one token is dropped: the decode instance samples it again
            route.token_ids += token_ids
            route.text = route.text[:offset] + text
            out = done.pop(rid, None)
            self._deltas.append(TokenDelta(rid, tuple(token_ids), text, offset, out is not None,
                                           out.finish_reason if out else None, inst.engine_id, t,
                                           out.error if out else None))
            if out is not None:
                self._finish(rid, out)
        for rid, out in done.items():
            route = self._routes[rid]
            if route.stage == "prefill" and out.finish_reason != "error":
                inst.load, route.instance = inst.load - 1, None
                if self.on_prefilled is not None:
                    self.on_prefilled(rid, inst.engine_id, out)
                self._forward(rid, route, "decode", route.params, out.kv_transfer_params)
            else:
                self._deltas.append(TokenDelta(rid, (), "", len(route.text), True, out.finish_reason,
                                               inst.engine_id, t, out.error))
                self._finish(rid, out)

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
        if not inst.alive:
            return
        inst.alive = False
        inst.process.join(timeout=5)
        error = f"{inst.engine_id}: the process is gone (exit code {inst.process.exitcode})"
        for rid in [rid for rid, route in self._routes.items() if route.instance is inst]:
            self._fail(rid, error, inst.engine_id)

    def records(self) -> dict[str, list]:
        """Each live instance's StepRecords so far, by engine id (prefill-0, decode-0, ...), for the dashboards
        (a dead process's records went with it). Messages that arrive meanwhile are handled as usual."""
        asked = []
        for inst in self.instances:
            if self._try_send(inst, ("records",)):
                asked.append(inst)
            else:
                self._instance_died(inst)
        self._records = {}
        while any(i.alive and i.engine_id not in self._records for i in asked):
            self._pump(None)
        return {i.engine_id: self._records.pop(i.engine_id) for i in asked if i.engine_id in self._records}
