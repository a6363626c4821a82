"""PhaseTracker: the phase of each scheduled request ("prefill", "chunk" i of n, "decode", "verify") from its
prefill's history, which it forgets when the request is preempted or finishes."""

from engine.core.sched.output import ScheduledRequest, SchedulerOutput
from engine.core.sched.phases import PhaseTracker
from engine.events import EventLog
from engine.request import Request
from tests.core.helpers import TOKEN, SchedulerHarness, make_request


def output(*scheduled: ScheduledRequest, preempted: tuple[str, ...] = (), finished: tuple[str, ...] = ()):
    return SchedulerOutput(list(scheduled), list(preempted), set(finished))


def run(request: Request, num_new: int, spec: list[int] | None = None) -> ScheduledRequest:
    """The request's next `num_new` tokens (drafts included), as the scheduler would hand them over."""
    return ScheduledRequest(request, num_new, request.num_computed_tokens, [], False, spec or [])


def label(tracker: PhaseTracker, out: SchedulerOutput) -> list[tuple[str, str, int, int]]:
    """Label one step; (request id, phase, chunk index, number of chunks) from its request.scheduled events."""
    tracker.events.begin(1)
    tracker.label(out)
    for s in out.scheduled:
        s.request.num_computed_tokens += s.num_new_tokens
    return [(e.request_id, e.phase, e.chunk_index, e.num_chunks) for e in tracker.events.drain()]


def test_a_one_token_last_chunk_is_a_chunk_not_a_decode():
    h = SchedulerHarness(max_num_batched_tokens=100)
    h.add(make_request("r", 201, max_tokens=2))
    chunks = []
    for _ in range(4):
        h.step()
        (event,) = h.of_kind("request.scheduled")
        chunks.append((event.num_tokens, event.phase, event.chunk_index, event.num_chunks))
    assert chunks == [(100, "chunk", 1, 3), (100, "chunk", 2, 3), (1, "chunk", 3, 3), (1, "decode", 0, 0)]


def test_a_preempted_request_prefills_again_over_its_outputs_too():
    tracker = PhaseTracker(EventLog())
    r = make_request("r", 10)
    assert label(tracker, output(run(r, 10))) == [("r", "prefill", 1, 1)]
    r.append_output_token_ids(TOKEN)
    assert label(tracker, output(run(r, 1))) == [("r", "decode", 0, 0)]
    r.num_computed_tokens = 0  # preempted: recomputed from the start, prompt and output
    assert label(tracker, output(run(r, 6), preempted=("r",))) == [("r", "chunk", 1, 2)]
    assert label(tracker, output(run(r, 5))) == [("r", "chunk", 2, 2)]
    r.append_output_token_ids(TOKEN)
    assert label(tracker, output(run(r, 1))) == [("r", "decode", 0, 0)]


def test_a_finished_id_that_comes_back_is_a_new_prefill():
    tracker = PhaseTracker(EventLog())
    old = make_request("r", 8)
    label(tracker, output(run(old, 8)))
    old.append_output_token_ids(TOKEN)
    new = make_request("r", 4)  # same id: without forgetting, 0 < 9 computed tokens would read as a chunk
    assert label(tracker, output(run(new, 4), finished=("r",))) == [("r", "prefill", 1, 1)]


def test_drafts_are_verified_and_events_follow_the_batch_order():
    tracker = PhaseTracker(EventLog())
    a, b = make_request("a", 4), make_request("b", 30)
    label(tracker, output(run(a, 4)))
    a.append_output_token_ids(TOKEN)
    events = label(tracker, output(run(b, 12), run(a, 3, spec=[TOKEN, TOKEN])))
    assert events == [("b", "chunk", 1, 3), ("a", "verify", 0, 0)]


def test_a_chunk_withdrawn_before_labelling_leaves_no_trace():
    # LLMEngine labels after a failed KV load withdrew a chunk: the recompute from the first bad block is the prefill
    tracker = PhaseTracker(EventLog())
    r = make_request("r", 20)
    assert label(tracker, output()) == []  # its chunk of this step was withdrawn
    r.num_computed_tokens = 8  # the blocks before the first bad one hold good KV
    assert label(tracker, output(run(r, 12))) == [("r", "prefill", 1, 1)]
