"""`workbench serve`: the OpenAI-compatible server of one engine and, on the same port, the live dashboard of that
engine at /dashboard (with data_parallel_size > 1, of the data-parallel front end: routing and each replica's load).

Same port, same process: Panel's FastAPI integration (bokeh-fastapi) mounts the Bokeh application on the FastAPI
app, so the dashboard's sessions and the API run on uvicorn's one event loop and the views subscribe to the very
engine the HTTP requests run on (a Bokeh server beside it would need a second port, or a proxy for its websocket).
Every browser session gets its own Workbench over the shared AsyncLLM: its Pause / Step / Play hold and release
the serving loop for everyone, which is the point (watch a step of real traffic, then the next)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import panel as pn
from fastapi import FastAPI
from fastapi.responses import RedirectResponse

from engine import EngineConfig, SamplingParams
from engine.async_llm import AsyncLLM
from engine.entrypoints.openai.api_server import build_app, run_server
from engine.entrypoints.openai.guards import DEFAULT_MAX_REQUEST_BODY_BYTES, warn_if_exposed
from workbench.app import Workbench
from workbench.views import ensure_extension

DASHBOARD_PATH = "/dashboard"
# the waiting queue's bound when serving (a flood past it gets 503s): four full batches of the default max_num_seqs
DEFAULT_MAX_NUM_QUEUED_REQS = 1024


@dataclass(frozen=True)
class ServerLimits:
    """What the server refuses at the door beyond the engine's own limits: more requests in flight (waiting or
    running) than `max_num_queued_reqs` (vLLM's setting and answer, 503; vLLM has no bound by default, this server
    1024), a body past `max_request_body_bytes` (413)."""

    max_num_queued_reqs: int | None = DEFAULT_MAX_NUM_QUEUED_REQS
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES


def build_serving_app(
    config: EngineConfig,
    model_name: str | None = None,
    api_key: str | None = None,
    prompts: Sequence[str] = (),
    params: SamplingParams | None = None,
    port: int = 8000,
    limits: ServerLimits = ServerLimits(),
) -> tuple[FastAPI, AsyncLLM]:
    """The API and the dashboard over one new engine. With `prompts`, they are queued first and the loop starts
    paused: they wait for Step or Play (HTTP requests queue behind them meanwhile). With data_parallel_size > 1,
    the dashboard follows the data-parallel front end (its records: routing, each replica's load, the requests'
    tokens; no Step, Play or Pause, which need one engine's loop), and `prompts` are refused."""
    if prompts and config.data_parallel_size > 1:
        raise ValueError(
            f"prompt: queued prompts wait for the dashboard's Step, which data_parallel_size="
            f"{config.data_parallel_size} has not"
        )
    # shutdown() closes its engine (and processes)
    llm = AsyncLLM(config=config, start_paused=bool(prompts), max_num_queued_reqs=limits.max_num_queued_reqs)
    try:  # its metrics follow every step from the first; the key guards the dashboard mounted below as well
        app = build_app(llm, model_name or config.model, api_key, max_request_body_bytes=limits.max_request_body_bytes)
    except ValueError:
        llm.shutdown()
        raise
    for prompt in prompts:
        llm.add_request(prompt, params)
    mount_dashboard(app, llm, port)
    return app, llm


def mount_dashboard(app: FastAPI, llm: AsyncLLM, port: int) -> None:
    """The live Workbench of `llm` at /dashboard (a session per browser tab), and `/` leading there."""
    from panel.io.fastapi import add_applications

    ensure_extension()

    def dashboard() -> pn.Row:
        workbench = Workbench(llm.engine, serving=llm)
        pn.state.on_session_destroyed(lambda context: workbench.close())  # a closed tab stops following
        return workbench.layout

    origins = [f"127.0.0.1:{port}", f"localhost:{port}"]
    add_applications({DASHBOARD_PATH: dashboard}, app=app, title="Inference Workbench", websocket_origin=origins)

    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse(DASHBOARD_PATH)


def serve_openai(
    config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    prompts: Sequence[str] = (),
    params: SamplingParams | None = None,
    model_name: str | None = None,
    announce: Callable[[str], Any] | None = None,
    limits: ServerLimits = ServerLimits(),
) -> None:
    """Build the engine (a bad model or config fails here, before any port is bound), then serve until
    interrupted; `announce(url)` once the port is bound. The engine loop stops with the server. Beyond the
    loopback without a key, a loud warning first (warn_if_exposed)."""
    warning = warn_if_exposed(host, api_key)
    if warning:
        print(f"\n{'!' * 100}\n{warning}\n{'!' * 100}\n", file=sys.stderr, flush=True)
    app, llm = build_serving_app(config, model_name, api_key, prompts, params, port, limits)
    try:
        run_server(app, host, port, announce)
    finally:
        llm.shutdown()
