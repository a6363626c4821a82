"""The vLLM side of `workbench fidelity`: runs workloads through vLLM 0.33.0's own V1 `Scheduler` and
`KVCacheManager` and writes what they decided at every step.

Run only with the reference venv's python (`make vllm-ref` builds .venv-vllm); nothing of the workbench imports
this file, and this file imports nothing of the workbench: it reads workloads (JSON lines, the format of
workbench/fidelity/workload.py) and writes one trace per workload (JSON lines, the format of
workbench/fidelity/trace.py's `step_record`), so each side can be read without the other.

    .venv-vllm/bin/python tests/fidelity/vllm_driver.py WORKLOADS.jsonl TRACES.jsonl

The scheduler is driven as vLLM's own tests drive it (tests/v1/core/utils.py): `schedule()`, then a
`ModelRunnerOutput` carrying the scripted token of each request whose computed tokens reached its length, then
`update_from_output(...)`. No model, no GPU, no tokenizer: a tiny Llama config.json stands for the model.

Speculative workloads (`num_speculative_tokens` in the config): vLLM's "ngram" method, whose drafts take no
lookahead slots and no extra input budget. The runner's part is scripted as the engine's ScriptedModel scripts it:
each scheduled request's `scheduled_spec_decode_tokens` are verified greedily against its script (the accepted
prefix plus one token in `sampled_token_ids`), then, as `EngineCore.post_step` does, `update_draft_token_ids` gets
the batch's next drafts (the workload's, after the request's outputs; none for a request that did not sample).
The runner drafts at most the step's `num_spec_tokens_to_schedule`. A workload's dynamic speculative decoding
schedule (`num_speculative_tokens_per_batch_size`) sets it by batch size, and the trace records it (`spec_k`);
without one, a schedule of K at every batch size turns off one thing only: the padding of a newly admitted one-token
decode to 1 + K rows with -1 drafts, kept for CUDA graphs (a deliberate difference, docs/FIDELITY.md).

Guided requests (`grammar_ready_step`): structured-output params (a JSON object), so vLLM's Request waits in
WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR; no grammar is compiled (EngineCore's grammar_init is never called, and
nothing here has a tokenizer). At that step, before it is scheduled, `structured_output_request.grammar` becomes a
stand-in that allows every token and never terminates, or an exception (a failed compile). The grammar bitmask is
not asked for: no model samples under it.

Connector workloads (`kv_connector` in the config): vLLM's Scheduler builds a `ScriptedConnector` (a
KVConnectorBase_V1 loaded from this module by `kv_connector_module_path`) whose scheduler side follows the workload:
`get_num_new_matched_tokens` answers the request's `remote_tokens` past its local hits (asynchronous with
`load_async`), `update_state_after_alloc` starts its load, `request_finished` holds a stopped request's blocks for
its `send_steps`. The runner's part: each step's ModelRunnerOutput carries a KVConnectorOutput with the loads
(`finished_recving`) and sends (`finished_sending`) the script ends in that step. No KV moves.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

_MODEL_DIR = tempfile.mkdtemp(prefix="fidelity-model-")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="fidelity-vllm-cache-"))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

FINISH_REASONS = {
    "FINISHED_STOPPED": "stop",
    "FINISHED_LENGTH_CAPPED": "length",
    "FINISHED_ABORTED": "abort",
    "FINISHED_ERROR": "error",
}


def _write_model_config(eos_token_id: int) -> None:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "num_hidden_layers": 1,
        "vocab_size": 49152,
        "max_position_embeddings": 1 << 16,
        "eos_token_id": eos_token_id,
        "bos_token_id": 1,
        "torch_dtype": "float32",
    }
    with open(os.path.join(_MODEL_DIR, "config.json"), "w") as f:
        json.dump(config, f)


_model_configs: dict = {}
_connector_script: dict = {}  # the workload whose ScriptedConnector vLLM's factory builds next


def _scripted_connector_class():
    """ScriptedConnector, made on first use (vLLM is imported only once the environment above is set)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata
    from vllm.v1.request import RequestStatus

    class ScriptedConnector(KVConnectorBase_V1):
        """The scheduler side of a connector workload's script; the worker side moves nothing."""

        def __init__(self, vllm_config, role, kv_cache_config=None):
            super().__init__(vllm_config, role, kv_cache_config)
            self.by_id = {r["request_id"]: r for r in _connector_script["requests"]}
            self.step = 0
            self.due_loads: dict[str, int] = {}  # request id -> the step whose output reports it done
            self.due_sends: dict[str, int] = {}
            self.freeing: set[str] = set()  # finished while loading

        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            r = self.by_id[request.request_id]
            n = max(r.get("remote_tokens", 0) - num_computed_tokens, 0)
            return n, bool(n) and r["load_async"]

        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            r = self.by_id[request.request_id]
            if num_external_tokens > 0 and r["load_async"]:
                self.due_loads[request.request_id] = self.step + r["load_steps"]

        def build_connector_meta(self, scheduler_output):
            return KVConnectorMetadata()

        def request_finished(self, request, block_ids):
            if request.request_id in self.due_loads:  # its blocks are freed when its load ends
                self.freeing.add(request.request_id)
            send = self.by_id[request.request_id].get("send_steps", 0)
            send *= request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
            if send:
                self.due_sends[request.request_id] = self.step + send
            return bool(send), None

        def output(self):
            """The KVConnectorOutput of this step's runner: what ends now. vLLM frees the blocks of the ids in
            each set in the set's order (a string hash's, which differs between processes), so at most one
            transfer that frees blocks ends per set and step; the others due wait a step, earliest due first."""
            from vllm.v1.outputs import KVConnectorOutput

            ended = []
            for due in (self.due_sends, self.due_loads):
                ready = sorted((step, rid) for rid, step in due.items() if step <= self.step)
                frees = [rid for _, rid in ready if due is self.due_sends or rid in self.freeing][:1]
                ended.append({rid for _, rid in ready if due is self.due_loads and rid not in self.freeing} | {*frees})
                for rid in ended[-1]:
                    del due[rid]
                    self.freeing.discard(rid)
            return KVConnectorOutput(finished_sending=ended[0], finished_recving=ended[1])

        def start_load_kv(self, forward_context, **kwargs):
            pass

        def wait_for_layer_load(self, layer_name):
            pass

        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
            pass

        def wait_for_save(self):
            pass

    return ScriptedConnector


def __getattr__(name: str):  # vLLM's KVConnectorFactory imports ScriptedConnector from this module by name
    if name == "ScriptedConnector":
        return _scripted_connector_class()
    raise AttributeError(name)


def make_scheduler(workload: dict, kv_events_config: dict | None = None):
    import torch
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVEventsConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    c = workload["config"]
    key = c["max_model_len"]
    if key not in _model_configs:  # the first build inspects the architecture in a subprocess (~10 s)
        _model_configs[key] = ModelConfig(
            model=_MODEL_DIR, skip_tokenizer_init=True, max_model_len=key, dtype="float32"
        )
    model_config = _model_configs[key]
    scheduler_config = SchedulerConfig(
        async_scheduling=c.get("async_scheduling", False),
        max_num_seqs=c["max_num_seqs"],
        max_num_batched_tokens=c["max_num_batched_tokens"],
        enable_chunked_prefill=c["enable_chunked_prefill"],
        long_prefill_token_threshold=c["long_prefill_token_threshold"],
        policy=c["scheduling_policy"],
        max_model_len=c["max_model_len"],
        is_encoder_decoder=False,
    )
    cache_config = CacheConfig(
        block_size=c["block_size"],
        enable_prefix_caching=c["enable_prefix_caching"],
        prefix_caching_hash_algo=c["prefix_caching_hash_algo"],
    )
    cache_config.num_gpu_blocks = c["num_blocks"]
    k = c.get("num_speculative_tokens", 0)
    speculative_config = None
    if k:
        speculative_config = SpeculativeConfig(
            method="ngram",
            num_speculative_tokens=k,
            prompt_lookup_max=k,
            prompt_lookup_min=1,
            num_speculative_tokens_per_batch_size=c.get("num_speculative_tokens_per_batch_size", [(1, 1, k)]),
        )
    vllm_config = VllmConfig(
        speculative_config=speculative_config,
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        device_config=DeviceConfig(device="cpu"),
        kv_events_config=None if kv_events_config is None else KVEventsConfig(**kv_events_config),
        kv_transfer_config=_kv_transfer_config(workload, KVTransferConfig),
    )
    spec = FullAttentionSpec(block_size=c["block_size"], num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(
        num_blocks=c["num_blocks"], kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)]
    )
    cls = AsyncScheduler if c.get("async_scheduling", False) else Scheduler
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=c["block_size"],
    )


def _kv_transfer_config(workload: dict, config_class):
    if "kv_connector" not in workload["config"]:
        return None
    _connector_script.clear()
    _connector_script.update(workload)
    return config_class(kv_connector="ScriptedConnector", kv_connector_module_path=__name__, kv_role="kv_both")


class StandInGrammar:
    """vLLM's StructuredOutputGrammar interface, allowing every token: what the scheduler calls on a grammar."""

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        return tokens

    def rollback(self, num_tokens: int) -> None:
        pass

    def fill_bitmask(self, bitmask, batch_index: int) -> None:
        bitmask[batch_index] = -1

    def is_terminated(self) -> bool:
        return False

    def reset(self) -> None:
        pass


def make_request(spec: dict, index: int, workload: dict, hasher):
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    from vllm.v1.request import Request

    params = SamplingParams(
        max_tokens=spec["max_tokens"],
        min_tokens=spec["min_tokens"],
        ignore_eos=spec["ignore_eos"],
        stop_token_ids=list(spec["stop_token_ids"]),
        structured_outputs=StructuredOutputsParams(json_object=True) if "grammar_ready_step" in spec else None,
    )
    params.update_from_generation_config({}, eos_token_id=workload["eos_token_id"])
    return Request(
        spec["request_id"],
        list(spec["prompt_token_ids"]),
        params,
        None,
        arrival_time=float(index),
        priority=spec["priority"],
        cache_salt=spec["cache_salt"],
        block_hasher=hasher,
    )


def _hash_hex(block) -> str | None:
    from vllm.v1.core.kv_cache_utils import get_block_hash

    return None if block.block_hash is None else get_block_hash(block.block_hash).hex()[:16]


def _schedule_record(out, requests: dict) -> dict:
    """What one schedule() decided, in the harness's terms."""
    cached = out.scheduled_cached_reqs
    # vLLM's V2 model runner gets resumed requests among the new ones: told apart by their preemptions
    admitted = {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
    for rid, num_computed in zip(cached.req_ids, cached.num_computed_tokens):
        if rid in cached.resumed_req_ids:
            admitted[rid] = num_computed
    return {
        "scheduled": [[rid, n] for rid, n in out.num_scheduled_tokens.items()],
        "new": [n.req_id for n in out.scheduled_new_reqs if requests[n.req_id].num_preemptions == 0],
        "resumed": sorted(rid for rid in admitted if requests[rid].num_preemptions > 0),
        "preempted": sorted(out.preempted_req_ids),
        "hit_tokens": dict(sorted(admitted.items())),
    }


def _runner_output(out, samples: set, requests: dict, workload: dict):
    """The scripted tokens of a batch: for each request that reached its sequence's end when scheduled, the
    script's next token after what it has (EOS past the script's end); with drafts, first the drafts that equal the
    script's tokens from there on (a greedy verification)."""
    from vllm.v1.outputs import ModelRunnerOutput

    scripts = {r["request_id"]: r["output_token_ids"] for r in workload["requests"]}
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in req_ids:
        i = len(requests[rid].output_token_ids)
        script = scripts[rid] + [workload["eos_token_id"]] * (
            i + 1 + workload["config"].get("num_speculative_tokens", 0)
        )
        drafts = out.scheduled_spec_decode_tokens.get(rid, [])
        accepted = next((j for j, d in enumerate(drafts) if d != script[i + j]), len(drafts))
        sampled.append(script[i : i + accepted + 1] if rid in samples else [])
    return ModelRunnerOutput(
        req_ids=req_ids, req_id_to_index={rid: i for i, rid in enumerate(req_ids)}, sampled_token_ids=sampled
    )


def _draft_token_ids(out, samples: set, requests: dict, workload: dict):
    """The drafts proposed after a batch, as the runner hands them to the scheduler: for each request in it, the
    workload's drafts once it has its outputs now (none for one that did not sample)."""
    from vllm.v1.outputs import DraftTokenIds

    drafts = {r["request_id"]: r["draft_token_ids"] for r in workload["requests"]}
    k = out.num_spec_tokens_to_schedule  # the step's, by the dynamic schedule
    req_ids = list(out.num_scheduled_tokens)
    proposed = []
    for rid in req_ids:
        n = len(requests[rid].output_token_ids)
        proposed.append(list(drafts[rid][n][:k]) if rid in samples and n < len(drafts[rid]) else [])
    return DraftTokenIds(req_ids, proposed)


def run_workload(workload: dict, kv_events_config: dict | None = None) -> dict:
    """Each step as vLLM's EngineCore takes it: `step()` (schedule, run, update) or, with async scheduling,
    `step_with_batch_queue()` (a queue of two batches: schedule the next batch; update from the oldest when the
    queue is full or nothing more can be scheduled). `kv_events_config` (vLLM's KVEventsConfig's keys): the
    scheduler publishes its KV cache events (tests/fidelity/vllm_kv_events.py)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import RequestStatus

    c = workload["config"]
    asynchronous = c.get("async_scheduling", False)
    hash_fn = get_hash_fn_by_name(c["prefix_caching_hash_algo"])
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(c["block_size"], hash_fn)
    scheduler = make_scheduler(workload, kv_events_config)
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    requests: dict = {}
    queue: list = []  # (scheduler output, the requests that sample in it), oldest first
    steps = []
    connector = scheduler.connector
    for step in range(workload["max_steps"]):
        if connector is not None:
            connector.step = step
        finished = []
        for index, spec in enumerate(workload["requests"]):
            if spec["arrival_step"] == step:
                requests[spec["request_id"]] = request = make_request(spec, index, workload, hasher)
                scheduler.add_request(request)
        for rid in workload["aborts"].get(str(step), []):
            if scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED):
                finished.append([rid, "abort"])
        for spec in workload["requests"]:
            if spec.get("grammar_ready_step") == step and spec["request_id"] in scheduler.requests:
                grammar = ValueError("the script's grammar does not compile") if spec["grammar_error"] else None
                scheduler.requests[spec["request_id"]].structured_output_request.grammar = grammar or StandInGrammar()
        pending = any(s["arrival_step"] > step for s in workload["requests"])
        # done when nothing is left to schedule and no batch with tokens is in flight (an empty batch in the queue,
        # scheduled only to report finished ids, changes nothing when it is taken)
        # (scheduler.requests also holds finished requests whose blocks a transfer still holds)
        if not scheduler.requests and not pending and not any(out.total_num_scheduled_tokens for out, _ in queue):
            break
        record = {"step": step, "scheduled": [], "new": [], "resumed": [], "preempted": [], "hit_tokens": {}}
        update = None
        if not asynchronous or scheduler.has_requests():
            out = scheduler.schedule()
            record.update(_schedule_record(out, requests))
            if "num_speculative_tokens" in c:  # the drafts each request verifies in this batch
                record["spec"] = {rid: list(d) for rid, d in out.scheduled_spec_decode_tokens.items()}
            if "num_speculative_tokens_per_batch_size" in c:
                record["spec_k"] = out.num_spec_tokens_to_schedule if out.num_scheduled_tokens else None
            # a request samples when its scheduled tokens reached its sequence's end (no prompt left)
            samples = {rid for rid in out.num_scheduled_tokens if not scheduler.requests[rid].is_prefill_chunk}
            queue.append((out, samples))
            if asynchronous and len(queue) < 2 and (out.total_num_scheduled_tokens > 0 or scheduler.has_requests()):
                queue_full = False
            else:
                queue_full = True
            if queue_full:
                update = queue.pop(0)
        elif queue:
            update = queue.pop(0)
        if update is not None:
            out, samples = update
            errors = []  # grammars that failed to compile, finished last, in a set's order: sorted here
            runner_output = _runner_output(out, samples, requests, workload)
            if connector is not None:
                runner_output.kv_connector_output = connector.output()
            for outputs in scheduler.update_from_output(out, runner_output).values():
                for o in outputs.outputs:
                    if o.finish_reason is not None:
                        (errors if o.error is not None else finished).append([o.request_id, str(o.finish_reason)])
            finished += sorted(errors)
            if "num_speculative_tokens" in c and out.total_num_scheduled_tokens:  # EngineCore.post_step
                scheduler.update_draft_token_ids(_draft_token_ids(out, samples, requests, workload))
        record["requests"] = {
            rid: {
                "computed": r.num_computed_tokens,
                "blocks": list(kv.get_block_ids(rid)[0]),
                "hashes": [_hash_hex(b) for b in kv.get_blocks(rid).blocks[0]],
            }
            for rid, r in sorted(scheduler.requests.items())
        }
        record["finished"] = finished
        record["free_blocks"] = pool.get_num_free_blocks()
        record["free_queue"] = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        steps.append(record)
    outputs = {rid: list(r.output_token_ids) for rid, r in sorted(requests.items())}
    return {"name": workload["name"], "steps": steps, "outputs": outputs}


def main(argv: list[str]) -> int:
    src, dst = argv[1], argv[2]
    with open(src) as f:
        workloads = [json.loads(line) for line in f if line.strip()]
    if workloads:
        _write_model_config(workloads[0]["eos_token_id"])
    with open(dst, "w") as f:
        for workload in workloads:
            f.write(json.dumps(run_workload(workload), separators=(",", ":")) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
