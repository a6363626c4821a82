"""Greedy token ids equal transformers' greedy `generate` on the same weights, under every scheduler setting."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.model import resolve_model
from tests.reference import hf_greedy

TEXT = (
    "Paged attention stores the key and value vectors of every token in fixed-size blocks, so that "
    "memory is allocated on demand and shared between requests with a common prefix. "
)


@dataclass
class Case:
    path: Path
    prompts: list[list[int]]
    max_tokens: int
    expected: list[list[int]]


def _tiny_prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in (1, 7, 16, 33, 120, 310)]


def _smollm2_prompts(path: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    texts = [
        "Hi",
        "The capital of France is",
        "Write a short poem about the sea.\n",
        TEXT,
        TEXT * 3 + "In one sentence:",
        TEXT * 6 + "Summary:",
    ]
    return [tok.encode(t) for t in texts]


@pytest.fixture(scope="module", params=["tiny-llama", pytest.param("smollm2-135m", marks=pytest.mark.slow)])
def case(request) -> Case:
    path = resolve_model(request.param)
    if request.param == "tiny-llama":
        prompts, max_tokens = _tiny_prompts(), 24
    else:
        prompts, max_tokens = _smollm2_prompts(path), 16
    return Case(path, prompts, max_tokens, hf_greedy(path, prompts, max_tokens))


def _preempting_blocks(case: Case) -> int:
    # every prompt fits when admitted, but not their growth while decoding: running requests get preempted
    at_admission = sum(-(-len(p) // 16) for p in case.prompts)
    at_finish = sum(-(-(len(p) + len(out)) // 16) for p, out in zip(case.prompts, case.expected))
    assert at_finish - at_admission >= 2, "the workload must outgrow the cache"
    return (at_admission + at_finish) // 2 + 1  # + the null block


SETTINGS = {
    "defaults": lambda case: {},
    "block16_no_prefix_cache": lambda case: {"block_size": 16, "enable_prefix_caching": False},
    "block32": lambda case: {"block_size": 32},
    "chunked_budget32_threshold16": lambda case: {"max_num_batched_tokens": 32, "long_prefill_token_threshold": 16},
    "preemption": lambda case: {
        "block_size": 16,
        "num_kv_blocks": _preempting_blocks(case),
        "enable_prefix_caching": False,
    },  # shared prefixes would shrink the need
    "max_num_seqs_1": lambda case: {"max_num_seqs": 1},
    # vLLM 0.33's default: each step scheduled before the last one's tokens are back
    "async_scheduling": lambda case: {"async_scheduling": True, "max_num_batched_tokens": 32},
    "async_preemption": lambda case: {
        "async_scheduling": True,
        "block_size": 16,
        "enable_prefix_caching": False,
        "num_kv_blocks": _preempting_blocks(case),
    },
}


@pytest.mark.parametrize("setting", SETTINGS)
def test_greedy_matches_transformers(case: Case, setting: str) -> None:
    llm = LLM(model=str(case.path), **SETTINGS[setting](case))
    records = []
    llm.engine.subscribe(records.append)
    outs = llm.generate(case.prompts, SamplingParams(temperature=0.0, max_tokens=case.max_tokens), use_tqdm=False)
    for i, (out, expected) in enumerate(zip(outs, case.expected)):
        assert out.token_ids == expected, f"prompt {i} ({len(case.prompts[i])} tokens) differs under {setting}"
    kinds = [e.kind for r in records for e in r.events]
    if setting in ("preemption", "async_preemption"):
        assert "request.preempted" in kinds
    if setting == "chunked_budget32_threshold16":
        assert any(p == "chunk" for r in records for p in r.phases.values())
        assert max(sum(r.scheduled.values()) for r in records) <= 32
    assert llm.engine.kv_cache_manager.usage().used == 0


def test_prefix_caching_changes_nothing_but_the_work() -> None:
    """Long shared prefixes, chunked prefill and preemption: outputs identical with the cache on and off,
    and equal to transformers'."""
    path = resolve_model("tiny-llama")
    rng = random.Random(1)
    prefixes = [[rng.randrange(3, 49152) for _ in range(n)] for n in (100, 160, 37)]
    prompts = [prefixes[i % 3] + [rng.randrange(3, 49152) for _ in range(rng.randrange(1, 40))] for i in range(9)]
    expected = hf_greedy(path, prompts, 12)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    cached = {}
    for enable in (True, False):
        llm = LLM(
            model=str(path),
            block_size=16,
            max_num_batched_tokens=64,
            long_prefill_token_threshold=32,
            num_kv_blocks=20,
            enable_prefix_caching=enable,
        )
        records = []
        llm.engine.subscribe(records.append)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in outs] == expected, f"enable_prefix_caching={enable}"
        assert any(r.of_kind("request.preempted") for r in records)
        cached[enable] = sum(o.num_cached_tokens for o in outs)
        assert llm.engine.kv_cache_manager.usage().used == 0
    assert cached[True] >= 16 * 6 and cached[False] == 0
