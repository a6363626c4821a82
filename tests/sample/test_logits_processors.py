"""The logits options (vLLM's SamplingParams): each against its definition or transformers' logits processor on
the same logits, through the sampler, validated with errors naming the field, and end to end on the tiny model."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from engine import LLM, SamplingParams
from engine.request import Request
from engine.sample.logits_processors import LogitsInputs, bad_words_token_ids
from engine.sample.sampler import Sampler, argmax_only
from tests.sample.test_sampler import chi_square, chi_square_critical, make_metadata, softmax

V = 64
CPU = torch.device("cpu")


def random_logits(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3  # both signs: the rule differs


def requests(params: list[SamplingParams], prompts: list[list[int]], outputs: list[list[int]]) -> list[Request]:
    out = []
    for i, (p, prompt, output) in enumerate(zip(params, prompts, outputs)):
        r = Request(str(i), prompt, p, eos_token_id=None)
        for t in output:
            r.append_output_token_ids(t)
        out.append(r)
    return out


def processed(params, prompts, outputs, logits, bad_words=None) -> torch.Tensor:
    reqs = requests(params, prompts, outputs)
    for r, words in zip(reqs, bad_words or [[] for _ in reqs]):
        r.bad_words_token_ids = words
    inputs = LogitsInputs.from_requests(reqs, CPU)
    return inputs.apply(logits.clone())


PROMPTS = [[1, 5, 5, 9], [3, 4], [7, 8, 9, 10, 11]]
OUTPUTS = [[5, 12, 12, 40], [4, 4, 4], []]


def test_repetition_penalty_equals_transformers():
    logits = random_logits(3, 0)
    penalties = [1.3, 0.7, 2.0]
    got = processed([SamplingParams(repetition_penalty=p) for p in penalties], PROMPTS, OUTPUTS, logits)
    for row, penalty in enumerate(penalties):
        # transformers penalises every token of input_ids: the prompt and what was generated
        ids = torch.tensor([PROMPTS[row] + OUTPUTS[row]])
        expected = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits[row : row + 1].clone())[0]
        torch.testing.assert_close(got[row], expected, rtol=0, atol=0)
    assert not torch.equal(got, logits)


def test_frequency_and_presence_penalties_follow_their_definition():
    logits = random_logits(3, 1)
    params = [
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(frequency_penalty=-1.0),
        SamplingParams(presence_penalty=2.0),
    ]
    got = processed(params, PROMPTS, OUTPUTS, logits)
    for row, p in enumerate(params):
        for token in range(V):
            count = OUTPUTS[row].count(token)  # output tokens only, as OpenAI and vLLM define them
            expected = logits[row, token] - p.frequency_penalty * count - p.presence_penalty * (count > 0)
            assert got[row, token].item() == pytest.approx(expected.item(), abs=1e-6)


def test_logit_bias_equals_transformers_sequence_bias():
    logits = random_logits(2, 2)
    biases = [{3: 5.0, 17: -100.0}, {0: 0.5}]
    got = processed([SamplingParams(logit_bias=b) for b in biases], PROMPTS[:2], OUTPUTS[:2], logits)
    for row, bias in enumerate(biases):
        hf = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})
        expected = hf(torch.tensor([PROMPTS[row]]), logits[row : row + 1].clone())[0]
        torch.testing.assert_close(got[row], expected, rtol=0, atol=0)


def test_bad_words_equal_transformers():
    logits = random_logits(2, 3)
    words = [[[12, 40, 7], [9], [12, 50]], [[4, 4, 8], [4, 5]]]
    got = processed([SamplingParams(bad_words=["x"])] * 2, PROMPTS[:2], OUTPUTS[:2], logits, bad_words=words)
    for row in range(2):
        # vLLM matches against the output only: give transformers the same history
        hf = NoBadWordsLogitsProcessor(words[row], eos_token_id=63)
        expected = hf(torch.tensor([OUTPUTS[row]]), logits[row : row + 1].clone())[0]
        torch.testing.assert_close(got[row], expected, rtol=0, atol=0)
    assert got[0, 7] == float("-inf") and got[0, 9] == float("-inf") and got[0, 50] > float("-inf")
    assert got[1, 8] == float("-inf") and got[1, 5] == float("-inf")


def test_allowed_token_ids_keep_only_those_and_sample_their_renormalised_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 3.0]])
    allowed = [1, 2, 4]
    draws = 20000
    params = SamplingParams(allowed_token_ids=allowed)
    reqs = requests([params] * draws, [[0]] * draws, [[]] * draws)
    md = make_metadata([1.0] * draws, default_generator=torch.Generator().manual_seed(7))
    md.logits_inputs = LogitsInputs.from_requests(reqs, CPU)
    out = Sampler()(logits.repeat(draws, 1), md)
    counts = torch.bincount(out.sampled_token_ids, minlength=6).tolist()
    assert sum(counts[t] for t in allowed) == draws
    z = logits[0].tolist()
    target = softmax([z[i] if i in allowed else -float("inf") for i in range(6)])
    stat, df = chi_square(counts, target)
    assert stat < chi_square_critical(df)
    # logprobs stay the raw model's (vLLM's default), not those of the masked distribution
    md = make_metadata([1.0], default_generator=torch.Generator().manual_seed(7), max_num_logprobs=0)
    md.logits_inputs = LogitsInputs.from_requests(reqs[:1], CPU)
    out = Sampler()(logits, md)
    token = out.sampled_token_ids.item()
    assert token in allowed
    assert out.logprobs.logprobs[0, 0].item() == pytest.approx(logits[0].log_softmax(-1)[token].item(), abs=1e-6)


def test_a_batch_without_options_builds_nothing_and_plain_rows_stay_untouched():
    plain = requests([SamplingParams()] * 2, PROMPTS[:2], OUTPUTS[:2])
    assert LogitsInputs.from_requests(plain, CPU) is None
    logits = random_logits(2, 4)
    got = processed([SamplingParams(), SamplingParams(repetition_penalty=1.5)], PROMPTS[:2], OUTPUTS[:2], logits)
    assert torch.equal(got[0], logits[0]) and not torch.equal(got[1], logits[1])


@pytest.mark.parametrize(
    "option",
    [
        {"logprobs": 0},
        {"min_tokens": 1},
        {"repetition_penalty": 1.2},
        {"frequency_penalty": 0.5},
        {"presence_penalty": 0.5},
        {"logit_bias": {3: 1.0}},
        {"allowed_token_ids": [3]},
        {"bad_words": ["x"]},
        {"temperature": 0.5},
    ],
)
def test_only_a_plain_greedy_request_skips_the_sampler(option):
    # the runner takes the argmax alone for a step whose every request is argmax_only: anything it would skip must
    # send the step through the sampler
    assert argmax_only(SamplingParams(temperature=0.0))
    assert argmax_only(SamplingParams(temperature=0.0, seed=3, max_tokens=5))
    assert not argmax_only(SamplingParams(**{"temperature": 0.0, **option}))


def test_min_tokens_bans_eos_and_the_stop_ids_until_that_many_tokens_are_out():
    # vLLM 0.33's MinTokensLogitsProcessor: min_tokens is the sampler's rule, not the scheduler's. EOS (2 here)
    # and the stop token ids get -inf while fewer than min_tokens tokens are out (EOS even with ignore_eos)
    eos, stop = 2, 9
    params = [
        SamplingParams(max_tokens=8, min_tokens=3, stop_token_ids=[stop]),
        SamplingParams(max_tokens=8, min_tokens=3, stop_token_ids=[stop]),
        SamplingParams(max_tokens=8, min_tokens=3, ignore_eos=True),
        SamplingParams(max_tokens=8, stop_token_ids=[stop]),
    ]
    outputs = [[5, 6], [5, 6, 7], [5], [5]]
    reqs = []
    for i, (p, output) in enumerate(zip(params, outputs)):
        r = Request(str(i), [1, 3], p, eos_token_id=eos)
        for t in output:
            r.append_output_token_ids(t)
        reqs.append(r)
    logits = random_logits(4, 7)
    logits[:, eos], logits[:, stop] = 50.0, 40.0  # the most likely tokens in every row
    got = LogitsInputs.from_requests(reqs, CPU).apply(logits.clone())
    assert got[0, eos] == got[0, stop] == float("-inf")  # two tokens out, three asked: both banned
    assert torch.equal(got[1], logits[1])  # three out: free to stop
    assert got[2, eos] == float("-inf") and got[2, stop] == 40.0  # no stop ids of its own; EOS despite ignore_eos
    assert torch.equal(got[3], logits[3])  # no min_tokens
    # the greedy choice moves off EOS and the stop id only where they are banned
    assert got.argmax(-1).tolist()[1:] == [eos, stop, eos]
    assert got[0].argmax().item() not in (eos, stop)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"presence_penalty": 2.5}, ValueError, r"presence_penalty: must be in \[-2, 2\]"),
        ({"frequency_penalty": -3}, ValueError, r"frequency_penalty: must be in \[-2, 2\]"),
        ({"frequency_penalty": "1"}, TypeError, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, ValueError, "repetition_penalty: must be > 0"),
        ({"logit_bias": {3: 101}}, ValueError, r"logit_bias\[3\]: must be in \[-100, 100\]"),
        ({"logit_bias": {"3": 1.0}}, TypeError, "logit_bias"),
        ({"logit_bias": [3]}, TypeError, "logit_bias"),
        ({"bad_words": ["ok", ""]}, ValueError, "bad_words: must be a list of non-empty strings"),
        ({"bad_words": "word"}, TypeError, "bad_words"),
        ({"allowed_token_ids": []}, ValueError, "allowed_token_ids: must not be empty"),
        ({"allowed_token_ids": [1, -2]}, ValueError, "allowed_token_ids: token ids must be >= 0"),
        ({"allowed_token_ids": [1, True]}, TypeError, "allowed_token_ids"),
    ],
)
def test_bad_values_name_the_field(kwargs, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)


# ---- end to end on the tiny model --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_model_path):
    return LLM(model=str(tiny_model_path), num_kv_blocks=128, seed=0)


PROMPT = [5, 9, 5, 9, 5, 9, 33, 34, 35]


def test_greedy_with_repetition_penalty_equals_transformers_generate(llm, tiny_model_path):
    from tests.reference import hf_model

    hf = hf_model(str(tiny_model_path))
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        expected = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=16,
            repetition_penalty=1.8,
            pad_token_id=2,
        )[0, len(PROMPT) :].tolist()
    got = llm.generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=1.8), use_tqdm=False
    )[0].token_ids
    assert got == expected
    plain = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0].token_ids
    assert plain != got  # the penalty changed something: the comparison above can fail


def test_bad_words_and_allowed_ids_and_bias_steer_generation(llm):
    tokenizer, vocab = llm.engine.tokenizer, llm.engine.runner.vocab_size
    the, space_the = bad_words_token_ids(["the"], tokenizer, vocab)  # "the" and " the": one token each

    def greedy(**kwargs) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, **kwargs)
        return llm.generate([PROMPT], params, use_tqdm=False)[0].token_ids

    assert greedy(logit_bias={space_the[0]: 100.0}) == [space_the[0]] * 6  # the bias alone wins every step
    avoided = greedy(logit_bias={space_the[0]: 100.0, the[0]: 100.0}, bad_words=["the"])
    assert the[0] not in avoided and space_the[0] not in avoided
    # (multi-token words are checked against transformers above)
    allowed = [100, 200, 300]
    sampled = llm.generate(
        [PROMPT],
        SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed),
        use_tqdm=False,
    )[0]
    assert set(sampled.token_ids) <= set(allowed) and len(set(sampled.token_ids)) > 1


def test_token_ids_outside_the_vocabulary_are_refused_at_add_request(llm):
    vocab = llm.engine.runner.vocab_size
    with pytest.raises(ValueError, match=rf"allowed_token_ids: token id {vocab} is outside the vocabulary"):
        llm.engine.add_request(PROMPT, SamplingParams(allowed_token_ids=[1, vocab]))
    with pytest.raises(ValueError, match=r"logit_bias: token id -1 is outside the vocabulary"):
        llm.engine.add_request(PROMPT, SamplingParams(logit_bias={-1: 1.0}))
    assert not llm.engine.has_unfinished_requests()
