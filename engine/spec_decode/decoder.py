"""SpecDecoder: the proposer of the configured method, the rejection sampler, and the drafts they exchange."""
from __future__ import annotations

import importlib

import torch

from engine.config import EngineConfig, SpeculativeConfig
from engine.core.sched.output import ScheduledRequest
from engine.events import EventLog
from engine.model.attention import AttentionMetadata
from engine.sample.rejection_sampler import RejectionSampler
from engine.sample.sampler import Sampler
from engine.spec_decode import PROPOSERS, method_names
from engine.spec_decode.proposer import DraftRequest, Drafts, Proposer, TargetModel

def proposer_class(spec: SpeculativeConfig) -> type[Proposer]:
    """The proposer registered under `spec.method` in PROPOSERS; an unknown method raises ValueError naming the
    known ones (EngineConfig refuses it first; a config built by hand is checked here)."""
    path = PROPOSERS.get(spec.method)
    if path is None:
        raise ValueError(f"speculative_config.method: must be one of {method_names()}, got {spec.method!r}")
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


class SpecDecoder:
    """Owns the proposer of the configured method and the rejection sampler of one model runner."""

    def __init__(self, config: EngineConfig, target: TargetModel, sampler: Sampler, events: EventLog) -> None:
        spec = config.speculative
        self.k = spec.num_speculative_tokens
        self.config = config  # max_model_len is resolved after the runner (and this) is built
        self.proposer = proposer_class(spec).from_config(target)
        self.rejection_sampler = RejectionSampler(sampler, events, spec.method)

    @property
    def stats(self):
        return self.rejection_sampler.stats

    def mirror(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> None:
        self.proposer.mirror(input_ids, positions, attn)

    def propose(self, rows: list[ScheduledRequest], sampled: dict[str, list[int]]) -> Drafts:
        """Drafts for every request that just sampled, capped so that drafts plus the bonus token stay
        within max_tokens and max_model_len."""
        requests = [r for s in rows if (r := self._draft_request(s, sampled[s.request_id])) is not None]
        return self.proposer.propose(requests) if requests else {}

    def _draft_request(self, s: ScheduledRequest, new: list[int]) -> DraftRequest | None:
        request = s.request
        tokens = request.all_token_ids + new
        left = request.sampling_params.max_tokens - request.num_output_tokens - len(new)
        k = min(self.k, left - 1, self.config.max_model_len - len(tokens) - 1)
        if k < 1:
            return None
        return DraftRequest(request.request_id, tokens, s.block_ids, k, request.sampling_params.temperature,
                            request.generator)
