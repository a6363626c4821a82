"""Disaggregated prefill/decode: prefill and decode engine instances in separate processes, and a router.

Each request goes to a prefill instance with max_tokens=1 and do_remote_decode; the prefill instance saves its
prompt KV to the store and answers with kv_transfer_params; the router hands the request, with those params, to a
decode instance, which loads the KV and decodes. Instances step on their own, so prefills of new requests run
while earlier requests decode.
"""
from __future__ import annotations

import itertools
import multiprocessing as mp
import tempfile
from collections import deque
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from typing import Any, Sequence

from engine.request import RequestOutput, SamplingParams

CONNECTOR_NAMES = {"shared_storage": "SharedStorageConnector", "redis": "RedisConnector"}


def _worker(conn: Connection, engine_kwargs: dict, max_records: int) -> None:
    """One instance's process: take requests between steps, step while there is work, send outputs back."""
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
            msg = conn.recv()
            if msg[0] == "stop":
                return
            if msg[0] == "records":
                conn.send(("records", list(records)))
            else:  # ("add", request_id, prompt, params, kv_transfer_params)
                _, rid, prompt, params, kv_params = msg
                try:
                    engine.add_request(prompt, params, request_id=rid, kv_transfer_params=kv_params)
                except (ValueError, TypeError) as exc:
                    conn.send(("rejected", (rid, repr(exc))))
        record = engine.step()
        records.append(record)
        for event in record.of_kind("request.finished"):
            conn.send(("output", engine.pop_output(event.request_id)))


@dataclass(eq=False)  # compared and hashed by identity: one per process
class Instance:
    """One engine process as the router sees it: its role, id, pipe and how many requests it holds."""

    role: str
    engine_id: str
    process: mp.Process
    conn: Connection
    load: int = 0


class PDCluster:
    """Owns the store (a temporary folder, or a private redis-server), the prefill and decode processes and
    the router between them. Use as a context manager; `generate` returns RequestOutputs in prompt order."""

    def __init__(self, model: str = "smollm2-135m", connector: str = "shared_storage", num_prefill: int = 1,
                 num_decode: int = 1, kv_connector_extra_config: dict | None = None,
                 kv_load_failure_policy: str = "recompute", start_timeout_s: float = 300.0,
                 max_records: int = 100_000, **engine_kwargs: Any) -> None:
        if connector not in CONNECTOR_NAMES:
            raise ValueError(f"connector: must be one of {sorted(CONNECTOR_NAMES)}, got {connector!r}")
        for name, n in (("num_prefill", num_prefill), ("num_decode", num_decode)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{name}: must be an int >= 1, got {n!r}")
        self.model, self.connector, self.engine_kwargs = model, connector, engine_kwargs
        self.num_prefill, self.num_decode = num_prefill, num_decode
        self.extra = dict(kv_connector_extra_config or {})
        self.policy = kv_load_failure_policy
        self.start_timeout_s, self.max_records = start_timeout_s, max_records
        self.instances: list[Instance] = []
        self._cleanup: list = []
        self._ids = itertools.count()

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
        proc = ctx.Process(target=_worker, args=(child, kwargs, self.max_records), name=engine_id, daemon=True)
        proc.start()
        child.close()
        return Instance(role, engine_id, proc, parent)

    def _await_ready(self, inst: Instance) -> None:
        if not inst.conn.poll(self.start_timeout_s):
            raise TimeoutError(f"{inst.engine_id}: no engine after {self.start_timeout_s} s")
        kind, detail = self._recv(inst)
        if kind != "ready":
            raise RuntimeError(f"{inst.engine_id}: the engine failed to start: {detail}")

    def close(self) -> None:
        """Stop every process (politely, then by force), then the store."""
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
        self.instances = []
        while self._cleanup:
            self._cleanup.pop()()

    # ---- routing -------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run every prompt through a prefill instance, then a decode instance; outputs in prompt order."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        elif len(params) != len(prompts):
            raise ValueError(f"params: {len(params)} given for {len(prompts)} prompts")
        rids = [f"pd-{next(self._ids)}" for _ in prompts]
        todo = {rid: (prompt, p) for rid, prompt, p in zip(rids, prompts, params)}
        where: dict[str, Instance] = {}
        for rid, (prompt, p) in todo.items():
            where[rid] = self._send(self._pick("prefill"), rid, prompt, replace(p, max_tokens=1, min_tokens=0),
                                    {"do_remote_decode": True})
        done: dict[str, RequestOutput] = {}
        while len(done) < len(rids):
            for conn in wait([inst.conn for inst in set(where.values())]):
                inst = next(i for i in self.instances if i.conn is conn)
                kind, payload = self._recv(inst)
                rid = payload[0] if kind == "rejected" else payload.request_id
                inst.load -= 1
                if kind == "rejected":
                    raise ValueError(f"{inst.engine_id} rejected request {rid}: {payload[1]}")
                if inst.role == "decode" or payload.finish_reason == "error":
                    done[rid] = payload
                    where.pop(rid)
                else:
                    prompt, p = todo[rid]
                    where[rid] = self._send(self._pick("decode"), rid, prompt, p, payload.kv_transfer_params)
        return [done[rid] for rid in rids]

    def _pick(self, role: str) -> Instance:
        return min((i for i in self.instances if i.role == role), key=lambda i: i.load)

    def _send(self, inst: Instance, rid: str, prompt, params: SamplingParams, kv_params: dict | None) -> Instance:
        try:
            inst.conn.send(("add", rid, prompt, params, kv_params))
        except (OSError, EOFError) as exc:
            raise RuntimeError(f"{inst.engine_id}: the process is gone") from exc
        inst.load += 1
        return inst

    @staticmethod
    def _recv(inst: Instance) -> tuple[str, Any]:
        try:
            return inst.conn.recv()
        except (OSError, EOFError) as exc:
            raise RuntimeError(f"{inst.engine_id}: the process is gone (exit code {inst.process.exitcode})") from exc

    def records(self) -> dict[str, list]:
        """Each instance's StepRecords so far, by engine id (prefill-0, decode-0, ...), for the dashboards."""
        out = {}
        for inst in self.instances:
            inst.conn.send(("records",))
            kind, records = self._recv(inst)
            out[inst.engine_id] = records
        return out

