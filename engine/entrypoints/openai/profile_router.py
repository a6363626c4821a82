"""vLLM's profiler routes (vllm/entrypoints/serve/profile/api_router.py): `POST /start_profile` and
`POST /stop_profile`, mounted only when the engine has a profiler_config (without one they are absent, a 404, as
vLLM leaves them). Behind the API key as every control route (guards.py).

Start takes vLLM's optional body `{"profile_prefix": NAME}` (the trace file's prefix) and answers 200, or 409 while a
session runs (vLLM's conflict); stop answers `{"trace": PATH}`, the Chrome trace it wrote (null when no session ran).
Both run on the engine loop's thread between two steps (engine/profiler.py says why)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from engine.async_llm import AsyncLLM
from engine.entrypoints.openai.serving_engine import RequestError
from engine.profiler import ProfilerAlreadyActiveError


class StartProfileRequest(BaseModel):
    """The body of /start_profile: vLLM's `profile_prefix` (its other overrides are not supported: refused)."""

    model_config = ConfigDict(extra="forbid")

    profile_prefix: str | None = None


async def _on_loop(call: Callable[..., Any], *args: Any) -> Any:
    """Run a profiler call of `llm` off the event loop; its refusals as 4xx, a loop that never got to it as 503."""
    try:
        return await asyncio.to_thread(call, *args)
    except ProfilerAlreadyActiveError as exc:
        raise RequestError(409, str(exc)) from None
    except ValueError as exc:  # a bad profile_prefix
        raise RequestError(400, str(exc), "profile_prefix") from None
    except TimeoutError:
        raise RequestError(503, "the engine loop did not get to the profiler within 60 s (a step that long)") from None


def attach_router(app: FastAPI, llm: AsyncLLM) -> None:
    """Mount the two routes on `app` when `llm`'s engine has a profiler."""
    if llm.engine.config.profiler is None:
        return

    @app.post("/start_profile")
    async def start_profile(body: StartProfileRequest | None = None) -> Response:
        await _on_loop(llm.start_profile, body.profile_prefix if body is not None else None)
        return Response(status_code=200)

    @app.post("/stop_profile")
    async def stop_profile() -> JSONResponse:
        return JSONResponse({"trace": await _on_loop(llm.stop_profile)})
