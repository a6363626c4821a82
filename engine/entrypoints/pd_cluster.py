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

import tempfile
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from engine.entrypoints.core_client import EngineProcs, Instance, TokenDelta, _Route, check_count
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

CONNECTOR_NAMES = {"shared_storage": "ExampleConnector", "redis": "RedisConnector"}
__all__ = ["PDCluster", "TokenDelta", "Instance", "CONNECTOR_NAMES"]


class PDCluster(EngineProcs):
    """Owns the store (a temporary folder, or a private redis-server), the prefill and decode processes, and the
    router between them (engine/entrypoints/core_client.py): the requests in flight, the deltas not yet streamed
    and the outputs not yet taken.

    Use as a context manager. `submit` + `stream`, or `generate_stream`, yield TokenDeltas as decode steps produce
    them; `generate` returns RequestOutputs in prompt order. `torch_threads` is each process's torch thread count
    (default: the machine's cores shared out among the processes). `on_prefilled(request_id, engine_id, output)`,
    if set (here or later as an attribute), is called after a prefill instance answered and before the request
    goes to a decode instance: to watch transfers, or to break a process right there in a failure test.
    `reply_timeout_s`: how long an instance that owes the router an answer may stay silent before it is declared
    dead (killed, its requests failed naming it; engine/entrypoints/core_client.py)."""

    id_prefix = "pd"

    def __init__(
        self,
        model: str = "smollm2-135m",
        connector: str = "shared_storage",
        num_prefill: int = 1,
        num_decode: int = 1,
        kv_connector_extra_config: dict | None = None,
        kv_load_failure_policy: str = "recompute",
        start_timeout_s: float = 300.0,
        max_records: int = 100_000,
        torch_threads: int | None = None,
        on_prefilled: Callable[[str, str, RequestOutput], None] | None = None,
        reply_timeout_s: float = 60.0,
        **engine_kwargs: Any,
    ) -> None:
        if connector not in CONNECTOR_NAMES:
            raise ValueError(f"connector: must be one of {sorted(CONNECTOR_NAMES)}, got {connector!r}")
        check_count("num_prefill", num_prefill)
        check_count("num_decode", num_decode)
        super().__init__(start_timeout_s, max_records, torch_threads, num_prefill + num_decode, reply_timeout_s)
        self.model, self.connector, self.engine_kwargs = model, connector, engine_kwargs
        self.num_prefill, self.num_decode = num_prefill, num_decode
        self.extra = dict(kv_connector_extra_config or {})
        self.policy = kv_load_failure_policy
        self.on_prefilled = on_prefilled

    def _prepare(self) -> None:
        if self.connector == "shared_storage" and "shared_storage_path" not in self.extra:
            tmp = tempfile.TemporaryDirectory(prefix="pd-kv-")
            self._cleanup.append(tmp.cleanup)
            self.extra["shared_storage_path"] = tmp.name
        elif self.connector == "redis" and "url" not in self.extra:
            from engine.kv_transfer.redis_server import RedisServer

            server = RedisServer().start()
            self._cleanup.append(server.stop)
            self.extra["url"] = server.url

    def _instance_specs(self) -> list[tuple[str, str, dict]]:
        specs = []
        for role, count in (("prefill", self.num_prefill), ("decode", self.num_decode)):
            for i in range(count):
                engine_id = f"{role}-{i}"
                kv = {
                    "kv_connector": CONNECTOR_NAMES[self.connector],
                    "engine_id": engine_id,
                    "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
                    "kv_connector_extra_config": self.extra,
                    "kv_load_failure_policy": self.policy,
                }
                specs.append((role, engine_id, {"model": self.model, **self.engine_kwargs, "kv_transfer_config": kv}))
        return specs

    # ---- routing -------------------------------------------------------------------------------
    def _route(self, rid: str, route: _Route) -> None:
        """A new request goes to a prefill instance for its prompt's KV and one token (dropped)."""
        self._forward(
            rid, route, "prefill", replace(route.params, max_tokens=1, min_tokens=0), {"do_remote_decode": True}
        )

    def _forward(self, rid: str, route: _Route, role: str, params: SamplingParams, kv_params: dict | None) -> None:
        """Hand the request to the least loaded live instance of `role`; with none left, finish it with an error."""
        live = [i for i in self.instances if i.role == role and i.alive]
        if not live:
            gone = ", ".join(i.engine_id for i in self.instances if i.role == role)
            self._fail(rid, f"no live {role} instance: {gone or 'none'} gone", "router")
            return
        self._send_to(min(live, key=lambda i: i.load), rid, route, role, params, kv_params)

    def _streams(self, route: _Route) -> bool:
        return route.stage == "decode"  # a prefill's one token is dropped: the decode instance samples it again

    def _on_output(self, inst: Instance, rid: str, route: _Route, output: RequestOutput, t: float) -> None:
        if route.stage == "prefill" and output.finish_reason != "error":
            inst.load, route.instance = inst.load - 1, None
            if self.on_prefilled is not None:
                self.on_prefilled(rid, inst.engine_id, output)
            self._forward(rid, route, "decode", route.params, output.kv_transfer_params)
        else:
            super()._on_output(inst, rid, route, output, t)
