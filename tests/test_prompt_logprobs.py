"""prompt_logprobs: every prompt token's logprob and top-n equal a Hugging Face forward over the prompt, however the
prompt is chunked, with prefix caching on (the request then skips the cache), and after a preemption."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.reference import hf_model

PROMPT = torch.randint(3, 49152, (37,), generator=torch.Generator().manual_seed(5)).tolist()
TOP = 3


@pytest.fixture(scope="module")
def expected(tiny_model_path) -> torch.Tensor:
    with torch.inference_mode():
        logits = hf_model(str(tiny_model_path))(torch.tensor([PROMPT])).logits[0].float()
    return logits.log_softmax(-1)  # row p predicts prompt token p + 1


def check(prompt_logprobs: list, expected: torch.Tensor) -> None:
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(PROMPT)
    for position, entry in enumerate(prompt_logprobs[1:]):
        token = PROMPT[position + 1]
        row = expected[position]
        ids = list(entry)
        assert ids[0] == token and entry[token] == pytest.approx(row[token].item(), abs=1e-4)
        top = row.topk(TOP)
        assert set(ids[1:]) <= set(top.indices.tolist()) and len(entry) >= TOP
        for t in top.indices.tolist():
            assert entry[t] == pytest.approx(row[t].item(), abs=1e-4)


@pytest.mark.parametrize("budget", [512, 8], ids=["one_prefill", "chunks_of_8"])
def test_prompt_logprobs_equal_a_transformers_forward(tiny_model_path, expected, budget):
    llm = LLM(model=str(tiny_model_path), block_size=4, max_num_batched_tokens=budget, num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=TOP)
    first, again = llm.generate([PROMPT, PROMPT], params, use_tqdm=False)
    check(first.prompt_logprobs, expected)
    check(again.prompt_logprobs, expected)  # computed again: a prefix hit has no logits to give
    assert again.num_cached_tokens == 0
    plain = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None and plain.num_cached_tokens > 0  # others still hit the cache


def test_prompt_logprobs_survive_a_preemption(tiny_model_path, expected):
    # Too few blocks for both requests to finish together: one is preempted and prefilled again.
    llm = LLM(model=str(tiny_model_path), block_size=4, max_num_batched_tokens=16, num_kv_blocks=22)
    records = []
    llm.engine.subscribe(records.append)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, prompt_logprobs=TOP)
    outs = llm.generate([PROMPT, PROMPT[:30]], params, use_tqdm=False)
    assert any(r.of_kind("request.preempted") for r in records)
    check(outs[0].prompt_logprobs, expected)
    assert len(outs[1].prompt_logprobs) == 30


def test_negative_prompt_logprobs_is_refused():
    with pytest.raises(ValueError, match="prompt_logprobs: must be >= 0"):
        SamplingParams(prompt_logprobs=-1)
