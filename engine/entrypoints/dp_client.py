"""Data parallelism: `data_parallel_size` engine replicas in their own processes behind a load-balancing front end
(vLLM's `DPLBAsyncMPClient`, at our size and synchronous).

Each replica ("dp-0", "dp-1", ...) is a whole LLMEngine in a spawned process, with its own scheduler, KV cache and
copy of the weights; the front end in the caller's process routes each request to one of them, streams its tokens
back and reaps the processes (engine/entrypoints/engine_procs.py, shared with PDCluster).

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

Failures: a replica whose process dies fails only the requests it holds (finish_reason "error", the error names
the replica); the front end sends it nothing more, and with no live replica a request fails at once.
"""
from __future__ import annotations

import time
from dataclasses import replace
from engine.config import EngineConfig
from engine.core.block_hash import hash_hex, sha256_hash
from engine.entrypoints.engine_procs import EngineProcs, Instance, _Route
from engine.events import DPReplicaDead, DPRouted, Event


def load_score(waiting: int, running: int) -> int:
    """vLLM's DP load balancer score: a waiting request weighs four running ones."""
    return waiting * 4 + running


class DPLBClient(EngineProcs):
    """The data-parallel front end over `config.data_parallel_size` replicas of `config` (each with
    data_parallel_size 1). `start()` (or `with`) starts them; `close()` stops them. Requests: `submit` / `stream`,
    `generate_stream`, `generate` (engine/entrypoints/engine_procs.py)."""

    id_prefix = "req"

    def __init__(self, config: EngineConfig, start_timeout_s: float = 300.0, max_records: int = 100_000,
                 torch_threads: int | None = None) -> None:
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config: expected EngineConfig, got {type(config).__name__}")
        super().__init__(start_timeout_s, max_records, torch_threads, config.data_parallel_size)
        self.config = config
        self.routing = config.data_parallel_routing
        self.replica_config = replace(
            config, data_parallel_size=1, data_parallel_routing="load",
            prefix_caching_hash_algo="sha256")  # hashes the front end can compute, for prefix routing
        self._events: list[Event] = []
        self._cached: dict[Instance, set[str]] = {}  # per replica: block hashes (hex) it is known to cache
        self._tokenizer = None

    def start(self) -> "DPLBClient":
        return self.__enter__()

    def _instance_specs(self) -> list[tuple[str, str, dict]]:
        return [("dp", f"dp-{k}", {"config": self.replica_config}) for k in range(self.config.data_parallel_size)]

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

    # ---- routing -------------------------------------------------------------------------------
    def _block_hashes(self, prompt) -> list[str]:
        """The hex hashes of the prompt's full blocks, chained as a replica hashes them (sha256, no extra keys)."""
        ids = self.tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else prompt
        size, parent, out = self.config.block_size, None, []
        for start in range(0, len(ids) - size + 1, size):
            parent = sha256_hash(parent, ids[start:start + size], None)
            out.append(hash_hex(parent))
        return out

    def _route(self, rid: str, route: _Route) -> None:
        replicas = self.instances
        live = [k for k, inst in enumerate(replicas) if inst.alive]
        if not live:
            gone = ", ".join(inst.engine_id for inst in replicas)
            self._fail(rid, f"no live data-parallel replica: {gone or 'none'} gone", "router")
            return
        waiting = tuple(i.num_waiting + i.num_sent - i.num_added for i in replicas)
        running = tuple(i.num_running for i in replicas)
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
        self._events.append(DPRouted(
            step=len(self._events) + 1, request_id=rid, replica=inst.engine_id, replica_index=chosen,
            rule=self.routing, scores=scores, waiting=waiting, running=running, prefix_hit_blocks=tuple(hits),
            alive=tuple(i.alive for i in replicas), time_ns=time.time_ns()))
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
        self._events.append(DPReplicaDead(
            step=len(self._events) + 1, replica=inst.engine_id, replica_index=self.instances.index(inst),
            error=error, failed_request_ids=tuple(failed), time_ns=time.time_ns()))

    def close(self) -> None:
        """Stop every replica (politely, then by force); requests in flight are dropped. Idempotent."""
        super().close()
        self._cached.clear()

