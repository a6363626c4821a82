"""`POST /v1/chat/completions` (vLLM's `serving_chat.py`): a conversation rendered by the model's chat template."""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.entrypoints.openai.protocol import ChatCompletionRequest
from engine.entrypoints.openai.serving_engine import OpenAIServing, RequestError, until_disconnected, usage
from engine.outputs import CompletionOutput


class OpenAIServingChat(OpenAIServing):
    """Owns the chat endpoint: messages through the chat template, the assistant's reply or its stream of deltas
    (the role first), logprobs in the chat shape (content: token, logprob, bytes, top_logprobs)."""

    id_prefix = "chatcmpl"
    chunk_object = "chat.completion.chunk"

    async def create(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        self.check(request)
        top = request.top_logprobs
        self.refuse(
            (request.tools, "tools", "tool calling is not supported"),
            (request.tool_choice not in (None, "none"), "tool_choice", "tool calling is not supported"),
            (top is not None and not request.logprobs, "top_logprobs", "needs logprobs set to true"),
            (top is not None and top < 0, "top_logprobs", f"must be >= 0, got {top}"),
            (not request.messages, "messages", "must not be empty"),
        )
        messages = [self._message(i, m) for i, m in enumerate(request.messages)]
        ids = await self.tokenize(lambda: self._render(messages, request.add_generation_prompt))
        max_field = "max_tokens" if request.max_completion_tokens is None else "max_completion_tokens"
        max_tokens = request.max_tokens if request.max_completion_tokens is None else request.max_completion_tokens
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = self.sampling_params(request, len(ids), max_tokens, None, logprobs, {"max_tokens": max_field})
        request_id, stream = await self.open(
            ids, params, request, {"prompt": "messages", "max_tokens": max_field}, raw_request
        )
        if request.stream:
            first = [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(params.n)
            ]
            return StreamingResponse(
                self.stream_events(stream, request_id, request, self._chunk, first), media_type="text/event-stream"
            )
        output = await until_disconnected(self.last_output(stream), raw_request)
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": self._logprobs(c, 0),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in output.outputs
        ]
        return JSONResponse(
            {
                "id": request_id,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": choices,
                "usage": usage(output),
            }
        )

    @staticmethod
    def _message(index: int, message: Any) -> dict[str, str]:
        content = message.content
        if isinstance(content, list):  # text parts joined; other kinds of part (images, audio) refused
            kinds = [part.get("type") for part in content]
            if any(kind != "text" for kind in kinds):
                raise RequestError(
                    400, f"messages[{index}].content: only text parts are supported, got {kinds}", "messages"
                )
            content = "".join(str(part.get("text", "")) for part in content)
        return {"role": "system" if message.role == "developer" else message.role, "content": content or ""}

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        try:
            return list(
                self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
                )
            )
        except Exception as exc:  # the template's own refusals (jinja's raise_exception): the conversation's fault
            raise RequestError(400, f"messages: the chat template refused them: {exc}", "messages") from None

    def _chunk(self, c: CompletionOutput, text_from: int, tokens_from: int) -> dict[str, Any] | None:
        if not self.has_news(c, text_from, tokens_from):
            return None
        delta = c.text[text_from:]
        return {
            "index": c.index,
            "delta": {"content": delta} if delta else {},
            "logprobs": self._logprobs(c, tokens_from),
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason if c.finish_reason else None,
        }

    def _logprobs(self, output: CompletionOutput, tokens_from: int) -> dict[str, Any] | None:
        if output.logprobs is None:
            return None

        def entry(token_id: int, logprob: float | None) -> dict[str, Any]:
            text = self.tokenizer.decode([token_id])
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        content = []
        for token_id, logprobs in zip(output.token_ids[tokens_from:], output.logprobs[tokens_from:]):
            top = [entry(t, lp) for t, lp in logprobs.items()]
            content.append({**entry(token_id, logprobs.get(token_id)), "top_logprobs": top})
        return {"content": content}
