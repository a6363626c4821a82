"""bench profile reports what explaining costs a step (#33): the reasons' fold into journeys and block lives
(Explainer.observe) as its own row of the split, and replayed without a profiler beside the events (never a timed
assertion: only that it is measured and reported)."""

from workbench.bench.profile import REASONS_ROW, format_markdown, run_profile


def test_the_reasons_fold_is_a_row_and_a_reported_line() -> None:
    result = run_profile(
        num_requests=4,
        prompt_len=16,
        steps=2,
        warmup=0,
        top_ops=0,
        max_num_batched_tokens=48,
        log=lambda _: None,
        model="tiny-llama",
        engine_kwargs={"num_kv_blocks": 64},
    )
    stages = dict(result["stages"])
    assert stages[REASONS_ROW] == result["explain_ms_profiled"] > 0
    assert result["explain_ms_replayed"] > 0
    text = format_markdown(result, "workbench bench profile")
    assert "reasons folded into journeys and block lives" in text and "with the events and the StepRecord" in text
