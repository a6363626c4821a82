"""The server fuzzed from its own schema (issue #39): schemathesis reads `/openapi.json` of a served tiny-llama (the
request bodies are the pydantic models of protocol.py, limits included) and generates requests for every route, the
hold (`/pause`, `/step`, `/resume`) included, in both modes (fitting the schema, and not). Every request, with the
key or without it, gets a 2xx or a 4xx in OpenAI's error shape, never a 5xx, each within a bound; afterwards the
server is idle: 0 running, 0 waiting, 0 KV blocks used. A few hundred cases, seeded (the same ones every run)."""

from __future__ import annotations

import itertools
import time

import httpx
import pytest

from tests.entrypoints.conftest import ENGINE, MODEL, serving

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402  (after the skip: hypothesis comes with schemathesis)

KEY = "fuzz-key"
# short contexts and few sequences: every generated request ends within seconds, whatever it asks
FUZZ_ENGINE = {**ENGINE, "max_model_len": 96, "max_num_seqs": 4}
EXAMPLES = 60  # per route and mode (a route without a body or parameter has one case): ~370 cases in all
BOUND_S = 60.0  # no request may take longer (a hang fails here, not in the suite's timeout)
OPEN = ("/health", "/metrics")
HOLD = ("/pause", "/step")  # they hold the loop: released after each, so later cases are not held behind them
_calls = itertools.count()
seen: dict[str, int] = {}


@pytest.fixture(scope="module")
def fuzzed(tiny_model_path, tmp_path_factory):
    from hypothesis import configuration

    from engine.async_llm import AsyncLLM

    # hypothesis keeps its caches in ./.hypothesis by default: in a temporary folder instead, not the checkout
    configuration.set_hypothesis_home_dir(tmp_path_factory.mktemp("hypothesis"))
    try:
        yield from serving(AsyncLLM(model=MODEL, max_num_queued_reqs=64, **FUZZ_ENGINE), api_key=KEY)
    finally:
        configuration.set_hypothesis_home_dir(None)


@pytest.fixture(scope="module")
def operations(fuzzed) -> list:
    """Every route of the served `/openapi.json` (fetched with the key: it is guarded too). schemathesis' own
    pytest loader does not run under pytest 9 (it reads a node's private `_nodeid`): its strategies are driven by
    hypothesis here instead."""
    from schemathesis.config import SchemathesisConfig

    config = SchemathesisConfig.from_dict({"seed": 39})
    schema = schemathesis.openapi.from_url(
        f"{fuzzed.base_url}/openapi.json", config=config, headers={"Authorization": f"Bearer {KEY}"}, timeout=30
    )
    found = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in found} >= {"/v1/completions", "/v1/chat/completions", "/pause", "/step", "/resume"}
    return found


def _check(case, fuzzed) -> None:
    """One generated request: a 2xx, or a 4xx in OpenAI's shape; 401 without the key; within BOUND_S."""
    path = case.operation.path
    keyed = next(_calls) % 5 != 0  # one case in five comes with a wrong key
    auth = f"Bearer {KEY}" if keyed else "Bearer not-the-key"
    t0 = time.monotonic()
    try:
        response = case.call(base_url=fuzzed.base_url, headers={"Authorization": auth}, timeout=BOUND_S)
    finally:
        if path in HOLD:  # whatever happened, let the loop go again
            httpx.post(f"{fuzzed.base_url}/resume", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    elapsed = time.monotonic() - t0
    status = response.status_code
    seen[f"{case.method} {path} {status}"] = seen.get(f"{case.method} {path} {status}", 0) + 1
    assert status < 500, f"{case.method} {path} -> {status}: {response.text[:500]}"
    assert elapsed < BOUND_S
    if not keyed and path not in OPEN:
        assert status == 401, f"{case.method} {path} without the key -> {status}"
    if 400 <= status < 500:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == status, response.text


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_every_generated_request_gets_a_2xx_or_an_openai_4xx_in_bounded_time(fuzzed, operations, mode):
    from hypothesis import given, seed
    from schemathesis.generation.modes import GenerationMode

    before = sum(seen.values())
    for operation in operations:
        if mode == "negative" and not (len(operation.body) or len(operation.query)):
            continue  # nothing to break in a route without a body or a parameter

        @seed(39)
        @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=GenerationMode(mode)))
        def fuzz(case) -> None:
            _check(case, fuzzed)

        fuzz()
    print(f"\n{mode}: {sum(seen.values()) - before} cases")
    assert sum(seen.values()) - before >= 100, seen  # the fuzz ran its cases
    _afterwards_the_server_is_idle_and_nothing_leaked(fuzzed)


def _afterwards_the_server_is_idle_and_nothing_leaked(fuzzed):
    """After each mode's fuzz (a check of that test, not a test of its own: under `--dist worksteal` a worker may run
    a module's tests in another order than they are written)."""
    print("\n" + "\n".join(f"{n:4d}  {k}" for k, n in sorted(seen.items())))
    assert fuzzed.llm.wait_until_idle(BOUND_S)
    stats = fuzzed.llm.stats()
    assert (stats["num_running"], stats["num_waiting"], stats["kv"].used) == (0, 0, 0), stats
    assert not fuzzed.llm.is_paused and not fuzzed.llm.errors
    assert not fuzzed.llm._collectors  # every request's stream was closed
    reply = httpx.post(
        f"{fuzzed.base_url}/v1/completions",
        json={"prompt": "The capital of France is", "max_tokens": 3},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=BOUND_S,
    )
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3  # and it serves on
