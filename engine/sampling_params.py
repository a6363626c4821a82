"""What a user asks of one request: how to sample its tokens, when to stop, and what its output must follow."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        _check_type("temperature", self.temperature, (int, float))
        _check_type("top_p", self.top_p, (int, float))
        _check_type("top_k", self.top_k, int)
        _check_type("min_p", self.min_p, (int, float))
        _check_type("seed", self.seed, int, allow_none=True)
        _check_type("max_tokens", self.max_tokens, int)
        _check_type("min_tokens", self.min_tokens, int)
        _check_type("logprobs", self.logprobs, int, allow_none=True)
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
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop: must be a string or a list of non-empty strings")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids):
            raise TypeError("stop_token_ids: must be a list of int")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
