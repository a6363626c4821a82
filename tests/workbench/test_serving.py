"""`workbench serve`'s parts without a browser, on tiny-llama: the Workbench over a served engine (its Step runs
exactly one step of the serving loop, Pause holds it, Play releases it, Reset is refused, a closed session stops
following), and the app: `/` leads to `/dashboard`, which Panel serves on the API's port; `--prompt` starts paused."""
from __future__ import annotations

import time

import pytest
from bokeh.document import Document

from engine import EngineConfig, SamplingParams


@pytest.fixture
def served_app(tiny_model_path):
    from workbench.serving import build_serving_app

    app, llm = build_serving_app(EngineConfig(model="tiny-llama", num_kv_blocks=64), "tiny",
                                 prompts=["The capital of France is"], params=SamplingParams(max_tokens=4, ignore_eos=True))
    try:
        yield app, llm
    finally:
        llm.shutdown()


def test_the_dashboard_steps_and_holds_the_serving_loop(served_app):
    from workbench.app import Workbench

    app, llm = served_app
    assert llm.is_paused and llm.step_count == 0  # --prompt: queued and held until Step or Play
    bench = Workbench(llm.engine, serving=llm)
    bench.layout.get_root(Document())
    assert bench.lock is llm.lock
    bench.step_button.clicks += 1
    deadline = time.monotonic() + 30
    while llm.step_count == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert llm.wait_until_idle(0.3) is False and llm.step_count == 1  # exactly one step, then held
    assert bench.step_text.object == "step 1"
    bench.reset_button.clicks += 1
    assert "shared with the HTTP server" in bench.message.object and bench.engine is llm.engine
    bench.play_button.clicks += 1
    assert not llm.is_paused and llm.wait_until_idle(30)
    bench.pause_button.clicks += 1
    assert llm.is_paused
    bench.step_button.clicks += 1
    assert "Nothing to run" in bench.message.object and llm.step_count == 4
    bench.close()
    llm.resume()
    llm.add_request("More", SamplingParams(max_tokens=2))
    assert llm.wait_until_idle(30) and bench.step_text.object == "step 4"  # closed: no longer follows


def test_root_leads_to_the_dashboard_on_the_same_port(served_app):
    from fastapi.testclient import TestClient

    app, _ = served_app
    with TestClient(app) as client:
        root = client.get("/", follow_redirects=False)
        assert root.status_code == 307 and root.headers["location"] == "/dashboard"
        page = client.get("/dashboard")
        assert page.status_code == 200 and "Bokeh" in page.text and "<title>Inference Workbench</title>" in page.text
        assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
