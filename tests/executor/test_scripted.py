"""The scripted executor: no model; the real scheduler and KV cache, with each request's sampled tokens taken from
a script (a dict of lists or a callable), EOS past a list's end, and clear errors for a bad script."""

from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams


def _engine(script, **kwargs) -> LLMEngine:
    return LLMEngine(
        executor="scripted", token_script=script, num_kv_blocks=16, block_size=4, max_model_len=64, **kwargs
    )


def test_a_dict_script_gives_each_request_its_tokens_in_order_then_eos_ends_it() -> None:
    engine = _engine({"a": [7, 8, 9], "b": [5]})
    eos = engine.eos_token_id
    seen: dict[str, list[int]] = {"a": [], "b": []}
    reasons: dict[str, str] = {}
    engine.subscribe(
        lambda record: [
            reasons.setdefault(e.request_id, e.reason) for e in record.events if e.kind == "request.finished"
        ]
    )
    a = engine.add_request([11, 12, 13], SamplingParams(max_tokens=10), request_id="a")
    b = engine.add_request([21, 22], SamplingParams(max_tokens=10), request_id="b")
    requests = {rid: engine.scheduler.requests[rid] for rid in (a, b)}
    engine.run()
    for rid, request in requests.items():
        seen[rid] = list(request.output_token_ids)
    # a's list runs out after three tokens and b's after one: the next token is the model's EOS ("stop")
    assert seen == {"a": [7, 8, 9, eos], "b": [5, eos]}
    assert reasons == {"a": "stop", "b": "stop"}


def test_a_callable_script_reads_the_request_and_max_tokens_ends_it_with_length() -> None:
    engine = _engine(lambda request: 100 + request.num_output_tokens)
    request_id = engine.add_request([11, 12, 13, 14, 15], SamplingParams(max_tokens=4), request_id="r")
    request = engine.scheduler.requests[request_id]
    records = engine.run()
    assert request.output_token_ids == [100, 101, 102, 103]
    assert request.status.finish_reason == "length"
    assert [r.scheduled for r in records] == [{"r": 5}, {"r": 1}, {"r": 1}, {"r": 1}]


def test_a_scripted_stop_token_ends_the_request_with_it_as_stop_reason() -> None:
    engine = _engine({"r": [7, 9, 8]})
    engine.add_request([11, 12], SamplingParams(max_tokens=10, stop_token_ids=[9]), request_id="r")
    request = engine.scheduler.requests["r"]
    engine.run()
    assert (request.output_token_ids, request.status.finish_reason, request.stop_reason) == ([7, 9], "stop", 9)


def test_a_token_outside_the_vocabulary_is_a_clear_value_error_naming_token_script() -> None:
    engine = _engine({"r": [7, -1]})
    engine.add_request([11, 12], SamplingParams(max_tokens=10), request_id="r")
    with pytest.raises(ValueError, match=r"token_script: request 'r' output 1 is -1, not a token id"):
        engine.run()
    callable_engine = _engine(lambda request: None)
    callable_engine.add_request([11, 12], SamplingParams(max_tokens=10), request_id="r")
    with pytest.raises(ValueError, match=r"token_script: request 'r' output 0 is None"):
        callable_engine.run()


def test_the_scripted_executor_needs_a_script_and_a_script_needs_a_model_free_executor() -> None:
    with pytest.raises(ValueError, match="token_script: executor 'scripted' samples from a script"):
        EngineConfig(executor="scripted")
    with pytest.raises(ValueError, match="token_script: only a model-free executor reads it"):
        EngineConfig(token_script={"r": [1]})
    with pytest.raises(TypeError, match="token_script: expected a dict"):
        EngineConfig(executor="scripted", token_script=[1, 2, 3])
    with pytest.raises(TypeError, match=r"token_script\['r'\]: token ids must be int"):
        EngineConfig(executor="scripted", token_script={"r": [1, "2"]})
    assert EngineConfig(executor="scripted", token_script={"r": [1]}).hardware == "cpu"
