"""The OpenAI-compatible server (vLLM's `api_server.py`): a FastAPI app over an AsyncLLM, served by uvicorn.

Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`, `GET /health`, `GET /metrics`
(Prometheus, vLLM's names), and the hold of the engine loop: `POST /pause`, `POST /resume`, `GET /is_paused`
(vLLM's names) and `POST /step` (ours: one step while paused); with a profiler_config, vLLM's `POST /start_profile`
and `POST /stop_profile` (profile_router.py). With an API key, every route but /health and
/metrics needs the key (engine/entrypoints/openai/guards.py: `Authorization: Bearer KEY`, or a browser's session
cookie from /login). Every error, the framework's own (404, 405, a body that is not JSON, 413) included, is a 4xx in
OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.async_llm import AsyncLLM
from engine.entrypoints.openai import guards, profile_router
from engine.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from engine.entrypoints.openai.serving_chat import OpenAIServingChat
from engine.entrypoints.openai.serving_completion import OpenAIServingCompletion
from engine.entrypoints.openai.serving_engine import RequestError, error_response
from engine.metrics import PrometheusStatLogger


def _validation_error(exc: RequestValidationError) -> Response:
    """Pydantic's first complaint as a 400 naming the field ("max_tokens: Input should be a valid integer"). Of a
    union's complaints (`stop`: a string, or a list of strings) the first that is not a wrong type: a list of 65 stop
    strings is refused for its length ("at most 64 items"), not for not being a string."""
    errors = exc.errors()
    error = next((e for e in errors if not str(e.get("type", "")).endswith("_type")), errors[0])
    loc = [str(part) for part in error.get("loc", ()) if part != "body"]
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    message = error.get("msg", "invalid request")
    if error.get("type") == "extra_forbidden":
        message = f"unknown field ({message})"
    return error_response(400, f"{where}: {message}", param)


def _http_error(exc: StarletteHTTPException) -> Response:
    """The framework's own refusals (no such route, wrong method, a body it could not parse, 413) in OpenAI's
    shape, as every other error."""
    message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    return error_response(exc.status_code, message)


def build_app(
    llm: AsyncLLM,
    model_name: str,
    api_key: str | None = None,
    metrics: PrometheusStatLogger | None = None,
    max_request_body_bytes: int = guards.DEFAULT_MAX_REQUEST_BODY_BYTES,
) -> FastAPI:
    """The app serving `llm` under `model_name`. The metrics logger subscribes to the engine here (pass one to
    share it); nothing binds a port until uvicorn runs the app. The guards (guards.py: the key on every route but
    /health and /metrics, routes mounted later such as the dashboard included; the body limit) wrap the app."""
    app = FastAPI(title="Inference Workbench OpenAI-compatible server")
    guards.install(app, api_key, max_request_body_bytes)
    completion = OpenAIServingCompletion(llm, model_name)
    chat = OpenAIServingChat(llm, model_name)
    if metrics is None:
        metrics = PrometheusStatLogger(model_name, llm.stats)
        llm.subscribe(metrics)
    app.state.llm, app.state.metrics, app.state.model_name = llm, metrics, model_name
    created = int(time.time())

    app.add_exception_handler(RequestValidationError, lambda request, exc: _validation_error(exc))
    app.add_exception_handler(RequestError, lambda request, exc: error_response(exc.status, exc.message, exc.param))
    app.add_exception_handler(StarletteHTTPException, lambda request, exc: _http_error(exc))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        body = await asyncio.to_thread(metrics.render)  # reads the engine under its lock: off the event loop
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = {
            "id": model_name,
            "object": "model",
            "created": created,
            "owned_by": "inference-workbench",
            "root": str(llm.engine.model_path),
            "parent": None,
            "max_model_len": llm.engine.config.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        return await completion.create(request, raw_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await chat.create(request, raw_request)

    @app.post("/pause")
    async def pause() -> JSONResponse:
        _hold(llm.pause)
        return JSONResponse(_hold_state(llm))

    @app.post("/resume")
    async def resume() -> JSONResponse:
        llm.resume()
        return JSONResponse(_hold_state(llm))

    @app.get("/is_paused")
    async def is_paused() -> JSONResponse:
        return JSONResponse(_hold_state(llm))

    @app.post("/step")
    async def step(num_steps: int = 1) -> JSONResponse:
        if num_steps < 1:
            raise RequestError(400, f"num_steps: must be at least 1, got {num_steps}", "num_steps")
        granted = await asyncio.to_thread(_hold, llm.step, num_steps, 60.0)
        return JSONResponse({**_hold_state(llm), "granted": granted})

    profile_router.attach_router(app, llm)  # /start_profile, /stop_profile: only with a profiler_config
    return app


def _hold(call: Callable, *args: Any) -> Any:
    """Pause or step the loop; a loop that cannot be held (data parallelism) is a 400 saying why."""
    try:
        return call(*args)
    except ValueError as exc:
        raise RequestError(400, str(exc)) from None


def _hold_state(llm: AsyncLLM) -> dict[str, Any]:
    return {"is_paused": llm.is_paused, "step": llm.step_count}


def run_server(
    app: FastAPI, host: str = "127.0.0.1", port: int = 8000, announce: Callable[[str], Any] | None = None
) -> None:
    """Serve `app` with uvicorn until interrupted; `announce(url)` once the port is bound."""
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    if announce is not None:
        original = server.startup

        async def startup(sockets: Any = None) -> None:
            await original(sockets)
            if server.started:
                announce(f"http://{host}:{port}/")

        server.startup = startup  # type: ignore[method-assign]  # uvicorn has no hook once the port is bound
    server.run()
