"""The speculative view's table of each request's last verification (the draft's q beside the target's p, the
outcome and the rule's verdict), and spec.verified's fields through a trace: real runs with n-gram (no draft
distribution; smollm2, which continues repeating text) and EAGLE (tiny-llama with a tiny trained head), a greedy and
a sampled request each."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pytest
from bokeh.document import Document

from engine import LLMEngine, SamplingParams, StepRecord
from engine.events import Event, KVUsage, SpecVerified
from tests.spec_decode.test_eagle_medusa import K, _trained_head
from tests.spec_decode.test_spec_decoding import NGRAM, _prompts
from workbench.trace import TraceWriter, read_trace
from workbench.views import SpecDecodeView

USAGE = KVUsage(8, 1, 0, 7)


@dataclass
class SpecRun:
    records: list[StepRecord]
    trace: Path
    greedy_id: str
    sampled_id: str


def _run(model: str, spec: dict, path: Path) -> SpecRun:
    engine = LLMEngine(model=model, speculative_config=spec, seed=0)
    prompts = [list(p) for p in _prompts(model)[:2]]
    greedy = engine.add_request(prompts[0], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    sampled = engine.add_request(prompts[1], SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=3))
    records = []
    with TraceWriter(path, engine) as writer:
        engine.subscribe(writer)
        engine.subscribe(records.append)
        while engine.has_unfinished_requests():
            engine.step()
    return SpecRun(records, path, greedy, sampled)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("spec_view")


@pytest.fixture(scope="module")
def ngram_run(root) -> SpecRun:
    return _run("smollm2-135m", NGRAM, root / "ngram.jsonl")


@pytest.fixture(scope="module")
def eagle_run(root) -> SpecRun:
    spec = {"method": "eagle", "model": _trained_head("eagle", str(root)), "num_speculative_tokens": K}
    return _run("tiny-llama", spec, root / "eagle.jsonl")


METHODS = [pytest.param("ngram", marks=pytest.mark.slow), "eagle"]


def _verified(records: list[StepRecord]) -> list[SpecVerified]:
    return [e for r in records for e in r.of_kind("spec.verified")]


@pytest.mark.parametrize("method", METHODS)
def test_the_spec_fields_survive_a_trace(method, request) -> None:
    run = request.getfixturevalue(f"{method}_run")
    trace = read_trace(run.trace)
    assert trace.records == run.records
    verified = _verified(trace.records)
    assert {e.request_id for e in verified} == {run.greedy_id, run.sampled_id}
    assert {e.rule for e in verified} == {"greedy", "sampled"}
    for e in verified:
        assert isinstance(e.target_argmax, tuple) and isinstance(e.uniform_probs, tuple)
        assert isinstance(e.draft_texts, tuple) and all(isinstance(t, str) for t in e.draft_texts)
        assert e.p_draft is None if method == "ngram" else isinstance(e.p_draft, tuple)


def test_a_trace_from_before_the_fields_reads_with_their_defaults() -> None:
    old = {
        "kind": "spec.verified",
        "step": 2,
        "request_id": "r",
        "draft_token_ids": [5, 6],
        "accepted": [True, False],
        "p_target": [0.9, 0.1],
        "p_draft": [1.0, 1.0],
        "emitted_token": 7,
        "bonus": False,
        "method": "ngram",
    }
    e = Event.from_dict(old)
    assert (e.rule, e.target_argmax, e.uniform_probs, e.draft_texts, e.emitted_text) == ("", (), (), (), "")
    view = SpecDecodeView()
    view.update(StepRecord(2, 0, 1, {}, {}, 0, 1, USAGE, {}, [e]))
    table = view.last.value
    assert list(table["token"]) == ["id 5", "id 6", "id 7"] and list(table["why"]) == ["", "", ""]


@pytest.mark.parametrize("method", METHODS)
def test_the_table_holds_each_requests_last_verification(method, request) -> None:
    run = request.getfixturevalue(f"{method}_run")
    view = SpecDecodeView()
    Document().add_root(view.panel.get_root())
    view.extend(run.records)
    table = view.last.value
    assert list(dict.fromkeys(table["request_id"])) == list(dict.fromkeys(e.request_id for e in _verified(run.records)))
    for rid in (run.greedy_id, run.sampled_id):
        e = [v for v in _verified(run.records) if v.request_id == rid][-1]
        rows = table[table["request_id"] == rid]
        n, num_accepted = len(e.draft_token_ids), sum(e.accepted)
        assert list(rows["step"]) == [next(r.step for r in run.records if e in r.events)] * (n + 1)
        assert list(rows["position"]) == list(range(n + 1))
        assert list(rows["token"]) == [repr(t) for t in (*e.draft_texts, e.emitted_text)]
        assert list(rows["p"])[:n] == list(e.p_target) and math.isnan(list(rows["p"])[n])
        q = list(rows["q"])
        assert all(math.isnan(x) for x in q) if method == "ngram" else q[:n] == list(e.p_draft)
        outcomes = ["accepted"] * num_accepted + (["rejected"] if num_accepted < n else [])
        outcomes += ["not reached"] * (n - len(outcomes)) + ["bonus" if e.bonus else "recovered"]
        assert list(rows["outcome"]) == outcomes
        judged = list(rows["why"])[: min(num_accepted + 1, n)]
        assert all(("u = " in w) if rid == run.sampled_id else ("top token" in w) for w in judged), judged
    assert ("no distribution" in view.methods.object) == (method == "ngram")


def test_the_verdicts_quote_the_numbers() -> None:
    view = SpecDecodeView()
    greedy = SpecVerified(
        1,
        "g",
        (5, 6, 7),
        (True, False, False),
        (0.7, 0.2, 0.4),
        (0.9, 0.6, 0.5),
        8,
        False,
        "eagle",
        "greedy",
        (5, 8, 3),
        (),
        ("a", " b", "c"),
        " d",
    )
    sampled = SpecVerified(
        1,
        "s",
        (5, 6),
        (True, True),
        (0.5, 0.3),
        (0.8, 0.2),
        9,
        True,
        "eagle",
        "sampled",
        (4, 6),
        (0.2, 0.99),
        ("x", "y"),
        "z",
    )
    view.update(StepRecord(1, 0, 1, {}, {}, 0, 2, USAGE, {}, [greedy, sampled]))
    assert list(view.last.value["why"]) == [
        "the target's top token too",
        "the target's top token is ' d'",
        "after the first rejection: never judged",
        "the target's own token in place of the rejected draft",
        "u = 0.200 < min(1, p/q) = 0.625",
        "u = 0.990 < min(1, p/q) = 1.000",
        "every draft stood: one more token from the target, after them",
    ]
    assert list(view.last.value["outcome"]) == [
        "accepted",
        "rejected",
        "not reached",
        "recovered",
        "accepted",
        "accepted",
        "bonus",
    ]
    # a newer verification of a request replaces its rows; a reset empties the table
    view.update(
        StepRecord(
            2,
            0,
            1,
            {},
            {},
            0,
            2,
            USAGE,
            {},
            [
                SpecVerified(
                    2, "g", (1,), (False,), (0.1,), (0.3,), 2, False, "eagle", "sampled", (2,), (0.5,), ("e",), "f"
                )
            ],
        )
    )
    rows = view.last.value
    assert list(rows["request_id"]) == ["g", "g", "s", "s", "s"] and list(rows["step"])[:2] == [2, 2]
    assert rows["why"][0] == "u = 0.500 >= min(1, p/q) = 0.333"
    assert rows["why"][1] == "drawn from max(p - q, 0), normalised, in place of the rejected draft"
    view.reset()
    assert view.last.value.empty
