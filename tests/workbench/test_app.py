"""The Workbench's controls without a browser: clicks are `button.clicks += 1` on the real widgets, the engine
is tiny-llama; plus the `serve` / `replay` command lines up to where a server would start."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from bokeh.document import Document

from engine import LLMEngine, SamplingParams, StructuredOutputsParams
from workbench.app import Workbench
from workbench.cli import build_parser, main

PROMPTS = ("The capital of France is", "A paged KV cache stores keys and values in blocks")


@pytest.fixture
def bench() -> Workbench:
    engine = LLMEngine(
        model="tiny-llama", block_size=16, num_kv_blocks=32, max_num_batched_tokens=64, max_model_len=256
    )
    wb = Workbench(engine, play_delay_s=0.0)
    wb.layout.get_root(Document())
    yield wb
    wb.pause()
    wb.stepper.join(timeout=30)


def queue(wb: Workbench, max_tokens: int = 8) -> list[str]:
    return [wb.engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=max_tokens)) for p in PROMPTS]


def used_cells(wb: Workbench) -> int:
    return wb.dashboard.kv_blocks.cells.source.data["kind"].count("used")


def test_step_and_run_buttons_move_the_engine_and_the_views(bench):
    assert bench.step_text.object == "step 0" and used_cells(bench) == 0
    ids = queue(bench)
    bench.step_button.clicks += 1
    assert bench.step_text.object == "step 1"
    assert used_cells(bench) == bench.engine.kv_cache_manager.usage().used > 0
    assert sum(bench.dashboard.timeline.segments.source.data["num_tokens"]) == sum(
        len(bench.engine.get_output(rid).prompt_token_ids) for rid in ids
    )
    bench.run_steps.value = 3
    bench.run_button.clicks += 1
    assert bench.step_text.object == "step 4" and bench.engine.step_count == 4
    table = bench.dashboard.requests.table.value
    assert list(table["text"]) == [bench.engine.get_output(rid).text for rid in ids]


def test_step_with_nothing_to_run_says_so(bench):
    bench.step_button.clicks += 1
    assert bench.step_text.object == "step 0" and bench.engine.step_count == 0
    assert bench.message.visible and "add a request" in bench.message.object


def test_reset_brings_a_fresh_engine_and_empty_views(bench):
    queue(bench)
    bench.run_steps.value = 2
    bench.run_button.clicks += 1
    old = bench.engine
    bench.reset_button.clicks += 1
    assert bench.engine is not old and bench.engine.config.max_num_batched_tokens == 64
    assert bench.step_text.object == "step 0" and not bench.engine.has_unfinished_requests()
    assert bench.dashboard.timeline.segments.source.data["step"] == []
    assert bench.dashboard.requests.table.value.empty and used_cells(bench) == 0
    old.step()  # the old engine no longer feeds the views
    assert bench.dashboard.timeline.steps.source.data["step"] == []


@pytest.mark.parametrize(
    "field, value, error",
    [
        ("max_tokens", 0, "max_tokens: must be >= 1"),
        ("temperature", -1.0, "temperature: must be >= 0"),
        ("prompt", "", "prompt: must not be empty"),
        ("guide", "{not json", "structured_outputs.json: not valid JSON"),
        ("guide", "", "structured_outputs: the JSON schema is empty"),
    ],
)
def test_a_bad_request_shows_the_error_and_leaves_the_engine_alone(bench, field, value, error):
    form = bench.request_form
    if field == "guide":
        form.guide_kind.value = "JSON schema"
    getattr(form, field).value = value
    form.button.clicks += 1
    assert bench.message.visible and error in bench.message.object and bench.message.alert_type == "danger"
    assert not bench.engine.has_unfinished_requests() and bench.engine.events.drain() == []


def test_a_bad_regex_from_the_form_is_refused_at_once_and_queues_nothing(bench):
    form = bench.request_form
    form.guide_kind.value, form.guide.value = "regex", "[a-z"
    form.button.clicks += 1  # no step: the engine refuses it at add_request, not when the grammar compiles
    assert bench.message.visible and bench.message.alert_type == "danger"
    assert "structured_outputs.regex: invalid regular expression" in bench.message.object, bench.message.object
    engine = bench.engine
    assert not engine.has_unfinished_requests() and engine.scheduler.requests == {}
    assert engine.events.drain() == [] and engine.kv_cache_manager.usage().used == 0
    form.guide.value = "[a-z]{3}"
    form.button.clicks += 1
    assert "request 0 queued" in bench.message.object  # the refused request took no id


def test_the_form_queues_a_request_that_the_next_step_shows(bench):
    form = bench.request_form
    form.prompt.value, form.max_tokens.value, form.seed.value, form.priority.value = "Hello there", 4, 7, 1
    form.cache_salt.value = "tenant-a"
    form.button.clicks += 1
    assert "request 0 queued" in bench.message.object
    bench.step_button.clicks += 1
    assert list(bench.dashboard.requests.table.value["request_id"]) == ["0"]


def test_a_guided_request_from_the_form_fills_the_grammar_view(bench):
    form = bench.request_form
    form.prompt.value, form.max_tokens.value = "Answer:", 6
    form.guide_kind.value, form.guide.value = "regex", "(yes|no)"
    form.button.clicks += 1
    assert "queued" in bench.message.object, bench.message.object
    assert bench.dashboard.grammar.empty.is_empty
    bench.run_steps.value = 1000
    bench.run_button.clicks += 1
    out = bench.engine.get_output("0")
    assert out.finished and out.text in ("yes", "no")
    grammar = bench.dashboard.grammar
    assert not grammar.empty.is_empty and grammar.compiled.source.data["request_id"] == ["0"]
    assert len(grammar.cells.source.data["x"]) == len(out.token_ids)


def test_config_knobs_rebuild_the_engine_or_show_why_not(bench):
    knobs = bench.engine_form
    knobs.budget.value, knobs.block_size.value, knobs.prefix_caching.value = 16, 32, False
    knobs.button.clicks += 1
    config = bench.engine.config
    assert (config.max_num_batched_tokens, config.block_size, config.enable_prefix_caching) == (16, 32, False)
    assert bench.dashboard.timeline.budget == 16 and "engine rebuilt" in bench.message.object
    knobs.spec_method.value, knobs.spec_k.value = "ngram", 2
    knobs.button.clicks += 1
    assert bench.engine.config.speculative_config == {"method": "ngram", "num_speculative_tokens": 2}
    engine = bench.engine
    knobs.spec_method.value = "draft_model"  # needs a draft model the knobs do not name
    knobs.button.clicks += 1
    assert "speculative_config.model" in bench.message.object and bench.message.alert_type == "danger"
    knobs.spec_method.value, knobs.block_size.value = "none", 12
    knobs.button.clicks += 1
    assert "block_size: must be a power of two" in bench.message.object
    assert bench.engine is engine


def test_an_ngram_engine_fills_the_speculative_view(bench):
    knobs = bench.engine_form
    knobs.spec_method.value, knobs.spec_k.value = "ngram", 3
    knobs.button.clicks += 1
    # a grammar makes even the random tiny model repeat its prompt, which is what n-gram lookup feeds on
    bench.engine.add_request(
        "a b c d a b c d a b c d a b c",
        SamplingParams(
            temperature=0.0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex="( a b c d){3}")
        ),
    )
    bench.run_steps.value = 50
    bench.run_button.clicks += 1
    spec = bench.dashboard.spec
    verified = spec.cells.source.data["outcome"]
    assert not spec.empty.is_empty and "ngram" in spec.methods.object
    assert verified.count("bonus") + verified.count("recovered") == len(set(zip(spec.cells.source.data["y"])))


def test_play_steps_off_the_ui_thread_until_pause(bench):
    queue(bench, max_tokens=200)
    bench.play_button.clicks += 1
    deadline = time.monotonic() + 20
    while bench.engine.step_count < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    bench.pause_button.clicks += 1
    bench.stepper.join(timeout=20)
    assert not bench.stepper.is_busy and bench.engine.step_count >= 3
    assert bench.step_text.object == f"step {bench.engine.step_count}"
    assert bench.engine.has_unfinished_requests(), "paused before the requests finished"
    assert not bench.message.visible


def test_play_stops_by_itself_when_every_request_has_finished(bench):
    ids = queue(bench, max_tokens=3)
    bench.play_button.clicks += 1
    bench.stepper.join(timeout=30)
    assert all(bench.engine.get_output(rid).finished for rid in ids)
    assert "Nothing to run" in bench.message.object


def test_an_engine_error_is_shown_not_raised(bench, monkeypatch):
    queue(bench)

    def broken_step():
        raise RuntimeError("the forward pass fell over")

    monkeypatch.setattr(bench.engine, "step", broken_step)
    bench.step_button.clicks += 1
    assert "engine error: RuntimeError: the forward pass fell over" in bench.message.object


# ---- command lines -----------------------------------------------------------------------------------------
def test_serve_and_replay_parse_their_flags():
    args = build_parser().parse_args(
        [
            "serve",
            "--port",
            "7000",
            "--model",
            "tiny-llama",
            "--prompt",
            "a",
            "--prompt",
            "b",
            "--max-num-batched-tokens",
            "32",
        ]
    )
    assert (args.port, args.prompt, args.max_num_batched_tokens, args.num_kv_blocks) == (7000, ["a", "b"], 32, 256)
    assert build_parser().parse_args(["replay", "t.jsonl", "--port", "7001"]).trace == "t.jsonl"


def test_replay_of_a_missing_trace_fails_before_serving(tmp_path, capsys):
    assert main(["replay", str(tmp_path / "missing.jsonl"), "--port", "7002"]) == 2
    assert "missing.jsonl" in capsys.readouterr().err


def test_the_cli_and_the_package_do_not_import_panel():
    code = (
        "import sys, workbench, workbench.cli; workbench.cli.build_parser(); "
        "assert 'panel' not in sys.modules and 'torch' not in sys.modules, 'a heavy import at start'"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    import workbench

    assert workbench.Workbench is Workbench  # exported lazily, on first use


# ---- a view attached mid-run; what the form reads --------------------------------------------------------------
def test_a_workbench_attached_mid_run_starts_from_the_engine_state():
    """Attached after 3 steps, with prefix caching on: `step 3`, every request with its status and text, and
    every block as the engine has it (held by whom, cached-free with its hash, free); then it follows records."""
    engine = LLMEngine(
        model="tiny-llama",
        block_size=16,
        num_kv_blocks=32,
        max_num_batched_tokens=64,
        max_model_len=256,
        enable_prefix_caching=True,
    )
    done = engine.add_request(PROMPTS[1] * 3, SamplingParams(temperature=0.0, max_tokens=2))
    going = engine.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=20))
    for _ in range(3):
        engine.step()
    queued = engine.add_request("Queued before the view came", SamplingParams(max_tokens=4))
    wb = Workbench(engine)
    wb.layout.get_root(Document())
    assert wb.step_text.object == "step 3"
    table = wb.dashboard.requests.table.value.set_index("request_id")
    assert table.loc[done, "status"] == "finished" and table.loc[going, "status"] == "running"
    assert table.loc[queued, "status"] == "waiting"
    assert table.loc[going, "text"] == engine.get_output(going).text != ""
    cells = wb.dashboard.kv_blocks.cells.source.data
    usage = engine.kv_cache_manager.usage()
    assert cells["kind"].count("used") == usage.used and cells["kind"].count("cached") == usage.cached_free > 0
    held = engine.kv_cache_manager.get_block_ids(going)
    assert [cells["holders"][b - 1] for b in held] == [going] * len(held)
    assert wb.dashboard.kv_blocks.select.options[1:] == [done, going, queued]
    assert len(wb.dashboard.prefix.nodes.source.data["hash"]) == usage.cached_free + sum(
        1 for b in engine.kv_cache_manager.block_pool.blocks if b.ref_cnt and b.block_hash is not None
    )
    wb.step_button.clicks += 1  # then it follows: the queued request's request.added is not a second row
    table = wb.dashboard.requests.table.value
    assert wb.step_text.object == "step 4" and list(table["request_id"]) == [done, going, queued]
    assert wb.dashboard.timeline.steps.source.data["step"] == [4]


def test_the_form_reads_the_prompt_as_typed_before_the_field_loses_focus(bench):
    """In a browser `value_input` follows each key and `value` only the blur: a click straight after typing
    must take what was typed. And text set from code (`value`) is what the form reads too."""
    form = bench.request_form
    form.prompt.value_input = "Typed, not yet blurred"
    form.cache_salt.value_input = "tenant-b"
    form.button.clicks += 1
    bench.step_button.clicks += 1
    assert bench.dashboard.state.requests["0"].prompt == "Typed, not yet blurred"
    form.prompt.value = "Set from code"
    form.button.clicks += 1
    bench.step_button.clicks += 1
    assert bench.dashboard.state.requests["1"].prompt == "Set from code"
