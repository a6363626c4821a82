"""One OpenAI-compatible server over tiny-llama per module, on a free loopback port, served by uvicorn in a thread
of the test process (so tests read its engine's blocks directly); stopped and joined at the end."""

from __future__ import annotations

import threading
import time

import pytest

from tests.net import free_port

MODEL = "tiny-llama"
ENGINE = {"num_kv_blocks": 128, "seed": 0}


class Served:
    """A running server: its base URL, its AsyncLLM, its FastAPI app."""

    def __init__(self, llm, app, base_url: str) -> None:
        self.llm, self.app, self.base_url = llm, app, base_url

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="none", max_retries=0, **kwargs)

    def async_client(self, **kwargs):
        import openai

        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key="none", max_retries=0, **kwargs)


@pytest.fixture(scope="module")
def served(tiny_model_path):
    from engine.async_llm import AsyncLLM

    yield from serving(AsyncLLM(model=MODEL, **ENGINE))


def serving(llm, **app_kwargs):
    """Serve `llm` (an AsyncLLM) on a free port while the generator is suspended (`app_kwargs` to build_app: an
    api_key, a body limit); then stop the server and the loop (which closes an engine the AsyncLLM built)."""
    import uvicorn

    from engine.entrypoints.openai.api_server import build_app

    app = build_app(llm, MODEL, **app_kwargs)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield Served(llm, app, f"http://127.0.0.1:{port}")
    finally:
        server.should_exit = True
        thread.join(30)
        llm.shutdown()
        assert not thread.is_alive()


@pytest.fixture(scope="module")
def offline(tiny_model_path):
    """The same model and settings in-process: what the server's greedy outputs must equal."""
    from engine import LLM

    return LLM(model=MODEL, **ENGINE)
