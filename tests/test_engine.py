"""The engine's public API on the tiny model: bad input, isolation of failures, seeds, stops, events."""

from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, EngineConfig, LLMEngine, SamplingParams, StepRecord


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="tiny-llama", block_size=16, num_kv_blocks=64, max_model_len=512)


def _drain(engine: LLMEngine) -> list[StepRecord]:
    records = []
    while engine.has_unfinished_requests():
        records.append(engine.step())
    return records


# ---- bad input ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, exc, field",
    [
        ({"max_tokens": 0}, ValueError, "max_tokens"),
        ({"temperature": -0.5}, ValueError, "temperature"),
        ({"top_p": 0.0}, ValueError, "top_p"),
        ({"top_p": 1.5}, ValueError, "top_p"),
        ({"top_k": -3}, ValueError, "top_k"),
        ({"min_p": 2.0}, ValueError, "min_p"),
        ({"max_tokens": "8"}, TypeError, "max_tokens"),
        ({"min_tokens": 9, "max_tokens": 4}, ValueError, "min_tokens"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, exc, field) -> None:
    with pytest.raises(exc, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, exc, field",
    [
        ({"block_size": 12}, ValueError, "block_size"),
        ({"max_num_batched_tokens": 0}, ValueError, "max_num_batched_tokens"),
        ({"scheduling_policy": "lifo"}, ValueError, "scheduling_policy"),
        ({"prefix_caching_hash_algo": "md5"}, ValueError, "prefix_caching_hash_algo"),
        ({"max_num_seqs": 1.5}, TypeError, "max_num_seqs"),
        ({"num_kv_blocks": 1}, ValueError, "num_kv_blocks"),
        ({"kv_cache_dtype": "fp8"}, ValueError, "kv_cache_dtype"),
        ({"kv_cache_dtype": "bfloat16", "device": "cuda", "dtype": "float16"}, ValueError, "kv_cache_dtype"),
        ({"no_such_knob": 1}, TypeError, "no_such_knob"),
    ],
)
def test_bad_config_names_the_field(kwargs, exc, field) -> None:
    with pytest.raises(exc, match=field):
        EngineConfig.from_kwargs(**kwargs)


def test_unknown_model_is_refused() -> None:
    with pytest.raises(ValueError, match="model: unknown model 'no-such-model'"):
        LLM(model="no-such-model")
    with pytest.raises(ValueError, match="model"):
        LLM(model="/nonexistent/folder")


@pytest.mark.parametrize(
    "prompt, exc, field",
    [
        ("", ValueError, "prompt: must not be empty"),
        ([], ValueError, "prompt: must not be empty"),
        ([1, 2, "x"], TypeError, "prompt: token ids must be int"),
        ([1, 2.5], TypeError, "prompt: token ids must be int"),
        ([1, 10**9], ValueError, "outside the vocabulary"),
        (list(range(3, 600)), ValueError, "max_model_len is 512"),
        (12, TypeError, "prompt"),
    ],
)
def test_bad_prompt_is_refused_and_others_go_on(llm: LLM, prompt, exc, field) -> None:
    engine = llm.engine
    ok = engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=4))
    with pytest.raises(exc, match=field):
        engine.add_request(prompt, SamplingParams(max_tokens=4))
    _drain(engine)
    out = engine.pop_output(ok)
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    assert engine.kv_cache_manager.usage().used == 0


def test_request_that_cannot_fit_the_cache_is_refused() -> None:
    small = LLM(model="tiny-llama", num_kv_blocks=5, block_size=16)  # 4 usable blocks = 64 tokens
    with pytest.raises(ValueError, match="KV blocks"):
        small.engine.add_request(list(range(3, 60)), SamplingParams(max_tokens=16))


def test_bad_prompt_in_a_batch_refuses_the_batch_cleanly(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[5, 6], []], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv_cache_manager.usage().used == 0


# ---- sampling --------------------------------------------------------------------------------
def test_seeded_sampling_is_reproducible_across_batch_compositions(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    other = SamplingParams(temperature=0.8, max_tokens=7, ignore_eos=True)
    alone = llm.generate([[11, 12, 13, 14]], seeded, use_tqdm=False)[0].token_ids
    crowd = llm.generate([[5] * 40, [11, 12, 13, 14], [9, 8, 7]], [other, seeded, other], use_tqdm=False)
    assert crowd[1].token_ids == alone
    first = llm.generate([[11, 12, 13, 14], [5] * 3], [seeded, other], use_tqdm=False)[0].token_ids
    assert first == alone
    different = llm.generate(
        [[11, 12, 13, 14]], SamplingParams(temperature=1.0, seed=99, max_tokens=12, ignore_eos=True), use_tqdm=False
    )
    assert different[0].token_ids != alone


def test_logprobs_of_sampled_tokens(llm: LLM) -> None:
    out = llm.generate([[4, 5, 6]], SamplingParams(temperature=0, max_tokens=3, logprobs=2), use_tqdm=False)[0]
    assert len(out.logprobs) == 3
    for token, lp in zip(out.token_ids, out.logprobs):
        assert token in lp and len(lp) >= 2
        assert lp[token] == max(lp.values())  # greedy: the sampled token is the most likely one


# ---- stops -------------------------------------------------------------------------------------
def _greedy_tokens(llm: LLM, prompt: list[int], n: int) -> list[int]:
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)[
        0
    ].token_ids


def test_stop_token_ids_and_min_tokens(llm: LLM) -> None:
    prompt = [21, 22, 23]
    free = _greedy_tokens(llm, prompt, 10)
    stop_at = free[3]
    first = free.index(stop_at)
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_at]), use_tqdm=False
    )[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    assert out.token_ids == free[: first + 1]
    later = [i for i, t in enumerate(free) if t == stop_at and i + 1 > first + 1]
    out = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_at], min_tokens=first + 2),
        use_tqdm=False,
    )[0]
    assert len(out.token_ids) == (later[0] + 1 if later else 10)


def test_eos_stops_unless_ignored() -> None:
    llm = LLM(model="tiny-llama", num_kv_blocks=32)
    prompt = [30, 31, 32]
    free = _greedy_tokens(llm, prompt, 6)
    llm.engine.eos_token_id = free[2]  # make the third greedy token the EOS of this engine
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.token_ids == free[: free.index(free[2]) + 1]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    assert out.finish_reason == "length" and out.token_ids == free


def test_stop_string_is_cut_from_the_text(llm: LLM) -> None:
    prompt = [40, 41, 42]
    text = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), f"pick a visible stop string from {text!r}"
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, stop=[stop], ignore_eos=True), use_tqdm=False
    )[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    kept = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=12, stop=stop, ignore_eos=True, include_stop_str_in_output=True),
        use_tqdm=False,
    )[0]
    assert kept.text == text[: text.index(stop) + len(stop)]


def test_max_model_len_caps_the_output() -> None:
    llm = LLM(model="tiny-llama", num_kv_blocks=16, max_model_len=20)
    out = llm.generate(
        [list(range(3, 18))], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), use_tqdm=False
    )[0]
    assert out.finish_reason == "length" and len(out.prompt_token_ids) + len(out.token_ids) == 20


# ---- abort and isolation --------------------------------------------------------------------------
def test_abort_in_every_state_frees_everything() -> None:
    engine = LLM(model="tiny-llama", num_kv_blocks=64, max_num_batched_tokens=64).engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    decoding = engine.add_request([7] * 20, params)
    engine.step()
    engine.step()
    mid_prefill = engine.add_request(list(range(3, 300)), params)
    engine.step()  # a 297-token prompt with a 64-token budget: still mid-prefill
    assert engine.scheduler.requests[mid_prefill].num_computed_tokens < 297
    engine.abort(decoding)
    engine.abort(mid_prefill)
    queued = engine.add_request([9] * 20, params)
    engine.abort(queued)  # never scheduled
    engine.abort("not-a-request")  # ignored
    keep = engine.add_request([10] * 5, params)
    records = _drain(engine)
    for rid in (decoding, mid_prefill, queued):
        assert engine.pop_output(rid).finish_reason == "abort"
    assert engine.pop_output(keep).finish_reason == "length"
    finished = [e for r in records for e in r.of_kind("request.finished")]
    # aborts between steps are reported by the step that follows them
    assert [(e.request_id, e.reason) for e in finished] == [
        (decoding, "abort"),
        (mid_prefill, "abort"),
        (queued, "abort"),
        (keep, "length"),
    ]
    assert engine.kv_cache_manager.usage().used == 0


# ---- events and records ---------------------------------------------------------------------------
def test_step_records_tell_the_story(llm: LLM) -> None:
    engine = llm.engine
    seen = []
    engine.subscribe(seen.append)
    rid = engine.add_request(list(range(100, 140)), SamplingParams(temperature=0, max_tokens=3))
    records = _drain(engine)
    engine.unsubscribe(seen.append)
    assert [r.step for r in seen] == [r.step for r in records]
    first = records[0]
    assert first.scheduled == {rid: 40} and first.phases == {rid: "prefill"}
    kinds = [e.kind for e in first.events]
    assert kinds[0] == "request.added" and "request.scheduled" in kinds and "kv.allocated" in kinds
    assert kinds[-1] == "step.timing"
    assert [r.phases[rid] for r in records[1:]] == ["decode", "decode"]
    assert records[-1].of_kind("request.finished")[0].num_output_tokens == 3
    assert records[-1].of_kind("kv.freed")[0].request_id == rid
    for r in records:
        assert r.kv.total == r.kv.used + r.kv.cached_free + r.kv.free
        assert set(r.timing) >= {"schedule", "forward", "sample", "total"}
        again = StepRecord.from_dict(json.loads(json.dumps(r.to_dict())))
        assert again == r
    engine.pop_output(rid)


def test_chat_goes_through_the_chat_template(llm: LLM) -> None:
    messages = [{"role": "user", "content": "Say hi."}]
    expected = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    outs = llm.chat(messages, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(outs) == 1 and outs[0].prompt_token_ids == list(expected)
    assert outs[0].prompt_token_ids[0] == 1  # <|im_start|>
    two = llm.chat([messages, messages], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert [o.token_ids for o in two] == [outs[0].token_ids] * 2


def test_request_tokens_events_rebuild_the_text(llm: LLM) -> None:
    engine = llm.engine
    rid = engine.add_request([50, 51, 52], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    text, tokens = "", []
    for record in _drain(engine):
        for e in record.of_kind("request.tokens"):
            text = text[: e.text_offset] + e.text
            tokens.extend(e.token_ids)
    out = engine.pop_output(rid)
    assert text == out.text and tokens == out.token_ids


# ---- run() and the numbers a lesson reads ----------------------------------------------------------
def test_run_finishes_exactly_the_given_requests(llm: LLM) -> None:
    engine = LLM(model="tiny-llama", block_size=16, num_kv_blocks=64).engine
    seen = []
    engine.subscribe(seen.append)
    short = engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    long = engine.add_request([8, 9, 10], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    records = engine.run([short])
    assert engine.get_output(short).finished and not engine.get_output(long).finished
    assert len(records) == 3 and [r.step for r in records] == [r.step for r in seen] == [1, 2, 3]
    assert all(short in r.scheduled and long in r.scheduled for r in records)  # one batch for both
    assert [e.request_id for e in records[-1].of_kind("request.finished")] == [short]
    assert engine.run(short) == []  # finished already: no step
    assert len(engine.run(max_steps=2)) == 2 and not engine.get_output(long).finished
    rest = engine.run()  # default: every unfinished request
    assert engine.get_output(long).finished and not engine.has_unfinished_requests()
    assert len(engine.pop_output(long).token_ids) == 12 and 3 + 2 + len(rest) == 12
    assert [r.step for r in seen] == list(range(1, 13))  # subscribers saw every step
    assert engine.pop_output(short).token_ids == _greedy_tokens(llm, [5, 6, 7], 3)
    assert engine.run() == []


@pytest.mark.parametrize(
    "kwargs, exc, field",
    [
        ({"request_ids": ["nope"]}, ValueError, "request_ids: \\['nope'\\] not held"),
        ({"request_ids": "nope"}, ValueError, "request_ids"),
        ({"request_ids": [0]}, TypeError, "request_ids: ids are str"),
        ({"request_ids": 3}, TypeError, "request_ids"),
        ({"max_steps": 0}, ValueError, "max_steps"),
        ({"max_steps": 1.5}, TypeError, "max_steps"),
        ({"max_steps": True}, TypeError, "max_steps"),
    ],
)
def test_run_refuses_bad_arguments_naming_the_field(llm: LLM, kwargs, exc, field) -> None:
    engine = llm.engine
    rid = engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=2))
    step = engine.step_count
    with pytest.raises(exc, match=field):
        engine.run(**kwargs)
    assert engine.step_count == step  # refused before any step
    engine.run([rid])
    engine.pop_output(rid)
    with pytest.raises(ValueError, match="request_ids"):
        engine.run([rid])  # taken by pop_output


def test_engine_numbers_equal_the_internals() -> None:
    engine = LLM(model="tiny-llama", block_size=16, num_kv_blocks=24).engine
    runner = engine.runner
    real = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in runner.kv_caches)
    assert engine.num_kv_blocks == runner.num_blocks == 24
    assert engine.bytes_per_block == runner.bytes_per_block == real // 24
    k = runner.kv_caches[0][0]
    assert engine.bytes_per_block == 2 * 16 * k.shape[2] * k.shape[3] * k.element_size() * len(runner.kv_caches)
    assert engine.vocab_size == runner.vocab_size == runner.hf_config.vocab_size
    sized = LLM(model="tiny-llama", kv_cache_memory=40 * engine.bytes_per_block).engine  # sized from memory
    assert sized.num_kv_blocks == sized.runner.num_blocks == 40


def test_a_bfloat16_cache_under_float32_weights_holds_twice_the_blocks() -> None:
    """kv_cache_dtype (vLLM's): K and V stored in bfloat16 under float32 weights, in the target's cache and in a
    draft model's; the same kv_cache_memory then holds twice the blocks."""
    draft = {"method": "draft_model", "model": "tiny-llama", "num_speculative_tokens": 2}
    full, half = (
        LLM(model="tiny-llama", kv_cache_memory=1 << 22, speculative_config=draft, **kw).engine
        for kw in ({}, {"kv_cache_dtype": "bfloat16"})
    )
    assert half.config.torch_dtype == torch.float32 and half.config.kv_cache_torch_dtype == torch.bfloat16
    assert full.bytes_per_block == 2 * half.bytes_per_block and half.num_kv_blocks == 2 * full.num_kv_blocks
    for engine, dtype in ((full, torch.float32), (half, torch.bfloat16)):
        caches = [*engine.runner.kv_caches, *engine.runner.spec.proposer.kv_caches]
        assert {t.dtype for pair in caches for t in pair} == {dtype}
    # the runs meet the cache where it is: one request end to end, its blocks freed
    out = LLM(model="tiny-llama", kv_cache_dtype="bfloat16").generate([[3, 4, 5, 6]], SamplingParams(max_tokens=8))
    assert len(out[0].token_ids) == 8


def test_get_block_ids_is_the_block_table() -> None:
    engine = LLM(model="tiny-llama", block_size=16, num_kv_blocks=24).engine
    rid = engine.add_request(list(range(3, 40)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert engine.get_block_ids(rid) == []  # waiting: no block yet
    record = engine.step()
    (allocated,) = record.of_kind("kv.allocated")
    table = engine.get_block_ids(rid)
    assert table == engine.kv_cache_manager.get_block_ids(rid) == list(allocated.block_ids)
    assert len(table) == 3 and 0 not in table  # 37 tokens in blocks of 16; never the null block
    engine.run([rid])
    assert engine.get_block_ids(rid) == []  # finished: its blocks are back in the pool
    engine.pop_output(rid)
    with pytest.raises(ValueError, match="request_id: '0' not held"):
        engine.get_block_ids(rid)
    with pytest.raises(TypeError, match="request_id"):
        engine.get_block_ids(0)
