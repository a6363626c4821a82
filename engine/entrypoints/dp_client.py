"""Data parallelism: `data_parallel_size` engine replicas in their own processes behind a load-balancing front end
(vLLM's `DPLBAsyncMPClient`, at our size and synchronous).

Each replica ("dp-0", "dp-1", ...) is a whole LLMEngine in a spawned process, with its own scheduler, KV cache and
copy of the weights; the front end in the caller's process routes each request to one of them, streams its tokens
back and reaps the processes (engine/entrypoints/core_client.py, shared with PDCluster).

Routing ("load", the default): the live replica with the least score `waiting * 4 + running`, ties to the lowest
index, as vLLM's DP load balancer. A replica's counts are what it reported after its last step, plus the requests
sent to it that it has not taken yet (counted as waiting, as vLLM's client bumps its waiting count on each send),
so a burst of requests spreads before any replica has stepped.

Routing ("prefix"): the live replica known to cache the most leading full blocks of the request's prompt, ties
and misses by the score. The front end hashes the prompt's blocks as the replicas do (sha256 chains, which agree
across processes: replicas always run with prefix_caching_hash_algo="sha256") and keeps, per replica, the hashes
it reported cached (kv.cached) minus those it evicted (kv.evicted), plus the blocks of requests sent to it under
this rule (cached once their prefill runs: a request that shares a prefix with one sent just before follows it).
`routing` may be changed between requests.

Every decision is a `dp.routed` event and every replica death a `dp.replica_dead` event (engine/events.py), in
`routing_events()`; each replica's StepRecords are in `records()` ({"dp-0": [...], "dp-1": [...]}).

Under AsyncLLM (the server), the front end is driven as an LLMEngine is (vLLM's AsyncLLM over its DP client):
`add_request` (which waits until the replica took the request, so that a refusal raises here), `step()`, `get_output`
/ `pop_output`, `abort`, `subscribe`, `snapshot()` (what a dashboard attached mid-run starts from). Each `step()`
that saw anything is the front end's own StepRecord (`front_end_records()`, and to subscribers: the server's
metrics, the dashboard, a trace): request.added / request.tokens /
request.finished of its requests, its dp.routed and dp.replica_dead events, and a dp.load per replica whose load
changed (waiting, running, KV blocks), with the replicas' sums as the record's queue counts and KV usage.

Failures: a replica whose process dies fails only the requests it holds (finish_reason "error", the error names
the replica); the front end sends it nothing more, and with no live replica a request fails at once. A replica that
hangs (owes an answer and sends nothing for `config.data_parallel_replica_timeout_s`, default 60 s) is declared dead
the same way, after its process is killed: no wait of the front end (`add_request`, `step`, `records()`,
`generate`) blocks on it for longer.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from engine.config import EngineConfig
from engine.core.block_hash import hash_hex, sha256_hash
from engine.entrypoints.core_client import EngineProcs, Instance, Prompt, TokenDelta, _Route
from engine.events import (
    DPLoad,
    DPReplicaDead,
    DPRouted,
    EngineSnapshot,
    Event,
    KVUsage,
    RequestAdded,
    RequestFinished,
    RequestSnapshot,
    RequestTokens,
    StepRecord,
)
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

ROUTING_KINDS = ("dp.routed", "dp.replica_dead")


def load_score(waiting: int, running: int) -> int:
    """vLLM's DP load balancer score: a waiting request weighs four running ones."""
    return waiting * 4 + running


class DPLBClient(EngineProcs):
    """The data-parallel front end over `config.data_parallel_size` replicas of `config` (each with
    data_parallel_size 1). `start()` (or `with`) starts them; `close()` stops them. Requests: `submit` / `stream`,
    `generate_stream`, `generate` (engine/entrypoints/core_client.py), or, for AsyncLLM, `add_request` / `step`.
    Owns the routing rule, what each replica is known to cache, the routing events, and the front end's records
    (their subscribers, the events and per-replica loads not yet recorded)."""

    id_prefix = "req"
    timeout_name = "data_parallel_replica_timeout_s"

    def __init__(
        self,
        config: EngineConfig,
        start_timeout_s: float = 300.0,
        max_records: int = 100_000,
        torch_threads: int | None = None,
    ) -> None:
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config: expected EngineConfig, got {type(config).__name__}")
        super().__init__(
            start_timeout_s,
            max_records,
            torch_threads,
            config.data_parallel_size,
            reply_timeout_s=config.data_parallel_replica_timeout_s,
        )
        self.config = config
        self.routing = config.data_parallel_routing
        self.replica_config = replace(
            config, data_parallel_size=1, data_parallel_routing="load", prefix_caching_hash_algo="sha256"
        )  # hashes the front end can compute, for prefix routing
        self._events: list[Event] = []
        self._cached: dict[Instance, set[str]] = {}  # per replica: block hashes (hex) it is known to cache
        self._tokenizer = None
        self.step_count = 0  # the front end's records
        self._front: deque[StepRecord] = deque(maxlen=max_records)
        self._subscribers: list[Callable[[StepRecord], None]] = []
        # events for the next record: kept only once something drives step() (offline generate() never records)
        self._recording = False
        self._pending: list[Event] = []
        self._num_tokens: dict[str, int] = {}  # request id -> output tokens recorded so far
        self._last_load: list[tuple] = []  # per replica: the load its last dp.load said

    def start(self) -> DPLBClient:
        self.__enter__()
        info = [inst.info for inst in self.instances]
        self.config.set_max_model_len(min(i["max_model_len"] for i in info))  # what the server's checks read
        self.model_path = Path(info[0]["model_path"])
        self.num_kv_blocks = min(i["num_kv_blocks"] for i in info)
        return self

    def _instance_specs(self) -> list[tuple[str, str, dict]]:
        # each replica its rank: its KV events go to the endpoints' ports + rank, as vLLM's DP engines' do
        return [
            ("dp", f"dp-{k}", {"config": replace(self.replica_config, data_parallel_rank=k)})
            for k in range(self.config.data_parallel_size)
        ]

    @property
    def tokenizer(self):
        """The model's tokenizer, loaded in this process on first use (chat, prefix routing of text prompts)."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            from engine.model.loader import resolve_model

            self._tokenizer = AutoTokenizer.from_pretrained(resolve_model(self.config.model, self.config.revision))
        return self._tokenizer

    def routing_events(self) -> list[Event]:
        """Every `dp.routed` and `dp.replica_dead` event so far, in order."""
        return list(self._events)

    def _emit(self, event: Event) -> None:
        if event.kind in ROUTING_KINDS:
            self._events.append(event)
        if self._recording:
            self._pending.append(event)

    def _loads(self) -> list[tuple[int, int, KVUsage]]:
        """Per replica: waiting (reported, plus sent and not taken yet), running and KV blocks, as the score counts
        them (a replica that has not stepped yet: all its blocks free)."""
        out = []
        for inst in self.instances:
            total = inst.info.get("num_kv_blocks", 1) - 1  # the null block is not counted
            kv = inst.kv_usage or KVUsage(total, 0, 0, total)
            out.append((inst.num_waiting + inst.num_sent - inst.num_added, inst.num_running, kv))
        return out

    # ---- routing -------------------------------------------------------------------------------
    def _block_hashes(self, prompt) -> list[str]:
        """The hex hashes of the prompt's full blocks, chained as a replica hashes them (sha256, no extra keys)."""
        ids = self.tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else prompt
        size, parent, out = self.config.block_size, None, []
        for start in range(0, len(ids) - size + 1, size):
            parent = sha256_hash(parent, ids[start : start + size], None)
            out.append(hash_hex(parent))
        return out

    def _route(self, rid: str, route: _Route) -> None:
        replicas = self.instances
        live = [k for k, inst in enumerate(replicas) if inst.alive]
        if not live:
            gone = ", ".join(inst.engine_id for inst in replicas)
            self._fail(rid, f"no live data-parallel replica: {gone or 'none'} gone", "router")
            return
        loads = self._loads()
        waiting = tuple(w for w, _, _ in loads)
        running = tuple(r for _, r, _ in loads)
        scores = tuple(load_score(w, r) for w, r in zip(waiting, running))
        hashes: list[str] = []
        hits = [0] * len(replicas)
        if self.routing == "prefix":
            hashes = self._block_hashes(route.prompt)
            for k in live:
                cached = self._cached.get(replicas[k], set())
                while hits[k] < len(hashes) and hashes[hits[k]] in cached:
                    hits[k] += 1
        chosen = min(live, key=lambda k: (-hits[k], scores[k], k))
        inst = replicas[chosen]
        self._emit(
            DPRouted(
                step=self.step_count + 1,
                request_id=rid,
                replica=inst.engine_id,
                replica_index=chosen,
                rule=self.routing,
                scores=scores,
                waiting=waiting,
                running=running,
                prefix_hit_blocks=tuple(hits),
                alive=tuple(i.alive for i in replicas),
                time_ns=time.time_ns(),
            )
        )
        self._cached.setdefault(inst, set()).update(hashes)
        self._send_to(inst, rid, route, "dp", route.params, None)

    def _on_report(self, inst: Instance, kv: list[tuple[str, str]]) -> None:
        cached = self._cached.setdefault(inst, set())
        for kind, block_hash in kv:
            if kind == "kv.cached":
                cached.add(block_hash)
            else:
                cached.discard(block_hash)

    def _on_death(self, inst: Instance, error: str, failed: list[str]) -> None:
        self._cached.pop(inst, None)
        self._emit(
            DPReplicaDead(
                step=self.step_count + 1,
                replica=inst.engine_id,
                replica_index=self.instances.index(inst),
                error=error,
                failed_request_ids=tuple(failed),
                time_ns=time.time_ns(),
            )
        )

    # ---- what AsyncLLM drives, as it drives an LLMEngine ------------------------------------------
    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> str:
        """Route a request and wait until its replica took it, so that what the replica refuses (a prompt too long,
        a bad priority or schema) raises its ValueError here, naming the field, as LLMEngine.add_request does. vLLM
        checks in the front end's process; ours asks the replica: up to two of its steps. Tokens come by `step()`."""
        self._recording = True
        arrival = time.time_ns()
        rid = self.submit(prompt, params, request_id, priority, cache_salt)
        route = self._routes.get(rid)
        inst = route.instance if route is not None else None
        sent = inst.num_sent if inst is not None else 0
        while inst is not None and inst.alive and rid in self._routes and inst.num_added < sent:
            self._pump(None)
        if rid in self._rejected:
            error = self.pop_output(rid).error
            self._next_delta({rid})  # its finishing delta: a refused request is not streamed
            raise ValueError(error)
        if route is None:
            raise RuntimeError(f"request {rid}: no replica took it")
        ids = self.tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else route.prompt
        text = prompt if isinstance(prompt, str) else self.tokenizer.decode(ids[:200])
        self._emit(
            RequestAdded(
                step=self.step_count + 1,
                request_id=rid,
                num_prompt_tokens=len(ids),
                max_tokens=route.params.max_tokens,
                priority=priority,
                arrival_ns=arrival,
                prompt=text[:200],
            )
        )
        return rid

    def child_ids(self, request_id: str) -> list[str]:
        """A request's ids as the front end streams it: itself (with n > 1, the replica joins its children)."""
        return [request_id]

    def get_output(self, request_id: str) -> RequestOutput | None:
        """The request's output so far: finished, or the tokens and text streamed so far. None while a request with
        n > 1 or logprobs runs: replicas stream tokens alone, so its output shows whole when it finishes."""
        if request_id in self._outputs:
            return self._outputs[request_id]
        route = self._routes.get(request_id)
        if route is None:
            raise ValueError(f"request_id: {request_id!r} is unknown (or was taken)")
        if route.params.n > 1 or route.params.logprobs is not None:
            return None
        return self._partial(request_id, route, None)

    @staticmethod
    def _partial(rid: str, route: _Route, finish_reason: str | None) -> RequestOutput:
        prompt_ids = [] if isinstance(route.prompt, str) else list(route.prompt)  # text: tokenized by a replica
        output = RequestOutput(rid, prompt_ids, list(route.token_ids), route.text, finish_reason)
        output.outputs = [CompletionOutput(0, route.text, list(route.token_ids), finish_reason)]
        return output

    def abort(self, request_id: str) -> None:
        """Drop a request in flight (its replica frees its blocks); its output so far, finish_reason "abort", waits
        in `pop_output` as LLMEngine's does. Unknown or finished ids are ignored."""
        route = self._routes.get(request_id)
        super().abort(request_id)
        if route is not None:
            self._outputs[request_id] = self._partial(request_id, route, "abort")
            self._num_tokens.pop(request_id, None)
            self._emit(
                RequestFinished(
                    step=self.step_count + 1,
                    request_id=request_id,
                    reason="abort",
                    num_output_tokens=len(route.token_ids),
                )
            )

    def has_unfinished_requests(self) -> bool:
        """Requests in flight, or deltas that no `step()` has recorded yet (a request that failed at once)."""
        return bool(self._routes) or bool(self._deltas)

    def subscribe(self, callback: Callable[[StepRecord], None]) -> Callable[[StepRecord], None]:
        """Call `callback(StepRecord)` with each of the front end's records. Returns the callback."""
        self._subscribers.append(callback)
        return callback

    def unsubscribe(self, callback: Callable[[StepRecord], None]) -> None:
        self._subscribers.remove(callback)

    def stats(self) -> dict:
        """The live replicas' sums, as last reported (reports already sent are read first): requests running and
        waiting, KV blocks (a KVUsage)."""
        while self._pump(0):  # an idle front end reads nobody's reports: a replica's last (an abort's) may wait
            pass
        loads = [load for inst, load in zip(self.instances, self._loads()) if inst.alive]
        return {
            "num_running": sum(r for _, r, _ in loads),
            "num_waiting": sum(w for w, _, _ in loads),
            "kv": KVUsage(
                *(sum(getattr(kv, f) for _, _, kv in loads) for f in ("total", "used", "cached_free", "free"))
            ),
        }

    def step(self, timeout: float = 0.05) -> StepRecord | None:
        """Wait up to `timeout` s for the replicas' messages, then record what arrived since the last record: the
        front end's StepRecord (also in `front_end_records()` and to subscribers), or None when nothing did."""
        self._recording = True
        start = time.time_ns()
        if self._pump(timeout):
            while self._pump(0):  # everything already sent: one record for it
                pass
        step = self.step_count + 1
        events = self._pending + [e for d in self._drain() for e in self._delta_events(step, d)]
        events += self._load_events(step)
        self._pending = []
        if not events:
            return None
        self.step_count = step
        stats = self.stats()
        record = StepRecord(
            step, start, time.time_ns(), {}, {}, stats["num_waiting"], stats["num_running"], stats["kv"], {}, events
        )
        self._front.append(record)
        for callback in list(self._subscribers):
            callback(record)
        return record

    def snapshot(self) -> EngineSnapshot:
        """The front end between two `step()`s, as a dashboard attached now must draw it: its last record's number,
        the live replicas' summed KV usage and every request it still knows (in flight: running once it streamed a
        token, else waiting; finished ones until their output is taken), except those whose request.added is still
        to be recorded (the next record adds them). No blocks: each replica has its own cache, which the front end
        does not see block by block."""
        requests = []
        unrecorded = {e.request_id for e in self._pending if isinstance(e, RequestAdded)}
        for rid, route in self._routes.items():
            if rid in unrecorded:
                continue
            status = "RUNNING" if route.token_ids else "WAITING"
            requests.append(
                self._request_snapshot(
                    rid,
                    route.prompt,
                    route.params,
                    route.priority,
                    route.arrival_ns,
                    status,
                    route.token_ids,
                    route.text,
                    None,
                    None,
                )
            )
        for rid, out in self._outputs.items():
            if rid in unrecorded:
                continue
            requests.append(
                self._request_snapshot(
                    rid,
                    out.prompt_token_ids,
                    None,
                    0,
                    0,
                    "FINISHED",
                    out.token_ids,
                    out.text,
                    out.finish_reason,
                    out.error,
                )
            )
        return EngineSnapshot(step=self.step_count, kv=self.stats()["kv"], requests=requests, blocks=[])

    def _request_snapshot(
        self,
        rid: str,
        prompt,
        params: SamplingParams | None,
        priority: int,
        arrival_ns: int,
        status: str,
        token_ids: list[int],
        text: str,
        finish_reason: str | None,
        error: str | None,
    ) -> RequestSnapshot:
        ids = self.tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else list(prompt)
        shown = prompt if isinstance(prompt, str) else self.tokenizer.decode(ids[:200])
        max_tokens = params.max_tokens if params is not None else len(token_ids)
        return RequestSnapshot(
            request_id=rid,
            prompt=shown[:200],
            num_prompt_tokens=len(ids),
            max_tokens=max_tokens,
            priority=priority,
            arrival_ns=arrival_ns,
            status=status,
            num_output_tokens=len(token_ids),
            num_cached_tokens=0,
            num_preemptions=0,
            text=text,
            finish_reason=finish_reason,
            error=error,
            block_ids=[],
        )

    def front_end_records(self) -> list[StepRecord]:
        """The front end's own StepRecords so far (its last `max_records`), in order: what a trace of it holds."""
        return list(self._front)

    def _drain(self) -> list[TokenDelta]:
        deltas = list(self._deltas)
        self._deltas.clear()
        return deltas

    def _delta_events(self, step: int, delta: TokenDelta) -> list[Event]:
        rid = delta.request_id
        count = self._num_tokens.get(rid, 0) + len(delta.token_ids)
        events: list[Event] = []
        if delta.token_ids:
            events.append(
                RequestTokens(
                    step=step,
                    request_id=rid,
                    token_ids=delta.token_ids,
                    text=delta.text,
                    text_offset=delta.text_offset,
                    num_output_tokens=count,
                )
            )
        if delta.finished:
            assert delta.finish_reason is not None, "a finishing delta names its reason"
            self._num_tokens.pop(rid, None)
            output = self._outputs.get(rid)
            count = len(output.token_ids) if output is not None else count  # n > 1: the replica's own count
            events.append(
                RequestFinished(
                    step=step, request_id=rid, reason=delta.finish_reason, num_output_tokens=count, error=delta.error
                )
            )
        else:
            self._num_tokens[rid] = count
        return events

    def _load_events(self, step: int) -> list[Event]:
        """A dp.load for each replica whose load changed since the last one."""
        events: list[Event] = []
        now = time.time_ns()
        self._last_load += [()] * (len(self.instances) - len(self._last_load))
        for k, (inst, (waiting, running, kv)) in enumerate(zip(self.instances, self._loads())):
            load = (waiting, running, kv.used, kv.total, inst.alive)
            if load != self._last_load[k]:
                self._last_load[k] = load
                events.append(
                    DPLoad(
                        step=step,
                        replica=inst.engine_id,
                        replica_index=k,
                        waiting=waiting,
                        running=running,
                        kv_used=kv.used,
                        kv_total=kv.total,
                        alive=inst.alive,
                        time_ns=now,
                    )
                )
        return events

    def close(self) -> None:
        """Stop every replica (politely, then by force); requests in flight are dropped. Idempotent."""
        super().close()
        self._cached.clear()
