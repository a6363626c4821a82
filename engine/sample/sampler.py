"""The sampler: one token per row of logits, the way vLLM V1's ``Sampler`` picks it.

Order (vLLM's): logprobs from the raw logits; then a request's logits options (allowed ids, bad words,
logit bias, penalties: ``logits_processors.py``); greedy rows take the argmax; random rows are
divided by their temperature, then min-p, then top-k, then top-p, and draw with the
exponential race ``argmax(probs / q)``, ``q ~ Exponential(1)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

import kernels
from engine.sample.logits_processors import LogitsInputs, uses_logits_options
from engine.sampling_params import SamplingParams

_SAMPLING_EPS = 1e-5
# Top-p first looks for the nucleus among this many most likely tokens (a partial sort);
# only rows whose nucleus is wider pay for a full sort of the vocabulary.
TOP_P_CANDIDATES = 1024


class LogprobsTensors(NamedTuple):
    """Logprobs of one step: column 0 is the sampled token, then the top-k, most likely first."""

    logprob_token_ids: torch.Tensor  # [N, k + 1] int64
    logprobs: torch.Tensor  # [N, k + 1] float32, from the raw logits
    selected_token_ranks: torch.Tensor  # [N] int64: tokens at least as likely as the sampled one (1 = the most likely)


@dataclass
class SamplingMetadata:
    """Per-step sampling parameters, one entry per logits row (built by the model runner)."""

    temperature: torch.Tensor  # [N] float32; < 1e-5 => greedy row
    top_k: torch.Tensor | None  # [N] int64; 0 or >= V => off; None => off for all rows
    top_p: torch.Tensor | None  # [N] float32 in (0, 1]; 1.0 => off; None => off for all
    min_p: torch.Tensor | None  # [N] float32 in [0, 1]; 0 => off; None => off for all
    generators: dict[int, torch.Generator]  # row index -> that request's own seeded generator
    default_generator: torch.Generator | None  # random rows without their own generator
    all_greedy: bool
    all_random: bool
    max_num_logprobs: int | None  # None => no logprobs; k >= 0 => sampled token + top-k
    logits_inputs: LogitsInputs | None = None  # penalties, bias, bad words, allowed ids; None => no row uses them


@dataclass
class SamplerOutput:
    """What one sampler call returns to the model runner."""

    sampled_token_ids: torch.Tensor  # [N] int64
    logprobs: LogprobsTensors | None


class Sampler:
    """Owns the choice of the next token for every sampling row of a step.

    The caller's logits are never modified. A row with its own generator draws its noise
    only from it, so a seeded request samples the same tokens whatever else is in the batch.
    """

    def __init__(self, top_p_candidates: int = TOP_P_CANDIDATES) -> None:
        self.top_p_candidates = top_p_candidates

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row of `logits` [N, V]; logprobs too when asked for."""
        raw = logits.float()
        # Logprobs stay those of the raw logits (vLLM's default raw_logprobs); the options change what is drawn.
        logits = raw if metadata.logits_inputs is None else metadata.logits_inputs.apply(raw.clone())
        sampled = self.sample(logits, metadata)
        logprobs = None
        if metadata.max_num_logprobs is not None:
            num = min(metadata.max_num_logprobs, logits.shape[-1])
            logprobs = gather_logprobs(compute_logprobs(raw), num, sampled)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """[N] int64 token ids: greedy rows by argmax, the others by `random_sample`."""
        greedy = None if metadata.all_random else greedy_sample(logits)
        if greedy is not None and metadata.all_greedy:
            return greedy
        sampled = self.random_sample(logits, metadata)
        if greedy is None:
            return sampled
        return torch.where(metadata.temperature < _SAMPLING_EPS, greedy, sampled)

    def random_sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Temperature, min-p, top-k, top-p, then the exponential race (every row, as vLLM)."""
        probs = self.probs(logits, metadata)
        noise = exponential_noise(probs, metadata.generators, metadata.default_generator)
        return greedy_sample(probs.div_(noise))

    def probs(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """The distribution random rows sample from: temperature, min-p, top-k, top-p, softmax.
        (Speculative decoding verifies drafts against exactly this distribution.)"""
        logits = apply_temperature(logits, metadata.temperature)  # a new tensor from here on
        min_p = _active(metadata.min_p, lambda v: v > 0)
        if min_p is not None:
            apply_min_p(logits, min_p)
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p, self.top_p_candidates)
        return logits.softmax(dim=-1)


def argmax_only(params: SamplingParams) -> bool:
    """Whether the sampler's whole work for a request is `greedy_sample`: greedy, no logprobs, no logits options
    (penalties, bias, bad words, allowed ids, min_tokens). A step of such requests skips `SamplingMetadata`, whose
    per-row tensors cost tens of microseconds right after a step's weights have streamed through the caches."""
    return params.greedy and params.logprobs is None and not params.min_tokens and not uses_logits_options(params)


def greedy_sample(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax, ties to the lowest index (``kernels.argmax_rows``: torch's reduction runs a row at a time on
    one thread, 2.5 ms for a batch-64 step's rows)."""
    return kernels.argmax_rows(logits)


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """A new tensor ``logits / T``; greedy rows (T ~ 0) are divided by 1 to stay finite."""
    temperature = torch.where(temperature < _SAMPLING_EPS, 1.0, temperature)
    return logits / temperature.unsqueeze(1)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """In place: drop tokens whose probability is below ``min_p`` times the row's largest."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill_(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None, top_p_candidates: int = TOP_P_CANDIDATES
) -> torch.Tensor:
    """In place: top-k, then top-p on what top-k kept; rows with both off are untouched."""
    vocab_size = logits.shape[-1]
    if k is not None:
        k = k.masked_fill((k <= 0) | (k >= vocab_size), vocab_size)
    k = _active(k, lambda v: v < vocab_size)
    p = _active(p, lambda v: v < 1.0)
    if k is not None:
        apply_top_k_only(logits, k)
    if p is not None:
        apply_top_p(logits, p, top_p_candidates)
    return logits


def apply_top_k_only(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """In place: keep each row's k largest logits (ties at the k-th kept); k == V means off.

    Needs only a partial sort up to the batch's largest k, as vLLM's CPU path.
    """
    off = k == logits.shape[-1]
    k = k.long().masked_fill(off, 1)
    kth = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))
    kth.masked_fill_(off.unsqueeze(1), float("-inf"))
    return logits.masked_fill_(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: torch.Tensor, top_p_candidates: int = TOP_P_CANDIDATES) -> torch.Tensor:
    """In place: keep the smallest most-likely set whose mass reaches p (at least one token).

    Each row is decided on its own (the same row gives the same mask in any batch): from the
    top candidates when their mass reaches p, else by a full sort. Rows with p >= 1 are skipped.
    """
    active = p < 1.0
    if not active.all():
        rows = active.nonzero().squeeze(1)
        logits[rows] = apply_top_p(logits[rows], p[rows], top_p_candidates)
        return logits
    drop, covered = _top_p_from_candidates(logits, p, top_p_candidates)
    logits.masked_fill_(drop, float("-inf"))
    rows = (~covered).nonzero().squeeze(1)
    if rows.numel():
        logits[rows] = _top_p_by_sort(logits[rows], p[rows])
    return logits


def _top_p_from_candidates(logits: torch.Tensor, p: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(drop mask [N, V], covered [N]): the mask is all False on rows the candidates do not cover."""
    probs = logits.softmax(dim=-1)
    top, idx = probs.topk(min(n, logits.shape[-1]), dim=-1)
    cumulative = top.cumsum(dim=-1)
    covered = cumulative[:, -1] >= p
    # A token stays while the mass strictly before it is below p: the first always does.
    keep = (cumulative - top) < p.unsqueeze(1)
    keep[:, 0] = True
    drop = torch.ones_like(logits, dtype=torch.bool).scatter_(1, idx, ~keep)
    drop &= covered.unsqueeze(1)
    return drop, covered


def _top_p_by_sort(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """vLLM's full-sort top-p: drop tokens whose ascending cumulative mass stays within 1 - p."""
    sorted_logits, idx = logits.sort(dim=-1)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= 1 - p.unsqueeze(1)
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, float("-inf"))
    return logits.scatter_(-1, idx, sorted_logits)


def exponential_noise(
    probs: torch.Tensor, generators: dict[int, torch.Generator], default_generator: torch.Generator | None
) -> torch.Tensor:
    """Exponential(1) noise shaped like probs: rows in `generators` from their own generator,
    all the others in one draw from `default_generator`.

    Drawn as -log(U): on CPU ``uniform_`` + ``log`` is ~6x faster than ``exponential_``.
    U in [0, 1) makes q in (0, inf], so probs / q is never NaN.
    """
    noise = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        noise.uniform_(generator=default_generator)
    for row, generator in generators.items():
        noise[row].uniform_(generator=generator)
    return noise.log_().neg_()


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """Raw logprobs, before temperature and filters (vLLM's default ``raw_logprobs``)."""
    return logits.log_softmax(dim=-1, dtype=torch.float32)


def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor) -> LogprobsTensors:
    """The sampled token's logprob and rank, followed by the top `num_logprobs`."""
    token_ids = token_ids.unsqueeze(1)
    token_logprobs = logprobs.gather(-1, token_ids)
    ranks = (logprobs >= token_logprobs).sum(dim=-1)
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
    return LogprobsTensors(
        logprob_token_ids=torch.cat((token_ids, top_ids), dim=1),
        logprobs=torch.cat((token_logprobs, top_logprobs), dim=1),
        selected_token_ranks=ranks,
    )


def _active(values: torch.Tensor | None, used: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
    """`values`, or None when no row uses it: the hot path then skips the work entirely."""
    if values is None or not bool(used(values).any()):
        return None
    return values
