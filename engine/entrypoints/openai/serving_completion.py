"""`POST /v1/completions` (vLLM's `serving_completion.py`): one prompt, text or token ids, continued."""

from __future__ import annotations

import time
from typing import Any, cast

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.entrypoints.openai.protocol import CompletionRequest
from engine.entrypoints.openai.serving_engine import OpenAIServing, RequestError, until_disconnected, usage
from engine.outputs import CompletionOutput

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


class OpenAIServingCompletion(OpenAIServing):
    """Owns the completions endpoint: the prompt's tokens, the reply or its stream of chunks, logprobs in the
    completions shape (tokens, token_logprobs, top_logprobs, text_offset)."""

    id_prefix = "cmpl"
    chunk_object = "text_completion"

    async def create(self, request: CompletionRequest, raw_request: Request) -> Response:
        self.check(request)
        self.refuse(
            (request.echo, "echo", "returning the prompt is not supported; send false"),
            (request.suffix, "suffix", "not supported"),
            (request.best_of not in (None, 1), "best_of", f"only 1 is supported, got {request.best_of}"),
        )
        prompt = request.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise RequestError(
                    400,
                    f"prompt: a batch of {len(prompt)} prompts is not supported; send one request per prompt",
                    "prompt",
                )
            prompt = prompt[0]
        if isinstance(prompt, str):
            # as LLMEngine.add_request tokenizes text: no special tokens added
            text = prompt
            ids = await self.tokenize(lambda: self.tokenizer.encode(text, add_special_tokens=False))
        else:
            ids = list(cast(list[int], prompt))  # token ids: the request model checked the shape
        params = self.sampling_params(request, len(ids), request.max_tokens, DEFAULT_MAX_TOKENS, request.logprobs)
        request_id, stream = await self.open(ids, params, request, {"prompt": "prompt"}, raw_request)
        if request.stream:
            return StreamingResponse(
                self.stream_events(stream, request_id, request, self._chunk), media_type="text/event-stream"
            )
        output = await until_disconnected(self.last_output(stream), raw_request)
        choices = [
            {
                "index": c.index,
                "text": c.text,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "logprobs": self._logprobs(c, 0, 0),
            }
            for c in output.outputs
        ]
        return JSONResponse(
            {
                "id": request_id,
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": choices,
                "usage": usage(output),
            }
        )

    def _chunk(self, c: CompletionOutput, text_from: int, tokens_from: int) -> dict[str, Any] | None:
        if not self.has_news(c, text_from, tokens_from):
            return None
        # a stop string found later trims text a chunk already carried: never send a negative delta
        return {
            "index": c.index,
            "text": c.text[text_from:],
            "logprobs": self._logprobs(c, tokens_from, text_from),
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason if c.finish_reason else None,
        }

    def _logprobs(self, output: CompletionOutput, tokens_from: int, text_offset: int) -> dict[str, Any] | None:
        if output.logprobs is None:
            return None
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token_id, entry in zip(output.token_ids[tokens_from:], output.logprobs[tokens_from:]):
            text = self.tokenizer.decode([token_id])
            tokens.append(text)
            token_logprobs.append(entry.get(token_id))
            top.append({self.tokenizer.decode([t]): lp for t, lp in entry.items()})
            offsets.append(text_offset)
            text_offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
