"""Speculative decoding on the scripted executor, as `workbench fidelity`'s spec group drives it: a ScriptedModel's
drafts verified greedily against its tokens, and the two rules of vLLM 0.33 the harness found the scheduler
missing (n-gram drafts take no lookahead slots; blocks filled by accepted drafts are cached after the step)."""

import pytest

from engine import LLMEngine, SamplingParams
from engine.executor.scripted import ScriptedModel

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


def _engine(drafts: dict, speculative_config: dict | None = NGRAM, **kwargs) -> LLMEngine:
    tokens = {"a": [10, 11, 12, 13, 14, 15, 16, 17]}
    return LLMEngine(
        executor="scripted",
        token_script=ScriptedModel(tokens, drafts),
        speculative_config=speculative_config,
        num_kv_blocks=16,
        block_size=4,
        max_model_len=64,
        **kwargs,
    )


def test_drafts_are_verified_greedily_against_the_script():
    # after 1 output: drafts 11 12 99 (two right, then wrong): 11 12 accepted, 13 recovered; after 4: all three
    # right, 14 15 16 accepted and 17 the bonus; then no drafts, and EOS (past the script) ends it
    engine = _engine({"a": [[], [11, 12, 99], [], [], [14, 15, 16]]})
    engine.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=20), request_id="a")
    engine.step()  # the prompt: samples 10, then drafts [11, 12, 99]
    record = engine.step()
    (verified,) = [e for e in record.events if e.kind == "spec.verified"]
    assert (verified.draft_token_ids, verified.accepted, verified.emitted_token) == (
        (11, 12, 99),
        (True, True, False),
        13,
    )
    assert record.scheduled == {"a": 4} and record.phases == {"a": "verify"}
    assert engine.get_output("a").token_ids == [10, 11, 12, 13]
    record = engine.step()
    (verified,) = [e for e in record.events if e.kind == "spec.verified"]
    assert verified.accepted == (True, True, True) and verified.bonus and verified.emitted_token == 17
    assert engine.step().phases == {"a": "decode"}
    out = engine.get_output("a")
    assert (out.token_ids, out.finish_reason) == ([10, 11, 12, 13, 14, 15, 16, 17, 2], "stop")


def test_ngram_drafts_take_no_lookahead_slots_and_draft_models_do():
    # vLLM 0.33's num_lookahead_tokens: K for draft models and EAGLE, whose proposers write the drafts' KV before
    # they are verified; 0 for n-gram (and Medusa). 6 prompt tokens in blocks of 4: 2 blocks, 3 with 3 lookahead
    for method, blocks in (("ngram", 2), ("draft_model", 2 + 1)):
        config = {**NGRAM, "method": method} | ({"model": "tiny-llama"} if method == "draft_model" else {})
        engine = _engine({}, config)
        assert engine.scheduler.num_lookahead_tokens == (0 if method == "ngram" else 3)
        engine.add_request([1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=20), request_id="a")
        engine.scheduler.schedule()
        assert len(engine.kv_cache_manager.get_block_ids("a")) == blocks


def test_blocks_filled_by_accepted_drafts_are_cached_after_the_step():
    # vLLM caches the blocks a verification filled once it knows what was accepted: the drafts were scheduled as
    # tokens of no known value, so allocate_slots could not cache them
    engine = _engine({"a": [[], [11, 12, 13]]})
    engine.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=20), request_id="a")
    engine.step()  # 5 prompt tokens: block 1 full (cached), block 2 holds 1 token
    assert [b.block_hash is not None for b in engine.kv_cache_manager.req_to_blocks["a"]] == [True, False]
    engine.step()  # 10 11 12 13 verified (all accepted) and 14 emitted: positions 5-8 computed, block 2 full
    assert engine.get_output("a").token_ids == [10, 11, 12, 13, 14]
    assert [b.block_hash is not None for b in engine.kv_cache_manager.req_to_blocks["a"]] == [True, True, False]


def test_the_simulated_executor_drafts_only_from_a_script():
    with pytest.raises(ValueError, match="speculative_config: not supported by the simulated executor without"):
        LLMEngine(executor="simulated", hardware="cpu", speculative_config=NGRAM)
