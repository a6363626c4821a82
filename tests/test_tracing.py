"""OpenTelemetry traces (engine/tracing.py), received over OTLP/HTTP by a stand-in collector in this process (an HTTP
server taking POST /v1/traces, decoded with opentelemetry-proto's ExportTraceServiceRequest; no collector binary):
a request through the OpenAI server with a `traceparent` header is one `llm_request` span in the caller's trace, its
parent the caller's span, with vLLM's gen_ai.* attributes and sane values; a request's journey (chunks, preemption,
finish) are the span's events; the settings are refused as vLLM refuses them (OpenTelemetry absent, no endpoint
for detailed traces, an endpoint that is no URL) and an unreachable endpoint never holds a request nor the close."""

from __future__ import annotations

import secrets
import sys
import threading
from collections.abc import Callable
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.tracing import SpanAttributes as A
from engine.tracing import extract_trace_headers
from tests.entrypoints.conftest import MODEL, serving
from tests.net import free_port

WAIT_S = 30  # the bound on every wait for a span: the batch processor sends within OTEL_BSP_SCHEDULE_DELAY


class OTLPReceiver:
    """A stand-in OpenTelemetry collector on a free loopback port: owns the HTTP server that accepts
    POST /v1/traces (OTLP/HTTP, protobuf) and the spans it decoded, each with its resource's attributes."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        self.spans: list[Any] = []
        self.resources: list[dict[str, Any]] = []
        self.cond = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                request = ExportTraceServiceRequest.FromString(body)
                with receiver.cond:
                    for resource_spans in request.resource_spans:
                        resource = attributes(resource_spans.resource.attributes)
                        for scope_spans in resource_spans.scope_spans:
                            for span in scope_spans.spans:
                                receiver.spans.append(span)
                                receiver.resources.append(resource)
                    receiver.cond.notify_all()
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:  # quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, name="otlp-receiver", daemon=True)
        self.thread.start()

    def wait_for(self, predicate: Callable[[list[Any]], bool]) -> list[Any]:
        """The spans once `predicate(spans)` holds; fails after WAIT_S seconds."""
        with self.cond:
            assert self.cond.wait_for(lambda: predicate(self.spans), WAIT_S), f"spans received: {self.spans}"
            return list(self.spans)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(WAIT_S)


def attributes(key_values: Any) -> dict[str, Any]:
    """OTLP key-values as a dict of Python values."""
    return {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in key_values}


def events(span: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(e.name, attributes(e.attributes)) for e in span.events]


@pytest.fixture
def receiver(monkeypatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # ms: the processor sends at once, not every 5 s
    r = OTLPReceiver()
    yield r
    r.close()


# ---- through the OpenAI server ------------------------------------------------------------------------------
def test_a_request_through_the_server_is_one_llm_request_span_in_the_callers_trace(tiny_model_path, receiver):
    from opentelemetry.proto.trace.v1.trace_pb2 import Span

    from engine.async_llm import AsyncLLM

    llm = AsyncLLM(model=MODEL, num_kv_blocks=128, seed=0, max_num_batched_tokens=8, otlp_traces_endpoint=receiver.url)
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    body = {
        "model": MODEL,
        "prompt": "The capital of France is a city that many people visit every year, for its",
        "max_tokens": 5,
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 3,
        "ignore_eos": True,
    }
    with contextmanager(serving)(llm) as served:
        traced = httpx.post(
            f"{served.base_url}/v1/completions", json=body, headers={"traceparent": f"00-{trace_id}-{parent_id}-01"}
        ).json()
        untraced = httpx.post(f"{served.base_url}/v1/completions", json=body).json()
        spans = receiver.wait_for(lambda spans: len(spans) == 2)
    by_id = {attributes(s.attributes)[A.GEN_AI_REQUEST_ID]: s for s in spans}
    span, other = by_id[traced["id"]], by_id[untraced["id"]]
    # the caller's trace and span are the span's; a request without a traceparent starts a trace of its own
    assert (span.trace_id.hex(), span.parent_span_id.hex()) == (trace_id, parent_id)
    assert other.trace_id.hex() != trace_id and other.parent_span_id == b""
    assert span.name == "llm_request" and span.kind == Span.SPAN_KIND_SERVER
    assert receiver.resources[0]["vllm.instrumenting_module_name"] == "engine.llm_engine"
    got = attributes(span.attributes)
    usage = traced["usage"]
    assert got[A.GEN_AI_USAGE_PROMPT_TOKENS] == usage["prompt_tokens"] > 8
    assert got[A.GEN_AI_USAGE_COMPLETION_TOKENS] == usage["completion_tokens"] == 5
    assert (got[A.GEN_AI_REQUEST_MAX_TOKENS], got[A.GEN_AI_REQUEST_N]) == (5, 1)
    assert got[A.GEN_AI_REQUEST_TEMPERATURE] == pytest.approx(0.7) and got[A.GEN_AI_REQUEST_TOP_P] == pytest.approx(0.9)
    # vLLM's latencies, in seconds, and how they relate
    queue, ttft, e2e = (
        got[A.GEN_AI_LATENCY_TIME_IN_QUEUE],
        got[A.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN],
        got[A.GEN_AI_LATENCY_E2E],
    )
    prefill, decode = got[A.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL], got[A.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE]
    assert 0 <= queue <= ttft <= e2e < WAIT_S and 0 < prefill and 0 < decode
    assert got[A.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE] == pytest.approx(prefill + decode)
    assert ttft == pytest.approx(queue + prefill)
    assert (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9 == pytest.approx(e2e)
    assert A.GEN_AI_LATENCY_TIME_IN_MODEL_FORWARD not in got  # only with collect_detailed_traces
    # the journey: added, the prompt in chunks of 8 tokens, the decode, finished
    journey = events(span)
    names = [name for name, _ in journey]
    chunks = [a for name, a in journey if name == "request.scheduled" and a["phase"] == "chunk"]
    assert names[0] == "request.added" and names[-1] == "request.finished"
    assert len(chunks) == -(-usage["prompt_tokens"] // 8) and [c["chunk_index"] for c in chunks] == list(
        range(1, len(chunks) + 1)
    )
    assert [a["phase"] for name, a in journey if name == "request.scheduled"][len(chunks) :] == ["decode"]
    assert journey[-1][1] == {"step": journey[-1][1]["step"], "reason": "length", "num_output_tokens": 5}
    assert [e.time_unix_nano for e in span.events] == sorted(e.time_unix_nano for e in span.events)


def test_trace_headers_are_the_w3c_ones():
    headers = {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01", "tracestate": "a=b", "x-other": "c"}
    assert extract_trace_headers(headers) == {"traceparent": headers["traceparent"], "tracestate": "a=b"}
    assert extract_trace_headers({"x-other": "c"}) is None


# ---- the engine alone: a preempted request's journey, detailed traces ---------------------------------------
def test_a_preempted_requests_span_tells_its_journey_and_detailed_traces_add_the_model_times(receiver):
    engine = LLMEngine(
        executor="scripted",
        token_script=lambda request: 7,
        num_kv_blocks=6,
        block_size=4,
        max_model_len=64,
        scheduler_reserve_full_isl=False,
        otlp_traces_endpoint=receiver.url,
        collect_detailed_traces=["all"],
    )
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    engine.add_request(list(range(10, 18)), params, request_id="a")
    engine.add_request(list(range(20, 28)), params, request_id="b")
    records = engine.run()
    assert any(r.of_kind("request.preempted") for r in records)
    engine.close()  # sends what is queued
    spans = {attributes(s.attributes)[A.GEN_AI_REQUEST_ID]: s for s in receiver.wait_for(lambda s: len(s) == 2)}
    preempted = next(s for s in spans.values() if any(e.name == "request.preempted" for e in s.events))
    journey = events(preempted)
    steps = [a["step"] for name, a in journey if name == "request.scheduled"]
    assert steps == sorted(steps) and len(steps) == len(set(steps))  # detailed: every step it ran, once each
    after = [name for name, _ in journey[[n for n, _ in journey].index("request.preempted") :]]
    assert after[1] == "request.scheduled" and after[-1] == "request.finished"  # rescheduled, then done
    got = attributes(preempted.attributes)
    assert got[A.GEN_AI_USAGE_COMPLETION_TOKENS] == 8
    assert 0 < got[A.GEN_AI_LATENCY_TIME_IN_MODEL_FORWARD] <= got[A.GEN_AI_LATENCY_TIME_IN_MODEL_EXECUTE]


# ---- refusals and bad endpoints ------------------------------------------------------------------------------
@pytest.mark.parametrize("endpoint", ["localhost:4317", "grpc://collector:4317", "http://", "not a url"])
def test_an_endpoint_that_is_not_an_http_url_is_refused_naming_the_field(endpoint):
    with pytest.raises(ValueError, match=r"otlp_traces_endpoint: expected the http:// or https:// URL"):
        EngineConfig(otlp_traces_endpoint=endpoint)


def test_tracing_is_refused_as_vllm_refuses_it(monkeypatch):
    with pytest.raises(ValueError, match="collect_detailed_traces: requires otlp_traces_endpoint to be set"):
        EngineConfig(collect_detailed_traces=["model"])
    with pytest.raises(ValueError, match="collect_detailed_traces: must be one of 'model', 'worker', 'all'"):
        EngineConfig(otlp_traces_endpoint="http://127.0.0.1:4318/v1/traces", collect_detailed_traces=["gpu"])
    with pytest.raises(ValueError, match="otlp_traces_endpoint: not supported with data_parallel_size 2"):
        EngineConfig(otlp_traces_endpoint="http://127.0.0.1:4318/v1/traces", data_parallel_size=2)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    with pytest.raises(ValueError, match=r"otlp_traces_endpoint: spans are sent over OTLP/HTTP .* is 'grpc'"):
        EngineConfig(otlp_traces_endpoint="http://127.0.0.1:4318/v1/traces")


def test_without_opentelemetry_the_endpoint_is_refused_naming_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # its import now fails
    with pytest.raises(ValueError, match="otlp_traces_endpoint: OpenTelemetry is not available .* install "):
        EngineConfig(otlp_traces_endpoint="http://127.0.0.1:4318/v1/traces")


def test_an_unreachable_endpoint_holds_no_request_nor_the_close(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "2")  # s: how long the exporter keeps retrying
    engine = LLMEngine(
        executor="scripted",
        token_script={"r": [7, 8]},
        num_kv_blocks=16,
        block_size=4,
        otlp_traces_endpoint=f"http://127.0.0.1:{free_port()}/v1/traces",  # nobody listens
    )
    engine.add_request([11, 12, 13], SamplingParams(max_tokens=4), request_id="r")
    engine.run()
    assert engine.pop_output("r").token_ids == [7, 8, engine.eos_token_id]
    closing = threading.Thread(target=engine.close)
    closing.start()
    closing.join(WAIT_S)
    assert not closing.is_alive(), "close() waited on the unreachable endpoint"
