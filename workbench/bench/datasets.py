"""Seeded synthetic workloads: random token-id prompts with fixed output lengths."""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    """One benchmark request: its prompt token ids and exactly how many tokens it must generate."""

    prompt_token_ids: list[int]
    output_len: int


def token_id_range(tokenizer) -> tuple[int, int]:
    """[low, high) of ordinary token ids: above every special and added token, below the vocabulary size.

    Random ids drawn from here look like text to the model, never like a chat marker or an end of sequence."""
    low = max([*tokenizer.all_special_ids, *tokenizer.added_tokens_decoder], default=-1) + 1
    return low, len(tokenizer)


def random_requests(num_requests: int, input_len_range: tuple[int, int], output_len_range: tuple[int, int],
                    token_range: tuple[int, int], seed: int = 0) -> list[BenchRequest]:
    """`num_requests` prompts of uniform random length and token ids, each with a uniform random output length
    (ranges inclusive). The same arguments always give the same requests."""
    _check_range("input_len_range", input_len_range)
    _check_range("output_len_range", output_len_range)
    rng = random.Random(seed)
    low, high = token_range
    requests = []
    for _ in range(num_requests):
        prompt_len = rng.randint(*input_len_range)
        requests.append(BenchRequest([rng.randrange(low, high) for _ in range(prompt_len)],
                                     rng.randint(*output_len_range)))
    return requests


def shared_prefix_requests(num_prefixes: int, prefix_len: int, suffix_len: int, num_requests: int,
                           output_len: int, token_range: tuple[int, int], seed: int = 0) -> list[BenchRequest]:
    """`num_requests` prompts, each one of `num_prefixes` random shared prefixes (round robin, so every prefix
    is reused equally) followed by its own random suffix: the system-prompt / few-shot pattern prefix caching
    is for."""
    if num_prefixes < 1 or prefix_len < 0 or suffix_len < 1:
        raise ValueError(f"num_prefixes >= 1, prefix_len >= 0, suffix_len >= 1 expected, got "
                         f"{num_prefixes}, {prefix_len}, {suffix_len}")
    rng = random.Random(seed)
    low, high = token_range
    prefixes = [[rng.randrange(low, high) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    return [
        BenchRequest(prefixes[i % num_prefixes] + [rng.randrange(low, high) for _ in range(suffix_len)], output_len)
        for i in range(num_requests)
    ]


def _check_range(name: str, bounds: tuple[int, int]) -> None:
    lo, hi = bounds
    if not 1 <= lo <= hi:
        raise ValueError(f"{name}: expected 1 <= low <= high, got {lo} {hi}")
