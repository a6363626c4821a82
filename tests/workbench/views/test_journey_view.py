"""Why, in the dashboard (workbench/views/journey.py): a request clicked in the requests table or on the timeline
opens its journey, a block clicked on the block map its life, live (from the engine's explain / block_life) and in
a replay (folded from the records, for what is opened alone); the waiting band counts each step's waiting requests
by reason."""

from __future__ import annotations

import pytest
from bokeh.document import Document

from engine import LLMEngine, SamplingParams, StepRecord
from tests.test_journey import A, B, scripted
from workbench.app import Replay, Workbench
from workbench.views import Dashboard
from workbench.views.journey import (
    JOURNEY_HINT,
    BlockLifeView,
    Explanations,
    JourneyView,
    block_life_markdown,
    journey_markdown,
)


def add_a_and_b(engine: LLMEngine) -> None:
    """tests/test_journey.py's run: b waits for the budget, hits a's prefix, is preempted, waits for blocks."""
    engine.add_request(A, SamplingParams(max_tokens=4, ignore_eos=True), request_id="a")
    engine.add_request(B, SamplingParams(max_tokens=6, ignore_eos=True), request_id="b")


@pytest.fixture(scope="module")
def run() -> tuple[LLMEngine, list[StepRecord]]:
    engine = scripted()
    add_a_and_b(engine)
    return engine, engine.run()


def fed(records: list[StepRecord]) -> Dashboard:
    dashboard = Dashboard(16, 7)
    dashboard.tabs().get_root(Document())
    dashboard.explanations.block_size = 4
    dashboard.extend(records)
    return dashboard


def test_a_row_picked_opens_its_journey_as_the_engine_explains_it(run):
    engine, records = run
    dashboard = fed(records)
    assert dashboard.journey.markdown.object == JOURNEY_HINT
    rows = list(dashboard.requests.table.value["request_id"])
    dashboard.requests.table.selection = [rows.index("b")]
    text = dashboard.journey.markdown.object
    assert text == journey_markdown(engine.explain("b"))  # folded from the records, for b alone
    assert "### Journey of request b · finished (length)" in text
    for line in ("`budget_spent`", "`kv_blocks`", "| preempted |", "recompute", "- **preemptions**: 1;"):
        assert line in text, line
    assert dashboard.kv_blocks.select.value == "b"  # the block table too, as before


def test_a_bar_picked_on_the_timeline_opens_that_request(run):
    engine, records = run
    dashboard = fed(records)
    source = dashboard.timeline.segments.source
    source.selected.indices = [source.data["request_id"].index("a")]
    assert dashboard.journey.markdown.object == journey_markdown(engine.explain("a"))


def test_a_cell_picked_on_the_block_map_opens_its_life(run):
    engine, records = run
    dashboard = fed(records)
    source = dashboard.kv_blocks.cells.source
    source.selected.indices = [source.data["block_id"].index(1)]
    text = dashboard.block_life.markdown.object
    assert text == block_life_markdown(1, engine.block_life(1))
    assert "### Life of block 1" in text and "allocated at step 1 to a" in text and "hit by b" in text


def test_the_waiting_band_counts_each_steps_waiting_requests_by_reason(run):
    _, records = run
    data = fed(records).timeline.waiting.source.data
    per_step: dict[int, dict[str, int]] = {}
    for step, reason, n in zip(data["step"], data["reason"], data["num_requests"]):
        per_step.setdefault(step, {})[reason] = n
    assert {r.step: sum(per_step.get(r.step, {}).values()) for r in records} == {r.step: r.num_waiting for r in records}
    assert per_step[1] == {"budget_spent": 1}  # b, behind a's first chunk
    assert {"preempted": 1} in per_step.values() and {"kv_blocks": 1} in per_step.values()


def test_live_the_journey_and_the_life_come_from_the_engine_and_follow_its_steps():
    engine = scripted()
    workbench = Workbench(engine)
    workbench.layout.get_root(Document())
    assert workbench.dashboard.explanations.live
    add_a_and_b(engine)
    workbench.step(1)
    dashboard = workbench.dashboard
    dashboard.journey.open("b")
    dashboard.block_life.open(1)
    assert "| 1 | waiting |" in dashboard.journey.markdown.object  # b waited at step 1 for the budget
    workbench.step(20)
    assert dashboard.journey.markdown.object == journey_markdown(engine.explain("b"))
    assert dashboard.block_life.markdown.object == block_life_markdown(1, engine.block_life(1))
    assert not dashboard.explanations.records  # a live engine keeps its own: the dashboard holds no records


def test_a_replay_explains_what_the_slider_shows(run):
    engine, records = run
    replay = Replay.from_records(records, "run")
    replay.layout.get_root(Document())
    dashboard = replay.dashboard
    replay.slider.value = 1
    dashboard.journey.open("b")
    assert "finished" not in dashboard.journey.markdown.object.splitlines()[0]  # as of step 1: b waits
    replay.slider.value = len(records)  # on to the end: the journey open follows
    assert dashboard.journey.markdown.object == journey_markdown(engine.explain("b"))


def test_the_panels_say_what_cannot_be_explained():
    view = JourneyView(explanations=Explanations())
    view.open("nobody")
    assert "nobody" in view.markdown.object and "no journey" in view.markdown.object
    life = BlockLifeView(explanations=Explanations())
    life.open(3)
    assert "Never allocated" in life.markdown.object


def test_a_front_end_without_steps_keeps_no_records(run):
    # a data-parallel front end's dashboard (the Workbench attaches it so): a server runs for days
    _, records = run
    explanations = Explanations()
    explanations.attach(None, None, keep_records=False)
    explanations.observe(records)
    assert explanations.records == []
    with pytest.raises(KeyError):
        explanations.explain("a")
