"""Step traces: what TraceWriter writes reads back into equal StepRecords, a file cut short still reads, and
malformed files fail with the line named."""

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest

from engine import SamplingParams
from workbench.trace import SCHEMA_VERSION, Trace, TraceWriter, read_trace, write_trace


@dataclass
class Recorded:
    path: Path
    records: list  # the StepRecords as the engine handed them to its subscribers
    num_records_while_open: int  # what read_trace saw after the first step, the writer still open
    config: dict
    model_path: str


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Recorded:
    """A tiny-llama run with a prefix hit, chunked prefill and preemption (a small cache), traced."""
    from engine import LLMEngine

    engine = LLMEngine(model="tiny-llama", block_size=4, num_kv_blocks=12, max_num_batched_tokens=16)
    path = tmp_path_factory.mktemp("trace") / "run.jsonl"
    shared = list(range(100, 112))
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for tail in ([7, 8, 9], [17, 18, 19], [27, 28]):
        engine.add_request(shared + tail, params)
    records = []
    with TraceWriter(path, engine) as writer:
        engine.subscribe(writer)
        engine.subscribe(records.append)
        engine.step()
        seen_open = len(read_trace(path).records)
        while engine.has_unfinished_requests():
            engine.step()
    return Recorded(path, records, seen_open, engine.config.to_dict(), str(engine.model_path))


def test_round_trip_gives_equal_step_records(recorded):
    trace = read_trace(recorded.path)
    assert len(trace.records) == len(recorded.records) > 3
    assert trace.records == recorded.records
    kinds = {e.kind for r in trace.records for e in r.events}
    # the run exercises what the views need, so equality covers the interesting payloads
    assert {
        "request.added",
        "request.scheduled",
        "request.tokens",
        "request.finished",
        "kv.allocated",
        "kv.freed",
        "kv.cached",
        "prefix.lookup",
        "step.timing",
    } <= kinds
    allocated = next(e for r in trace.records for e in r.events if e.kind == "kv.allocated")
    assert isinstance(allocated.block_ids, tuple) and isinstance(allocated.new_block_ids, tuple)


def test_a_preemption_survives_the_round_trip(recorded):
    preempted = [e for r in read_trace(recorded.path).records for e in r.events if e.kind == "request.preempted"]
    assert preempted, "the small cache should force a preemption"


def test_header_holds_schema_config_model_and_time(recorded):
    header = read_trace(recorded.path).header
    assert header["schema_version"] == SCHEMA_VERSION
    assert header["config"] == recorded.config and header["config"]["block_size"] == 4
    assert header["model"] == {"name": "tiny-llama", "path": recorded.model_path}
    assert datetime.fromisoformat(header["created"]).tzinfo is not None
    assert header["engine_version"]


def test_each_step_is_flushed_as_it_is_written(recorded):
    assert recorded.num_records_while_open == 1


def test_write_trace_writes_what_trace_writer_writes(recorded, tmp_path):
    trace = read_trace(recorded.path)
    out = tmp_path / "copy.jsonl"
    write_trace(out, trace.header, trace.records)
    assert out.read_text() == recorded.path.read_text()
    assert read_trace(out) == trace


def test_a_file_cut_in_its_last_line_reads_every_complete_line(recorded, tmp_path):
    text = recorded.path.read_text()
    last_line_start = text.rstrip("\n").rfind("\n") + 1
    cut = tmp_path / "cut.jsonl"
    for end in (last_line_start + 1, (last_line_start + len(text)) // 2, len(text) - 2):
        cut.write_text(text[:end])
        assert read_trace(cut).records == recorded.records[:-1]
    cut.write_text(text[:-1])  # only the final newline lost: the last line is whole
    assert read_trace(cut).records == recorded.records


def test_a_file_cut_in_an_early_line_keeps_the_steps_before(recorded, tmp_path):
    lines = recorded.path.read_text().splitlines(keepends=True)
    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join(lines[:3]) + lines[3][: len(lines[3]) // 2])
    assert read_trace(cut).records == recorded.records[:2]


def test_a_header_only_trace_has_no_records(recorded, tmp_path):
    header_only = tmp_path / "header.jsonl"
    header_only.write_text(recorded.path.read_text().splitlines(keepends=True)[0])
    assert read_trace(header_only) == Trace(read_trace(recorded.path).header, [])


@pytest.mark.parametrize(
    "mangle, message",
    [
        (lambda lines: lines[:2] + ["{not json\n"] + lines[2:], ":3: not a JSON line"),
        (lambda lines: [], "empty"),
        (lambda lines: ['{"schema_version": 99}\n'] + lines[1:], "newer than this reader"),
        (lambda lines: ['{"config": {}}\n'] + lines[1:], "not a trace header"),
        (lambda lines: lines[:1] + ["[1, 2]\n"] + lines[1:], ":2: expected a JSON object"),
    ],
)
def test_malformed_files_fail_naming_the_line(recorded, tmp_path, mangle, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(mangle(recorded.path.read_text().splitlines(keepends=True))))
    with pytest.raises(ValueError, match=message):
        read_trace(bad)


def test_an_unknown_event_kind_is_named(recorded, tmp_path):
    lines = recorded.path.read_text().splitlines(keepends=True)
    record = json.loads(lines[1])
    record["events"].append({"kind": "no.such.event", "step": record["step"]})
    bad = tmp_path / "unknown.jsonl"
    bad.write_text(lines[0] + json.dumps(record) + "\n")
    with pytest.raises(ValueError, match=r":2: .*no\.such\.event"):
        read_trace(bad)
