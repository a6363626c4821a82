"""Structured output on the scripted executor, as `workbench fidelity`'s guided group drives it: scripted grammars
(StructuredOutputManager.script_grammars) are ready, or fail, when the driver says, and a request waits for its
grammar in WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR meanwhile, the others going on."""

from engine import LLMEngine, SamplingParams, StructuredOutputsParams
from engine.request import RequestStatus

GUIDED = SamplingParams(max_tokens=3, structured_outputs=StructuredOutputsParams(json_object=True))


def _engine() -> LLMEngine:
    engine = LLMEngine(
        executor="scripted", token_script={"g": [7, 8, 9], "p": [5, 6, 7]}, num_kv_blocks=16, block_size=4
    )
    engine.structured.script_grammars()
    return engine


def test_a_guided_request_waits_for_its_scripted_grammar_and_the_others_go_on():
    engine = _engine()
    engine.add_request([10, 11, 12], GUIDED, request_id="g")
    engine.add_request([20, 21], SamplingParams(max_tokens=3), request_id="p")
    g = engine.scheduler.requests["g"]
    # no grammar yet: no compile runs, the step does not wait for one, and p goes on
    assert [engine.step().scheduled for _ in range(2)] == [{"p": 2}, {"p": 1}]
    assert g.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    engine.structured.grammar_ready("g")
    record = engine.step()
    assert record.scheduled == {"p": 1, "g": 3}
    kinds = [e.kind for e in record.events if getattr(e, "request_id", None) == "g"]
    assert kinds[:2] == ["grammar.compiled", "prefix.lookup"] and "request.scheduled" in kinds
    engine.run()
    assert engine.get_output("g").token_ids == [7, 8, 9]  # the scripted grammar allows every token


def test_a_scripted_grammar_that_fails_finishes_its_request_with_the_error():
    engine = _engine()
    engine.add_request([10, 11, 12], GUIDED, request_id="g")
    engine.structured.grammar_ready("g", "no such grammar")
    record = engine.step()
    assert record.scheduled == {}
    (finished,) = [e for e in record.events if e.kind == "request.finished"]
    assert (finished.request_id, finished.reason) == ("g", "error") and "no such grammar" in finished.error
    assert not engine.has_unfinished_requests() and engine.kv_cache_manager.block_pool.get_num_free_blocks() == 15
