"""AsyncLLM on tiny-llama: generate() yields growing outputs ending in the offline engine's; leaving the iterator
early aborts the request and frees its blocks before any further step; add_request and abort from many threads
leak nothing; a refused request leaves the others untouched; the hold (pause, step exactly n, resume)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine import LLM, AsyncLLM, SamplingParams

ENGINE = {"num_kv_blocks": 64, "seed": 0}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
PROMPTS = ["The capital of France is", "A paged KV cache", "Continuous batching means"]


@pytest.fixture(scope="module")
def llm(tiny_model_path):
    with AsyncLLM(model="tiny-llama", **ENGINE) as llm:
        yield llm
    assert not llm._thread.is_alive()


@pytest.fixture(scope="module")
def offline(tiny_model_path):
    return LLM(model="tiny-llama", **ENGINE).generate(PROMPTS, GREEDY, use_tqdm=False)


def _used_blocks(llm: AsyncLLM) -> int:
    return llm.stats()["kv"].used


def test_generate_yields_growing_outputs_that_end_in_the_offline_ones(llm, offline):
    async def one(prompt):
        seen = [out async for out in llm.generate(prompt, GREEDY)]
        return seen

    async def main():
        return await asyncio.gather(*(one(p) for p in PROMPTS))

    for seen, expected in zip(asyncio.run(main()), offline):
        assert [o.finished for o in seen] == [False] * (len(seen) - 1) + [True]
        lengths = [len(o.token_ids) for o in seen]
        assert lengths == sorted(lengths) and lengths[-1] == 8
        assert seen[-1].token_ids == expected.token_ids and seen[-1].text == expected.text
        assert all(expected.token_ids[: len(o.token_ids)] == o.token_ids for o in seen)
    assert llm.wait_until_idle(10) and _used_blocks(llm) == 0


def test_leaving_the_iterator_aborts_at_once_even_while_paused(llm):
    async def main():
        llm.pause()
        try:
            stream = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=50))
            first = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0.05)
            assert llm.step(1, timeout=30) == 1
            out = await first
            assert len(out.token_ids) == 1 and _used_blocks(llm) > 0
            steps = llm.step_count
            await stream.aclose()  # the consumer leaves: the request is aborted without another step
            assert await asyncio.to_thread(llm.wait_until_idle, 10)
            assert _used_blocks(llm) == 0 and llm.step_count == steps
        finally:
            llm.resume()

    asyncio.run(main())


def test_a_cancelled_task_aborts_its_request(llm):
    async def main():
        # held, one step at a time: the request is surely running, not finished, when its task is cancelled. Polling
        # a free loop for its blocks missed one that ran to its end between two looks, and waited forever (make test)
        llm.pause()
        try:
            task = asyncio.ensure_future(
                _drain(llm.generate(PROMPTS[1], SamplingParams(max_tokens=60, ignore_eos=True)))
            )
            deadline = time.monotonic() + 30
            while _used_blocks(llm) == 0:
                assert time.monotonic() < deadline, "the request never ran"
                if not await asyncio.to_thread(llm.step, 1, 10):
                    await asyncio.sleep(0.01)  # not added yet: nothing to step
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            llm.resume()
        assert await asyncio.to_thread(llm.wait_until_idle, 10)

    asyncio.run(main())
    assert _used_blocks(llm) == 0


async def _drain(stream):
    return [out async for out in stream]


def test_add_and_abort_from_many_threads_leak_nothing(llm):
    ids, errors = [], []

    def worker(k: int) -> None:
        try:
            for i in range(5):
                rid = llm.add_request(f"{PROMPTS[i % 3]} {k}", SamplingParams(max_tokens=20), request_id=f"t{k}-{i}")
                ids.append(rid)
                if i % 2:
                    llm.abort(rid)
        except Exception as exc:  # pragma: no cover - a failure to report
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and len(ids) == 20
    assert llm.wait_until_idle(60) and _used_blocks(llm) == 0
    with llm.lock:  # requests added without a stream keep their outputs in the engine, finished or aborted
        reasons = [llm.engine.pop_output(rid).finish_reason for rid in ids]
    assert reasons.count("abort") >= 1 and set(reasons) <= {"abort", "length", "stop"}


def test_a_refused_request_leaves_the_others_alone(llm, offline):
    async def main():
        good = asyncio.ensure_future(_drain(llm.generate(PROMPTS[2], GREEDY)))
        with pytest.raises(ValueError, match="prompt: must not be empty"):
            await _drain(llm.generate("", GREEDY))
        with pytest.raises(TypeError, match="params"):
            await _drain(llm.generate("x", {"max_tokens": 3}))
        return await good

    assert asyncio.run(main())[-1].token_ids == offline[2].token_ids


def test_step_runs_exactly_the_steps_asked_for(llm):
    llm.pause()
    try:
        rid = llm.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=10))
        start = llm.step_count
        assert llm.step(3, timeout=30) == 3 and llm.step_count == start + 3
        assert not llm.wait_until_idle(0.2) and llm.step_count == start + 3  # held: nothing more ran
        with pytest.raises(ValueError, match="num_steps"):
            llm.step(0)
    finally:
        llm.resume()
    assert llm.wait_until_idle(30)
    with llm.lock:
        assert len(llm.engine.pop_output(rid).token_ids) == 10
    assert llm.step(1) == 0  # nothing to run: no step granted
