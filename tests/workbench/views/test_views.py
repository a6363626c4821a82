"""Each dashboard view in pure Python: build its Bokeh model, push the StepRecords of a real tiny-llama run
(shared prefixes, chunked prefill, a preemption, evictions), and check the data it would draw."""

from __future__ import annotations

import ast
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import panel as pn
import pytest
from bokeh.document import Document

import workbench.views
from engine import LLMEngine, SamplingParams, StepRecord, StructuredOutputsParams
from engine.events import (
    GrammarCompiled,
    GrammarStep,
    KVTransferFail,
    KVTransferLoad,
    KVTransferSave,
    KVUsage,
    SpecProposed,
    SpecVerified,
)
from workbench.state import EngineState
from workbench.trace import write_trace
from workbench.views import (
    Dashboard,
    GrammarView,
    KVBlockMap,
    MetricsView,
    PrefixCacheView,
    RequestsView,
    SchedulerTimeline,
    SpecDecodeView,
)
from workbench.views.base import SourceBuffer
from workbench.views.colors import CACHED_FREE_COLOR, FREE_COLOR, request_color
from workbench.views.metrics import latency_bin

BUDGET = 48


@dataclass
class Run:
    records: list[StepRecord]
    texts: dict[str, str]  # request id -> engine.get_output(rid).text at the end
    tables: list[dict[str, list[int]]]  # after each step: the engine's own block table per request
    ids: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def run() -> Run:
    """Two requests share a 40-token prefix, a third does not, a fourth arrives at step 3; 11 usable blocks
    force a preemption and, late in the run, evictions of cached-free blocks."""
    engine = LLMEngine(
        model="tiny-llama", block_size=16, num_kv_blocks=12, max_num_batched_tokens=BUDGET, max_model_len=512
    )
    prefix = list(range(100, 140))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ids = [engine.add_request(prefix + [200 + i] * 6, params) for i in range(2)]
    ids.append(engine.add_request(list(range(300, 340)), params))
    records, tables = [], []
    while engine.has_unfinished_requests():
        records.append(engine.step())
        tables.append(
            {
                rid: engine.kv_cache_manager.get_block_ids(rid)
                for rid in ids
                if engine.kv_cache_manager.get_block_ids(rid)
            }
        )
        if len(records) == 3:
            ids.append(engine.add_request(list(range(400, 436)), params))
    kinds = Counter(e.kind for r in records for e in r.events)
    assert kinds["request.preempted"] and kinds["kv.evicted"] and kinds["kv.cached"], kinds
    return Run(records, {rid: engine.get_output(rid).text for rid in ids}, tables, ids)


def rendered(view):
    """The view with its Bokeh model built in a document, as a page or a notebook would."""
    view.panel.get_root(Document())
    return view


# ---- the event-derived state -----------------------------------------------------------------------------
def test_state_follows_the_engine_step_by_step(run):
    state = EngineState()
    for record, tables in zip(run.records, run.tables):
        state.apply(record)
        counts = state.counts()
        assert counts == {"used": record.kv.used, "cached_free": record.kv.cached_free, "free": record.kv.free}
        assert {rid: list(t) for rid, t in state.block_tables.items()} == tables
        for block_id, block in state.blocks.items():
            assert block.ref_cnt == sum(block_id in t for t in tables.values())
    assert {rid: r.text for rid, r in state.requests.items()} == run.texts
    assert all(r.status == "finished" and r.finish_reason == "length" for r in state.requests.values())
    assert sum(r.num_preemptions for r in state.requests.values()) == 1


# ---- KV block map ---------------------------------------------------------------------------------------------
def test_block_map_colours_cells_by_holder_then_frees_them(run):
    view = rendered(KVBlockMap(num_blocks=11))
    data = view.cells.source.data
    assert data["block_id"] == list(range(1, 12)) and set(data["kind"]) == {"free"}
    view.update(run.records[0])
    first = run.tables[0]
    shared = set(first[run.ids[0]]) & set(first[run.ids[1]])
    assert shared, "the two requests share their prefix blocks"
    for rid, block_ids in first.items():
        for block_id in block_ids:
            i = block_id - 1
            assert data["kind"][i] == "used" and rid in data["holders"][i].split(", ")
            assert data["ref_cnt"][i] == (2 if block_id in shared else 1)
            assert data["color"][i] == request_color(data["holders"][i].split(", ")[0])
    view.extend(run.records[1:])
    assert set(data["kind"]) <= {"free", "cached"} and "cached" in data["kind"]
    for kind, color, digest in zip(data["kind"], data["color"], data["hash"]):
        assert color == (CACHED_FREE_COLOR if kind == "cached" else FREE_COLOR)
        assert bool(digest) == (kind == "cached")


def test_block_map_draws_the_selected_request_block_table_in_order(run):
    view = rendered(KVBlockMap(num_blocks=11))
    view.update(run.records[0])
    rid = run.ids[0]
    view.select.value = rid
    table = view.table.source.data
    assert table["block_id"] == run.tables[0][rid]
    assert table["order"] == [str(i) for i in range(len(run.tables[0][rid]))]
    cells = view.cells.source.data
    assert [(x, y) for x, y in zip(table["x"], table["y"])] == [
        (cells["x"][b - 1], cells["y"][b - 1]) for b in run.tables[0][rid]
    ]
    view.extend(run.records[1:])
    assert view.table.source.data["block_id"] == [], "a finished request holds no block"


def test_block_map_shows_the_first_blocks_of_a_large_cache():
    view = rendered(KVBlockMap(num_blocks=10_000, max_blocks=256))
    assert len(view.cells.source.data["block_id"]) == 256
    assert "256 of 10000" in view.note.object


# ---- scheduler timeline -----------------------------------------------------------------------------------
def test_timeline_stacks_what_each_step_scheduled(run):
    view = rendered(SchedulerTimeline(budget=BUDGET))
    view.extend(run.records)
    seg, steps = view.segments.source.data, view.steps.source.data
    for record in run.records:
        rows = [i for i, s in enumerate(seg["step"]) if s == record.step]
        assert sum(seg["num_tokens"][i] for i in rows) == sum(record.scheduled.values())
        assert {seg["request_id"][i]: seg["phase"][i] for i in rows} == record.phases
        assert [seg["bottom"][i] for i in rows[1:]] == [seg["top"][i] for i in rows[:-1]]  # stacked
    assert steps["step"] == [r.step for r in run.records]
    assert set(steps["budget"]) == {BUDGET} and max(steps["total"]) <= BUDGET
    assert steps["num_waiting"] == [r.num_waiting for r in run.records]
    assert {"prefill", "chunk", "decode"} <= set(seg["phase"])


def test_timeline_says_when_each_step_s_tokens_came_back():
    from engine import LLMEngine, SamplingParams

    def timeline(asynchronous: bool) -> SchedulerTimeline:
        engine = LLMEngine(
            executor="scripted",
            token_script={"r": [5, 6, 7]},
            num_kv_blocks=8,
            block_size=4,
            async_scheduling=asynchronous,
        )
        engine.add_request([10, 11, 12], SamplingParams(max_tokens=3), request_id="r")
        view = rendered(SchedulerTimeline())
        view.extend(engine.run())
        return view

    sync, asynchronous = timeline(False), timeline(True)
    assert sync.segments.source.data["back_at"] == ["step 1", "step 2", "step 3"]
    assert "asynchronously" not in sync.tokens_figure.title.text
    # asynchronous: the prefill of step 1 samples a token the scheduler takes in step 2, while step 2 decodes it
    assert asynchronous.segments.source.data["back_at"] == ["step 2", "step 3", "step 4"]
    assert "asynchronously: a step's tokens come back in the next step" in asynchronous.tokens_figure.title.text


# ---- requests -----------------------------------------------------------------------------------------------
def test_requests_table_text_grows_into_the_engine_output(run):
    view = rendered(RequestsView())
    view.update(run.records[0])
    first = view.table.value
    assert list(first["request_id"]) == run.ids[:3]
    assert dict(zip(first["request_id"], first["status"])) == {
        rid: "running" if rid in run.records[0].scheduled else "waiting" for rid in run.ids[:3]
    }
    view.extend(run.records[1:])
    table = view.table.value
    assert list(table["request_id"]) == run.ids
    assert dict(zip(table["request_id"], table["text"])) == run.texts
    assert set(table["finish_reason"]) == {"length"} and set(table["num_output_tokens"]) == {12}
    assert (table["ttft_ms"] > 0).all() and (table["itl_ms"] > 0).all()
    assert table.loc[table["request_id"] == run.ids[1], "num_cached_tokens"].item() == 32


# ---- prefix cache -------------------------------------------------------------------------------------------
def test_prefix_view_counts_hits_and_links_cached_chains(run):
    view = rendered(PrefixCacheView())
    view.extend(run.records)
    lookups = {e.request_id: e for r in run.records for e in r.of_kind("prefix.lookup")}  # the last per request
    hits = view.hits.source.data
    assert dict(zip(hits["request_id"], hits["hit_tokens"])) == {rid: e.num_hit_tokens for rid, e in lookups.items()}
    assert hits["hit_tokens"][1] == 32, "the second request hits the first one's two full prefix blocks"
    cached = [e for r in run.records for e in r.of_kind("kv.cached")]
    nodes, edges = view.nodes.source.data, view.edges.source.data
    assert len(nodes["hash"]) == len({e.block_hash for e in cached})
    assert len(edges["x0"]) == len({e.block_hash for e in cached if e.parent_hash is not None})
    evicted = {e.block_hash[:12] for r in run.records for e in r.of_kind("kv.evicted")}
    assert {h for h, s in zip(nodes["hash"], nodes["status"]) if s == "evicted"} <= evicted
    rate = view.rate.source.data["hit_rate"]
    assert 0 < rate[-1] < 1


# ---- metrics ----------------------------------------------------------------------------------------------------
def test_metrics_histograms_and_kv_usage(run):
    view = rendered(MetricsView())
    view.extend(run.records)
    assert view.throughput.source.data["step"] == [r.step for r in run.records]
    assert view.kv.source.data["used"] == [r.kv.used for r in run.records]
    num_token_steps = sum(len(r.of_kind("request.tokens")) for r in run.records)
    assert sum(view.ttft.source.data["count"]) == len(run.ids)
    assert sum(view.itl.source.data["count"]) == num_token_steps - len(run.ids)
    assert f"{len(run.ids)}/{len(run.ids)} requests finished" in view.summary.object
    assert [latency_bin(ms) for ms in (0.0, 0.1, 1.0, 1e9)] == [0, 0, 10, 69]


# ---- views of features not built yet --------------------------------------------------------------------------
def _record(step: int, events: list) -> StepRecord:
    return StepRecord(
        step=step,
        start_ns=0,
        end_ns=1_000_000,
        scheduled={},
        phases={},
        num_waiting=0,
        num_running=0,
        kv=KVUsage(8, 0, 0, 8),
        timing={},
        events=events,
    )


def test_grammar_view_is_empty_until_grammar_events(run):
    view = rendered(GrammarView())
    view.extend(run.records)
    assert view.empty.is_empty and view.empty.message.visible
    step = len(run.records) + 1
    view.update(
        _record(
            step,
            [
                GrammarCompiled(step, request_id="g", ms=9.0, cache_hit=False),
                GrammarStep(step, request_id="g", num_allowed_tokens=12, sampled_token=90, terminated=False),
                GrammarStep(
                    step, request_id="g", num_allowed_tokens=1, sampled_token=91, terminated=True, jump_forward='"}'
                ),
            ],
        )
    )
    assert not view.empty.is_empty and view.empty.content.visible
    assert view.cells.source.data["x"] == [0, 1]
    assert view.cells.source.data["num_allowed_tokens"] == [12, 1]
    assert view.compiled.source.data["ms"] == [9.0]
    view.reset()
    assert view.empty.is_empty


def test_spec_view_is_empty_until_spec_events(run):
    view = rendered(SpecDecodeView())
    view.extend(run.records)
    assert view.empty.is_empty
    view.update(
        _record(
            1,
            [
                SpecProposed(1, request_id="s", method="ngram", draft_token_ids=(5, 6, 7)),
                SpecVerified(
                    1,
                    request_id="s",
                    draft_token_ids=(5, 6, 7),
                    accepted=(True, True, False),
                    p_target=(0.9, 0.8, 0.1),
                    p_draft=(1.0, 1.0, 1.0),
                    emitted_token=3,
                    bonus=False,
                ),
                SpecVerified(
                    1,
                    request_id="s",
                    draft_token_ids=(8, 9),
                    accepted=(True, True),
                    p_target=(0.7, 0.6),
                    p_draft=(1.0, 1.0),
                    emitted_token=4,
                    bonus=True,
                ),
            ],
        )
    )
    assert not view.empty.is_empty and "ngram" in view.methods.object
    cells = view.cells.source.data
    assert cells["outcome"] == ["accepted", "accepted", "rejected", "recovered", "accepted", "accepted", "bonus"]
    assert cells["token_id"] == [5, 6, 7, 3, 8, 9, 4] and cells["y"] == [0, 0, 0, 0, -1, -1, -1]
    acceptance = view.by_position.source.data
    assert acceptance["proposed"] == [2, 2, 1] and acceptance["rate"] == [1.0, 1.0, 0.0]
    assert "cut by the grammar" not in view.methods.object
    # a guided request's drafts: the grammar cut 2 of them, then all 3 (nothing left to verify)
    view.update(
        _record(
            2,
            [
                SpecProposed(2, "g", "ngram", (5,), num_cut_by_grammar=2),
                SpecProposed(2, "g", "ngram", (), num_cut_by_grammar=3),
            ],
        )
    )
    assert view.state.spec.num_cut_by_grammar == 5 and "drafts cut by the grammar: 5" in view.methods.object
    assert len(view.cells.source.data["x"]) == 7  # nothing verified: no new cells


# ---- the dashboard and the buffers under it -------------------------------------------------------------------
def _snapshot(dashboard: Dashboard) -> dict:
    return {(type(v).__name__, b.source.name): dict(b.source.data) for v in dashboard.views for b in v._buffers}


def test_dashboard_in_one_batch_equals_step_by_step(run):
    batch, steps = Dashboard(BUDGET, 11), Dashboard(BUDGET, 11)
    batch.tabs().get_root(Document())
    batch.extend(run.records)
    for record in run.records:
        steps.update(record)
    assert _snapshot(batch) == _snapshot(steps)
    assert batch.requests.table.value.equals(steps.requests.table.value)


def test_source_buffer_sends_rows_and_patches_once():
    buf = SourceBuffer(["a", "b"])
    buf.append(a=1, b="x")
    buf.set(0, b="y")  # a row not yet sent is changed in place
    buf.flush()
    assert buf.source.data == {"a": [1], "b": ["y"]}
    buf.append(a=2, b="z")
    buf.set(0, a=10)
    assert buf.get(0, "a") == 10 and buf.get(1, "b") == "z" and len(buf) == 2
    buf.flush()
    assert buf.source.data == {"a": [10, 2], "b": ["y", "z"]}


def test_shared_state_views_are_fed_by_their_dashboard(run):
    dashboard = Dashboard()
    with pytest.raises(RuntimeError, match="Dashboard"):
        dashboard.timeline.update(run.records[0])


def test_views_render_alone_in_panel(run):
    for view in (
        SchedulerTimeline(),
        KVBlockMap(),
        PrefixCacheView(),
        RequestsView(),
        MetricsView(),
        GrammarView(),
        SpecDecodeView(),
    ):
        assert pn.panel(view).get_root(Document()) is not None


# ---- replay ---------------------------------------------------------------------------------------------------
def test_replay_moves_through_a_trace_with_the_slider(run, tmp_path):
    from workbench.app import Workbench

    path = tmp_path / "run.jsonl"
    write_trace(
        path,
        {
            "schema_version": 1,
            "config": {"max_num_batched_tokens": BUDGET},
            "model": {"name": "tiny-llama"},
            "created": "now",
        },
        run.records,
    )
    replay = Workbench.from_trace(path)
    replay.layout.get_root(Document())
    n = len(run.records)
    assert replay.step_text.object == f"step {n}" and replay.slider.end == n
    replay.slider.value = 2
    assert replay.step_text.object == "step 2"
    fresh = Dashboard(BUDGET, 11)
    fresh.extend(run.records[:2])
    assert _snapshot(replay.dashboard) == _snapshot(fresh)
    replay.step_button.clicks += 1
    assert replay.step_text.object == "step 3"
    assert replay.dashboard.timeline.steps.source.data["step"] == [1, 2, 3]


# ---- scales that show the data -----------------------------------------------------------------------------------
def _ticks_are_integers(axis) -> bool:
    return getattr(axis.ticker, "min_interval", 0) >= 1


def test_axes_fit_the_data_not_the_budget_or_the_cache_size(run):
    """A budget of 2048 or a cache of 1455 blocks, drawn beside bars of 13 tokens or 30 used blocks, must not
    set the scale: the y axes fit the data (the budget and the size are in the titles, their lines clipped)."""
    dashboard = Dashboard(2048, 1455)
    dashboard.tabs().get_root(Document())
    dashboard.extend(run.records)
    tokens = dashboard.timeline.tokens_figure
    bars = [r for r in tokens.renderers if r.data_source is dashboard.timeline.segments.source]
    assert tokens.y_range.renderers == bars and tokens.y_range.start == 0
    assert "budget 2048" in tokens.title.text
    kv = dashboard.metrics.kv_figure
    assert kv.y_range.renderers and all(r.glyph.__class__.__name__ == "VArea" for r in kv.y_range.renderers)
    assert kv.title.text.endswith(f"of {run.records[-1].kv.total} blocks")


def test_counts_get_integer_ticks_and_rates_run_from_0_to_1(run):
    dashboard = Dashboard(BUDGET, 11)
    dashboard.tabs().get_root(Document())
    timeline, metrics, prefix = dashboard.timeline, dashboard.metrics, dashboard.prefix
    figures = [pane.object for pane in timeline.panel.objects]
    for fig in figures:  # tokens per step; queue depths (no 0.5 request)
        assert _ticks_are_integers(fig.xaxis[0]) and _ticks_are_integers(fig.yaxis[0]), fig.title.text
    assert _ticks_are_integers(metrics.kv_figure.yaxis[0])
    rate = prefix.panel.objects[0].objects[1].object
    assert (rate.y_range.start, rate.y_range.end) == (0, 1.05) and _ticks_are_integers(rate.xaxis[0])
    hits = prefix.panel.objects[0].objects[0].object
    assert hits.xaxis[0].formatter.args["source"] is prefix.hits.source  # bars named by request, not -0.5


def test_grammar_and_speculative_views_label_their_rows_and_explain_their_colours():
    grammar, spec = rendered(GrammarView()), rendered(SpecDecodeView())
    grammar_fig = grammar.empty.content.objects[0].object
    assert grammar_fig.yaxis[0].visible and grammar_fig.yaxis[0].formatter.args["source"] is grammar.cells.source
    assert any(type(r).__name__ == "ColorBar" for r in grammar_fig.right)
    spec_fig = spec.empty.content.objects[1].objects[0].object
    assert spec_fig.yaxis[0].formatter.args["source"] is spec.cells.source
    spec.update(
        StepRecord(
            1,
            0,
            1,
            {"0": 3},
            {"0": "verify"},
            0,
            1,
            KVUsage(8, 1, 0, 7),
            {},
            [
                SpecProposed(1, "0", "ngram", (5, 6)),
                SpecVerified(1, "0", (5, 6), (True, False), (0.9, 0.1), (1.0, 1.0), 7, False),
            ],
        )
    )
    assert spec.cells.source.data["row"][0] == "step 1 · 0"
    assert {item.label["field"] for item in spec_fig.legend[0].items} == {"outcome"}


def test_the_requests_table_shows_its_text_early_and_wrapped():
    table = RequestsView().table
    assert list(table.value.columns).index("text") <= 3
    assert table.formatters["text"] == {"type": "textarea"}


# ---- one state: the views read it and the step's delta, never the events -------------------------------------------
def test_no_view_reads_the_events_of_a_record():
    """Every event is handled once, in EngineState.apply: no view module touches `.events` or `.of_kind(`."""
    readers = []
    for path in sorted(Path(workbench.views.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in ("events", "of_kind"):
                readers.append(f"{path.name}:{node.lineno} .{node.attr}")
    assert not readers, readers


@pytest.fixture(scope="module")
def guided() -> list[StepRecord]:
    """An n-gram engine with guided requests: grammar.* and spec.* events besides the prefix cache's."""
    engine = LLMEngine(
        model="tiny-llama",
        block_size=16,
        num_kv_blocks=32,
        max_num_batched_tokens=64,
        max_model_len=256,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    repeat = StructuredOutputsParams(regex="( a b c d){3}")  # the random tiny model repeats: drafts to verify
    for guide, max_tokens in ((repeat, 12), (repeat, 12), (StructuredOutputsParams(regex="(yes|no)"), 6)):
        engine.add_request(
            "a b c d a b c d a b c d a b c",
            SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=guide),
        )
    records = []
    while engine.has_unfinished_requests():
        records.append(engine.step())
    kinds = Counter(e.kind for r in records for e in r.events)
    assert kinds["grammar.compiled"] and kinds["grammar.step"] and kinds["spec.verified"], kinds
    return records


def _fed(records: list[StepRecord]) -> tuple[EngineState, Dashboard]:
    """A state and a Dashboard, each fed the records on its own."""
    state, dashboard = EngineState(), Dashboard()
    for record in records:
        state.apply(record)
    dashboard.extend(records)
    return state, dashboard


def _events(records: list[StepRecord], kind: str) -> list:
    return [e for r in records for e in r.of_kind(kind)]


def test_state_holds_the_grammar_steps_the_grammar_view_draws(guided):
    state, dashboard = _fed(guided)
    steps = _events(guided, "grammar.step")
    expected = {
        rid: [e.num_allowed_tokens for e in steps if e.request_id == rid]
        for rid in dict.fromkeys(e.request_id for e in steps)
    }
    assert {rid: [p.num_allowed_tokens for p in ps] for rid, ps in state.grammar.positions.items()} == expected
    assert all([p.position for p in ps] == list(range(len(ps))) for ps in state.grammar.positions.values())
    assert [(c.request_id, c.ms) for c in state.grammar.compiles] == [
        (e.request_id, e.ms) for e in _events(guided, "grammar.compiled")
    ]
    cells = dashboard.grammar.cells.source.data
    assert cells["num_allowed_tokens"] == [e.num_allowed_tokens for e in steps]
    assert cells["request_id"] == [e.request_id for e in steps]


def test_state_holds_the_verifications_the_spec_view_draws(guided):
    state, dashboard = _fed(guided)
    verified = _events(guided, "spec.verified")
    assert [(v.request_id, v.draft_token_ids, v.accepted, v.emitted_token) for v in state.spec.verifications] == [
        (e.request_id, e.draft_token_ids, e.accepted, e.emitted_token) for e in verified
    ]
    depth = max(len(e.draft_token_ids) for e in verified)
    proposed = [sum(len(e.accepted) > i for e in verified) for i in range(depth)]
    accepted = [sum(len(e.accepted) > i and e.accepted[i] for e in verified) for i in range(depth)]
    assert (state.spec.proposed, state.spec.accepted) == (proposed, accepted)
    assert state.spec.method == _events(guided, "spec.proposed")[-1].method == "ngram"
    drawn = dashboard.spec.by_position.source.data
    assert (drawn["proposed"], drawn["accepted"]) == (proposed, accepted)
    assert drawn["rate"] == [a / p for a, p in zip(accepted, proposed)]


def test_state_holds_the_lookups_and_chains_the_prefix_view_draws(run):
    state, view = EngineState(), rendered(PrefixCacheView())
    deltas = [state.apply(record) for record in run.records]
    view.extend(run.records)
    lookups = _events(run.records, "prefix.lookup")
    last = {e.request_id: e for e in lookups}
    assert {rid: (lu.hit_tokens, lu.hit_blocks) for rid, lu in state.prefix.lookups.items()} == {
        rid: (e.num_hit_tokens, e.num_hit_blocks) for rid, e in last.items()
    }
    assert state.prefix.hit_tokens == sum(e.num_hit_tokens for e in lookups)
    assert state.prefix.hit_rate == view.rate.source.data["hit_rate"][-1]
    evicted: dict[str, bool] = {}  # hash -> evicted, replaying the events in order
    for e in (e for r in run.records for e in r.events if e.kind in ("kv.cached", "kv.evicted")):
        if e.kind == "kv.cached" or e.block_hash in evicted:
            evicted[e.block_hash] = e.kind == "kv.evicted"
    assert {h: node.evicted for h, node in state.prefix.chains.items()} == evicted
    assert list(state.prefix.chains) == list(evicted)  # in the order first cached: parents first
    assert [h for d in deltas for h in d.cached] == [e.block_hash for e in _events(run.records, "kv.cached")]
    nodes = view.nodes.source.data
    assert [(h[:12], "evicted" if node.evicted else "cached") for h, node in state.prefix.chains.items()] == list(
        zip(nodes["hash"], nodes["status"])
    )


def test_state_holds_the_transfers_per_instance_the_transfer_view_draws():
    common = dict(connector="SharedStorageConnector", key="k", num_blocks=2, num_tokens=20, ms=2.0, mb_per_s=1.0)
    records = [
        _record(1, [KVTransferSave(1, request_id="a", instance="prefill-0", num_bytes=2_000_000, **common)]),
        _record(
            2,
            [
                KVTransferLoad(2, request_id="a", instance="decode-0", num_bytes=3_000_000, **common),
                KVTransferFail(
                    2,
                    request_id="b",
                    instance="decode-0",
                    connector="RedisConnector",
                    failure="timeout",
                    policy_action="recompute",
                    num_recomputed_tokens=31,
                ),
            ],
        ),
    ]
    dashboard = Dashboard()
    dashboard.extend(records)
    moved = dashboard.state.kv_transfer
    assert moved.mb_by_instance == {"prefill-0": 2.0, "decode-0": 3.0} and moved.origin_ns == 0
    assert [(t.kind, t.instance, t.mb, t.instance_mb, t.failure) for t in moved.transfers] == [
        ("kv_transfer.save", "prefill-0", 2.0, 2.0, ""),
        ("kv_transfer.load", "decode-0", 3.0, 3.0, ""),
        ("kv_transfer.fail", "decode-0", 0.0, 3.0, "timeout"),
    ]
    assert dashboard.kv_transfer.points.source.data["mb"] == [t.instance_mb for t in moved.transfers]
    assert dashboard.kv_transfer.rows.source.data["kind"] == ["save", "load", "fail"]


def test_a_snapshot_state_holds_its_cached_chains_parents_first():
    """A view attached mid-run draws the chains of `EngineState.load` (show_state): each hash after its parent."""
    engine = LLMEngine(
        model="tiny-llama", block_size=16, num_kv_blocks=16, max_num_batched_tokens=64, max_model_len=256
    )
    engine.add_request(list(range(100, 150)), SamplingParams(temperature=0.0, max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    dashboard = Dashboard()
    dashboard.reset(snapshot=engine.snapshot())
    chains = dashboard.state.prefix.chains
    assert len(chains) == 3 and not any(node.evicted for node in chains.values())
    order = list(chains)
    assert all(node.parent_hash is None or order.index(node.parent_hash) < i for i, node in enumerate(chains.values()))
    assert dashboard.prefix.nodes.source.data["hash"] == [h[:12] for h in order]
