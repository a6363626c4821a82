"""Asynchronous transfers (`async_transfers`), over both stores: loads run beside the steps while their request
waits in WAITING_FOR_REMOTE_KVS, saves hold their blocks until stored (delay_free_blocks), a consumer waits a
bounded time for a producer's save to land. Outputs equal a single engine's; no block leaks on either side.

A gate (a job that blocks the connector's one transfer thread until released) makes "still in flight" certain."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest

from engine import LLM, LLMEngine
from engine.request import RequestStatus
from tests.kv_transfer.test_connectors import GREEDY, KW, PREFILL, assert_no_leaks, assert_same, damage, events, run

PROMPTS = [
    "Asynchronous loads let the decode instance keep stepping while KV arrives from the store, so that",
    "In a hole in the ground there lived",
]


@pytest.fixture(scope="module")
def reference() -> LLM:
    return LLM(**KW)


@pytest.fixture(scope="module")
def engines(kv_config) -> SimpleNamespace:
    def make(role: str, policy: str = "recompute", **extra) -> LLMEngine:
        return LLMEngine(**KW, kv_transfer_config=kv_config(role, policy, async_transfers=True, **extra))

    return SimpleNamespace(
        producer=make("kv_producer"),
        consumer=make("kv_consumer"),
        consumer_fail=make("kv_consumer", "fail"),
        impatient=make("kv_consumer", load_wait_s=0.2),
    )


@contextmanager
def gate(engine: LLMEngine) -> Iterator[None]:
    """Hold the engine's transfer thread: whatever is submitted meanwhile stays in flight."""
    release = threading.Event()
    engine.connector._pool.submit(release.wait)
    try:
        yield
    finally:
        release.set()


def prefill(engine: LLMEngine, prompts) -> list[dict]:
    outs, _ = run(engine, prompts, PREFILL, [{"do_remote_decode": True}] * len(prompts))
    return [o.kv_transfer_params for o in outs]


def test_async_loads_park_the_request_then_match_a_single_engine(engines, reference) -> None:
    params = prefill(engines.producer, PROMPTS)
    consumer = engines.consumer
    with gate(consumer):
        ids = [consumer.add_request(p, GREEDY, kv_transfer_params=k) for p, k in zip(PROMPTS, params)]
        first = consumer.step()
        requests = [consumer.scheduler.requests[i] for i in ids]
        assert first.scheduled == {} and not first.of_kind("kv_transfer.load")
        assert all(r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in requests)
        # blocks are allocated for the load, but not in the prefix cache until the KV is there
        assert first.kv.used > 0
        probe = consumer.kv_cache_manager.get_computed_blocks(requests[0])
        assert probe == ([], 0)
    records = [first]
    while consumer.has_unfinished_requests():
        records.append(consumer.step())
    outs = [consumer.pop_output(i) for i in ids]
    assert_same(outs, reference.generate(PROMPTS, GREEDY, use_tqdm=False))
    loads = events(records, "kv_transfer.load")
    assert {e.request_id for e in loads} == set(ids)
    # after the load only each prompt's last token is computed here
    first_scheduled = next(r.scheduled for r in records if r.scheduled)
    assert set(first_scheduled.values()) == {1}
    assert all(o.num_cached_tokens == len(o.prompt_token_ids) - 1 for o in outs)
    assert_no_leaks(consumer)


def test_async_saves_hold_the_blocks_until_stored(engines) -> None:
    producer = engines.producer
    prompt = ["Held blocks: the save thread still reads them after the request has finished."]
    with gate(producer):
        rid = producer.add_request(prompt[0], PREFILL, kv_transfer_params={"do_remote_decode": True})
        record = producer.step()
        assert record.of_kind("request.finished") and not record.of_kind("kv.freed")
        assert rid in producer.scheduler.held and record.kv.used > 0
        assert producer.has_unfinished_requests()  # the engine keeps stepping until the save lands
        out = producer.pop_output(rid)
        assert out.kv_transfer_params["do_remote_prefill"] and out.kv_transfer_params["remote_request_id"] == rid
    records = []
    while producer.has_unfinished_requests():
        records.append(producer.step())
    assert [e.request_id for e in events(records, "kv_transfer.save")] == [rid]
    assert [e.request_id for e in events(records, "kv.freed")] == [rid]
    assert not producer.scheduler.held
    assert_no_leaks(producer)


def test_a_consumer_waits_for_a_save_still_in_flight(engines, reference) -> None:
    producer, consumer = engines.producer, engines.consumer
    prompt = ["The decode instance asked before the store had it; it waits a while, then loads it."]
    with gate(producer):
        pid = producer.add_request(prompt[0], PREFILL, kv_transfer_params={"do_remote_decode": True})
        producer.step()
        params = producer.pop_output(pid).kv_transfer_params
        cid = consumer.add_request(prompt[0], GREEDY, kv_transfer_params=params)
        waited = [consumer.step() for _ in range(3)]
        assert all(r.scheduled == {} for r in waited) and cid in consumer.scheduler.awaiting_kv
    while producer.has_unfinished_requests():
        producer.step()
    records = []
    while consumer.has_unfinished_requests():
        records.append(consumer.step())
    assert_same([consumer.pop_output(cid)], reference.generate(prompt, GREEDY, use_tqdm=False))
    assert events(records, "kv_transfer.load") and not events(waited + records, "kv_transfer.fail")
    assert_no_leaks(producer, consumer)


def test_a_save_that_never_lands_is_a_miss_after_load_wait_s(engines, reference) -> None:
    prompt = ["Nobody will ever store this prompt's KV; after load_wait_s the consumer recomputes it."]
    outs, records = run(engines.impatient, prompt, GREEDY, [{"do_remote_prefill": True}])
    (fail,) = events(records, "kv_transfer.fail")
    assert (fail.failure, fail.policy_action) == ("missing", "recompute")
    assert_same(outs, reference.generate(prompt, GREEDY, use_tqdm=False))
    assert_no_leaks(engines.impatient)


def test_aborting_a_request_mid_load_holds_its_blocks_until_the_load_ends(engines, reference) -> None:
    consumer = engines.consumer
    params = prefill(engines.producer, PROMPTS)
    with gate(consumer):
        doomed = consumer.add_request(PROMPTS[0], GREEDY, kv_transfer_params=params[0])
        other = consumer.add_request(PROMPTS[1], GREEDY, kv_transfer_params=params[1])
        consumer.step()
        consumer.abort(doomed)
        # the transfer thread will still write into the doomed request's blocks: nobody else may get them
        assert doomed in consumer.scheduler.held and consumer.kv_cache_manager.usage().used > 0
    while consumer.has_unfinished_requests():
        consumer.step()
    assert consumer.pop_output(doomed).finish_reason == "abort"
    assert_same([consumer.pop_output(other)], reference.generate(PROMPTS[1:], GREEDY, use_tqdm=False))
    assert not consumer.scheduler.held
    assert_no_leaks(consumer)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_corrupt_kv_in_an_async_load_goes_by_the_policy(engines, reference, policy) -> None:
    prompt = [[2000 + 11 * i + (policy == "fail") for i in range(40)]]  # three blocks, the last one partial
    consumer = engines.consumer if policy == "recompute" else engines.consumer_fail
    params = prefill(engines.producer, prompt)
    damage(engines.producer.connector, params[0]["remote_key"], 1, "corrupt")
    outs, records = run(consumer, prompt, GREEDY, params)
    (fail,) = events(records, "kv_transfer.fail")
    assert (fail.failure, fail.policy_action) == ("corrupt", policy)
    if policy == "recompute":
        assert_same(outs, reference.generate(prompt, GREEDY, use_tqdm=False))
        assert fail.num_recomputed_tokens == len(outs[0].prompt_token_ids) - 1 - 16  # from the bad block on
    else:
        assert outs[0].finish_reason == "error" and "kv_transfer" in outs[0].error
    assert_no_leaks(consumer)


def test_an_async_load_missing_a_layer_is_recomputed_once(engines, reference) -> None:
    """A missing layer spoils every block: the request comes back from its load with nothing computed and goes
    through admission again; it must compute its prompt here, not match the same bad entry and load it again."""
    prompt = ["This prompt's stored KV loses a layer file before the decode side loads it, so every block is bad"]
    params = prefill(engines.producer, prompt)
    damage(engines.producer.connector, params[0]["remote_key"], 1, "missing")
    consumer = engines.consumer
    rid = consumer.add_request(prompt[0], GREEDY, kv_transfer_params=params[0])
    records = []
    while consumer.has_unfinished_requests() and len(records) < 40:
        records.append(consumer.step())
    assert not consumer.has_unfinished_requests(), "the request loads its bad entry over and over"
    (fail,) = events(records, "kv_transfer.fail")
    outs = [consumer.pop_output(rid)]
    assert (fail.failure, fail.policy_action) == ("missing", "recompute")
    assert len(events(records, "kv_transfer.load")) == 0
    first = next(r.scheduled[rid] for r in records if rid in r.scheduled)
    assert first == len(outs[0].prompt_token_ids)  # the whole prompt, computed here
    assert_same(outs, reference.generate(prompt, GREEDY, use_tqdm=False))
    assert_no_leaks(consumer)
