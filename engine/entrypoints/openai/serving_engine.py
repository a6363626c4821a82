"""What the completions and chat endpoints share (vLLM's `serving_engine.py`): the model check, request fields to
SamplingParams, the engine's refusals as 400s naming the field, usage, server-sent events, and waiting for a
result while watching for the client to leave."""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse

from engine.async_llm import AsyncLLM, QueueFullError, RequestStream
from engine.entrypoints.openai.protocol import ErrorInfo, ErrorResponse, SamplingRequest
from engine.limits import check_logprobs, check_max_tokens, check_n
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine.tracing import extract_trace_headers

T = TypeVar("T")
ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
# the engine's messages start with the field they refuse ("max_tokens: must be >= 1, got 0", "logit_bias[5]: must
# be in [-100, 100]", "logit_bias (token id): expected int")
_FIELD = re.compile(r"^([A-Za-z_]\w*)(?:[.\[][^:\s]*| \([^)]*\))?:")


class RequestError(Exception):
    """A request the server refuses: the HTTP status, the message, and the request field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    """OpenAI's error shape, with vLLM's type names and the status as the code."""
    body = ErrorResponse(
        error=ErrorInfo(message=message, type=ERROR_TYPES.get(status, "BadRequestError"), param=param, code=status)
    )
    return JSONResponse(body.model_dump(), status_code=status)


def engine_refusal(exc: ValueError | TypeError, field_map: dict[str, str] | None = None) -> RequestError:
    """The engine's ValueError/TypeError as a 400 naming the field (engine names mapped to the API's)."""
    message = str(exc)
    match = _FIELD.match(message)
    param = match.group(1) if match else None
    if param is not None and field_map and param in field_map:
        # the message names the field as the client sent it ("max_completion_tokens: must be >= 1")
        message = field_map[param] + message[len(param) :]
        param = field_map[param]
    return RequestError(400, message, param)


def usage(output: RequestOutput) -> dict[str, int]:
    """OpenAI's usage: the prompt once, the tokens of every sampled sequence (n > 1: all n)."""
    prompt = len(output.prompt_token_ids)
    completion = sum(len(c.token_ids) for c in output.outputs) if output.outputs else len(output.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


async def until_disconnected(awaitable: Awaitable[T], raw_request: Request) -> T:
    """Await `awaitable` unless the client leaves first; then it is cancelled (aborting its request) and
    RequestError(499) raised (nginx's "client closed request": nobody reads the reply)."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_disconnect(raw_request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
    if work.cancelled():
        raise RequestError(499, "client disconnected")
    return work.result()


async def _disconnect(raw_request: Request) -> None:
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass


class OpenAIServing:
    """Owns what both endpoints need of the engine: the AsyncLLM, the served model name, the tokenizer's prompt
    building (under the engine lock: the loop decodes with the same tokenizer), and the request -> SamplingParams
    mapping with its refusals."""

    id_prefix = "cmpl"

    def __init__(self, llm: AsyncLLM, model_name: str) -> None:
        self.llm = llm
        self.model_name = model_name
        engine = llm.engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.config.max_model_len
        # a request must fit alone in the cache: the longest sequence the server can promise
        self.max_cache_tokens = (engine.num_kv_blocks - 1) * engine.config.block_size
        self.policy = engine.config.scheduling_policy
        self.config = engine.config

    def check(self, request: SamplingRequest) -> None:
        """The model name (404 if it is not this server's), the engine's limits on what needs no prompt (n,
        logprobs: refused in microseconds, before the prompt is tokenized under the engine's lock), then fields
        this server cannot honour as sent: refused, never silently ignored."""
        if request.model is not None and request.model != self.model_name:
            raise RequestError(404, f"The model `{request.model}` does not exist.", "model")
        try:
            check_n(request.n, self.config)
            for name in ("logprobs", "top_logprobs"):
                value = getattr(request, name, None)
                if isinstance(value, int) and not isinstance(value, bool):  # chat's logprobs is a flag
                    check_logprobs(name, value, self.config)
        except ValueError as exc:
            raise engine_refusal(exc) from None
        if request.priority != 0 and self.policy != "priority":
            raise RequestError(
                400,
                f"priority: {request.priority} given, but the server schedules "
                f"{self.policy!r}; start it with --scheduling-policy priority",
                "priority",
            )
        if request.stream_options is not None and not request.stream:
            raise RequestError(400, "stream_options: only allowed when stream is true", "stream_options")

    @staticmethod
    def refuse(*rules: tuple[Any, str, str]) -> None:
        """(condition, field, why): the first rule whose condition holds is a 400 "field: why" naming the field."""
        for condition, field, why in rules:
            if condition:
                raise RequestError(400, f"{field}: {why}", field)

    def sampling_params(
        self,
        request: SamplingRequest,
        num_prompt_tokens: int,
        max_tokens: int | None,
        default_max_tokens: int | None,
        logprobs: int | None,
        field_map: dict[str, str] | None = None,
    ) -> SamplingParams:
        room = min(self.max_model_len, self.max_cache_tokens) - num_prompt_tokens
        if max_tokens is None:  # vLLM's default: what is left of the context (capped by an endpoint's default)
            max_tokens = max(min(room, default_max_tokens or room), 1)
        else:
            try:  # as vLLM's server: the prompt and max_tokens within max_model_len, refused past it
                check_max_tokens(max_tokens, num_prompt_tokens, self.max_model_len)
            except ValueError as exc:
                raise engine_refusal(exc, field_map) from None
        if logprobs is not None and logprobs < 0:
            raise RequestError(400, f"logprobs: must be >= 0, got {logprobs}", "logprobs")
        logit_bias = None
        if request.logit_bias is not None:  # JSON keys are strings; the engine's are token ids
            bad = next((k for k in request.logit_bias if not k.strip().lstrip("-").isdigit()), None)
            if bad is not None:
                raise RequestError(400, f"logit_bias: keys must be token ids, got {bad!r}", "logit_bias")
            logit_bias = {int(k): float(v) for k, v in request.logit_bias.items()}
        try:
            return SamplingParams(
                n=request.n,
                presence_penalty=request.presence_penalty,
                frequency_penalty=request.frequency_penalty,
                repetition_penalty=request.repetition_penalty,
                logit_bias=logit_bias,
                bad_words=request.bad_words,
                allowed_token_ids=request.allowed_token_ids,
                temperature=1.0 if request.temperature is None else request.temperature,
                top_p=1.0 if request.top_p is None else request.top_p,
                top_k=request.top_k or 0,
                min_p=request.min_p or 0.0,
                seed=request.seed,
                max_tokens=max_tokens,
                min_tokens=request.min_tokens,
                stop=request.stop,
                stop_token_ids=request.stop_token_ids,
                ignore_eos=request.ignore_eos,
                include_stop_str_in_output=request.include_stop_str_in_output,
                logprobs=logprobs,
                skip_special_tokens=request.skip_special_tokens,
                structured_outputs=self._structured(request),
            )
        except (ValueError, TypeError) as exc:
            raise engine_refusal(exc, field_map) from None

    @staticmethod
    def _structured(request: SamplingRequest) -> StructuredOutputsParams | None:
        fmt, so = request.response_format, request.structured_outputs
        if fmt is not None and fmt.type != "text" and so is not None:
            raise RequestError(
                400, "response_format: give either response_format or structured_outputs, not both", "response_format"
            )
        if fmt is not None and fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise RequestError(
                    400, "response_format.json_schema: required when type is json_schema", "response_format"
                )
            return StructuredOutputsParams(json=fmt.json_schema.json_schema)
        if so is not None:
            try:
                return StructuredOutputsParams(
                    json=so.json_,
                    regex=so.regex,
                    choice=so.choice,
                    grammar=so.grammar,
                    json_object=bool(so.json_object),
                )
            except ValueError as exc:
                raise RequestError(400, str(exc), "structured_outputs") from None
        return None

    async def tokenize(self, build: Callable[[], list[int]]) -> list[int]:
        """Run `build` (the tokenizer) under the engine lock, off the event loop."""

        def locked() -> list[int]:
            with self.llm.lock:
                return build()

        return await asyncio.to_thread(locked)

    async def open(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request: SamplingRequest,
        field_map: dict[str, str],
        raw_request: Request,
    ) -> tuple[str, RequestStream]:
        """Queue the request in the engine, with the caller's W3C trace context (its request's span's parent when
        tracing is on); its refusals (prompt too long, a bad schema) as 400s."""
        request_id = f"{self.id_prefix}-{request.request_id or uuid.uuid4().hex}"
        if request.response_format is not None and request.response_format.type != "text":
            field_map = {**field_map, "structured_outputs": "response_format"}  # the engine's name for it
        try:
            stream = await self.llm.open(
                prompt_ids,
                params,
                request_id=request_id,
                priority=request.priority,
                cache_salt=request.cache_salt,
                trace_headers=extract_trace_headers(raw_request.headers),
            )
        except (ValueError, TypeError) as exc:
            raise engine_refusal(exc, field_map) from None
        except QueueFullError as exc:  # vLLM's answer when overloaded: retry later, nothing was queued
            raise RequestError(503, str(exc)) from None
        return request_id, stream

    @staticmethod
    async def last_output(stream: RequestStream) -> RequestOutput:
        """Iterate to the finished output (closing the stream however it ends)."""
        output = None
        try:
            async for output in stream:  # noqa: B007 (the last one is kept)
                pass
        finally:
            stream.close()
        if output is None or output.finish_reason == "error":
            raise RequestError(500, f"the request failed: {output.error if output else 'no output'}")
        return output

    async def stream_events(
        self,
        stream: RequestStream,
        request_id: str,
        request: SamplingRequest,
        chunk: Callable[[CompletionOutput, int, int], dict[str, Any] | None],
        first: list[dict[str, Any]] | None = None,
    ) -> AsyncIterator[str]:
        """Server-sent events: a chunk per choice in `first` (the role, for chat), a chunk per sampled sequence
        that grew, from `chunk(completion, text_from, tokens_from)` (a choice, or None: nothing new to send), the
        usage chunk when asked for, then `data: [DONE]`. With n > 1 each chunk carries one choice, named by its
        index (as OpenAI and vLLM stream them). The request is aborted if the client leaves (Starlette cancels
        this generator) or sending fails."""
        created = int(time.time())
        include_usage = request.stream_options is not None and request.stream_options.include_usage
        continuous = request.stream_options is not None and request.stream_options.continuous_usage_stats
        base = {"id": request_id, "created": created, "model": self.model_name, "object": self.chunk_object}
        sent: dict[int, tuple[int, int]] = {}  # choice index -> (text, tokens) already streamed
        done: set[int] = set()  # choice indices whose finish was streamed
        output = None
        try:
            for opening in first or []:
                yield sse({**base, "choices": [opening], **({"usage": None} if include_usage else {})})
            async for output in stream:
                if output.finish_reason == "error":
                    yield sse(
                        {
                            "error": ErrorInfo(
                                message=f"the request failed: {output.error}", type=ERROR_TYPES[500], code=500
                            ).model_dump()
                        }
                    )
                    break
                for completion in output.outputs:
                    if completion.index in done:  # n > 1: a sequence that finished earlier is repeated, unchanged
                        continue
                    if completion.finish_reason is not None:
                        done.add(completion.index)
                    text_from, tokens_from = sent.get(completion.index, (0, 0))
                    choice = chunk(completion, text_from, tokens_from)
                    sent[completion.index] = len(completion.text), len(completion.token_ids)
                    if choice is None:
                        continue
                    extra = {}
                    if include_usage:
                        extra["usage"] = usage(output) if continuous else None
                    yield sse({**base, "choices": [choice], **extra})
            else:
                if include_usage and output is not None:
                    yield sse({**base, "choices": [], "usage": usage(output)})
            yield sse("[DONE]")
        finally:
            stream.close()

    @staticmethod
    def has_news(completion: CompletionOutput, text_from: int, tokens_from: int) -> bool:
        """Whether a sequence has anything to stream: new text, new tokens (logprobs) or its finish."""
        return (
            bool(completion.text[text_from:])
            or completion.finish_reason is not None
            or len(completion.token_ids) != tokens_from
        )

    chunk_object = "text_completion"
