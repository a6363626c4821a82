"""The serving benchmark over HTTP (`workbench bench serve --base-url URL`, or `--chaos-*` on the engine served
in-process): each request a streamed completion read as raw server-sent events, so the client sees what the server
really sent (`data: [DONE]` at the end, or not), times taken at the client as vLLM's `benchmark_serving` takes them.

With chaos (`--chaos-disconnect SHARE`, `--chaos-malformed SHARE`), a bad client joins the burst: that share of the
requests is cut mid-stream (the connection closed after 1 to 3 chunks), and malformed requests (that share of the
number of requests: an absurd `n`, a wrong type, an unknown field, a body that is not JSON, ...) are sent among
them; meanwhile `/health` is polled. What is reported: each request's outcome (finished with [DONE], cut, refused
with a status, lost), the malformed ones' statuses, /health's answers, and what the server still holds once idle
(requests running and waiting, KV cache usage, from its /metrics). Lost must be 0, and so must what it holds."""

from __future__ import annotations

import asyncio
import json
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine import LLM
    from workbench.bench.datasets import BenchRequest

# what a bad client sends: each must be refused with a 4xx, never crash or hold the server
MALFORMED: tuple[tuple[str, dict[str, Any] | bytes], ...] = (
    ("n = 1000000", {"prompt": "Hello", "n": 1_000_000, "stream": True}),
    ("max_tokens as a string", {"prompt": "Hello", "max_tokens": "16", "stream": True}),
    ("an unknown field", {"prompt": "Hello", "temprature": 0.5}),
    ("not JSON", b'{"prompt": "Hello", "max_tokens": 4'),
    ("logprobs past max_logprobs", {"prompt": "Hello", "logprobs": 10_000}),
    ("a prompt nested three deep", {"prompt": [[[1, 2, 3]]]}),
    ("a token id outside the vocabulary", {"prompt": [10**12], "stream": True}),
    ("1000 stop strings", {"prompt": "Hello", "stop": ["x"] * 1000}),
)
HEALTH_EVERY_S = 0.2


@dataclass(frozen=True)
class Chaos:
    """The bad client's shares: of the requests, those cut mid-stream (`disconnect`); malformed requests sent
    among them, as a share of their number (`malformed`)."""

    disconnect: float = 0.0
    malformed: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("disconnect", "malformed"):
            value = getattr(self, name)
            if not 0 <= value <= 1:
                raise ValueError(f"chaos_{name}: a share in [0, 1], got {value}")

    @property
    def active(self) -> bool:
        return bool(self.disconnect or self.malformed)

    def cuts(self, num_requests: int) -> dict[int, int]:
        """{request index: chunks read before the client leaves}, seeded."""
        rng = random.Random(self.seed)
        chosen = rng.sample(range(num_requests), round(num_requests * self.disconnect))
        return {i: rng.randint(1, 3) for i in chosen}

    def num_malformed(self, num_requests: int) -> int:
        return round(num_requests * self.malformed)


@dataclass
class Outcomes:
    """What the client saw: each request's outcome, the malformed requests' statuses, /health's answers, and what
    the server held once idle."""

    requests: Counter = field(default_factory=Counter)  # "done", "cut", "refused 503", "lost"
    malformed: Counter = field(default_factory=Counter)  # "400", "413", "lost" ...
    health_ok: int = 0
    health_failed: int = 0
    left: dict[str, float] = field(default_factory=dict)  # running, waiting, kv_cache_usage_perc once idle

    @property
    def lost(self) -> int:
        """Well-formed requests that neither finished with [DONE], nor were cut by the client, nor refused; and
        malformed ones that got no 4xx."""
        return self.requests["lost"] + sum(n for status, n in self.malformed.items() if not status.startswith("4"))

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests": dict(self.requests),
            "malformed": dict(self.malformed),
            "health_ok": self.health_ok,
            "health_failed": self.health_failed,
            "left": self.left,
            "lost": self.lost,
        }


@dataclass
class Streamed:
    """One request as the client saw it: its outcome ("done": ended with `data: [DONE]`; "cut": the client left
    mid-stream; "refused STATUS"; "lost"), the text streamed, the output length (the server's usage, else the chunks
    that carried text) and when each chunk with text came (s after the request was sent)."""

    prompt_len: int
    outcome: str = "lost"
    text: str = ""
    output_len: int = 0
    times: list[float] = field(default_factory=list)


def _root(base_url: str) -> str:
    return base_url[: -len("/v1")] if base_url.rstrip("/").endswith("/v1") else base_url.rstrip("/")


async def _stream(
    client: Any,
    base_url: str,
    body: dict[str, Any],
    arrival: float,
    semaphore: asyncio.Semaphore,
    cut_after: int | None,
) -> Streamed:
    """One streamed completion at its arrival time, read as raw SSE; the client leaves after `cut_after` chunks."""
    await asyncio.sleep(max(0.0, arrival - time.monotonic()))
    seen = Streamed(len(body["prompt"]))
    async with semaphore:
        start, chunks = time.monotonic(), 0
        try:
            async with client.stream("POST", f"{base_url}/completions", json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    seen.outcome = f"refused {response.status_code}"
                    return seen
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        seen.outcome = "done"
                        break
                    chunk = json.loads(line[len("data: ") :])
                    if "error" in chunk:  # the request failed after the stream began: lost
                        break
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        seen.times.append(time.monotonic() - start)
                        seen.text += chunk["choices"][0]["text"]
                    chunks += bool(chunk.get("choices"))
                    if chunk.get("usage"):
                        seen.output_len = chunk["usage"]["completion_tokens"]
                    if cut_after is not None and chunks >= cut_after:
                        seen.outcome = "cut"  # leaving the block closes the connection mid-stream: the server aborts
                        break
        except Exception:  # a connection that failed: lost (counted, the others go on)
            seen.outcome = "lost"
    seen.output_len = seen.output_len or len(seen.times)
    return seen


async def _malformed(client: Any, base_url: str, body: dict[str, Any] | bytes, arrival: float) -> str:
    """A malformed request at its arrival: its status as a string, or "lost" without an answer."""
    await asyncio.sleep(max(0.0, arrival - time.monotonic()))
    try:
        if isinstance(body, bytes):
            response = await client.post(
                f"{base_url}/completions", content=body, headers={"content-type": "application/json"}
            )
        else:
            response = await client.post(f"{base_url}/completions", json=body)
        return str(response.status_code)
    except Exception:
        return "lost"


async def _poll_health(client: Any, root: str, outcomes: Outcomes, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            ok = (await client.get(f"{root}/health", timeout=5)).status_code == 200
        except Exception:
            ok = False
        outcomes.health_ok += ok
        outcomes.health_failed += not ok
        try:
            await asyncio.wait_for(stop.wait(), HEALTH_EVERY_S)
        except TimeoutError:
            pass


def server_load(root: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """Requests running and waiting and the KV cache's usage, from the server's /metrics (vLLM's names)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    names = {
        "vllm:num_requests_running": "running",
        "vllm:num_requests_waiting": "waiting",
        "vllm:kv_cache_usage_perc": "kv_cache_usage_perc",
    }
    load = {v: 0.0 for v in names.values()}
    for family in text_string_to_metric_families(httpx.get(f"{root}/metrics", headers=headers, timeout=30).text):
        for sample in family.samples:
            if sample.name in names:
                load[names[sample.name]] += sample.value
    return load


def wait_idle(root: str, timeout: float = 60.0, headers: dict[str, str] | None = None) -> dict[str, float]:
    """What the server holds once nothing runs or waits (or at `timeout`): `server_load`."""
    deadline = time.monotonic() + timeout
    while True:
        load = server_load(root, headers)
        if load["running"] == load["waiting"] == 0 or time.monotonic() > deadline:
            return load
        time.sleep(0.1)


def run_http_serve_once(
    base_url: str,
    model: str,
    requests: Sequence[BenchRequest],
    arrivals: Sequence[float],
    max_concurrency: int | None = None,
    chaos: Chaos = Chaos(),
) -> tuple[list[Streamed], float, Outcomes]:
    """Send `requests` at `arrivals` to an OpenAI-compatible server at `base_url` (ending in /v1), as `model`,
    streamed, with `chaos`'s bad client among them. Returns what the client saw of each request, in order, the
    duration (first send to last finish, s) and the outcomes (the server's load read once it is idle)."""
    import httpx

    cuts = chaos.cuts(len(requests))
    rng = random.Random(chaos.seed + 1)
    bad = [
        (rng.choice(MALFORMED)[1], rng.uniform(0, max(arrivals, default=0.0)))
        for _ in range(chaos.num_malformed(len(requests)))
    ]
    outcomes = Outcomes()
    key = os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    def body(r: BenchRequest) -> dict[str, Any]:
        # vLLM's extras: exactly output_len tokens where the dataset says so; JSON-schema requests guided
        b = {
            "model": model,
            "prompt": r.prompt_token_ids,
            "max_tokens": r.output_len,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": r.ignore_eos,
        }
        if r.json_schema is not None:
            b["structured_outputs"] = {"json": r.json_schema}
        return b

    async def everyone() -> list[Streamed]:
        cap = max_concurrency or len(requests) or 1
        limits = httpx.Limits(max_connections=cap + len(bad) + 1)
        semaphore = asyncio.Semaphore(cap)
        async with httpx.AsyncClient(limits=limits, timeout=600, headers=headers) as client:
            stop = asyncio.Event()
            health = asyncio.ensure_future(_poll_health(client, _root(base_url), outcomes, stop))
            start = time.monotonic()
            try:
                sent = asyncio.gather(
                    *(
                        _stream(client, base_url, body(r), start + a, semaphore, cuts.get(i))
                        for i, (r, a) in enumerate(zip(requests, arrivals))
                    )
                )
                broken = asyncio.gather(*(_malformed(client, base_url, b, start + a) for b, a in bad))
                results, statuses = await asyncio.gather(sent, broken)
            finally:
                stop.set()
                await health
        outcomes.malformed.update(statuses)
        return results

    start = time.monotonic()
    streamed = asyncio.run(everyone())
    duration = time.monotonic() - start
    outcomes.requests.update(seen.outcome for seen in streamed)
    outcomes.left = wait_idle(_root(base_url), headers=headers)
    return streamed, duration, outcomes


@contextmanager
def served_in_process(llm: LLM, model_name: str) -> Iterator[str]:
    """`llm`'s engine behind the OpenAI-compatible server on a free loopback port, stepped by an AsyncLLM, while the
    block runs; yields the base URL (ending in /v1). The server and the loop stop after; the engine stays `llm`'s."""
    import socket

    import uvicorn

    from engine.async_llm import AsyncLLM
    from engine.entrypoints.openai.api_server import build_app

    async_llm = AsyncLLM(llm.engine)
    app = build_app(async_llm, model_name)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="bench-serve-uvicorn", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(30)
        async_llm.unsubscribe(app.state.metrics)
        async_llm.shutdown()
