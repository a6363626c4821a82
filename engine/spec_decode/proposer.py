"""The interface every proposer implements, and what it is given: a new method (EAGLE, Medusa, ...) is a subclass
of Proposer plus one entry in `PROPOSERS` (engine/spec_decode/decoder.py), under its speculative_config.method."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from engine.config import EngineConfig
from engine.model.attention import AttentionMetadata

# drafts by request id, with their draft distributions [len(drafts), V], or None where the method has none
# (the rejection sampler then takes the drafts as certain)
Drafts = dict[str, tuple[list[int], torch.Tensor | None]]


@dataclass(frozen=True)
class TargetModel:
    """What a proposer may know of the target model it drafts for: the engine config, and the model runner's
    KV cache size (a draft model's cache shares its block ids), vocabulary, device and default generator."""

    config: EngineConfig
    num_blocks: int
    vocab_size: int
    device: torch.device
    default_generator: torch.Generator


@dataclass(frozen=True)
class DraftRequest:
    """One request that just sampled: its tokens (the new ones included), its block ids, how many drafts it may
    take (capped by max_tokens and max_model_len), and how to sample them."""

    request_id: str
    token_ids: list[int]
    block_ids: list[int]
    num_drafts: int
    temperature: float
    generator: torch.Generator | None


class Proposer(ABC):
    """A way to draft tokens for the target to verify. Each owns what it drafts with (nothing but the requests'
    tokens for n-gram; a model and its KV cache for a draft model)."""

    method: ClassVar[str]  # its speculative_config.method

    @classmethod
    @abstractmethod
    def from_config(cls, target: TargetModel) -> Proposer:
        """Build it from `target.config.speculative` (num_speculative_tokens and the method's own keys)."""

    @abstractmethod
    def propose(self, requests: list[DraftRequest]) -> Drafts:
        """Drafts for the requests that just sampled (never an empty list); a request without drafts is left out."""

    def mirror(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> None:
        """See the target's batch of this step, after the target ran it: a proposer with its own KV cache runs it
        too, so that cache holds the same tokens. Nothing to do for the others."""
