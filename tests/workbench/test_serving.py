"""`workbench serve`'s parts without a browser, on tiny-llama: the Workbench over a served engine (its Step runs
exactly one step of the serving loop, Pause holds it, Play releases it, Reset is refused, a closed session stops
following), and the app: `/` leads to `/dashboard`, which Panel serves on the API's port; `--prompt` starts paused."""

from __future__ import annotations

import os
import time

import pytest
from bokeh.document import Document

from engine import EngineConfig, SamplingParams


@pytest.fixture
def served_app(tiny_model_path):
    from workbench.serving import build_serving_app

    app, llm = build_serving_app(
        EngineConfig(model="tiny-llama", num_kv_blocks=64),
        "tiny",
        prompts=["The capital of France is"],
        params=SamplingParams(max_tokens=4, ignore_eos=True),
    )
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


def test_the_dashboard_follows_a_data_parallel_front_end_live(tiny_model_path):
    """`workbench serve --data-parallel-size 2`: the dashboard follows the front end's records as requests arrive:
    the Parallelism tab's DP section fills with each replica's load and every routing decision, the requests table
    with the requests; the views of one engine's steps or blocks say they are per replica; Step / Play are off."""
    from workbench.app import Workbench
    from workbench.serving import build_serving_app
    from workbench.views.dashboard import PER_REPLICA

    app, llm = build_serving_app(EngineConfig(model="tiny-llama", num_kv_blocks=64, data_parallel_size=2), "tiny")
    pids = list(llm.engine.pids().values())
    try:
        bench = Workbench(llm.engine, serving=llm)
        bench.layout.get_root(Document())
        board = bench.dashboard
        assert board.data_parallel_size == 2 and not board.parallel.dp.panel.visible  # nothing routed yet
        for view in board.per_replica:
            notice = board.notices[view]
            assert notice.visible and not view.panel.visible
            assert notice.object == PER_REPLICA.format(title=view.title, n=2)
        assert "per replica, not available with data parallelism" in board.notices[board.kv_blocks].object
        assert bench.step_button.disabled and bench.play_button.disabled and bench.pause_button.disabled
        assert "Data parallelism: 2 replicas" in bench.message.object and "data parallel: 2" in bench.title.object
        rids = [
            llm.add_request(p, SamplingParams(max_tokens=4, ignore_eos=True))
            for p in ("The capital of France is", "Once upon a time", "Hello there")
        ]
        assert llm.wait_until_idle(60)
        deadline = time.monotonic() + 10
        while len(board.parallel.dp.routes.source.data["request_id"]) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)  # the last record is drawn on the loop's thread right after the step
        routes = board.parallel.dp.routes.source.data
        assert list(routes["request_id"]) == rids and set(routes["replica"]) == {"dp-0", "dp-1"}
        assert board.parallel.dp.panel.visible
        loads = board.parallel.dp.loads.source.data
        assert {"dp-0", "dp-1"} <= set(loads["replica"])
        assert set(board.state.requests) == set(rids)
        assert all(board.state.requests[r].num_output_tokens == 4 for r in rids)
        bench.close()
    finally:
        llm.shutdown()
    assert not [pid for pid in pids if os.path.exists(f"/proc/{pid}")]


@pytest.mark.parametrize(
    "host, api_key, loud", [("0.0.0.0", None, True), ("127.0.0.1", None, False), ("0.0.0.0", "k", False)]
)
def test_serving_beyond_the_loopback_without_a_key_warns_before_anything_loads(
    monkeypatch, capsys, host, api_key, loud
):
    """The warning is printed at start, before the model loads or a port is bound (nothing is bound here: the
    build that would follow is replaced by a stop)."""
    import workbench.serving as serving

    def stop(*args, **kwargs):
        raise RuntimeError("stopped before building")

    monkeypatch.setattr(serving, "build_serving_app", stop)
    with pytest.raises(RuntimeError, match="stopped before building"):
        serving.serve_openai(EngineConfig(model="tiny-llama"), host=host, port=1, api_key=api_key)
    err = capsys.readouterr().err
    assert ("anyone who can reach this port" in err and host in err) == loud, err


def test_serve_flags_reach_the_engine_and_the_server_limits(monkeypatch):
    """--max-num-seqs / --max-model-len / --max-logprobs to the EngineConfig; --max-num-queued-reqs and
    --max-request-body-bytes to the ServerLimits (defaults where not given)."""
    import workbench.app
    import workbench.serving as serving
    from workbench.cli import main

    seen = {}
    monkeypatch.setattr(workbench.app, "check_port", lambda port, host: None)
    monkeypatch.setattr(
        serving, "serve_openai", lambda config, *args, limits, **kwargs: seen.update(config=config, limits=limits)
    )
    assert (
        main(
            [
                "serve",
                "tiny-llama",
                "--max-num-seqs",
                "8",
                "--max-model-len",
                "512",
                "--max-logprobs",
                "5",
                "--max-num-queued-reqs",
                "7",
            ]
        )
        == 0
    )
    assert (seen["config"].max_num_seqs, seen["config"].max_model_len, seen["config"].max_logprobs) == (8, 512, 5)
    assert seen["limits"] == serving.ServerLimits(max_num_queued_reqs=7)


def test_the_dashboard_form_says_when_the_served_queue_is_full(tiny_model_path):
    """The form's request goes through the serving loop's door too: past max_num_queued_reqs it is refused with
    the reason shown (an HTTP client would get a 503), and nothing is queued."""
    from workbench.app import Workbench
    from workbench.serving import ServerLimits, build_serving_app

    _, llm = build_serving_app(
        EngineConfig(model="tiny-llama", num_kv_blocks=64),
        "tiny",
        prompts=["Held"],
        params=SamplingParams(max_tokens=2),
        limits=ServerLimits(max_num_queued_reqs=1),
    )
    try:
        bench = Workbench(llm.engine, serving=llm)
        bench.layout.get_root(Document())
        assert bench.add_request_from_form() is None
        assert "max_num_queued_reqs=1" in bench.message.object and llm.stats()["num_waiting"] == 1
        bench.close()
    finally:
        llm.shutdown()
