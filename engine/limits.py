"""The limits every request is held to wherever it enters (`SamplingParams`, `LLM`, `AsyncLLM`, the OpenAI server):
one request must never be able to take the engine from everyone else (issue #39: `n = 1000000` queued 999,496
children and held the server for minutes).

Two kinds. What does not depend on the engine (the seed's range, how many stop strings, logit-bias entries, bad
words, allowed token ids) is checked when `SamplingParams` is built. What does (`n` against `max_num_seqs`, logprobs
against `max_logprobs`, `max_tokens` against `max_model_len` minus the prompt) is checked by `check_engine_limits`
/ `check_max_tokens` with the engine's config. Every refusal is a ValueError whose message starts with the field
and names the limit ("n: at most 256 (max_num_seqs), got 1000000"), which the server turns into a 400 naming it.

vLLM's setting names where vLLM has one (`max_logprobs`, `max_model_len`, `max_num_seqs`); the list limits below
are ours (vLLM has none), generous enough for any real use and small enough that checking them each step is cheap."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from engine.config import EngineConfig

# vLLM's seed range (its protocol's Field(ge=torch.long min, le=torch.long max)): what a torch generator takes
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
MAX_STOP_STRINGS = 64  # stop strings are searched in the text's tail after every step: their number bounds that
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries; OpenAI documents 300 in its examples, vLLM sets none
MAX_BAD_WORDS = 1024  # each one is tokenized at add_request and matched against the output every step
MAX_BAD_WORD_CHARS = 1024
MAX_ALLOWED_TOKEN_IDS = 1 << 17  # more than any vocabulary here has (SmolLM2: 49,152): a mask, not a loop


class RequestOptions(Protocol):
    """What the limits read of a request's options: `SamplingParams` (which imports this module, so it is named by
    its shape here)."""

    n: int
    seed: int | None
    stop: str | list[str] | None
    stop_token_ids: list[int] | None
    logprobs: int | None
    prompt_logprobs: int | None
    logit_bias: dict[int, float] | None
    bad_words: list[str] | None
    allowed_token_ids: list[int] | None


def _at_most(field: str, count: int, limit: int, what: str) -> None:
    if count > limit:
        raise ValueError(f"{field}: at most {limit} {what}, got {count}")


def check_static_limits(params: RequestOptions) -> None:
    """The limits that need no engine: the seed's range and the size of every list option. Called by
    `SamplingParams.__post_init__` once the types are checked."""
    if params.seed is not None and not SEED_MIN <= params.seed <= SEED_MAX:
        raise ValueError(f"seed: must be in [{SEED_MIN}, {SEED_MAX}] (a 64-bit integer), got {params.seed}")
    stop = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
    _at_most("stop", len(stop), MAX_STOP_STRINGS, "strings")
    longest = max((len(s) for s in stop if isinstance(s, str)), default=0)
    _at_most("stop", longest, MAX_STOP_STRING_CHARS, "characters a string")
    _at_most("stop_token_ids", len(params.stop_token_ids or []), MAX_STOP_TOKEN_IDS, "token ids")
    _at_most("logit_bias", len(params.logit_bias or {}), MAX_LOGIT_BIAS, "entries")
    words = params.bad_words or []
    _at_most("bad_words", len(words), MAX_BAD_WORDS, "words")
    longest = max((len(w) for w in words if isinstance(w, str)), default=0)
    _at_most("bad_words", longest, MAX_BAD_WORD_CHARS, "characters a word")
    _at_most("allowed_token_ids", len(params.allowed_token_ids or []), MAX_ALLOWED_TOKEN_IDS, "token ids")


def check_engine_limits(params: RequestOptions, config: EngineConfig) -> None:
    """The limits an engine's config sets: `n` within `max_num_seqs` (the children of one request must fit the
    engine's batch at once; more would queue a request against itself), `logprobs` and `prompt_logprobs` within
    `max_logprobs` (vLLM's check in its processor). Cheap: called before anything is tokenized or queued."""
    check_n(params.n, config)
    for name in ("logprobs", "prompt_logprobs"):
        check_logprobs(name, getattr(params, name), config)


def check_n(n: int, config: EngineConfig) -> None:
    """`n` within `max_num_seqs`."""
    if n > config.max_num_seqs:
        raise ValueError(
            f"n: at most {config.max_num_seqs} (max_num_seqs, the sequences the engine holds at once), got {n}"
        )


def check_logprobs(name: str, value: int | None, config: EngineConfig) -> None:
    """A logprobs count (`logprobs`, `prompt_logprobs`, `top_logprobs`) within `max_logprobs`."""
    if value is not None and value > config.max_logprobs:
        raise ValueError(f"{name}: at most {config.max_logprobs} (max_logprobs), got {value}")


def check_max_tokens(max_tokens: Any, num_prompt_tokens: int, max_model_len: int, field: str = "max_tokens") -> None:
    """vLLM's serving check: the prompt and `max_tokens` together within `max_model_len` (the offline engine, as
    vLLM's, stops such a request at max_model_len with finish_reason "length" instead)."""
    if (
        isinstance(max_tokens, int)
        and not isinstance(max_tokens, bool)
        and max_tokens > max_model_len - num_prompt_tokens
    ):
        raise ValueError(
            f"{field}: at most {max(max_model_len - num_prompt_tokens, 0)} (max_model_len "
            f"{max_model_len} minus the prompt's {num_prompt_tokens} tokens), got {max_tokens}"
        )
