"""spec.verified says why each draft stood or fell: per position the draft's q and the target's p of the draft, the
target's top token, a sampled request's uniform draw, the tokens' text. Each decision is redone here from those
numbers alone (greedy: a draft stands iff it is the target's top token; sampled: iff u * q < p), for n-gram (no
draft distribution: q None, taken as 1; on smollm2, which continues repeating text) and EAGLE (a tiny head trained
on tiny-llama's answers, so that drafts both stand and fall)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.events import SpecVerified
from engine.spec_decode.proposer import DraftRequest, sample_drafts
from tests.spec_decode.test_eagle_medusa import K, _trained_head
from tests.spec_decode.test_spec_decoding import NGRAM, _prompts


@pytest.fixture(scope="module")
def eagle_head(tmp_path_factory) -> str:
    return _trained_head("eagle", str(tmp_path_factory.mktemp("heads")))


def _verified(model: str, spec: dict, temperature: float) -> tuple[list[SpecVerified], object]:
    llm = LLM(model=model, speculative_config=spec, seed=0)
    records = []
    llm.engine.subscribe(records.append)
    prompts = [list(p) for p in _prompts(model)]
    params = [
        SamplingParams(temperature=temperature, max_tokens=24, ignore_eos=True, seed=i if temperature else None)
        for i in range(len(prompts))
    ]
    llm.generate(prompts, params, use_tqdm=False)
    return [e for r in records for e in r.of_kind("spec.verified")], llm.tokenizer


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize("method", [pytest.param("ngram", marks=pytest.mark.slow), "eagle"])
def test_each_decision_follows_from_the_event(method, temperature, request) -> None:
    if method == "ngram":
        verified, tok = _verified("smollm2-135m", NGRAM, temperature)
    else:
        head = request.getfixturevalue("eagle_head")
        verified, tok = _verified(
            "tiny-llama", {"method": "eagle", "model": head, "num_speculative_tokens": K}, temperature
        )
    assert verified
    greedy, verdicts = temperature == 0.0, set()
    for e in verified:
        n = len(e.draft_token_ids)
        assert e.rule == ("greedy" if greedy else "sampled") and e.method == method
        assert e.draft_texts == tuple(tok.decode([t]) for t in e.draft_token_ids)
        assert e.emitted_text == tok.decode([e.emitted_token])
        assert len(e.p_target) == len(e.target_argmax) == n and len(e.uniform_probs) == (0 if greedy else n)
        if method == "ngram":
            assert e.p_draft is None  # no draft distribution
        else:
            assert len(e.p_draft) == n and all(0 < q <= 1 for q in e.p_draft)
        q = e.p_draft or (1.0,) * n
        num_accepted = sum(e.accepted)
        for i in range(min(num_accepted + 1, n)):  # the accepted prefix and the first rejection were judged
            stands = e.draft_token_ids[i] == e.target_argmax[i] if greedy else e.uniform_probs[i] * q[i] < e.p_target[i]
            assert stands == e.accepted[i], (e, i)
            verdicts.add(stands)
        if greedy and not e.bonus:  # greedy recovers with the target's top token
            assert e.emitted_token == e.target_argmax[num_accepted]
    assert verdicts == {True, False}  # drafts stood and fell: both paths were checked


def test_greedy_drafts_carry_their_confidence() -> None:
    """A greedy draft is the argmax, and its distribution is at temperature 1 (not a point mass): what a learner
    compares with the target's p, also at temperature 1 for greedy requests. Sampled rows keep their temperature."""
    logits = torch.tensor([[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]])
    inputs = [DraftRequest("g", [1], [0], 1, 0.0, None), DraftRequest("s", [1], [0], 1, 0.5, None)]
    drafts, dist = sample_drafts(logits, inputs, torch.Generator().manual_seed(0))
    assert drafts[0] == 2
    torch.testing.assert_close(dist[0], torch.softmax(logits[0], dim=-1))
    torch.testing.assert_close(dist[1], torch.softmax(logits[1] / 0.5, dim=-1))
