"""The Experts view over a real run of a seeded tiny Qwen3-MoE: the state's per-step and cumulative counts, and the
cells both heatmaps draw, equal the moe.routed records; the Dashboard adds the Experts tab only for a routing model."""

from __future__ import annotations

import shutil

import pytest
import torch
from bokeh.document import Document
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from engine import LLMEngine, SamplingParams, StepRecord
from tests.model.test_llama import SMALL, random_prompt, spread_init
from workbench.state import EngineState
from workbench.views import Dashboard, MoEView

MOE = dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def moe_records(tmp_path_factory, tiny_model_path) -> list[StepRecord]:
    """Two requests in chunks of 8 tokens then decodes, on a tiny Qwen3-MoE (every layer sparse)."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**SMALL, **MOE, head_dim=16, norm_topk_prob=True))
    spread_init(hf, 0)
    path = tmp_path_factory.mktemp("qwen3_moe")
    hf.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_model_path / name).is_file():
            shutil.copy2(tiny_model_path / name, path / name)
    engine = LLMEngine(model=str(path), block_size=4, max_num_batched_tokens=8, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for n, seed in ((13, 20), (6, 21)):
        engine.add_request(random_prompt(256, n, seed), params)
    records = []
    while engine.has_unfinished_requests():
        records.append(engine.step())
    assert all(r.of_kind("moe.routed") for r in records)
    return records


def _counts(records: list[StepRecord]) -> list[list[list[int]]]:
    """Each record's counts[layer row][expert], summed over its moe.routed events."""
    out = []
    for r in records:
        events = r.of_kind("moe.routed")
        out.append(
            [
                [sum(e.counts[row][x] for e in events) for x in range(events[0].num_experts)]
                for row in range(len(events[0].layers))
            ]
        )
    return out


def _grid(source) -> list[list[int]]:
    data = source.data
    rows = max(data["y"]) + 1
    grid = [[0] * (max(data["x"]) + 1) for _ in range(rows)]
    for y, x, n in zip(data["y"], data["x"], data["tokens"]):
        grid[y][x] = n
    return grid


def test_state_counts_equal_the_records_step_by_step(moe_records):
    state, expected = EngineState(), _counts(moe_records)
    running = [[0] * MOE["num_experts"] for _ in expected[0]]
    for record, counts in zip(moe_records, expected):
        delta = state.apply(record)
        running = [[a + b for a, b in zip(r, c)] for r, c in zip(running, counts)]
        assert delta.moe_routed and state.moe.step == record.step
        assert state.moe.step_counts == counts and state.moe.total == running
    assert state.moe.layers == (0, 1) and state.moe.num_experts == 8 and state.moe.num_steps == len(moe_records)
    # every token of a step chose top-k experts in each sparse layer
    assert all(sum(row) == 2 * sum(r.scheduled.values()) for r, c in zip(moe_records, expected) for row in c)


def test_heatmaps_draw_the_last_step_and_the_total(moe_records):
    view = MoEView()
    view.panel.get_root(Document())
    assert view.empty.is_empty
    expected = _counts(moe_records)
    for i, record in enumerate(moe_records):
        view.update(record)
        assert _grid(view.step_cells.source) == expected[i]  # patched in place, step by step
    total = [[sum(c[row][x] for c in expected) for x in range(8)] for row in range(2)]
    assert _grid(view.total_cells.source) == total and not view.empty.is_empty
    shares = view.total_cells.source.data["share"]
    assert max(shares) == 1.0 and shares == [n / max(map(max, total)) for row in total for n in row]
    assert view.total_cells.source.data["layer"][:9] == [0] * 8 + [1]
    view.reset()
    assert view.empty.is_empty and view.total_cells.source.data["tokens"] == []


def test_the_experts_tab_appears_only_for_a_routing_model(moe_records, tiny_model_path):
    dense = LLMEngine(model="tiny-llama", num_kv_blocks=32, seed=0)
    dense.add_request("Hello there", SamplingParams(temperature=0.0, max_tokens=2))
    dashboard = Dashboard()
    tabs = dashboard.tabs()
    tabs.get_root(Document())
    titles = list(tabs._names)
    dashboard.extend(dense.run())
    assert list(tabs._names) == titles and "Experts" not in titles  # a dense model: the tabs it always had
    dashboard.extend(moe_records[:2])
    assert list(tabs._names) == titles + ["Experts"]
    assert dashboard.moe.state is dashboard.state and dashboard.state.moe.total  # the shared state
    assert list(dashboard.tabs()._names) == titles + ["Experts"]  # a layout built now has it from the start
    dashboard.extend(moe_records[2:])
    assert list(tabs._names).count("Experts") == 1
    dashboard.reset()
    assert list(tabs._names) == titles
