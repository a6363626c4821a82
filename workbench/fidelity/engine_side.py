"""This engine's side of `workbench fidelity`: a workload through `LLMEngine` with the scripted executor (no model),
recording at every step what vLLM's side records (tests/fidelity/vllm_driver.py), in the same shape:

- scheduled: [[request id, tokens]] in the order the scheduler took them (running first, then waiting);
- new / resumed: the requests admitted from waiting this step (first time, or after a preemption);
- preempted: sorted ids; hit_tokens: for each admitted request, the tokens it starts from (prefix-cache hits);
- requests: every live request's num_computed_tokens, block ids and the hash each block holds (None if uncached);
- finished: [request id, reason] in the order they finished (aborts before the step first);
- free_blocks and free_queue: the free block count and the free queue's block ids, head first;
- spec (speculative workloads only): the drafts each request verified this step, by request id.

A guided request's grammar is scripted (StructuredOutputManager.script_grammars): ready, or failed, at its
`grammar_ready_step`, before that step is scheduled, as vLLM's side sets its stand-in grammar.

A connector workload's scheduler gets a `ScriptedConnector` (the engine's KVConnectorBase, scheduler side from the
workload, worker side empty: no KV moves without a model). After each step its `get_finished` reports the loads and
sends the script ends then, and the scheduler takes them (`update_kv_xfer_finished`) as vLLM's takes the step's
`kv_connector_output`; `requests` then also lists the finished requests whose blocks a send or a load still holds.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from engine import LLMEngine, SamplingParams, StructuredOutputsParams
from engine.core.block_hash import hash_hex
from engine.executor.scripted import ScriptedModel
from engine.kv_transfer.base import KVConnectorBase, KVConnectorMetadata
from engine.request import Request, RequestStatus


class ScriptedConnector(KVConnectorBase):
    """Owns a connector workload's script of transfers: which prompt tokens another instance stored (a load,
    synchronous or landing `load_steps` steps after its blocks are allocated) and which finished requests send
    their KV for `send_steps` steps. `step` is the harness's step number, set before each step."""

    def __init__(self, workload: dict[str, Any]) -> None:
        self.specs = {r["request_id"]: r for r in workload["requests"]}
        self.step = 0
        self.loads: dict[str, int] = {}  # request id -> the step whose end reports its load landed
        self.sends: dict[str, int] = {}
        self.freeing: set[str] = set()

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        spec = self.specs[request.request_id]
        num_external = max(spec.get("remote_tokens", 0) - num_computed_tokens, 0)
        return num_external, num_external > 0 and spec["load_async"]

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        spec = self.specs[request.request_id]
        if num_external_tokens and spec["load_async"]:
            self.loads[request.request_id] = self.step + spec["load_steps"]

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if request.request_id in self.loads:  # finished while loading: its blocks are freed when the load ends
            self.freeing.add(request.request_id)
        steps = self.specs[request.request_id].get("send_steps")
        stopped = request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
        if steps and stopped:  # a prefill instance sends what it computed; an aborted request sends nothing
            self.sends[request.request_id] = self.step + steps
        return bool(steps and stopped), None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """The sends and loads that end now. At most one of each that frees blocks (vLLM's side frees in a set's
        order, which is a string hash's): the others wait a step, earliest due first, then by id."""
        sends = sorted((at, rid) for rid, at in self.sends.items() if at <= self.step)[:1]
        loads = sorted((at, rid) for rid, at in self.loads.items() if at <= self.step)
        frees = [rid for _, rid in loads if rid in self.freeing][:1]
        recving = {rid for _, rid in loads if rid not in self.freeing} | set(frees)
        for rid in recving:
            del self.loads[rid]
            self.freeing.discard(rid)
        for _, rid in sends:
            del self.sends[rid]
        return {rid for _, rid in sends}, recving

    def start_load_kv(self, kv_caches: Any) -> None:
        pass

    def save_kv_layer(self, layer_index: int, kv_layer: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()


def make_engine(workload: dict[str, Any], kv_events_config: dict[str, Any] | None = None) -> LLMEngine:
    """The engine of a workload's config; `kv_events_config` (vLLM's keys) turns its KV cache events on."""
    c = workload["config"]
    scripts = {r["request_id"]: r["output_token_ids"] for r in workload["requests"]}
    k = c.get("num_speculative_tokens", 0)
    drafts = {r["request_id"]: r["draft_token_ids"] for r in workload["requests"] if "draft_token_ids" in r}
    engine = LLMEngine(
        executor="scripted",
        # vLLM's side runs the "ngram" method, whose drafts need no lookahead slots: so does this engine's
        token_script=ScriptedModel(scripts, drafts) if k else scripts,
        speculative_config={"method": "ngram", "num_speculative_tokens": k, **_schedule(c)} if k else None,
        num_kv_blocks=c["num_blocks"],
        block_size=c["block_size"],
        max_num_batched_tokens=c["max_num_batched_tokens"],
        max_num_seqs=c["max_num_seqs"],
        max_model_len=c["max_model_len"],
        enable_chunked_prefill=c["enable_chunked_prefill"],
        enable_prefix_caching=c["enable_prefix_caching"],
        long_prefill_token_threshold=c["long_prefill_token_threshold"],
        scheduling_policy=c["scheduling_policy"],
        prefix_caching_hash_algo=c["prefix_caching_hash_algo"],
        async_scheduling=c.get("async_scheduling", False),
        kv_events_config=kv_events_config,
    )
    engine.structured.script_grammars()
    if c.get("kv_connector") == "scripted":  # the scheduler's connector only: the runner has no KV to move
        engine.scheduler.connector = ScriptedConnector(workload)
    return engine


def _schedule(config: dict[str, Any]) -> dict[str, Any]:
    key = "num_speculative_tokens_per_batch_size"
    return {key: config[key]} if key in config else {}


def _add(engine: LLMEngine, spec: dict[str, Any], index: int) -> None:
    params = SamplingParams(
        max_tokens=spec["max_tokens"],
        min_tokens=spec["min_tokens"],
        ignore_eos=spec["ignore_eos"],
        stop_token_ids=list(spec["stop_token_ids"]),
        structured_outputs=StructuredOutputsParams(json_object=True) if "grammar_ready_step" in spec else None,
    )
    engine.add_request(
        list(spec["prompt_token_ids"]),
        params,
        request_id=spec["request_id"],
        priority=spec["priority"],
        cache_salt=spec["cache_salt"],
        arrival_time=float(index),
    )


def _live_requests(engine: LLMEngine) -> dict[str, dict[str, Any]]:
    """Every request the scheduler holds blocks or state for: vLLM keeps a finished request whose blocks a
    transfer still holds among its requests."""
    kv, scheduler = engine.kv_cache_manager, engine.scheduler
    return {
        rid: {
            "computed": r.num_computed_tokens,
            "blocks": kv.get_block_ids(rid),
            "hashes": [hash_hex(b.block_hash) for b in kv.req_to_blocks.get(rid, [])],
        }
        for rid, r in sorted({**scheduler.requests, **scheduler.held}.items())
    }


def trace_steps(workload: dict[str, Any], engine: LLMEngine) -> Iterator[dict[str, Any]]:
    """Drive `engine` (made by make_engine) through the workload, one step at a time, and yield each step's record
    as vLLM's side writes it; a view subscribed to the engine shows each step as it is taken."""
    if engine.eos_token_id != workload["eos_token_id"]:
        raise ValueError(
            f"eos_token_id: the workload's is {workload['eos_token_id']}, the engine's {engine.eos_token_id}"
        )
    scheduler, pool = engine.scheduler, engine.kv_cache_manager.block_pool
    connector = scheduler.connector if isinstance(scheduler.connector, ScriptedConnector) else None
    for step in range(workload["max_steps"]):
        if connector is not None:
            connector.step = step
        for index, spec in enumerate(workload["requests"]):
            if spec["arrival_step"] == step:
                _add(engine, spec, index)
        for rid in workload["aborts"].get(str(step), []):  # its request.finished lands in this step's record
            if rid in scheduler.requests:
                engine.abort(rid)
        for spec in workload["requests"]:
            if spec.get("grammar_ready_step") == step and spec["request_id"] in scheduler.requests:
                error = "the script's grammar does not compile" if spec["grammar_error"] else None
                engine.structured.grammar_ready(spec["request_id"], error)
        pending = any(s["arrival_step"] > step for s in workload["requests"])
        if not engine.has_unfinished_requests() and not pending:
            return
        was_running = {r.request_id for r in scheduler.running}
        live = dict(scheduler.requests)
        record = engine.step()
        if connector is not None:  # the transfers the script ends in this step, as its runner output reports them
            scheduler.update_kv_xfer_finished(*connector.get_finished(set()), set())
        events = [e for e in record.events if e.step == record.step]
        admitted = [e for e in events if e.kind == "request.scheduled" and e.request_id not in was_running]
        spec = {"spec": {e.request_id: list(e.draft_token_ids) for e in events if e.kind == "spec.verified"}}
        if "num_speculative_tokens_per_batch_size" in workload["config"]:  # the drafts this step's batch may take
            spec["spec_k"] = next((e.num_spec_tokens for e in events if e.kind == "spec.scheduled"), None)
        yield {
            "step": step,
            "scheduled": [[rid, n] for rid, n in record.scheduled.items()],
            "new": [e.request_id for e in admitted if live[e.request_id].num_preemptions == 0],
            "resumed": sorted(e.request_id for e in admitted if live[e.request_id].num_preemptions > 0),
            "preempted": sorted(e.request_id for e in events if e.kind == "request.preempted"),
            "hit_tokens": dict(sorted((e.request_id, e.num_computed_tokens) for e in admitted)),
            "requests": _live_requests(engine),
            "finished": [[e.request_id, e.reason] for e in events if e.kind == "request.finished"],
            "free_blocks": pool.get_num_free_blocks(),
            "free_queue": [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
            **(spec if "num_speculative_tokens" in workload["config"] else {}),
        }


def run_workload(workload: dict[str, Any]) -> dict[str, Any]:
    """The workload through a new engine; returns its trace: {"name", "steps": [step records], "outputs"}."""
    engine = make_engine(workload)
    steps = list(trace_steps(workload, engine))
    outputs = {
        r["request_id"]: list(engine.get_output(r["request_id"]).token_ids)
        for r in sorted(workload["requests"], key=lambda r: r["request_id"])
    }
    return {"name": workload["name"], "steps": steps, "outputs": outputs}
