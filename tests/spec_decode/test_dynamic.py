"""Dynamic speculative decoding (speculative_config.num_speculative_tokens_per_batch_size, vLLM 0.33's): the schedule's
checks name the field, its lookup is vLLM's (gaps and the tail carry the K before them), and an engine drafts the
step's K by its batch size: none while the batch is large, the full K once it is small, the greedy output unchanged
(the draft model; EAGLE, whose head keeps mirroring the target while it does not draft)."""

from __future__ import annotations

import pytest

from engine import LLM, EngineConfig, SamplingParams
from engine.spec_decode.dynamic import schedule_lookup
from tests.spec_decode.test_eagle_medusa import heads  # noqa: F401 (the trained heads fixture)
from tests.spec_decode.test_spec_decoding import DRAFT, PARAMS, _prompts, _reference

FIELD = "num_speculative_tokens_per_batch_size"


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        ([], "non-empty list"),
        ([(1, 4)], "each entry"),
        ([(1, 4, 2.0)], "each entry"),
        ([(0, 4, 2)], "1 <= start <= end"),
        ([(3, 2, 2)], "1 <= start <= end"),
        ([(1, 4, -1)], ">= 0"),
        ([(1, 4, 2), (4, 8, 1)], "overlap"),
        ([(2, 4, 2)], "must start at 1"),
    ],
)
def test_a_bad_schedule_is_refused_naming_the_field(schedule, message) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 3, FIELD: schedule}
    with pytest.raises(ValueError, match=f"speculative_config.{FIELD}") as info:
        EngineConfig(speculative_config=spec)
    assert message in str(info.value)


def test_the_lookup_is_vllms() -> None:
    """vLLM's docstring example: [(1, 16, 3), (32, 128, 2)] maps 17-31 to 3 (the gap takes the K before it); the
    tail past the last range keeps its K; every K is capped by num_speculative_tokens; entries may come unsorted."""
    lookup = schedule_lookup([(32, 128, 2), (1, 16, 3)], 200, 5)
    assert lookup[0] == 0 and lookup[1:32] == [3] * 31 and lookup[32:] == [2] * 169
    assert schedule_lookup([(1, 2, 9), (3, 3, 0)], 6, 4) == [0, 4, 4, 0, 0, 0, 0]


# every request runs at once while 5 are in the batch; drafts only once 2 or fewer are left
SCHEDULE = [(1, 2, 4), (3, 256, 0)]


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_drafts_follow_the_batch_size_and_the_output_is_unchanged(heads, method) -> None:  # noqa: F811
    spec = (
        DRAFT if method == "draft_model" else {"method": "eagle", "model": heads["eagle"], "num_speculative_tokens": 4}
    )
    llm = LLM(model="tiny-llama", speculative_config={**spec, FIELD: SCHEDULE})
    records = []
    llm.engine.subscribe(records.append)
    prompts = [list(p) for p in _prompts("tiny-llama")]
    # they finish one by one: the batch shrinks
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (24, 30, 36, 40, 48)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    plain = LLM(model="tiny-llama").generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    by_step = {r.step: [e.num_spec_tokens for e in r.of_kind("spec.scheduled")] for r in records}
    sizes = {e.batch_size: e.num_spec_tokens for r in records for e in r.of_kind("spec.scheduled")}
    assert sizes[5] == sizes[3] == 0 and sizes[1] == 4  # the batch went through both ranges
    # drafts are proposed only in steps whose K is not 0 (their verification comes a step later)
    for r in records:
        if r.of_kind("spec.proposed"):
            assert by_step[r.step] == [4]
    assert any(r.of_kind("spec.verified") for r in records)
    assert llm.engine.kv_cache_manager.usage().used == 0


def test_without_a_schedule_no_step_says_so() -> None:
    llm = LLM(model="tiny-llama", speculative_config=DRAFT)
    records = []
    llm.engine.subscribe(records.append)
    outs = llm.generate([list(p) for p in _prompts("tiny-llama")], PARAMS, use_tqdm=False)
    assert [o.token_ids for o in outs] == _reference("tiny-llama", "defaults", 4)
    assert not any(r.of_kind("spec.scheduled") for r in records)
