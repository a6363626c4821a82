"""Seeded random workloads for the differential check against vLLM: a config, requests as token ids with the
tokens each will sample (its script), arrival steps, priorities, cache salts and aborts. Plain JSON, so the vLLM
side (tests/fidelity/vllm_driver.py, in another venv) reads the same thing this engine runs.

Each coverage group draws what it covers and keeps the rest at defaults that cannot hide it:
- core: FCFS and priority, chunked prefill on and off, prefix caching on and off with cache salts, the long-prefill
  threshold, max_num_seqs, pools small enough to preempt;
- lifecycle: the same, plus aborts in every state (waiting, running, preempted, finished, before arrival), EOS,
  stop tokens, min_tokens, ignore_eos and max_model_len reached before max_tokens;
- async: the lifecycle group under asynchronous scheduling (vLLM's AsyncScheduler, against this engine's
  async_scheduling): each step scheduled before the previous step's tokens are back;
- spec: the lifecycle group (min_tokens aside: the engine refuses it with drafts) under speculative decoding, 1 to 4
  speculative tokens (vLLM's "ngram" method: no lookahead slots), each request with scripted drafts after each of
  its outputs, some equal to the tokens it will sample and some not, so that verifications accept all, some or none;
  half of them with a dynamic schedule (num_speculative_tokens_per_batch_size: the drafts a step takes by its batch
  size, some ranges 0), drawn from a generator of its own so the other workloads stay as they were;
- guided: the lifecycle group with structured output: some requests are guided and wait for their grammar
  (WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR) until a given step, when it is ready (a stand-in that allows every token)
  or fails to compile;
- connector: the lifecycle group with a scripted KV connector (its scheduler side: what vLLM's Scheduler asks of
  a KVConnectorBase_V1). Some requests find part of their prompt stored by another instance: loaded synchronously
  (vLLM's ExampleConnector: the block-aligned prompt but its last token) or asynchronously (P/D: the request waits
  in WAITING_FOR_REMOTE_KVS until its load lands, `load_steps` steps after its blocks are allocated); some send
  their KV when they finish (the connector's request_finished holds their blocks until `send_steps` steps later).
"""

from __future__ import annotations

import random
from typing import Any

GROUPS = ("core", "lifecycle", "async", "spec", "guided", "connector")
EOS_TOKEN_ID = 2
VOCAB = range(3, 500)  # script and prompt tokens: small ids, never EOS unless placed on purpose


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _config(rng: random.Random) -> dict[str, Any]:
    block_size = rng.choice([4, 8, 16])
    max_model_len = rng.choice([32, 48, 64, 96, 128])
    chunked = rng.random() < 0.7
    max_num_seqs = rng.choice([1, 2, 3, 4, 6, 8])
    budget = rng.choice([8, 16, 24, 32, 48, 64, 128])
    if not chunked:  # vLLM refuses a budget below max_model_len without chunking
        budget = max(budget, max_model_len)
    budget = max(budget, max_num_seqs)
    threshold = rng.choice([0, 0, 0, 4, 8, 16, 32])
    min_blocks = _cdiv(max_model_len, block_size) + 1  # one request alone always fits (and the null block)
    num_blocks = rng.randint(min_blocks, min_blocks * 3)
    return {
        "block_size": block_size,
        "num_blocks": num_blocks,
        "max_num_batched_tokens": budget,
        "max_num_seqs": max_num_seqs,
        "max_model_len": max_model_len,
        "enable_chunked_prefill": chunked,
        "enable_prefix_caching": rng.random() < 0.7,
        "long_prefill_token_threshold": min(threshold, max_model_len),
        "scheduling_policy": rng.choice(["fcfs", "priority"]),
        "prefix_caching_hash_algo": rng.choice(["sha256_cbor", "sha256_cbor", "sha256"]),
    }


def _prompt(rng: random.Random, prefixes: list[list[int]], max_len: int) -> list[int]:
    length = rng.randint(1, max_len)
    if prefixes and rng.random() < 0.6:  # a shared prefix: prefix-cache hits, blocks held by two requests
        prefix = rng.choice(prefixes)[:length]
        return prefix + [rng.choice(VOCAB) for _ in range(length - len(prefix))]
    return [rng.choice(VOCAB) for _ in range(length)]


def _script(rng: random.Random, max_tokens: int, stops: list[int], lifecycle: bool) -> list[int]:
    script = [rng.choice(VOCAB) for _ in range(max_tokens)]
    if lifecycle and rng.random() < 0.5:  # an EOS or a stop token somewhere in what it will sample
        script[rng.randrange(max_tokens)] = rng.choice([EOS_TOKEN_ID, *stops])
    return script


def _request(rng: random.Random, i: int, config: dict, prefixes: list[list[int]], lifecycle: bool) -> dict:
    max_model_len = config["max_model_len"]
    prompt = _prompt(rng, prefixes, max_model_len - 1)
    room = max_model_len - len(prompt)
    # lifecycle: max_tokens past max_model_len now and then, so the length cap ends the request first
    max_tokens = rng.randint(1, room + 8 if lifecycle else max(1, min(room, 24)))
    stops = rng.sample(list(VOCAB), rng.choice([0, 1, 2])) if lifecycle else []
    return {
        "request_id": f"r{i}",
        "prompt_token_ids": prompt,
        "max_tokens": max_tokens,
        "min_tokens": rng.choice([0, 0, 0, min(2, max_tokens), max_tokens]) if lifecycle else 0,
        "ignore_eos": lifecycle and rng.random() < 0.15,
        "stop_token_ids": stops,
        "priority": rng.randint(-2, 2) if config["scheduling_policy"] == "priority" else 0,
        "cache_salt": rng.choice([None, None, None, "a", "b"]),
        "arrival_step": rng.choice([0, 0, rng.randint(0, 12), rng.randint(0, 40)]),
        "output_token_ids": _script(rng, max_tokens, stops, lifecycle),
    }


def _drafts(rng: random.Random, script: list[int], k: int) -> list[list[int]]:
    """Item n: the drafts proposed once the request has n outputs, 0 to k tokens; a prefix of them (often all) is
    the script's next tokens, so a greedy verification accepts that prefix (EOS past the script's end)."""
    drafts = []
    for n in range(len(script) + 1):
        target = [*script[n : n + k], *[EOS_TOKEN_ID] * k][:k]
        length = rng.randint(0, k)
        accepted = length if rng.random() < 0.4 else rng.randint(0, length)
        wrong = [rng.choice(VOCAB) for _ in range(length - accepted)]
        if wrong and wrong[0] == target[accepted]:  # a rejection where one was drawn
            wrong[0] = VOCAB[(wrong[0] - VOCAB[0] + 1) % len(VOCAB)]
        drafts.append(target[:accepted] + wrong)
    return drafts


def _spec_schedule(rng: random.Random, k: int) -> list[list[int]] | None:
    """Half the time, a dynamic schedule: ranges from batch size 1 over the workloads' up to 12 requests, sometimes
    with gaps and a last range ending short (both carry the K before them), each K in 0..k + 1 (above k: capped)."""
    if rng.random() < 0.5:
        return None
    schedule, start = [], 1
    while start <= 12:
        end = start + rng.randint(0, 2)
        schedule.append([start, end, rng.randint(0, k + 1)])
        start = end + 1 + (rng.randint(1, 3) if rng.random() < 0.2 else 0)
    return schedule


def _remote(rng: random.Random, request: dict, block_size: int) -> None:
    """What the scripted connector says of a request: `remote_tokens` of its prompt stored elsewhere, loaded
    synchronously or not (`load_async`, landing `load_steps` steps after its blocks are allocated), and
    `send_steps`: its blocks held that long after it stops or reaches its length, while its KV is sent."""
    n = len(request["prompt_token_ids"])
    if n > 1 and rng.random() < 0.6:
        request["load_async"] = rng.random() < 0.6
        most = n if request["load_async"] else n - 1  # a synchronous load leaves the last token to compute
        aligned = (n - 1) // block_size * block_size  # ExampleConnector's: whole blocks of the prompt but its last
        request["remote_tokens"] = rng.choice([most, aligned, rng.randint(1, most)])
        request["load_steps"] = rng.choice([0, 1, 1, 2, 3, 5, 10])
    if rng.random() < 0.3:
        request["send_steps"] = rng.choice([1, 1, 2, 3, 6])


def _aborts(rng: random.Random, requests: list[dict]) -> dict[str, list[str]]:
    """Aborts at steps spread over the run: before arrival, waiting, running, preempted or finished (a no-op),
    and an id never added."""
    aborts: dict[str, list[str]] = {}
    for request in rng.sample(requests, rng.randint(0, max(1, len(requests) // 2))):
        step = request["arrival_step"] + rng.choice([-1, 0, 1, 2, 5, 10, 30])
        aborts.setdefault(str(max(step, 0)), []).append(request["request_id"])
    if rng.random() < 0.2:
        aborts.setdefault(str(rng.randint(0, 20)), []).append("never-added")
    return aborts


def make_workload(group: str, seed: int) -> dict[str, Any]:
    """The workload `seed` of coverage group `group`: the same dict on every machine and Python."""
    if group not in GROUPS:
        raise ValueError(f"group: must be one of {GROUPS}, got {group!r}")
    rng = random.Random(f"{group}-{seed}")
    config = {**_config(rng), "async_scheduling": group == "async"}
    if group == "connector":
        config["kv_connector"] = "scripted"  # each side's scripted connector (engine_side.py, vllm_driver.py)
    lifecycle = group in ("lifecycle", "async", "spec", "guided", "connector")
    if group == "spec":
        config["num_speculative_tokens"] = rng.randint(1, 4)
        schedule = _spec_schedule(random.Random(f"{group}-{seed}-schedule"), config["num_speculative_tokens"])
        if schedule:
            config["num_speculative_tokens_per_batch_size"] = schedule
    prefixes = [[rng.choice(VOCAB) for _ in range(config["max_model_len"])] for _ in range(rng.randint(0, 3))]
    requests = [_request(rng, i, config, prefixes, lifecycle) for i in range(rng.randint(1, 12))]
    for request in requests if group == "spec" else ():
        request["min_tokens"] = 0
        request["draft_token_ids"] = _drafts(rng, request["output_token_ids"], config["num_speculative_tokens"])
    for request in requests if group == "guided" else ():
        if rng.random() < 0.6:  # guided: its grammar is ready (or fails) this many steps after it arrives
            request["grammar_ready_step"] = request["arrival_step"] + rng.choice([0, 0, 1, 2, 3, 5, 10, 20])
            request["grammar_error"] = rng.random() < 0.1
    for request in requests if group == "connector" else ():
        _remote(rng, request, config["block_size"])
    return {
        "name": f"{group}-{seed}",
        "group": group,
        "seed": seed,
        "config": config,
        "eos_token_id": EOS_TOKEN_ID,
        "requests": requests,
        "aborts": _aborts(rng, requests) if lifecycle else {},
        "max_steps": 2000,
    }
