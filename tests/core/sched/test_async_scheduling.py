"""Asynchronous scheduling (vLLM 0.33's AsyncScheduler, this engine's async_scheduling): each step schedules the
next batch before the previous batch's tokens are back, with a placeholder for each token in flight. Fidelity to
vLLM's own AsyncScheduler, step for step, is checked by workbench fidelity (group "async")."""

import pytest

from engine import LLMEngine, SamplingParams


def scripted(**kw) -> LLMEngine:
    return LLMEngine(
        executor="scripted",
        token_script={"r": [5, 6, 7, 8]},
        num_kv_blocks=16,
        block_size=4,
        async_scheduling=True,
        **kw,
    )


def test_each_step_is_scheduled_before_the_last_steps_token_is_back():
    engine = scripted()
    engine.add_request([10, 11, 12, 13], SamplingParams(max_tokens=3), request_id="r")
    request = engine.scheduler.requests["r"]
    seen, came_back = [], []
    while engine.has_unfinished_requests():
        record = engine.step()
        seen.append((record.scheduled, list(request.output_token_ids), request.num_output_placeholders))
        came_back.append(record.outputs_of_step)
    assert seen == [
        ({"r": 4}, [], 1),  # the prefill; its token is in flight: a placeholder
        ({"r": 1}, [5], 1),  # the decode of that placeholder is scheduled, then the prefill's token comes back
        ({"r": 1}, [5, 6], 1),
        ({}, [5, 6, 7], 0),  # the tokens in flight already reach max_tokens: nothing scheduled past them
    ]
    assert came_back == [0, 1, 2, 3]  # each step's record names the step whose tokens it took (0: none yet)
    assert request.status.finish_reason == "length" and engine.kv_cache_manager.usage().used == 0


def test_the_same_workload_takes_one_step_more_than_synchronously():
    def steps(asynchronous: bool) -> list[dict]:
        engine = LLMEngine(
            executor="scripted",
            token_script={"r": [5, 6, 7, 8]},
            num_kv_blocks=16,
            block_size=4,
            async_scheduling=asynchronous,
        )
        engine.add_request([10, 11, 12, 13], SamplingParams(max_tokens=3), request_id="r")
        return [r.scheduled for r in engine.run()]

    assert steps(False) == [{"r": 4}, {"r": 1}, {"r": 1}]
    assert steps(True) == [{"r": 4}, {"r": 1}, {"r": 1}, {}]


@pytest.mark.parametrize(
    "other",
    [
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
        {"kv_transfer_config": {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}},
    ],
)
def test_async_scheduling_refuses_what_it_does_not_support_yet(other):
    from engine import EngineConfig

    with pytest.raises(ValueError, match="async_scheduling: not supported with"):
        EngineConfig(async_scheduling=True, **other)
