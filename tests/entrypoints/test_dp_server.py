"""The OpenAI-compatible server over data parallelism (AsyncLLM over DPLBClient, two tiny-llama replicas) with the
real `openai` client: greedy completions and chat, streamed and not, equal one engine's and spread over both
replicas; every bad input the single-engine server refuses is refused the same way (OpenAI's error shape, the
field named), the replica's own refusals included; a closed stream aborts its request on its replica; the hold is
refused naming data_parallel_size; /metrics follow the front end's records; a killed replica fails only its own
stream, later requests go to the live one, and no replica outlives the server; `workbench serve
--data-parallel-size 2` serves and leaves no process behind."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import psutil
import pytest

from engine import SamplingParams
from tests.entrypoints.conftest import ENGINE, MODEL, serving
from tests.entrypoints.test_openai_server import BAD, PROMPT, _metrics, check_refused
from tests.net import free_port, wait_for_http

pytestmark = pytest.mark.slow
PROMPTS = [PROMPT, "Paged attention stores the KV cache in", "One, two, three,", "The scheduler admits"]


def _dp_llm():
    from engine.async_llm import AsyncLLM

    return AsyncLLM(model=MODEL, data_parallel_size=2, **ENGINE)


@pytest.fixture(scope="module")
def dp_served(tiny_model_path):
    yield from serving(_dp_llm())


def _routed(served, since: int = 0) -> list:
    return [e for e in served.llm.engine.routing_events()[since:] if e.kind == "dp.routed"]


def _idle(served) -> dict:
    assert served.llm.wait_until_idle(30), "the front end did not go idle"
    return served.llm.stats()


def test_concurrent_streams_equal_one_engine_and_use_both_replicas(dp_served, offline):
    expected = offline.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    first = len(dp_served.llm.engine.routing_events())

    async def one(client, prompt: str) -> tuple[str, str]:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True)
        text, finish = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def everyone():
        async with dp_served.async_client() as client:
            return await asyncio.gather(*(one(client, p) for p in PROMPTS))

    assert asyncio.run(everyone()) == [(e.text, e.finish_reason) for e in expected]
    assert {e.replica for e in _routed(dp_served, first)} == {"dp-0", "dp-1"}
    reply = dp_served.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert reply.choices[0].text == expected[0].text
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(expected[0].prompt_token_ids), 12)


def test_chat_and_logprobs_equal_one_engine(dp_served, offline):
    messages = [{"role": "user", "content": "Name a colour."}]
    expected = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)[0]
    client = dp_served.client()
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0)
    assert reply.choices[0].message.content == expected.text
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    # logprobs stream whole at the end (replicas stream tokens alone), the same as one engine's
    want = offline.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=5, logprobs=2), use_tqdm=False)[0]
    streamed = list(
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2, stream=True)
    )
    got = [lp for c in streamed if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs]
    assert got == pytest.approx([entry[t] for t, entry in zip(want.token_ids, want.logprobs)], abs=1e-4)


@pytest.mark.parametrize(
    "endpoint, body, status, param", BAD, ids=[f"{e}-{p}-{i}" for i, (e, _, _, p) in enumerate(BAD)]
)
def test_bad_input_is_refused_as_by_one_engine(dp_served, endpoint, body, status, param):
    check_refused(dp_served, endpoint, body, status, param)


def test_a_replicas_refusal_names_its_limit(dp_served):
    # the prompt reaches a replica, whose add_request refuses it: the front end answers 400 with its words
    error = httpx.post(f"{dp_served.base_url}/v1/completions", json={"prompt": [5] * 100_000}).json()["error"]
    assert "100000 tokens" in error["message"] and "max_model_len is" in error["message"]
    assert error["param"] == "prompt"


def test_a_closed_stream_aborts_on_its_replica_and_nothing_leaks(dp_served):
    async def cut():
        async with dp_served.async_client() as client:
            stream = await client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=400, temperature=0, stream=True, extra_body={"ignore_eos": True}
            )
            async for _ in stream:
                break
            await stream.close()

    asyncio.run(cut())
    for _ in range(600):  # the replica reports its freed blocks once it applied the abort
        stats = _idle(dp_served)
        if stats["kv"].used == 0:
            break
        time.sleep(0.05)
    assert stats["kv"].used == 0 and stats["num_running"] == stats["num_waiting"] == 0
    assert not dp_served.llm._collectors


def test_the_hold_is_refused_naming_data_parallel_size(dp_served):
    for path in ("/pause", "/step"):
        reply = httpx.post(f"{dp_served.base_url}{path}")
        assert reply.status_code == 400 and "data_parallel_size=2" in reply.json()["error"]["message"], reply.text
    assert httpx.get(f"{dp_served.base_url}/is_paused").json()["is_paused"] is False


def test_metrics_follow_the_front_ends_records(dp_served):
    _idle(dp_served)
    before = _metrics(dp_served)
    dp_served.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=7, temperature=0)
    after = _metrics(dp_served)
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 7
    assert (
        after["vllm:request_success_total{finished_reason=length}"]
        - before["vllm:request_success_total{finished_reason=length}"]
        == 1
    )
    records = dp_served.llm.engine.front_end_records()
    assert any(r.of_kind("dp.routed") for r in records) and any(r.of_kind("dp.load") for r in records)


def test_a_killed_replica_fails_only_its_stream_and_no_replica_outlives_the_server(tiny_model_path, offline):
    expected, expected_long = (
        offline.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)[0]
        for n in (200, 1500)
    )
    gen = serving(_dp_llm())
    served = next(gen)
    procs = [inst.process for inst in served.llm.engine.instances]
    try:
        client = served.client()
        kwargs = dict(model=MODEL, prompt=PROMPT, temperature=0, stream=True, extra_body={"ignore_eos": True})
        # dp-0: both idle, ties to the lowest; as long as the second, so that it still runs when the second is routed
        # however fast the host (200 tokens of the tiny model once ended first on a busy machine)
        first = client.completions.create(max_tokens=1500, **kwargs)
        second = client.completions.create(max_tokens=1500, **kwargs)  # dp-1: dp-0 holds a request
        assert [e.replica for e in _routed(served)] == ["dp-0", "dp-1"]
        text = next(iter(second)).choices[0].text  # running on dp-1
        os.kill(served.llm.engine.pids()["dp-1"], signal.SIGKILL)
        with pytest.raises(openai.APIError, match="dp-1"):
            for chunk in second:
                text += chunk.choices[0].text
        assert "".join(c.choices[0].text for c in first) == expected_long.text  # dp-0's stream, untouched
        later = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=200, temperature=0, extra_body={"ignore_eos": True}
        )
        assert later.choices[0].text == expected.text and _routed(served)[-1].replica == "dp-0"
        assert [e.replica for e in served.llm.engine.routing_events() if e.kind == "dp.replica_dead"] == ["dp-1"]
    finally:
        gen.close()
    assert all(p.exitcode is not None for p in procs)


def test_workbench_serve_with_data_parallelism_leaves_no_process(tiny_model_path, offline):
    # SIGTERM: uvicorn stops, then re-raises it, so the process ends without its `finally`; the replicas see their
    # pipe close and stop on their own (the worst case: a parent that could not clean up)
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "workbench.cli",
            "serve",
            MODEL,
            "--port",
            str(port),
            "--data-parallel-size",
            "2",
            "--num-kv-blocks",
            "128",
        ],
        stderr=subprocess.PIPE,
    )
    try:
        wait_for_http(f"http://127.0.0.1:{port}/health", server, 300, "workbench serve")
        replicas = psutil.Process(server.pid).children(recursive=True)
        assert len([p for p in replicas if "resource_tracker" not in " ".join(p.cmdline())]) == 2
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        expected = offline.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0]
        reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
        assert reply.choices[0].text == expected.text
        # the front end's dashboard: one request, waited for as long as the page takes to build (httpx's default 5 s
        # read timeout failed on a loaded machine; a dead server fails it at once)
        page = httpx.get(f"http://127.0.0.1:{port}/dashboard", timeout=600)
        assert page.status_code == 200 and "Bokeh" in page.text
        server.send_signal(signal.SIGTERM)
        server.wait(60)
        gone, alive = psutil.wait_procs(replicas, timeout=30)
        assert not alive, alive
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
