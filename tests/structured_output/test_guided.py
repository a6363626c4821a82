"""Guided decoding with xgrammar: outputs obey their grammar, greedy equals a masked transformers run,
a broken grammar fails alone, and compiling never blocks other requests."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pydantic
import pytest
import torch

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.model import resolve_model
from engine.structured_output.backend_xgrammar import XgrammarBackend, grammar_key

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "maxLength": 24},
        },
        "required": ["name", "age"],
    },
    "order": {
        "type": "object",
        "properties": {
            "status": {"enum": ["pending", "shipped", "delivered"]},
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["sku", "qty"],
                },
            },
            "total": {"type": "number", "minimum": 0, "maximum": 1000},
        },
        "required": ["status", "items", "total"],
    },
    "flags": {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "scores": {"type": "array", "items": {"type": "integer"}, "maxItems": 4},
            "meta": {"type": "object", "properties": {"level": {"enum": [1, 2, 3]}}, "required": ["level"]},
        },
        "required": ["ok", "meta"],
    },
}
EXPR_GRAMMAR = r"""
root ::= term (op term)? (op term)?
term ::= num | "(" num op num ")"
op ::= "+" | "-"
num ::= [1-9] [0-9]?
"""


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="smollm2-135m", max_num_batched_tokens=256, long_prefill_token_threshold=64)


def test_exactly_one_constraint_is_required() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a+", choice=["a"])
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])


@pytest.mark.slow
def test_sampled_json_validates_against_its_schema(llm: LLM) -> None:
    prompts, params, schemas = [], [], []
    for name, schema in SCHEMAS.items():
        for seed in range(4):
            prompts.append(f"Return one {name} record as JSON: ")
            params.append(
                SamplingParams(
                    temperature=1.0, seed=seed, max_tokens=160, structured_outputs=StructuredOutputsParams(json=schema)
                )
            )
            schemas.append(schema)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, schema in zip(outs, schemas):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)


@pytest.mark.slow
def test_regex_choice_grammar_and_json_object(llm: LLM) -> None:
    regex = r"[A-Z][a-z]{2,6}-\d{2,3}"
    kinds = [
        ("regex", StructuredOutputsParams(regex=regex)),
        ("choice", StructuredOutputsParams(choice=["Positive", "Negative", "Neutral"])),
        ("grammar", StructuredOutputsParams(grammar=EXPR_GRAMMAR)),
        ("json_object", StructuredOutputsParams(json_object=True)),
    ]
    prompts, params, names = [], [], []
    for name, so in kinds:
        for seed in range(3):
            prompts.append("Answer: ")
            params.append(SamplingParams(temperature=1.0, seed=seed, max_tokens=60, structured_outputs=so))
            names.append(name)
    for name, out in zip(names, llm.generate(prompts, params, use_tqdm=False)):
        text = out.text
        if name == "regex":
            assert re.fullmatch(regex, text), text
        elif name == "choice":
            assert text in ("Positive", "Negative", "Neutral"), text
        elif name == "grammar":
            assert re.fullmatch(r"[0-9()+\-]+", text) and out.finish_reason == "stop", text
            assert eval(text) == eval(text)  # parses as the arithmetic the grammar describes
        elif out.finish_reason == "stop":  # json_object may run out of tokens; a finished one must parse
            json.loads(text)


class _GrammarLogitsProcessor:
    """transformers-side reference: the same compiled grammar's mask, applied to generate()'s logits."""

    def __init__(self, backend: XgrammarBackend, key) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(backend.compile(key))
        self.bitmask = backend.allocate_bitmask(1)
        self.prompt_len = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        import xgrammar as xgr

        if self.prompt_len is None:
            self.prompt_len = input_ids.shape[1]
        else:
            assert self.matcher.accept_token(int(input_ids[0, -1]))
        self.matcher.fill_next_token_bitmask(self.bitmask)
        scores = scores.clone()
        xgr.apply_token_bitmask_inplace(scores, self.bitmask)
        return scores


@pytest.mark.slow
def test_greedy_guided_equals_masked_transformers(llm: LLM) -> None:
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    path = resolve_model("smollm2-135m")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    backend = XgrammarBackend(llm.tokenizer, llm.engine.runner.vocab_size)
    cases = [
        ("A person as JSON: ", StructuredOutputsParams(json=SCHEMAS["person"])),
        ("Sum: ", StructuredOutputsParams(grammar=EXPR_GRAMMAR)),
        ("Code: ", StructuredOutputsParams(regex=r"[a-z]{3}_[0-9]{4}")),
    ]
    outs = llm.generate(
        [p for p, _ in cases],
        [SamplingParams(temperature=0, max_tokens=48, structured_outputs=so) for _, so in cases],
        use_tqdm=False,
    )
    for (prompt, so), out in zip(cases, outs):
        ids = torch.tensor([llm.tokenizer.encode(prompt)])
        proc = _GrammarLogitsProcessor(backend, grammar_key(so))
        ref = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=48,
            logits_processor=LogitsProcessorList([proc]),
            pad_token_id=2,
        )[0, ids.shape[1] :].tolist()
        assert out.token_ids == ref[: len(out.token_ids)], (out.text, llm.tokenizer.decode(ref))
        assert len(out.token_ids) == len(ref) or out.finish_reason == "stop"


@pytest.mark.slow
def test_mixed_batch_and_broken_grammar_leave_others_untouched(llm: LLM, monkeypatch) -> None:
    shared = "You are a careful assistant. Always answer in the requested format. " * 6
    healthy = [
        (shared + "Name: ", SamplingParams(temperature=0, max_tokens=12)),
        (
            shared + "JSON: ",
            SamplingParams(
                temperature=0, max_tokens=80, structured_outputs=StructuredOutputsParams(json=SCHEMAS["person"])
            ),
        ),
        (
            shared + "Pick: ",
            SamplingParams(
                temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])
            ),
        ),
    ]
    # malformed grammars are refused at add_request (see below); these validate, then fail to compile
    broken = [
        (
            "Broken: ",
            SamplingParams(
                temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(grammar='root ::= "late"')
            ),
        ),
        (
            "Bad schema: ",
            SamplingParams(
                temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(json='{"title": "late"}')
            ),
        ),
    ]
    _fail_compiling(monkeypatch, {'root ::= "late"', '{"title": "late"}'})
    first_run = []
    llm.engine.subscribe(first_run.append)
    alone = llm.generate([p for p, _ in healthy], [s for _, s in healthy], use_tqdm=False)
    llm.engine.unsubscribe(first_run.append)
    records = []
    llm.engine.subscribe(records.append)
    mixed = llm.generate(
        [healthy[0][0], broken[0][0], healthy[1][0], broken[1][0], healthy[2][0]],
        [healthy[0][1], broken[0][1], healthy[1][1], broken[1][1], healthy[2][1]],
        use_tqdm=False,
    )
    llm.engine.unsubscribe(records.append)
    assert [o.token_ids for o in (mixed[0], mixed[2], mixed[4])] == [o.token_ids for o in alone]
    for bad in (mixed[1], mixed[3]):
        assert bad.finish_reason == "error" and bad.error.startswith("grammar:") and bad.token_ids == []
    assert any("chunk" in r.phases.values() for r in first_run)  # the shared prompts were chunked
    assert sum(o.num_cached_tokens for o in mixed) > 0  # ...and hit the prefix cache
    compiled = [e for r in records for e in r.of_kind("grammar.compiled")]
    assert compiled and all(e.cache_hit for e in compiled)  # the first run compiled them: the second reuses
    steps = [e for r in records for e in r.of_kind("grammar.step")]
    assert steps and all(e.num_allowed_tokens >= 1 for e in steps)
    assert llm.engine.kv_cache_manager.usage().used == 0


def _fail_compiling(monkeypatch, specs: set[str]) -> None:
    """Make the compile of these grammars fail (after validation passed): the late-error path."""
    real_compile = XgrammarBackend.compile

    def compile_or_fail(self, key):
        if key[1] in specs:
            raise RuntimeError("simulated compile failure")
        return real_compile(self, key)

    monkeypatch.setattr(XgrammarBackend, "compile", compile_or_fail)


@pytest.fixture(scope="module")
def tiny(tiny_model_path) -> LLM:
    return LLM(model="tiny-llama", num_kv_blocks=32)


def _engine_state(engine) -> tuple:
    sched = engine.scheduler
    return (
        list(sched.requests),
        len(sched.waiting),
        [r.request_id for r in sched.running],
        list(engine.structured.requests),
        engine.kv_cache_manager.usage(),
        engine.has_unfinished_requests(),
    )


def _run_to_completion(engine, rids: list[str]) -> list:
    while engine.has_unfinished_requests():
        engine.step()
    return [engine.pop_output(rid) for rid in rids]


class _Person(pydantic.BaseModel):
    name: str
    age: int


@pytest.mark.parametrize(
    "constraint, field, detail",
    [
        ({"json": {"type": "strng"}}, "structured_outputs.json", "at $.type: 'strng' is not valid"),
        (
            {"json": {"type": "object", "properties": {"age": {"type": "integr"}}}},
            "structured_outputs.json",
            "at $.properties.age.type: 'integr' is not valid",
        ),
        (
            {"json": {"type": "string", "minLength": -1}},
            "structured_outputs.json",  # xgrammar alone accepts this one
            "at $.minLength: -1 is less than the minimum of 0",
        ),
        ({"json": '{"type": "object",'}, "structured_outputs.json", "not valid JSON"),
        ({"json": "[1, 2]"}, "structured_outputs.json", "must be an object or a boolean"),
        (
            {"regex": "[a-z"},
            "structured_outputs.regex",
            "invalid regular expression: Regex parsing error at position 5",
        ),
        ({"regex": r"(a)\1"}, "structured_outputs.regex", "Backreference is not supported"),
        ({"grammar": "root ::= ("}, "structured_outputs.grammar", "invalid EBNF grammar: EBNF parser error at line 1"),
        ({"grammar": "root ::= digit"}, "structured_outputs.grammar", 'Rule "digit" is not defined'),
    ],
    ids=[
        "json-type",
        "json-nested-type",
        "json-metaschema",
        "json-string-not-json",
        "json-not-a-schema",
        "regex-unclosed",
        "regex-backreference",
        "grammar-unclosed",
        "grammar-undefined-rule",
    ],
)
def test_an_invalid_constraint_is_refused_at_add_request(tiny: LLM, constraint, field, detail) -> None:
    engine = tiny.engine
    engine.events.drain()
    before = _engine_state(engine)
    params = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(**constraint))
    with pytest.raises(ValueError) as info:
        engine.add_request([5, 6, 7], params, request_id="checked")
    assert str(info.value).startswith(field + ": ") and detail in str(info.value), str(info.value)
    assert _engine_state(engine) == before and engine.events.drain() == []  # nothing queued, emitted or held
    # the id is free and the engine goes on: a valid guided request runs to completion
    rid = engine.add_request(
        [5, 6, 7],
        SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[ab]{4}")),
        request_id="checked",
    )
    [out] = _run_to_completion(engine, [rid])
    assert out.finish_reason == "stop" and re.fullmatch("[ab]{4}", out.text), out
    assert engine.kv_cache_manager.usage().used == 0


@pytest.mark.parametrize(
    "constraint, field",
    [
        ({"regex": 5}, "structured_outputs.regex"),
        ({"json": [1]}, "structured_outputs.json"),
        ({"json": int}, "structured_outputs.json"),
    ],
)
def test_a_constraint_of_the_wrong_type_is_a_type_error(tiny: LLM, constraint, field) -> None:
    before = _engine_state(tiny.engine)
    with pytest.raises(TypeError, match=re.escape(field)):
        tiny.engine.add_request([5, 6, 7], SamplingParams(structured_outputs=StructuredOutputsParams(**constraint)))
    assert _engine_state(tiny.engine) == before


def test_valid_constraints_are_accepted_and_run(tiny: LLM) -> None:
    engine = tiny.engine
    constraints = [
        {"json": SCHEMAS["order"]},
        {"json": json.dumps(SCHEMAS["person"])},
        {"json": _Person},
        {"json_object": True},
        {"regex": r"[A-Z][a-z]{2,6}-\d{2,3}"},
        {"choice": ["yes", "no", 'a "b"']},
        {"grammar": EXPR_GRAMMAR},
    ]
    rids = [
        engine.add_request(
            [5, 6, 7], SamplingParams(temperature=0, max_tokens=6, structured_outputs=StructuredOutputsParams(**c))
        )
        for c in constraints
    ]
    outs = _run_to_completion(engine, rids)
    assert [o.finish_reason in ("stop", "length") and o.error is None for o in outs] == [True] * len(outs), outs
    assert outs[5].text in ("yes", "no", 'a "b"') and engine.kv_cache_manager.usage().used == 0


def test_a_grammar_that_validates_but_fails_to_compile_finishes_alone(tiny: LLM, monkeypatch) -> None:
    engine = tiny.engine
    _fail_compiling(monkeypatch, {"[xy]{3}"})
    bad = engine.add_request(
        [5, 6, 7],
        SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[xy]{3}")),
    )
    good = engine.add_request(
        [8, 9], SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[ab]{4}"))
    )
    plain = engine.add_request([8, 9], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    bad_out, good_out, plain_out = _run_to_completion(engine, [bad, good, plain])
    assert bad_out.finish_reason == "error" and bad_out.error.startswith("grammar:") and bad_out.token_ids == []
    assert "simulated compile failure" in bad_out.error
    assert good_out.finish_reason == "stop" and re.fullmatch("[ab]{4}", good_out.text)
    assert plain_out.finish_reason == "length" and engine.kv_cache_manager.usage().used == 0


def test_compiling_grammar_does_not_block_others(monkeypatch) -> None:
    llm = LLM(model="tiny-llama", num_kv_blocks=32)
    engine = llm.engine
    gate = threading.Event()
    real_compile = XgrammarBackend.compile

    def slow_compile(self, key):
        gate.wait(timeout=30)
        return real_compile(self, key)

    monkeypatch.setattr(XgrammarBackend, "compile", slow_compile)
    guided = engine.add_request(
        [5, 6, 7],
        SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[ab]{4}")),
    )
    plain = engine.add_request([8, 9], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    for _ in range(3):
        record = engine.step()
        assert guided not in record.scheduled and plain in record.scheduled
    assert engine.scheduler.requests[guided].status.name == "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR"
    gate.set()
    records = []
    while engine.has_unfinished_requests():
        records.append(engine.step())
    assert any(r.of_kind("grammar.compiled") for r in records)
    out = engine.pop_output(guided)
    assert re.fullmatch("[ab]{4}", out.text) and out.finish_reason == "stop"
    assert engine.pop_output(plain).finish_reason == "length"


def test_a_lone_compiling_request_waits_instead_of_spinning(monkeypatch) -> None:
    llm = LLM(model="tiny-llama", num_kv_blocks=32)
    real_compile = XgrammarBackend.compile

    def slow_compile(self, key):
        threading.Event().wait(0.3)
        return real_compile(self, key)

    monkeypatch.setattr(XgrammarBackend, "compile", slow_compile)
    rid = llm.engine.add_request(
        [5, 6, 7],
        SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[ab]{4}")),
    )
    first = llm.engine.step()
    assert first.scheduled == {rid: 3} and first.of_kind("grammar.compiled")


def test_drafts_the_grammar_refuses_are_cut_and_counted(tiny_model_path) -> None:
    """The scheduler checks a guided request's drafts against its grammar before they are verified, cuts them at
    the first refused token, and says how many it cut in spec.proposed (even when it cut them all)."""
    from transformers import AutoTokenizer

    from engine.core.kv_cache_manager import KVCacheManager
    from engine.core.sched.scheduler import Scheduler
    from engine.events import EventLog
    from engine.structured_output.manager import StructuredOutputManager
    from tests.core.helpers import make_config, make_request

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    digit = {d: tokenizer.convert_tokens_to_ids(d) for d in "123"}
    letter = tokenizer.convert_tokens_to_ids("x")
    config = make_config(speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    events = EventLog()
    kv = KVCacheManager(64, config.block_size, False, config.prefix_caching_hash_algo, events)
    scheduler = Scheduler(config, kv, events, StructuredOutputManager(tokenizer, len(tokenizer), events))
    request = make_request("digits", 8, max_tokens=32, structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    scheduler.add_request(request)

    def step(sampled: int, drafts: list[int]) -> list:
        events.begin(events.step + 1)
        out = scheduler.schedule()
        while not out.scheduled:  # the grammar compiles on its thread
            scheduler.structured.wait_for_any(["digits"], timeout=5.0)
            out = scheduler.schedule()
        scheduler.update_from_output(out, {"digits": [sampled]}, {"digits": (drafts, None)})
        return [e for e in events.drain() if e.kind == "spec.proposed"]

    (partly,) = step(digit["1"], [digit["2"], digit["3"], letter, digit["1"]])
    assert (partly.draft_token_ids, partly.num_cut_by_grammar) == ((digit["2"], digit["3"]), 2)
    assert request.spec_token_ids == [digit["2"], digit["3"]]
    # both drafts rejected, "2" recovered; then the first new draft is refused, so none is left to verify
    (whole,) = step(digit["2"], [letter, digit["1"], digit["2"], digit["3"]])
    assert (whole.draft_token_ids, whole.num_cut_by_grammar) == ((), 4) and request.spec_token_ids == []
    (none_cut,) = step(digit["3"], [digit["1"], digit["2"]])
    assert (none_cut.draft_token_ids, none_cut.num_cut_by_grammar) == ((digit["1"], digit["2"]), 0)


def test_wait_for_all_returns_with_every_grammar_compiled_and_they_schedule_together(tiny_model_path) -> None:
    """`bench guided` waits so for its batch: a grammar compiled late would start its request after the others."""
    from transformers import AutoTokenizer

    from engine.core.kv_cache_manager import KVCacheManager
    from engine.core.sched.scheduler import Scheduler
    from engine.events import EventLog
    from engine.structured_output.manager import StructuredOutputManager
    from tests.core.helpers import make_config, make_request

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    config, events = make_config(), EventLog()
    kv = KVCacheManager(64, config.block_size, False, config.prefix_caching_hash_algo, events)
    scheduler = Scheduler(config, kv, events, StructuredOutputManager(tokenizer, len(tokenizer), events))
    patterns = {"digits": "[0-9]+", "letters": "[a-z]{3,9}", "json": '\\{"a": [0-9]{1,4}\\}'}
    for rid, pattern in patterns.items():
        params = StructuredOutputsParams(regex=pattern)
        scheduler.add_request(make_request(rid, 8, max_tokens=8, structured_outputs=params))
    scheduler.structured.wait_for_all(list(patterns), timeout=60)
    assert all(scheduler.structured.requests[rid].future.done() for rid in patterns)
    assert {s.request.request_id for s in scheduler.schedule().scheduled} == set(patterns)
