"""OpenTelemetry traces of requests, as vLLM 0.33 sends them (vllm/tracing/, and its output processor's do_tracing).

With `otlp_traces_endpoint` set, each request that finishes becomes one `llm_request` span (kind SERVER), sent over
OTLP/HTTP by a batch processor: it starts at the request's arrival and ends with the step that finished it; its
parent is the caller's span when the request brought W3C trace context headers (`traceparent`, `tracestate`),
else it starts a trace of its own; its attributes are vLLM's `gen_ai.*` names (SpanAttributes) with vLLM's
definitions of each latency; and its events are the request's journey through the engine's steps, read off the
StepRecords: added, scheduled (each prefill chunk, and where the phase changes), preempted, finished.

OpenTelemetry is imported only when tracing is configured (this module's top imports none of it): without the SDK
and the OTLP/HTTP exporter the setting is refused naming what to install (EngineConfig asks
check_tracing_available)."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from engine.events import RequestAdded, RequestFinished, RequestPreempted, RequestScheduled, RequestTokens, StepRecord

if TYPE_CHECKING:
    from opentelemetry.context import Context

logger = logging.getLogger(__name__)

# the W3C trace context headers (vLLM's TRACE_HEADERS)
TRACE_HEADERS = ("traceparent", "tracestate")
# the only OTLP protocol sent here (vLLM also sends "grpc", its default, with the gRPC exporter installed)
OTLP_PROTOCOL = "http/protobuf"
SPAN_NAME = "llm_request"


class SpanAttributes:
    """vLLM's names of the span's attributes (vllm/tracing/utils.py): OpenTelemetry's gen_ai conventions, and
    vLLM's own for the latencies. Every latency is in seconds."""

    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_FORWARD = "gen_ai.latency.time_in_model_forward"
    GEN_AI_LATENCY_TIME_IN_MODEL_EXECUTE = "gen_ai.latency.time_in_model_execute"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"


def check_tracing_available() -> None:
    """Refuse otlp_traces_endpoint (ValueError naming it) where no span could be sent: OpenTelemetry's SDK or its
    OTLP/HTTP exporter cannot be imported (named to install, as vLLM refuses it), or OpenTelemetry's environment asks
    for another protocol."""
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as exc:
        raise ValueError(
            f"otlp_traces_endpoint: OpenTelemetry is not available ({exc}); install opentelemetry-sdk and "
            "opentelemetry-exporter-otlp-proto-http"
        ) from None
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", OTLP_PROTOCOL)
    if protocol != OTLP_PROTOCOL:
        raise ValueError(
            f"otlp_traces_endpoint: spans are sent over OTLP/HTTP ({OTLP_PROTOCOL}) only, but "
            f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL is {protocol!r}"
        )


def extract_trace_headers(headers: Mapping[str, str]) -> dict[str, str] | None:
    """The W3C trace context headers among an HTTP request's (vLLM's _get_trace_headers); None when it has none."""
    found = {name: headers[name] for name in TRACE_HEADERS if name in headers}
    return found or None


@functools.cache
def log_tracing_disabled_warning() -> None:
    """Once per process, as vLLM: a request brought trace context that no span will carry."""
    logger.warning("Received a request with trace context but tracing is disabled (otlp_traces_endpoint is not set)")


class SamplingOptions(Protocol):
    """What a span reads of a request's SamplingParams (named by its shape: that module imports the config, which
    imports this one)."""

    temperature: float
    top_p: float
    max_tokens: int
    n: int


@dataclass
class _Journey:
    """One request's way through the steps, as its events tell it, until it finishes. Times are the engine
    clock's nanoseconds (StepRecord.start_ns / end_ns)."""

    request_id: str  # the id its caller holds (with n > 1, the parent's)
    options: SamplingOptions
    context: Context | None  # the caller's trace context; None: the span starts a trace
    arrival_ns: int = 0
    num_prompt_tokens: int = 0
    scheduled_ns: int | None = None
    first_token_ns: int | None = None
    last_token_ns: int | None = None
    phase: str | None = None  # the phase of its last step; None after a preemption
    forward_ms: float = 0.0
    execute_ms: float = 0.0
    events: list[tuple[str, int, dict[str, Any]]] = field(default_factory=list)  # (name, time_ns, attributes)


def _seconds(start_ns: int, end_ns: int) -> float:
    return (end_ns - start_ns) / 1e9


class RequestTracer:
    """Owns an engine's OpenTelemetry tracer provider (its own, not the process's global one: two engines may send
    to two endpoints), its OTLP/HTTP exporter and batch processor, and the journey of each request in flight.
    A subscriber of the engine's StepRecords: it ends a request's `llm_request` span with the step that finishes it.
    `detailed` is collect_detailed_traces: "model" and "worker" add the forward and execute times, any of them an
    event for every step the request ran in."""

    def __init__(self, endpoint: str, detailed: Iterable[str] | None = None) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        # vLLM's resource attributes; the service name from OTEL_SERVICE_NAME, as OpenTelemetry reads it
        resource = Resource.create(
            {"vllm.instrumenting_module_name": "engine.llm_engine", "vllm.process_id": str(os.getpid())}
        )
        self.provider = TracerProvider(resource=resource)
        # the processor sends from a thread of its own: a slow or unreachable endpoint never holds a step
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer("engine.llm_engine")
        self._propagator = TraceContextTextMapPropagator()
        modules = set(detailed or ())
        self.model_forward = bool(modules & {"model", "all"})
        self.model_execute = bool(modules & {"worker", "all"})
        self.every_step = bool(modules)
        self._journeys: dict[str, _Journey] = {}

    def add_request(
        self,
        request_id: str,
        child_ids: Sequence[str],
        options: SamplingOptions,
        trace_headers: Mapping[str, str] | None,
    ) -> None:
        """Follow a request the engine accepted (each child of one with n > 1: a span each, as vLLM), its parent
        the span of `trace_headers`' traceparent."""
        context = self._propagator.extract(dict(trace_headers)) if trace_headers else None
        for child in child_ids:
            self._journeys[child] = _Journey(request_id, options, context)

    def __call__(self, record: StepRecord) -> None:
        if self.every_step:  # the step's forward and sampling, counted for each request it ran
            for rid in record.scheduled:
                journey = self._journeys.get(rid)
                if journey is not None:
                    journey.forward_ms += record.timing.get("forward", 0.0)
                    journey.execute_ms += record.timing.get("forward", 0.0) + record.timing.get("sample", 0.0)
        for event in record.events:
            journey = self._journeys.get(getattr(event, "request_id", ""))
            if journey is None:
                continue
            if isinstance(event, RequestAdded):
                journey.arrival_ns, journey.num_prompt_tokens = event.arrival_ns, event.num_prompt_tokens
                attributes = {"num_prompt_tokens": event.num_prompt_tokens, "priority": event.priority}
                journey.events.append((event.kind, event.arrival_ns, attributes))
            elif isinstance(event, RequestScheduled):
                self._scheduled(journey, event, record)
            elif isinstance(event, RequestTokens):
                journey.first_token_ns = journey.first_token_ns or record.end_ns
                journey.last_token_ns = record.end_ns
            elif isinstance(event, RequestPreempted):
                journey.phase = None
                attributes = {
                    "step": event.step,
                    "num_computed_tokens": event.num_computed_tokens,
                    "num_freed_blocks": event.num_freed_blocks,
                }
                journey.events.append((event.kind, record.start_ns, attributes))
            elif isinstance(event, RequestFinished):
                del self._journeys[event.request_id]
                self._end(journey, event, record.end_ns)

    def _scheduled(self, journey: _Journey, event: RequestScheduled, record: StepRecord) -> None:
        """The first scheduling starts the time in the model; an event for each prefill chunk and each change of
        phase (a decode's every step only with detailed traces: a long request's steps would crowd the span)."""
        if journey.scheduled_ns is None:
            journey.scheduled_ns = record.start_ns
        if self.every_step or event.phase == "chunk" or event.phase != journey.phase:
            attributes: dict[str, Any] = {
                "step": event.step,
                "phase": event.phase,
                "num_tokens": event.num_tokens,
                "num_computed_tokens": event.num_computed_tokens,
                "num_cached_tokens": event.num_cached_tokens,
            }
            if event.phase == "chunk":
                attributes.update(chunk_index=event.chunk_index, num_chunks=event.num_chunks)
            journey.events.append((event.kind, record.start_ns, attributes))
        journey.phase = event.phase

    def _end(self, journey: _Journey, finished: RequestFinished, end_ns: int) -> None:
        """The span, with vLLM's attributes and its definitions of each latency (those a request that never ran or
        never got a token cannot have are left out), then ended: the batch processor sends it."""
        from opentelemetry.trace import SpanKind, Status, StatusCode

        attrs: dict[str, Any] = {
            SpanAttributes.GEN_AI_REQUEST_ID: journey.request_id,
            SpanAttributes.GEN_AI_USAGE_PROMPT_TOKENS: journey.num_prompt_tokens,
            SpanAttributes.GEN_AI_USAGE_COMPLETION_TOKENS: finished.num_output_tokens,
            SpanAttributes.GEN_AI_LATENCY_E2E: _seconds(journey.arrival_ns, end_ns),
        }
        scheduled, first, last = journey.scheduled_ns, journey.first_token_ns, journey.last_token_ns
        if scheduled is not None:
            attrs[SpanAttributes.GEN_AI_LATENCY_TIME_IN_QUEUE] = _seconds(journey.arrival_ns, scheduled)
        if first is not None and last is not None:
            attrs[SpanAttributes.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] = _seconds(journey.arrival_ns, first)
            attrs[SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE] = _seconds(first, last)
            if scheduled is not None:
                attrs[SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL] = _seconds(scheduled, first)
                attrs[SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE] = _seconds(scheduled, last)
        if self.model_forward:
            attrs[SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_FORWARD] = journey.forward_ms / 1e3
        if self.model_execute:
            attrs[SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_EXECUTE] = journey.execute_ms / 1e3
        options = journey.options  # set only where given a truthy value, as vLLM
        for name, value in (
            (SpanAttributes.GEN_AI_REQUEST_TOP_P, options.top_p),
            (SpanAttributes.GEN_AI_REQUEST_MAX_TOKENS, options.max_tokens),
            (SpanAttributes.GEN_AI_REQUEST_TEMPERATURE, options.temperature),
            (SpanAttributes.GEN_AI_REQUEST_N, options.n),
        ):
            if value:
                attrs[name] = value
        finished_attrs = {
            "step": finished.step,
            "reason": finished.reason,
            "num_output_tokens": finished.num_output_tokens,
        }
        journey.events.append((finished.kind, end_ns, finished_attrs))
        span = self.tracer.start_span(
            SPAN_NAME, context=journey.context, kind=SpanKind.SERVER, attributes=attrs, start_time=journey.arrival_ns
        )
        for name, time_ns, attributes in journey.events:
            span.add_event(name, attributes, timestamp=time_ns)
        if finished.reason == "error":
            span.set_status(Status(StatusCode.ERROR, finished.error))
        span.end(end_time=end_ns)

    def shutdown(self) -> None:
        """Send the spans still queued and stop the processor's thread (bounded by the exporter's timeout:
        OTEL_EXPORTER_OTLP_TRACES_TIMEOUT, 10 s by default, however unreachable the endpoint)."""
        self.provider.shutdown()
