"""The profile's input-preparation measures on the tiny model (never timed assertions)."""

import pytest

from workbench.bench.profile import REASONS_ROW, capture_scheduler_output, format_markdown, run_profile

TINY = {"model": "tiny-llama", "engine_kwargs": {"num_kv_blocks": 64}}


@pytest.fixture(scope="module")
def result():
    return run_profile(
        num_requests=4,
        prompt_len=16,
        steps=1,
        warmup=0,
        top_ops=0,
        max_num_batched_tokens=48,
        log=lambda _: None,
        **TINY,
    )


def test_input_preparation_is_its_own_row_and_measured_alone(result) -> None:
    names = [name for name, _ in result["stages"]]
    assert names[1:3] == ["runner: input preparation", "runner: sampling metadata, logits rows, results"]
    prep = result["input_prep"]
    assert prep["decode_requests"] == 4 and prep["decode_ms"] > 0 and prep["prefill_ms"] > 0
    # a 96-token prompt under a 48-token budget: the second chunk is measured, with the first one as context
    assert (prep["prefill_tokens"], prep["prefill_context"]) == (48, 96)
    text = format_markdown(result, "workbench bench profile")
    assert "at 4 decoding requests" in text and "48-token prefill chunk (context 96)" in text


def test_the_reasons_fold_is_a_row_and_a_reported_line(result) -> None:
    """What explaining costs a step (#33): the reasons' fold into journeys and block lives (Explainer.observe) is its
    own row of the split, and replayed without a profiler beside the events (measured and reported, never timed)."""
    stages = dict(result["stages"])
    assert stages[REASONS_ROW] == result["explain_ms_profiled"] > 0
    assert result["explain_ms_replayed"] > 0
    text = format_markdown(result, "workbench bench profile")
    assert "reasons folded into journeys and block lives" in text and "with the events and the StepRecord" in text


def test_each_model_row_is_a_real_share_of_the_step(result) -> None:
    # the rows are differences of cumulative times: a hook on a function the model no longer calls reads 0, and
    # the linear layers' row (all linears minus the LM head) once came out as minus the whole LM head. On the tiny
    # model the layers' linears are small beside its 49k-row LM head, so only that sign error is asserted.
    stages = dict(result["stages"])
    assert stages["model: attention (KV write + paged attention)"] > 0 and stages["LM head (logits)"] > 0
    assert stages["model: linear layers"] > -0.5 * stages["LM head (logits)"]


def test_time_outside_the_ops_is_part_of_the_step() -> None:
    result = run_profile(
        num_requests=2,
        prompt_len=16,
        steps=2,
        warmup=0,
        top_ops=3,
        max_num_batched_tokens=48,
        log=lambda _: None,
        **TINY,
    )
    assert len(result["torch_ops"]) == 3
    assert 0 < result["inside_ops_ms"] and sum(ms for _, ms, _ in result["torch_ops"]) <= result["inside_ops_ms"]
    assert "outside any torch op" in format_markdown(result, "workbench bench profile")


def test_chunked_prefill_measure_needs_a_prompt_longer_than_the_budget() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        run_profile(
            num_requests=1,
            prompt_len=8,
            steps=1,
            warmup=0,
            top_ops=0,
            max_num_batched_tokens=1024,
            log=lambda _: None,
            **TINY,
        )


def test_capture_refuses_a_step_that_ran_nothing() -> None:
    from engine import LLM

    llm = LLM(model="tiny-llama", num_kv_blocks=8)
    with pytest.raises(RuntimeError, match="scheduled nothing"):
        capture_scheduler_output(llm.engine)


def test_kv_events_publishing_is_costed_when_asked() -> None:
    """--kv-events: the engine publishes (to a subscriber) and each plain step's batch is rebuilt, encoded and sent
    again, its cost set against the step (never a timed assertion: only that it is measured and reported)."""
    result = run_profile(
        num_requests=4,
        prompt_len=16,
        steps=4,
        warmup=0,
        top_ops=0,
        max_num_batched_tokens=48,
        kv_events=True,
        log=lambda _: None,
        model="tiny-llama",
        engine_kwargs={"num_kv_blocks": 64, "block_size": 4},  # decode fills a block every 4 steps: batches to cost
    )
    kv = result["kv_events"]
    assert kv["batches_per_step"] > 0 and kv["events_per_step"] >= kv["batches_per_step"]
    assert kv["ms_replayed"] > 0 and kv["share"] == pytest.approx(kv["ms_replayed"] / result["step_ms"])
    assert "KV events published" in format_markdown(result, "workbench bench profile --kv-events")
