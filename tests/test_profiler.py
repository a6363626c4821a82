"""The torch profiler behind vLLM's /start_profile and /stop_profile (engine/profiler.py, engine/entrypoints/openai/
profile_router.py): through the server and behind its API key, start, a request, stop writes a Chrome trace (gzipped
JSON, vLLM's default) into torch_profiler_dir holding a marker for every engine step that ran; a second start is
vLLM's 409; without a profiler_config the routes are absent (404). The engine alone: a session's file is named by
its prefix, and every refusal names what is wrong."""

from __future__ import annotations

import gzip
import json
import re
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.profiler import ProfilerAlreadyActiveError, step_marker_name
from tests.entrypoints.conftest import MODEL, serving

KEY = {"Authorization": "Bearer k"}


def _markers(trace: dict) -> dict[str, dict]:
    """The step markers of a Chrome trace, by name (complete events: "ph" X, a start and a duration)."""
    return {e["name"]: e for e in trace["traceEvents"] if e.get("name", "").startswith("step_")}


def test_start_a_request_stop_writes_a_chrome_trace_with_a_marker_per_step(tiny_model_path, tmp_path):
    from engine.async_llm import AsyncLLM

    folder = tmp_path / "traces"
    profiler = {"profiler": "torch", "torch_profiler_dir": str(folder), "torch_profiler_with_stack": False}
    llm = AsyncLLM(model=MODEL, num_kv_blocks=128, seed=0, profiler_config=profiler)
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    with contextmanager(serving)(llm, api_key="k") as served:
        url = served.base_url
        refused = httpx.post(f"{url}/start_profile")
        assert refused.status_code == 401 and refused.json()["error"]["message"]  # OpenAI's shape, as /pause
        assert httpx.post(f"{url}/start_profile", headers=KEY).status_code == 200
        again = httpx.post(f"{url}/start_profile", headers=KEY)
        assert again.status_code == 409 and "already active" in again.json()["error"]["message"]
        first = llm.step_count
        assert httpx.post(f"{url}/v1/completions", json=body, headers=KEY).status_code == 200
        stopped = httpx.post(f"{url}/stop_profile", headers=KEY)
        last = llm.step_count
        assert stopped.status_code == 200
        assert httpx.post(f"{url}/stop_profile", headers=KEY).json() == {"trace": None}  # no session: ignored
        bad = httpx.post(f"{url}/start_profile", json={"profile_prefix": "../elsewhere"}, headers=KEY)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "profile_prefix"
        unknown = httpx.post(f"{url}/start_profile", json={"max_iterations": 3}, headers=KEY)
        assert unknown.status_code == 400 and "max_iterations" in unknown.json()["error"]["message"]
    path = Path(stopped.json()["trace"])
    assert path.parent == folder and re.fullmatch(r".+_\d+\.engine\.\d+\.pt\.trace\.json\.gz", path.name)
    trace = json.loads(gzip.decompress(path.read_bytes()))
    markers = _markers(trace)
    assert last > first and set(markers) == {step_marker_name(n) for n in range(first + 1, last + 1)}
    assert all(m["ph"] == "X" and m["dur"] > 0 for m in markers.values())
    assert len(trace["traceEvents"]) > len(markers)  # the model's ops inside the steps


def test_without_a_profiler_config_the_routes_are_absent(tiny_model_path):
    from fastapi.testclient import TestClient

    from engine.async_llm import AsyncLLM
    from engine.entrypoints.openai.api_server import build_app

    with AsyncLLM(model=MODEL, num_kv_blocks=32) as llm:
        client = TestClient(build_app(llm, MODEL))
        for route in ("/start_profile", "/stop_profile"):
            assert client.post(route).status_code == 404
        with pytest.raises(RuntimeError, match="Profiling is not enabled: set profiler_config"):
            llm.start_profile()


def test_the_engine_alone_names_a_session_by_its_prefix_and_writes_plain_json(tmp_path):
    engine = LLMEngine(
        executor="scripted",
        token_script={"r": [7, 8, 9]},
        num_kv_blocks=16,
        block_size=4,
        profiler_config={"profiler": "torch", "torch_profiler_dir": str(tmp_path), "torch_profiler_use_gzip": False},
    )
    engine.add_request([11, 12, 13], SamplingParams(max_tokens=3), request_id="r")
    engine.step()  # before the session: no marker
    engine.start_profile("lesson-1")
    with pytest.raises(ProfilerAlreadyActiveError):
        engine.start_profile()
    engine.run()
    path = Path(engine.stop_profile() or "")
    assert path.name.startswith("lesson-1_") and path.name.endswith(".pt.trace.json")
    assert set(_markers(json.loads(path.read_text()))) == {step_marker_name(n) for n in (2, 3)}
    with pytest.raises(ValueError, match="profile_prefix: must be 1-128 ASCII characters"):
        engine.start_profile("a/b")


@pytest.mark.parametrize(
    "profiler_config, error",
    [
        ({"profiler": "cuda", "torch_profiler_dir": "/tmp/p"}, "profiler_config.profiler: must be one of 'torch'"),
        ({"profiler": "torch"}, "profiler_config.torch_profiler_dir: must be set when profiler is 'torch'"),
        ({"torch_profiler_dir": "/tmp/p"}, "torch_profiler_dir: only applicable when profiler is set to 'torch'"),
        ({"profiler": "torch", "torch_profiler_dir": "gs://b/p"}, "torch_profiler_dir: must be a local folder"),
        ({"profiler": "torch", "torch_profiler_dir": "p", "delay_iterations": 2}, "delay_iterations: unknown key"),
    ],
)
def test_a_bad_profiler_config_is_refused_naming_the_key(profiler_config, error):
    with pytest.raises(ValueError, match=error):
        EngineConfig(profiler_config=profiler_config)


def test_profiling_is_off_without_a_profiler_and_refused_with_data_parallelism():
    assert EngineConfig(profiler_config={}).profiler is None
    assert EngineConfig(
        profiler_config={"profiler": "torch", "torch_profiler_dir": "~/p"}
    ).profiler.torch_profiler_dir == str(Path("~/p").expanduser().absolute())
    with pytest.raises(ValueError, match="profiler_config: not supported with data_parallel_size 2"):
        EngineConfig(profiler_config={"profiler": "torch", "torch_profiler_dir": "/tmp/p"}, data_parallel_size=2)
