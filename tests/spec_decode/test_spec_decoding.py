"""Speculative decoding: greedy outputs are identical with and without drafts, under every scheduler setting."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams, StructuredOutputsParams
from engine.config import SpeculativeConfig
from engine.model import resolve_model
from engine.spec_decode import PROPOSERS
from engine.spec_decode.decoder import proposer_class
from engine.spec_decode.ngram_proposer import NgramProposer
from engine.spec_decode.proposer import DraftRequest, Proposer

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
DRAFT = {"method": "draft_model", "model": "tiny-llama", "num_speculative_tokens": 4}


# ---- configuration ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec, field",
    [
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 3},
            "prompt_lookup_min",
        ),
        ({"method": "mtp", "num_speculative_tokens": 2}, "method"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "lookahead"),
    ],
)
def test_invalid_speculative_config_names_the_field(spec, field) -> None:
    with pytest.raises(ValueError, match=f"speculative_config.{field}"):
        EngineConfig(speculative_config=spec)


def test_an_unknown_method_is_refused_naming_the_known_ones() -> None:
    for refuse in (
        lambda: EngineConfig(speculative_config={"method": "mtp", "num_speculative_tokens": 2}),
        lambda: proposer_class(SpeculativeConfig("mtp", 2)),
    ):  # a config built by hand, unchecked
        with pytest.raises(ValueError, match="speculative_config.method") as error:
            refuse()
        assert "'mtp'" in str(error.value) and all(repr(method) in str(error.value) for method in PROPOSERS)


def test_proposers_are_chosen_by_method_name() -> None:
    assert {"ngram", "draft_model", "eagle", "medusa"} <= set(PROPOSERS)
    for method in PROPOSERS:
        cls = proposer_class(SpeculativeConfig(method, 2, model="tiny-llama"))
        assert issubclass(cls, Proposer) and cls.method == method


def test_min_tokens_with_speculative_decoding_is_refused_at_add_request() -> None:
    # min_tokens is the sampler's rule (EOS and the stop ids banned before it); the verification of drafts does not
    # apply it yet, so a request asking for it is refused rather than allowed to stop early
    engine = LLM(model="tiny-llama", num_kv_blocks=16, speculative_config=NGRAM).engine
    with pytest.raises(ValueError, match="min_tokens: not supported with speculative_config"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, min_tokens=2))
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=4))  # without it, accepted


def test_draft_model_with_another_vocabulary_is_refused(tmp_path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=1000,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    ).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(
            model="tiny-llama",
            num_kv_blocks=16,
            speculative_config={"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 2},
        )


# ---- the n-gram proposer ------------------------------------------------------------------------------
def test_ngram_takes_the_earliest_match_of_the_longest_window() -> None:
    p = NgramProposer(3, prompt_lookup_max=3, prompt_lookup_min=1)
    # suffix [1, 2, 3] occurs at 0 and 5: the earliest wins; the 3 tokens that followed it are proposed
    assert p.lookup([1, 2, 3, 7, 8, 1, 2, 3, 9, 1, 2, 3]) == [7, 8, 1]


def test_ngram_window_shrinks_until_a_match() -> None:
    p = NgramProposer(2, prompt_lookup_max=4, prompt_lookup_min=2)
    # no earlier [5, 6, 7, 8] nor [6, 7, 8]; [7, 8] occurs at 1
    assert p.lookup([4, 7, 8, 9, 10, 5, 6, 7, 8]) == [9, 10]
    assert p.lookup([4, 7, 9, 8]) == []  # nothing of length >= 2 repeats
    assert NgramProposer(2, 4, 1).lookup([4, 7, 9, 8, 1, 7]) == [9, 8]  # down to a window of one


def test_ngram_cuts_k_at_the_end() -> None:
    p = NgramProposer(5, prompt_lookup_max=2, prompt_lookup_min=2)
    assert p.lookup([1, 2, 3, 1, 2]) == [3, 1, 2]  # only 3 tokens follow the match
    assert p.lookup([1, 2, 3, 1, 2], k=2) == [3, 1]


def test_ngram_proposes_for_each_request_that_finds_a_match() -> None:
    p = NgramProposer(5, prompt_lookup_max=2, prompt_lookup_min=2)
    requests = [DraftRequest("a", [1, 2, 3, 1, 2], [1], 2, 0.0, None), DraftRequest("b", [4, 5, 6], [2], 2, 0.0, None)]
    assert p.propose(requests) == {"a": ([3, 1], None)}  # capped at its num_drafts; "b" has no match: left out


# ---- exactness ----------------------------------------------------------------------------------------
_TEXTS = [
    "Count: one two three four five six seven eight nine ten eleven twelve. Again: one two three",
    "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return",
    "The quick brown fox jumps over the lazy dog. " * 3 + "The quick",
    "Repeat after me: I like green apples and red cherries. I like green",
    "Paged attention stores keys and values in blocks. " * 6 + "Paged",
]


def _tiny_prompts() -> list[list[int]]:
    rng = random.Random(3)
    motif = [rng.randrange(3, 49152) for _ in range(7)]
    return [
        motif * 4 + [11],
        [rng.randrange(3, 49152) for _ in range(45)],
        motif * 2,
        [17] * 9,
        [rng.randrange(3, 49152) for _ in range(130)],
    ]


@functools.cache
def _prompts(model: str) -> tuple[tuple[int, ...], ...]:
    """N-gram lookup needs text that repeats itself, which a real model continues: smollm2 for n-gram; the
    draft model is checked on tiny-llama drafting for itself."""
    if model == "tiny-llama":
        return tuple(map(tuple, _tiny_prompts()))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model(model))
    return tuple(tuple(tok.encode(t)) for t in _TEXTS)


def _blocks_for_preemption(model: str, block_size: int, k: int) -> int:
    # every prompt (with its lookahead) fits when admitted; 24 more tokens each do not: running requests are
    # preempted. Each request alone still fits.
    prompts = _prompts(model)
    at_admission = sum(-(-(len(p) + k + 1) // block_size) for p in prompts)
    return at_admission + 8 + 1


def _settings(model: str, k: int) -> dict[str, dict]:
    return {
        "defaults": {},
        "block4_drafts_cross_blocks": {"block_size": 4},
        "chunked": {"max_num_batched_tokens": 24, "long_prefill_token_threshold": 16},
        "preemption": {
            "block_size": 4,
            "num_kv_blocks": _blocks_for_preemption(model, 4, k),
            "enable_prefix_caching": False,
        },
        "prefix_cache_and_preemption": {"block_size": 4, "num_kv_blocks": _blocks_for_preemption(model, 4, k)},
    }


SETTINGS = list(_settings("tiny-llama", 1))
CASES = {"ngram": ("smollm2-135m", NGRAM), "draft_model": ("tiny-llama", DRAFT)}
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@functools.cache
def _reference(model: str, setting: str, k: int) -> list[list[int]]:
    llm = LLM(model=model, **_settings(model, k)[setting])
    return [o.token_ids for o in llm.generate([list(p) for p in _prompts(model)], PARAMS, use_tqdm=False)]


@pytest.mark.parametrize("case", [pytest.param("ngram", marks=pytest.mark.slow), "draft_model"])
@pytest.mark.parametrize("setting", SETTINGS)
def test_greedy_is_identical_with_speculation(case, setting) -> None:
    model, spec = CASES[case]
    k = spec["num_speculative_tokens"]
    llm = LLM(model=model, speculative_config=spec, **_settings(model, k)[setting])
    records = []
    llm.engine.subscribe(records.append)
    outs = llm.generate([list(p) for p in _prompts(model)], PARAMS, use_tqdm=False)
    assert [o.token_ids for o in outs] == _reference(model, setting, k)
    phases = [p for r in records for p in r.phases.values()]
    assert "verify" in phases
    stats = llm.engine.spec_stats
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens >= stats.num_accepted_tokens
    if spec is DRAFT:  # the draft is the target itself: under greedy it is always right
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    if "preemption" in setting:
        assert any(r.of_kind("request.preempted") for r in records)
    assert llm.engine.kv_cache_manager.usage().used == 0


@pytest.mark.slow
def test_prefix_hits_on_blocks_filled_while_speculating() -> None:
    """Round two's prompts extend round one's outputs: they hit blocks filled during verification, which
    must hold the real tokens' KV only."""
    prompts = [list(p) for p in _prompts("smollm2-135m")]
    plain = LLM(model="smollm2-135m", block_size=4)
    spec = LLM(model="smollm2-135m", block_size=4, speculative_config=NGRAM)
    first = [o.token_ids for o in spec.generate(prompts, PARAMS, use_tqdm=False)]
    assert spec.engine.spec_stats.num_accepted_tokens > 0
    second = [p + out[:20] for p, out in zip(prompts, first)]
    got = spec.generate(second, PARAMS, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain.generate(second, PARAMS, use_tqdm=False)]
    assert all(o.num_cached_tokens >= len(p) - 4 for o, p in zip(got, prompts))


@pytest.mark.parametrize("spec", [NGRAM, DRAFT], ids=["ngram", "draft_model"])
def test_guided_requests_with_drafts(spec) -> None:
    """Drafts are validated by the matcher and masked per position: the same tokens as without drafts."""
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "yy"]}},
        "required": ["a", "b"],
    }
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema)),
        SamplingParams(
            temperature=0.0, max_tokens=30, structured_outputs=StructuredOutputsParams(regex="(ab|abc){2,6}")
        ),
    ]
    base = LLM(model="tiny-llama")
    # prompts that hold the grammar's own text, so n-gram lookup finds drafts the grammar accepts
    prompts = [
        base.tokenizer.encode('{"a": 12, "b": "yy"} {"a": 7, "b": "x"} ') * 2,
        base.tokenizer.encode("ababcabab abcab ab"),
    ]
    ref = base.generate(prompts, params, use_tqdm=False)
    llm = LLM(model="tiny-llama", speculative_config=spec)
    records = []
    llm.engine.subscribe(records.append)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert [o.finish_reason for o in outs] == [o.finish_reason for o in ref]
    if spec is NGRAM:
        assert any(r.of_kind("spec.verified") for r in records)


@pytest.mark.slow
def test_spec_events_describe_each_verification() -> None:
    llm = LLM(model="smollm2-135m", speculative_config=NGRAM)
    records = []
    llm.engine.subscribe(records.append)
    llm.generate(
        [list(_prompts("smollm2-135m")[0])],
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
        use_tqdm=False,
    )
    proposed = [e for r in records for e in r.of_kind("spec.proposed")]
    verified = [e for r in records for e in r.of_kind("spec.verified")]
    assert proposed and verified and proposed[0].method == "ngram"
    assert [e.draft_token_ids for e in verified] == [e.draft_token_ids for e in proposed][: len(verified)]
    for e in verified:
        n = sum(e.accepted)
        assert list(e.accepted) == [True] * n + [False] * (len(e.draft_token_ids) - n)  # a prefix stands
        assert e.bonus == (n == len(e.draft_token_ids)) and e.p_draft is None  # n-gram: no draft distribution


def test_random_sampling_with_drafts_is_seeded_and_valid() -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=5, max_tokens=20, ignore_eos=True)
    prompts = [list(p) for p in _prompts("tiny-llama")[:2]]
    a = LLM(model="tiny-llama", speculative_config=DRAFT).generate(prompts, params, use_tqdm=False)
    b = LLM(model="tiny-llama", speculative_config=DRAFT).generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(len(o.token_ids) == 20 for o in a)


@pytest.mark.parametrize("spec", [NGRAM, DRAFT], ids=["ngram", "draft_model"])
def test_a_prompt_at_max_model_len_stops_without_disturbing_the_batch(spec) -> None:
    # the first prompt leaves room for one token (the model's whole context: 4096): lookahead slots for its drafts
    # once took a block past the runner's block table, and the step failed for every request in it
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outputs = {}
    for name, config in (("none", None), ("spec", spec)):
        llm = LLM(model="tiny-llama", num_kv_blocks=300, speculative_config=config)
        limit = llm.engine.config.max_model_len
        prompts = [[5 + i % 4 for i in range(limit - 1)], [7 + i % 3 for i in range(10)]]
        outputs[name] = [(o.token_ids, o.finish_reason) for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.kv_cache_manager.block_pool.get_num_free_blocks() == 299  # no block leaks
    assert [(len(t), why) for t, why in outputs["spec"]] == [(1, "length"), (20, "length")]
    assert outputs["spec"] == outputs["none"]
