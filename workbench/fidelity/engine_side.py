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
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from engine import LLMEngine, SamplingParams, StructuredOutputsParams
from engine.core.block_hash import hash_hex
from engine.executor.scripted import ScriptedModel


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
        speculative_config={"method": "ngram", "num_speculative_tokens": k} if k else None,
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
    return engine


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
    kv = engine.kv_cache_manager
    return {
        rid: {
            "computed": r.num_computed_tokens,
            "blocks": kv.get_block_ids(rid),
            "hashes": [hash_hex(b.block_hash) for b in kv.req_to_blocks.get(rid, [])],
        }
        for rid, r in sorted(engine.scheduler.requests.items())
    }


def trace_steps(workload: dict[str, Any], engine: LLMEngine) -> Iterator[dict[str, Any]]:
    """Drive `engine` (made by make_engine) through the workload, one step at a time, and yield each step's record
    as vLLM's side writes it; a view subscribed to the engine shows each step as it is taken."""
    if engine.eos_token_id != workload["eos_token_id"]:
        raise ValueError(
            f"eos_token_id: the workload's is {workload['eos_token_id']}, the engine's {engine.eos_token_id}"
        )
    scheduler, pool = engine.scheduler, engine.kv_cache_manager.block_pool
    for step in range(workload["max_steps"]):
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
        events = [e for e in record.events if e.step == record.step]
        admitted = [e for e in events if e.kind == "request.scheduled" and e.request_id not in was_running]
        spec = {"spec": {e.request_id: list(e.draft_token_ids) for e in events if e.kind == "spec.verified"}}
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
