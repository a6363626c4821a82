"""Incremental detokenization, stop strings, and RequestOutputs: the engine's text side."""

from __future__ import annotations

from engine.outputs import CompletionOutput, RequestOutput
from engine.request import Request


class IncrementalDetokenizer:
    """Turns one request's output tokens into text a few tokens at a time and watches for stop strings.

    Decoding only a short window (prefix_offset..end) keeps each step O(1); a window that ends in an
    incomplete UTF-8 sequence is held back until the next token completes it.
    """

    def __init__(self, tokenizer, request: Request) -> None:
        self.tokenizer = tokenizer
        self.params = request.sampling_params
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0
        self.stop_string: str | None = None
        self.stop_strings: list[str] = list(self.params.stop or ())  # SamplingParams made it a list
        self._max_stop_len = max((len(s) for s in self.stop_strings), default=0)

    def update(self, output_token_ids: list[int]) -> str | None:
        """Decode what is new; return the stop string that ended the request, if one appeared."""
        skip = self.params.skip_special_tokens
        prefix = self.tokenizer.decode(
            output_token_ids[self.prefix_offset : self.read_offset], skip_special_tokens=skip
        )
        full = self.tokenizer.decode(output_token_ids[self.prefix_offset :], skip_special_tokens=skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        new_text = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(output_token_ids)
        self.text += new_text
        return self._check_stop_strings(len(new_text)) if self._max_stop_len else None

    def _check_stop_strings(self, new_len: int) -> str | None:
        # a stop string may straddle the old text and the new piece: search only that tail
        start = max(0, len(self.text) - new_len - self._max_stop_len + 1)
        found = [(self.text.find(s, start), s) for s in self.stop_strings]
        found = [(i, s) for i, s in found if i >= 0]
        if not found:
            return None
        index, stop = min(found)
        end = index + len(stop) if self.params.include_stop_str_in_output else index
        self.text = self.text[:end]
        self.stop_string = stop
        return stop


def make_output(request: Request, text: str) -> RequestOutput:
    return RequestOutput(
        request_id=request.request_id,
        prompt_token_ids=list(request.prompt_token_ids),
        token_ids=list(request.output_token_ids),
        text=text,
        finish_reason=request.status.finish_reason,
        num_cached_tokens=max(request.num_cached_tokens, 0),
        stop_reason=request.stop_reason,
        error=request.error,
        logprobs=request.logprobs,
        prompt_logprobs=request.prompt_logprobs,
        outputs=[
            CompletionOutput(
                0,
                text,
                list(request.output_token_ids),
                request.status.finish_reason,
                request.stop_reason,
                request.logprobs,
            )
        ],
        metrics=request.metrics,
    )
