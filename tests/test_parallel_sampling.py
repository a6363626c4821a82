"""n > 1 (parallel sampling): n sequences from one prompt, sharing the prompt's KV blocks, each seeded child
reproducible alone, and the n first tokens distributed as the model's next-token distribution."""

from __future__ import annotations

import math

import pytest
import torch

from engine import LLM, SamplingParams
from tests.reference import hf_model
from tests.sample.test_sampler import chi_square, chi_square_critical

PROMPT = torch.randint(3, 49152, (37,), generator=torch.Generator().manual_seed(9)).tolist()


@pytest.fixture(scope="module")
def llm(tiny_model_path):
    return LLM(model=str(tiny_model_path), block_size=4, num_kv_blocks=1024, max_num_seqs=512, seed=0)


def test_children_share_the_prompts_blocks_and_output_together(llm):
    eng = llm.engine
    # The module's other tests run the same prompt, in any order under `--dist worksteal`: start with no cached block.
    assert eng.reset_prefix_cache()
    rid = eng.add_request(PROMPT, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=5, ignore_eos=True))
    children = eng.child_ids(rid)
    assert children == [f"{i}_{rid}" for i in range(3)]
    record = eng.step()
    assert set(record.scheduled) == set(children)
    tables = [eng.get_block_ids(c) for c in children]
    shared = (len(PROMPT) - 1) // 4  # the full prompt blocks a hit may cover (one token is always computed)
    assert tables[0][:shared] == tables[1][:shared] == tables[2][:shared]
    tails = [set(t[shared:]) for t in tables]  # each child writes its own last prompt token and outputs
    assert not (tails[0] & tails[1] or tails[0] & tails[2] or tails[1] & tails[2])
    hits = {e.request_id: e.num_hit_tokens for e in record.of_kind("prefix.lookup")}
    assert hits == {children[0]: 0, children[1]: shared * 4, children[2]: shared * 4}
    with pytest.raises(ValueError, match="each with its own block table"):
        eng.get_block_ids(rid)
    eng.run([rid])
    out = eng.pop_output(rid)
    assert out.finished and [c.index for c in out.outputs] == [0, 1, 2]
    assert out.token_ids == out.outputs[0].token_ids and all(len(c.token_ids) == 5 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # sampled, not copied
    # child i is the request with seed + i, alone
    alone = llm.generate(
        [PROMPT], SamplingParams(temperature=1.0, seed=8, max_tokens=5, ignore_eos=True), use_tqdm=False
    )[0]
    assert alone.token_ids == out.outputs[1].token_ids
    assert not eng.has_unfinished_requests()


def test_first_tokens_follow_the_models_distribution(llm, tiny_model_path):
    with torch.inference_mode():
        logits = hf_model(str(tiny_model_path))(torch.tensor([PROMPT])).logits[0, -1].float()
    # The model's five most likely tokens (a small support gives a chi-square test power with a few hundred
    # draws), at the temperature that makes the most likely ten times the least: spread, never degenerate.
    top = logits.topk(5)
    allowed, values = top.indices.tolist(), top.values
    temperature = float((values[0] - values[-1]) / math.log(10))
    target = (values / temperature).softmax(-1).tolist()
    n = 400
    out = llm.generate(
        [PROMPT], SamplingParams(n=n, temperature=temperature, max_tokens=1, allowed_token_ids=allowed), use_tqdm=False
    )[0]
    assert len(out.outputs) == n
    firsts = [c.token_ids[0] for c in out.outputs]
    counts = [firsts.count(t) for t in allowed]
    stat, df = chi_square(counts, target)
    assert stat < chi_square_critical(df)
    # and the check can fail: the uniform distribution over the same tokens is rejected
    assert chi_square(counts, [1 / len(allowed)] * len(allowed))[0] > chi_square_critical(df)


def test_abort_and_bad_n(llm):
    eng = llm.engine
    rid = eng.add_request(PROMPT, SamplingParams(n=2, max_tokens=50))
    eng.step()
    eng.abort(rid)
    out = eng.pop_output(rid)
    assert [c.finish_reason for c in out.outputs] == ["abort", "abort"]
    with pytest.raises(ValueError, match="n: must be >= 1"):
        SamplingParams(n=0)
    with pytest.raises(TypeError, match="n"):
        SamplingParams(n=2.0)
    eng.add_request(PROMPT, SamplingParams(n=2, max_tokens=1), request_id="x")
    with pytest.raises(ValueError, match="request_id: '0_x' is already in use"):
        eng.add_request(PROMPT, SamplingParams(max_tokens=1), request_id="0_x")
    eng.run()
    assert len(eng.pop_output("x").outputs) == 2
