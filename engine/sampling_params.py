"""What a user asks of one request: how to sample its tokens, when to stop, and what its output must follow."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.limits import check_static_limits


def _check_type(name: str, value: Any, types: type | tuple[type, ...], allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    # bool is an int subclass; a flag where a number belongs is a mistake worth naming
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise TypeError(f"{name}: expected {types}, got bool")
    if not isinstance(value, types):
        raise TypeError(f"{name}: expected {getattr(types, '__name__', types)}, got {type(value).__name__}")


@dataclass
class StructuredOutputsParams:
    """What a guided request must follow: exactly one of json, json_object, regex, choice, grammar."""

    json: dict | str | type | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError(
                "structured_outputs: exactly one of json, json_object, regex, choice, grammar must be set; "
                f"got {given or 'none'}"
            )
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice: must be a non-empty list of non-empty strings")


@dataclass
class SamplingParams:
    """How to sample one request's tokens and when to stop. Validated on construction."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables, as in vLLM
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # per prompt token: its logprob and the top-n (the first token has none)
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    n: int = 1  # sequences to sample from the prompt (parallel sampling; they share the prompt's KV blocks)
    # Logits options, vLLM's names and ranges (applied by engine/sample/logits_processors.py).
    presence_penalty: float = 0.0  # [-2, 2]: minus p for each token already in the output
    frequency_penalty: float = 0.0  # [-2, 2]: minus f times each token's count in the output
    repetition_penalty: float = 1.0  # > 0: divides (multiplies if negative) logits of tokens seen in prompt or output
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100]
    bad_words: list[str] | None = None  # words never to generate (as token sequences)
    allowed_token_ids: list[int] | None = None  # only these tokens may be generated

    def __post_init__(self) -> None:
        _check_type("n", self.n, int)
        if self.n < 1:
            raise ValueError(f"n: must be >= 1, got {self.n}")
        _check_type("temperature", self.temperature, (int, float))
        _check_type("top_p", self.top_p, (int, float))
        _check_type("top_k", self.top_k, int)
        _check_type("min_p", self.min_p, (int, float))
        _check_type("seed", self.seed, int, allow_none=True)
        _check_type("max_tokens", self.max_tokens, int)
        _check_type("min_tokens", self.min_tokens, int)
        _check_type("logprobs", self.logprobs, int, allow_none=True)
        _check_type("prompt_logprobs", self.prompt_logprobs, int, allow_none=True)
        _check_type("structured_outputs", self.structured_outputs, StructuredOutputsParams, allow_none=True)
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k: must be -1, 0 (off) or >= 1, got {self.top_k}")
        if self.top_k == -1:
            self.top_k = 0
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p: must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens: must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs: must be >= 0, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs: must be >= 0, got {self.prompt_logprobs}")
        self._check_logits_options()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop: must be a string or a list of non-empty strings")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids):
            raise TypeError("stop_token_ids: must be a list of int")
        check_static_limits(self)  # sizes and ranges no engine is needed for (engine/limits.py)

    def _check_logits_options(self) -> None:
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            _check_type(name, getattr(self, name), (int, float))
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name}: must be in [-2, 2], got {getattr(self, name)}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty: must be > 0, got {self.repetition_penalty}")
        _check_type("logit_bias", self.logit_bias, dict, allow_none=True)
        for token, bias in (self.logit_bias or {}).items():
            _check_type("logit_bias (token id)", token, int)
            _check_type(f"logit_bias[{token}]", bias, (int, float))
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias[{token}]: must be in [-100, 100], got {bias}")
        _check_type("bad_words", self.bad_words, list, allow_none=True)
        if self.bad_words is not None and not all(isinstance(w, str) and w.strip() for w in self.bad_words):
            raise ValueError("bad_words: must be a list of non-empty strings")
        _check_type("allowed_token_ids", self.allowed_token_ids, list, allow_none=True)
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids: must not be empty (None allows every token)")
            for t in self.allowed_token_ids:
                _check_type("allowed_token_ids (token id)", t, int)
                if t < 0:
                    raise ValueError(f"allowed_token_ids: token ids must be >= 0, got {t}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
