"""The OpenAI-compatible server with the real `openai` client: completions and chat, streamed and not, equal to the
offline engine; guided JSON; presence/frequency/repetition penalties, logit_bias and n > 1 equal to the offline engine;
64 concurrent streams with 16 disconnects and no block leaked; every bad input a 400
(or 404, 401) naming its field, the server serving on after each; /metrics in vLLM's names agreeing with the step
records; Pause / Step / Resume over HTTP."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import httpx
import jsonschema
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import SamplingParams
from tests.entrypoints.conftest import MODEL

PROMPT = "The capital of France is"


def _greedy(offline, prompt, max_tokens: int, **kwargs):
    return offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs), use_tqdm=False)[
        0
    ]


def _idle(served) -> dict:
    assert served.llm.wait_until_idle(30), "the engine did not go idle"
    return served.llm.stats()


def _metrics(served) -> dict[str, float]:
    """Every sample of /metrics, parsed by prometheus_client: {name{labels}: value}, labels but model/engine."""
    text = httpx.get(f"{served.base_url}/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.labels.get("model_name") == MODEL, s
            extra = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "engine"))
            samples[f"{s.name}{{{extra}}}" if extra else s.name] = s.value
    return samples


# ---- the client, end to end -----------------------------------------------------------------------------------
def test_completion_streamed_and_not_equals_offline_greedy_with_usage(served, offline):
    expected = _greedy(offline, PROMPT, 12)
    client = served.client()
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert reply.object == "text_completion" and reply.model == MODEL and reply.id.startswith("cmpl-")
    assert reply.choices[0].text == expected.text and reply.choices[0].finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (
        len(expected.prompt_token_ids),
        12,
        len(expected.prompt_token_ids) + 12,
    )
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])
    # token ids as the prompt give the same continuation
    ids = client.completions.create(model=MODEL, prompt=expected.prompt_token_ids, max_tokens=12, temperature=0)
    assert ids.choices[0].text == expected.text


def test_chat_streamed_and_not_equals_offline_chat(served, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    expected = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)[0]
    client = served.client()
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0)
    assert reply.object == "chat.completion" and reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == expected.text
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert reply.usage.completion_tokens == len(expected.token_ids)
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason


def test_logprobs_are_the_engines(served, offline):
    expected = _greedy(offline, PROMPT, 4, logprobs=2)
    reply = served.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == 4 and all(1 <= len(c.top_logprobs) <= 3 for c in content)
    assert all(c.logprob == max(t.logprob for t in c.top_logprobs) for c in content)  # greedy: the top token
    completion = served.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    got = completion.choices[0].logprobs
    assert got.token_logprobs == pytest.approx([lp[t] for t, lp in zip(expected.token_ids, expected.logprobs)])
    assert "".join(got.tokens) == completion.choices[0].text and got.text_offset[0] == 0


def test_guided_json_validates_against_its_schema(served):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "level": {"enum": [1, 2, 3]}},
        "required": ["ok", "level"],
        "additionalProperties": False,
    }
    reply = served.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Status as JSON"}],
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "status", "schema": schema}},
    )
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    choice = served.client().completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["Paris", "Rome"]}},
    )
    assert choice.choices[0].text in ("Paris", "Rome")


def test_models_and_health(served):
    models = served.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(f"{served.base_url}/health").status_code == 200


# ---- sampling options passed through: penalties, logit_bias, n ----------------------------------------------
def test_penalties_and_logit_bias_equal_the_offline_engine(served, offline):
    client = served.client()
    plain = _greedy(offline, PROMPT, 12)
    forced = plain.token_ids[0] + 1  # not the greedy first token: only the bias can make it win everywhere
    biased = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logit_bias={str(forced): 100}
    )
    assert biased.choices[0].text == offline.engine.tokenizer.decode([forced] * 5)
    # a bias of 40 alone keeps the forced token every time; the penalties grow with its count until it loses
    options = dict(presence_penalty=0.5, frequency_penalty=1.0, logit_bias={str(forced): 40})
    expected = _greedy(
        offline,
        PROMPT,
        12,
        repetition_penalty=2.0,
        presence_penalty=0.5,
        frequency_penalty=1.0,
        logit_bias={forced: 40},
    )
    bias_only = _greedy(offline, PROMPT, 12, logit_bias={forced: 40})
    assert bias_only.token_ids == [forced] * 12 and forced in expected.token_ids  # the bias acts
    assert expected.token_ids != bias_only.token_ids != plain.token_ids  # and the penalties act on top of it
    reply = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, **options, extra_body={"repetition_penalty": 2.0}
    )
    assert reply.choices[0].text == expected.text
    messages = [{"role": "user", "content": "Name a colour."}]
    chat_expected = offline.chat(
        messages, SamplingParams(temperature=0.0, max_tokens=8, logit_bias={forced: 100}), use_tqdm=False
    )[0]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, logit_bias={str(forced): 100}
    )
    assert chat.choices[0].message.content == chat_expected.text


def test_n_samples_equal_the_offline_children_streamed_and_not(served, offline):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    expected = offline.generate([PROMPT], params, use_tqdm=False)[0]
    texts = [c.text for c in expected.outputs]
    assert len(set(texts)) > 1  # seeds 7, 8, 9 sample different sequences
    client = served.client()
    body = dict(model=MODEL, prompt=PROMPT, n=3, temperature=1.0, seed=7, max_tokens=8, extra_body={"ignore_eos": True})
    reply = client.completions.create(**body)
    assert [(c.index, c.text) for c in reply.choices] == list(enumerate(texts))
    assert reply.usage.completion_tokens == 24 and reply.usage.prompt_tokens == len(expected.prompt_token_ids)
    streamed, finishes = ["", "", ""], [0, 0, 0]
    chunks = list(client.completions.create(**body, stream=True, stream_options={"include_usage": True}))
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices  # one choice per chunk, named by its index
        streamed[choice.index] += choice.text
        finishes[choice.index] += choice.finish_reason is not None
    assert streamed == texts and finishes == [1, 1, 1] and chunks[-1].usage.completion_tokens == 24
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        n=2,
        temperature=1.0,
        seed=3,
        max_tokens=6,
        stream=True,
    )
    roles, contents = [0, 0], ["", ""]
    for chunk in chat:
        roles[chunk.choices[0].index] += chunk.choices[0].delta.role == "assistant"
        contents[chunk.choices[0].index] += chunk.choices[0].delta.content or ""
    assert roles == [1, 1] and all(contents)
    stats = _idle(served)
    assert stats["kv"].used == 0 and stats["num_running"] == 0


def test_n_stream_cut_aborts_every_child(served):
    async def cut() -> None:
        async with served.async_client() as client:
            stream = await client.completions.create(
                model=MODEL, prompt=PROMPT, n=4, max_tokens=60, seed=1, stream=True, extra_body={"ignore_eos": True}
            )
            async for _ in stream:
                break
            await stream.close()

    asyncio.run(cut())
    stats = _idle(served)
    assert stats["kv"].used == 0 and stats["num_running"] == stats["num_waiting"] == 0
    assert not served.llm._collectors and not served.llm._parent_of  # nothing kept for the children


# ---- load: 64 streams, 16 of them cut ---------------------------------------------------------------------------
def test_64_streams_with_16_disconnects_finish_exactly_and_leak_nothing(served, offline):
    rng = random.Random(0)
    words = ["paged", "blocks", "tokens", "budget", "prefix", "cache", "decode", "batch"]
    prompts = [f"Request {i}: " + " ".join(rng.choice(words) for _ in range(rng.randint(2, 12))) for i in range(64)]
    cut = {i: rng.randint(1, 3) for i in rng.sample(range(64), 16)}  # close after this many chunks
    expected = offline.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    before = _metrics(served)

    async def one(client, i: int):
        max_tokens = 40 if i in cut else 16  # a long output, so the cut lands mid-stream
        stream = await client.completions.create(
            model=MODEL,
            prompt=prompts[i],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": i in cut},
        )
        text, finish, chunks = "", None, 0
        async for chunk in stream:
            chunks += 1
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
            if i in cut and chunks >= cut[i]:
                await stream.close()  # the client goes away mid-stream
                return text, "cut" if finish is None else finish
        return text, finish

    async def everyone():
        async with served.async_client(http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=64))) as c:
            return await asyncio.gather(*(one(c, i) for i in range(64)))

    results = asyncio.run(everyone())
    for i, (text, finish) in enumerate(results):
        if i not in cut:
            assert (text, finish) == (expected[i].text, expected[i].finish_reason), i
    stats = _idle(served)
    assert stats["kv"].used == 0 and stats["num_running"] == stats["num_waiting"] == 0
    after = _metrics(served)
    assert after["vllm:num_requests_running"] == 0 and after["vllm:kv_cache_usage_perc"] == 0
    reasons = {
        r: after[f"vllm:request_success_total{{finished_reason={r}}}"]
        - before[f"vllm:request_success_total{{finished_reason={r}}}"]
        for r in ("stop", "length", "abort")
    }
    cut_mid_stream = sum(finish == "cut" for _, finish in results)
    # a client may close after its request finished but before reading that: then it is not an abort
    assert sum(reasons.values()) == 64 and 0 < reasons["abort"] <= cut_mid_stream


# ---- bad input ----------------------------------------------------------------------------------------------
BAD = [
    ("completions", {"prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens"),
    (
        "chat",
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
    ),
    ("completions", {"prompt": PROMPT, "max_tokens": "5"}, 400, "max_tokens"),
    ("completions", {"prompt": PROMPT, "temprature": 0.5}, 400, "temprature"),
    ("completions", {"prompt": PROMPT, "temperature": -1}, 400, "temperature"),
    ("completions", {"prompt": [5] * 100_000}, 400, "prompt"),
    ("chat", {"messages": [{"role": "user", "content": "word " * 5000}]}, 400, "messages"),
    ("completions", {"prompt": PROMPT, "n": 0}, 400, "n"),
    ("completions", {"prompt": PROMPT, "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("completions", {"prompt": PROMPT, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("completions", {"prompt": PROMPT, "logit_bias": {"five": 1.0}}, 400, "logit_bias"),
    ("completions", {"prompt": PROMPT, "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"10000000": 1}}, 400, "logit_bias"),
    ("completions", {"prompt": PROMPT, "logprobs": 50}, 400, "logprobs"),
    (
        "chat",
        {
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "objekt"}}},
        },
        400,
        "response_format",
    ),
    ("completions", {"prompt": PROMPT, "structured_outputs": {"regex": "a[b"}}, 400, "structured_outputs"),
    ("chat", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("completions", {"prompt": PROMPT, "model": "gpt-17"}, 404, "model"),
]


@pytest.mark.parametrize(
    "endpoint, body, status, param", BAD, ids=[f"{e}-{p}-{i}" for i, (e, _, _, p) in enumerate(BAD)]
)
def test_bad_input_is_refused_naming_the_field_and_the_server_serves_on(served, endpoint, body, status, param):
    check_refused(served, endpoint, body, status, param)
    assert _idle(served)["kv"].used == 0


def check_refused(served, endpoint: str, body: dict, status: int, param: str) -> None:
    """One row of BAD: its status and OpenAI's error shape naming the field; then the server serves on."""
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    reply = httpx.post(f"{served.base_url}{path}", json={"model": MODEL, **body}, timeout=60)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["code"] == status and param in error["message"], error
    ok = served.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens == 2


def test_the_limit_is_named(served):
    error = httpx.post(f"{served.base_url}/v1/completions", json={"prompt": [5] * 100_000}).json()["error"]
    assert (
        "100000 tokens" in error["message"]
        and f"max_model_len is {served.llm.engine.config.max_model_len}" in error["message"]
    )


def test_api_key_is_required_when_set(served):
    from fastapi.testclient import TestClient

    from engine.entrypoints.openai.api_server import build_app

    app = build_app(served.llm, MODEL, api_key="s3cret")
    try:
        with TestClient(app) as client:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                reply = client.get("/v1/models", headers=headers)
                assert reply.status_code == 401 and reply.json()["error"]["code"] == 401
            assert client.post("/pause", headers={"Authorization": "Bearer nope"}).status_code == 401
            assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200
            good = client.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
            assert good.status_code == 200 and good.json()["data"][0]["id"] == MODEL
    finally:
        served.llm.unsubscribe(app.state.metrics)


# ---- metrics ------------------------------------------------------------------------------------------------
def test_metrics_agree_with_the_step_records(served):
    _idle(served)
    records = []
    served.llm.subscribe(records.append)
    try:
        before = _metrics(served)
        client = served.client()
        shared = "A shared system prompt that fills more than one block of sixteen tokens, for the prefix cache. "
        for i in range(3):
            client.completions.create(model=MODEL, prompt=shared + f"Question {i}?", max_tokens=5 + i, temperature=0)
        _idle(served)
        after = _metrics(served)
    finally:
        served.llm.unsubscribe(records.append)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    events = [e for r in records for e in r.events]
    tokens = [e for e in events if e.kind == "request.tokens"]
    added = {e.request_id: e.num_prompt_tokens for e in events if e.kind == "request.added"}
    firsts = {e.request_id for e in tokens}
    assert delta("vllm:generation_tokens_total") == sum(len(e.token_ids) for e in tokens) == 5 + 6 + 7
    assert delta("vllm:prompt_tokens_total") == sum(added[r] for r in firsts)
    assert (
        delta("vllm:prefix_cache_hits_total") == sum(e.num_hit_tokens for e in events if e.kind == "prefix.lookup") > 0
    )
    assert delta("vllm:prefix_cache_queries_total") == sum(added.values())
    assert delta("vllm:request_success_total{finished_reason=length}") == 3
    assert delta("vllm:time_to_first_token_seconds_count") == 3 == delta("vllm:e2e_request_latency_seconds_count")
    assert delta("vllm:request_queue_time_seconds_count") == 3
    assert delta("vllm:inter_token_latency_seconds_count") == len(tokens) - len(firsts)
    assert delta("vllm:num_preemptions_total") == sum(e.kind == "request.preempted" for e in events)
    assert "vllm:spec_decode_num_drafts_total" in after


# ---- the hold over HTTP -------------------------------------------------------------------------------------
def test_pause_queues_requests_and_step_advances_exactly_one(served, offline):
    base = served.base_url
    _idle(served)
    assert httpx.post(f"{base}/pause").json()["is_paused"] is True
    replies = []
    sender = threading.Thread(
        target=lambda: replies.append(
            served.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
        )
    )
    sender.start()
    try:
        deadline = time.monotonic() + 20
        while served.llm.stats()["num_waiting"] == 0:
            assert time.monotonic() < deadline, "the request never queued"
            time.sleep(0.02)
        step = served.llm.step_count
        time.sleep(0.3)
        assert served.llm.step_count == step and served.llm.stats()["num_waiting"] == 1  # paused: no step ran
        for n in (1, 2):
            reply = httpx.post(f"{base}/step", timeout=60).json()
            assert (reply["step"], reply["granted"], reply["is_paused"]) == (step + n, 1, True)
        assert httpx.get(f"{base}/is_paused").json() == {"is_paused": True, "step": step + 2}
        assert not replies  # 3 tokens need 3 steps: still running
    finally:
        assert httpx.post(f"{base}/resume").json()["is_paused"] is False
        sender.join(60)
    assert replies[0].choices[0].text == _greedy(offline, PROMPT, 3).text
    assert httpx.post(f"{base}/step", timeout=60).json()["granted"] == 0  # nothing to run: no step granted
    assert httpx.post(f"{base}/resume").json()["is_paused"] is False


# ---- `workbench bench serve --base-url` -----------------------------------------------------------------------
def test_bench_serve_over_http_measures_every_request_at_the_client(served):
    from transformers import AutoTokenizer

    from engine import resolve_model
    from workbench.bench.datasets import sample_dataset
    from workbench.bench.http_serve import run_http_serve_once
    from workbench.bench.serve import compute_metrics, http_results, request_arrivals

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(MODEL))
    requests = sample_dataset("random", tokenizer, 6, 0, input_len=12, output_len=5)
    streamed, duration, _ = run_http_serve_once(
        f"{served.base_url}/v1", MODEL, requests, request_arrivals(6, 50.0, seed=0), max_concurrency=4
    )
    results = http_results(streamed)
    assert all(r.success for r in results) and [r.output_len for r in results] == [5] * 6
    assert all(0 < r.ttft <= r.e2el <= duration and len(r.itl) <= 4 for r in results)
    metrics = compute_metrics(results, duration)
    assert metrics["completed"] == 6 and metrics["total_output_tokens"] == 30
    failed, _, seen = run_http_serve_once(f"{served.base_url}/v1", "no-such-model", requests[:1], [0.0])
    assert not http_results(failed)[0].success  # a 404 is a failed request, not a crash
    assert seen.requests == {"refused 404": 1} and seen.lost == 0
