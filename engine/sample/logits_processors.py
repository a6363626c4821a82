"""What a request asks to change in its logits before a token is drawn, as vLLM V1 applies it: allowed token ids,
bad words, logit bias, min_tokens (EOS and the stop token ids banned until that many tokens are out: vLLM's
MinTokensLogitsProcessor), then the repetition, frequency and presence penalties
(``vllm/v1/sample/ops/penalties.py``).

``LogitsInputs`` holds the per-row inputs of one step; it exists only when some row uses an option, so a batch
that uses none pays nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams


@dataclass
class LogitsInputs:
    """Owns one step's per-row logits options and the token histories the penalties and bad words read."""

    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
    presence_penalties: torch.Tensor  # [N] float32; 0 => off
    frequency_penalties: torch.Tensor  # [N] float32; 0 => off
    repetition_penalties: torch.Tensor  # [N] float32; 1 => off
    logit_bias: list[dict[int, float] | None]
    allowed_token_ids: list[list[int] | None]
    bad_words_token_ids: list[list[list[int]]]
    min_tokens_banned: list[list[int]]  # per row: EOS and stop ids while the row is short of min_tokens, else []

    @classmethod
    def from_requests(cls, requests: Sequence, device: torch.device) -> LogitsInputs | None:
        """The inputs for `requests` (engine Requests, one per logits row), or None when none uses an option."""
        params = [r.sampling_params for r in requests]
        if not any(uses_logits_options(p) or p.min_tokens for p in params):
            return None
        return cls(
            prompt_token_ids=[r.prompt_token_ids for r in requests],
            output_token_ids=[r.output_token_ids for r in requests],
            presence_penalties=torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=device),
            frequency_penalties=torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=device),
            repetition_penalties=torch.tensor(
                [p.repetition_penalty for p in params], dtype=torch.float32, device=device
            ),
            logit_bias=[p.logit_bias for p in params],
            allowed_token_ids=[p.allowed_token_ids for p in params],
            bad_words_token_ids=[getattr(r, "bad_words_token_ids", []) for r in requests],
            min_tokens_banned=[min_tokens_banned(r) for r in requests],
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """In place on float32 `logits` [N, V], in vLLM's order; returns them."""
        apply_allowed_token_ids(logits, self.allowed_token_ids)
        apply_bad_words(logits, self.bad_words_token_ids, self.output_token_ids)
        apply_logit_bias(logits, self.logit_bias)
        apply_min_tokens(logits, self.min_tokens_banned)
        apply_penalties(
            logits,
            self.prompt_token_ids,
            self.output_token_ids,
            self.presence_penalties,
            self.frequency_penalties,
            self.repetition_penalties,
        )
        return logits


def uses_logits_options(p: SamplingParams) -> bool:
    """Whether a request changes its logits (any penalty, bias, bad word or allowed-token list)."""
    return bool(
        p.presence_penalty
        or p.frequency_penalty
        or p.repetition_penalty != 1.0
        or p.logit_bias
        or p.allowed_token_ids
        or p.bad_words
    )


def min_tokens_banned(request) -> list[int]:
    """The tokens a request may not sample yet: EOS (even with ignore_eos, as vLLM) and its stop token ids, while
    fewer than min_tokens of its tokens are out."""
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        return []
    eos = getattr(request, "eos_token_id", None)
    return [*([] if eos is None else [eos]), *params.stop_token_ids]


def apply_min_tokens(logits: torch.Tensor, banned: list[list[int]]) -> torch.Tensor:
    """In place: each row's banned tokens get -inf."""
    for row, ids in enumerate(banned):
        if ids:
            logits[row, ids] = float("-inf")
    return logits


def apply_allowed_token_ids(logits: torch.Tensor, allowed: list[list[int] | None]) -> torch.Tensor:
    """In place: a row with a list keeps only those tokens."""
    for row, ids in enumerate(allowed):
        if ids:
            keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
            keep[ids] = True
            logits[row].masked_fill_(~keep, float("-inf"))
    return logits


def apply_bad_words(logits: torch.Tensor, bad_words: list[list[list[int]]], outputs: list[list[int]]) -> torch.Tensor:
    """In place: ban each bad word's last token where the output so far ends with the word's other tokens (a
    one-token word is always banned)."""
    for row, words in enumerate(bad_words):
        past = outputs[row]
        for ids in words:
            prefix = ids[:-1]
            if len(prefix) <= len(past) and past[len(past) - len(prefix) :] == prefix:
                logits[row, ids[-1]] = float("-inf")
    return logits


def apply_logit_bias(logits: torch.Tensor, biases: list[dict[int, float] | None]) -> torch.Tensor:
    """In place: add each row's bias to its tokens."""
    for row, bias in enumerate(biases):
        if bias:
            ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
            logits[row, ids] += torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
    return logits


def token_counts(token_ids: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """``[N, V]`` int64: how often each token occurs in each row's list."""
    counts = torch.zeros(len(token_ids), vocab_size, dtype=torch.long, device=device)
    for row, ids in enumerate(token_ids):
        if ids:
            counts[row].index_add_(
                0,
                torch.tensor(ids, dtype=torch.long, device=device),
                torch.ones(len(ids), dtype=torch.long, device=device),
            )
    return counts


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """In place, vLLM's definitions: the repetition penalty divides positive (multiplies negative) logits of
    tokens seen in the prompt or the output; the frequency penalty subtracts ``f * count`` and the presence
    penalty ``p * (count > 0)``, counting output tokens only (OpenAI's definition)."""
    vocab = logits.shape[-1]
    output_counts = token_counts(output_ids, vocab, logits.device)
    if bool((repetition != 1.0).any()):
        seen = (token_counts(prompt_ids, vocab, logits.device) > 0) | (output_counts > 0)
        penalty = torch.where(seen, repetition.unsqueeze(1), 1.0)
        logits.copy_(torch.where(logits > 0, logits / penalty, logits * penalty))
    logits -= frequency.unsqueeze(1) * output_counts
    logits -= presence.unsqueeze(1) * (output_counts > 0)
    return logits


def bad_words_token_ids(words: list[str], tokenizer, vocab_size: int) -> list[list[int]]:
    """vLLM's tokenization of `bad_words`: each word alone and after a space (when that makes other tokens of the
    same length), so it is banned at the start of the text and mid-text."""
    out: list[list[int]] = []
    for word in words:
        for prefix in ("", " "):
            ids = tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False)
            if not ids:
                continue
            if prefix and out and (ids[0] == out[-1][0] or len(ids) != len(out[-1])):
                continue
            out.append(ids)
    too_large = [t for ids in out for t in ids if t >= vocab_size]
    if too_large:
        raise ValueError(f"bad_words: token id {too_large[0]} is outside the vocabulary [0, {vocab_size})")
    return out


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Refuse token ids outside the vocabulary in `allowed_token_ids` and `logit_bias`, naming the field."""
    for name, ids in (("allowed_token_ids", params.allowed_token_ids or []), ("logit_bias", params.logit_bias or {})):
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"{name}: token id {bad} is outside the vocabulary [0, {vocab_size})")
