"""Hand-made workloads, one per rule that vLLM 0.33 changed since the seeds' article, each small enough to read step
by step. `workbench fidelity record` writes vLLM's traces of them (group "lessons"), and notebook 11 runs each
through this engine, shows it, and asserts the rule on vLLM's own recorded decisions.
"""

from __future__ import annotations

from typing import Any

from workbench.fidelity.workload import EOS_TOKEN_ID

_CONFIG = {
    "block_size": 4,
    "num_blocks": 11,
    "max_num_batched_tokens": 64,
    "max_num_seqs": 8,
    "max_model_len": 40,
    "enable_chunked_prefill": True,
    "enable_prefix_caching": True,
    "long_prefill_token_threshold": 0,
    "scheduling_policy": "fcfs",
    "prefix_caching_hash_algo": "sha256_cbor",
}


def _request(
    rid: str, prompt: list[int], max_tokens: int, arrival_step: int = 0, script: list[int] | None = None
) -> dict[str, Any]:
    return {
        "request_id": rid,
        "prompt_token_ids": prompt,
        "max_tokens": max_tokens,
        "min_tokens": 0,
        "ignore_eos": False,
        "stop_token_ids": [],
        "priority": 0,
        "cache_salt": None,
        "arrival_step": arrival_step,
        "output_token_ids": script or [7] * max_tokens,
    }


def _lesson(name: str, requests: list[dict], **config: Any) -> dict[str, Any]:
    return {
        "name": f"lessons-{name}",
        "group": "lessons",
        "seed": list(LESSON_NAMES).index(name),
        "config": {**_CONFIG, **config},
        "eos_token_id": EOS_TOKEN_ID,
        "requests": requests,
        "aborts": {},
        "max_steps": 100,
    }


LESSON_NAMES = {
    "free-queue": "a finished request's uncached tail block is reused first (LIFO); its cached block waits at the "
    "tail (LRU)",
    "lone-request": "long_prefill_token_threshold cuts nobody when one request is alone; two requests are cut",
    "whole-sequence": "a waiting request is admitted only once its whole prompt fits, not just its first chunk",
    "eos-at-max-tokens": "an EOS sampled as the last allowed token finishes with 'stop', not 'length'",
}


def make_lesson(index: int) -> dict[str, Any]:
    """The lesson workload number `index` (the order of LESSON_NAMES)."""
    name = list(LESSON_NAMES)[index]
    if name == "free-queue":
        # a: 6 prompt tokens + 1 output = block 1 (full: cached) and block 2 (partial: no hash); b comes later
        return _lesson(name, [_request("a", list(range(10, 16)), 1), _request("b", [40, 41, 42], 2, 3)])
    if name == "lone-request":
        # a alone: its 24 tokens in one step; then b and c together: 8 tokens each per step
        return _lesson(
            name,
            [
                _request("a", list(range(10, 34)), 1),
                _request("b", list(range(50, 74)), 1, 3),
                _request("c", list(range(80, 104)), 1, 3),
            ],
            long_prefill_token_threshold=8,
        )
    if name == "whole-sequence":
        # 10 usable blocks of 4; a holds 7 of them; b's first chunk (8 tokens, 2 blocks) would fit the 3 free
        # blocks, but its 16-token prompt needs 4: it waits for a to finish
        return _lesson(
            name,
            [_request("a", list(range(10, 34)), 4), _request("b", list(range(50, 66)), 2, 1)],
            max_num_batched_tokens=8,
        )
    if name == "eos-at-max-tokens":
        return _lesson(name, [_request("a", [10, 11, 12], 2, script=[7, EOS_TOKEN_ID])])
    raise ValueError(f"lesson: {name!r} is not one of {list(LESSON_NAMES)}")
