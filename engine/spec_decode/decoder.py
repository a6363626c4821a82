"""SpecDecoder: the proposer of the configured method, the rejection sampler, and the drafts they exchange."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.config import EngineConfig
from engine.events import EventLog
from engine.spec_decode.draft_model import DraftInput, DraftModelProposer
from engine.spec_decode.ngram_proposer import NgramProposer
from engine.sample.rejection_sampler import RejectionSampler

if TYPE_CHECKING:
    from engine.model.runner import ModelRunner


class SpecDecoder:
    """Owns the proposer (n-gram or draft model) and the rejection sampler of one model runner."""

    def __init__(self, config: EngineConfig, runner: "ModelRunner", events: EventLog) -> None:
        spec = config.speculative
        self.k = spec.num_speculative_tokens
        self.config = config  # max_model_len is resolved after the runner (and this) is built
        if spec.method == "ngram":
            self.proposer = NgramProposer(self.k, spec.prompt_lookup_max, spec.prompt_lookup_min)
        else:
            from engine.model.loader import resolve_model

            self.proposer = DraftModelProposer(resolve_model(spec.model), self.k, runner.num_blocks,
                                               config.block_size, config.torch_dtype, runner.device,
                                               runner.vocab_size, runner.default_generator)
        self.rejection_sampler = RejectionSampler(runner.sampler, events, spec.method)

    @property
    def stats(self):
        return self.rejection_sampler.stats

    def mirror(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> None:
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.mirror(input_ids, positions, attn)

    def propose(self, rows: list, sampled: dict[str, list[int]]) -> dict[str, tuple[list[int], torch.Tensor | None]]:
        """Drafts for every request that just sampled, capped so that drafts plus the bonus token stay
        within max_tokens and max_model_len."""
        todo = []
        for s in rows:
            request, new = s.request, sampled[s.request_id]
            tokens = request.all_token_ids + new
            left = request.sampling_params.max_tokens - request.num_output_tokens - len(new)
            k = min(self.k, left - 1, self.config.max_model_len - len(tokens) - 1)
            if k >= 1:
                todo.append((s, tokens, k))
        if isinstance(self.proposer, NgramProposer):
            drafts = {s.request_id: (self.proposer.propose(tokens, k), None) for s, tokens, k in todo}
            return {rid: d for rid, d in drafts.items() if d[0]}
        inputs = [DraftInput(tokens[-1], len(tokens) - 1, s.block_ids, k, s.request.sampling_params.temperature,
                             s.request.generator) for s, tokens, k in todo]
        proposals = self.proposer.propose(inputs) if inputs else []
        return {s.request_id: p for (s, _, _), p in zip(todo, proposals)}
