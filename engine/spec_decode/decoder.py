"""SpecDecoder: the proposer of the configured method, the rejection sampler, and the drafts they exchange."""

from __future__ import annotations

import importlib
import time

import torch

from engine.config import EngineConfig, SpeculativeConfig
from engine.core.sched.output import ScheduledRequest
from engine.events import EventLog
from engine.model.attention import AttentionMetadata
from engine.sample.rejection_sampler import RejectionSampler
from engine.sample.sampler import Sampler
from engine.spec_decode import PROPOSERS, method_names
from engine.spec_decode.proposer import DraftRequest, Drafts, Proposer, TargetBatch, TargetModel


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
        spec = target.speculative
        self.k = spec.num_speculative_tokens
        self.config = config  # max_model_len is resolved after the runner (and this) is built
        cls = proposer_class(spec)
        self.proposer = cls.from_config(target)
        self.rejection_sampler = RejectionSampler(sampler, events, spec.method, cls.drafts_have_probs)
        self._batch: TargetBatch | None = None  # this step's, between mirror and propose
        self._first_rows: dict[str, int] = {}  # each request's first row in that batch

    @property
    def stats(self):
        return self.rejection_sampler.stats

    def mirror(
        self,
        scheduled: list[ScheduledRequest],
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        hidden_states: torch.Tensor,
    ) -> None:
        """Keep the step's batch as the target ran it (with the target's final hidden states) for the proposer. It
        sees the batch once the step's tokens are drawn (in `propose`), so that each position is paired with the
        token really after it; a step where no request samples shows it now."""
        t0 = time.perf_counter()
        starts = attn.query_start_loc.tolist()
        next_ids = input_ids.roll(-1)
        ends = [b - 1 for b in starts[1:]]
        # the token after each request's last position: the next prompt token mid-prefill; not drawn yet otherwise
        following = [
            -1 if s.samples else s.request.all_token_ids[s.num_computed_tokens + s.num_new_tokens] for s in scheduled
        ]
        next_ids[ends] = torch.tensor(following, dtype=next_ids.dtype, device=next_ids.device)
        self._batch = TargetBatch(input_ids, positions, attn, hidden_states, next_ids)
        self._first_rows = {s.request_id: start for s, start in zip(scheduled, starts)}
        if not any(s.samples for s in scheduled):
            self.proposer.mirror(self._batch)
        self.stats.proposer_seconds += time.perf_counter() - t0

    def propose(self, rows: list[ScheduledRequest], sampled: dict[str, list[int]]) -> Drafts:
        """Show the proposer the step's batch with the drawn tokens, then drafts for every request that just
        sampled, capped so that drafts plus the bonus token stay within max_tokens and max_model_len."""
        t0 = time.perf_counter()
        batch = self._kept_batch()
        # each drawn token follows the row that drew it: after a verification, the accepted drafts' rows
        drew = [(self._row_before(s, j), t) for s in rows for j, t in enumerate(sampled[s.request_id])]
        next_ids = batch.next_token_ids
        next_ids[[r for r, _ in drew]] = torch.tensor(
            [t for _, t in drew], dtype=next_ids.dtype, device=next_ids.device
        )
        self.proposer.mirror(batch)
        requests = [r for s in rows if (r := self._draft_request(batch, s, sampled[s.request_id])) is not None]
        drafts = self.proposer.propose(requests) if requests else {}
        self.stats.proposer_seconds += time.perf_counter() - t0
        return drafts

    def _kept_batch(self) -> TargetBatch:
        if self._batch is None:
            raise RuntimeError("propose before mirror: this step's batch was not kept")
        return self._batch

    def _row_before(self, s: ScheduledRequest, j: int) -> int:
        """The batch row whose position precedes this step's j-th drawn token of `s` (the row that drew it)."""
        return self._first_rows[s.request_id] + len(s.request.all_token_ids) - 1 - s.num_computed_tokens + j

    def _draft_request(self, batch: TargetBatch, s: ScheduledRequest, new: list[int]) -> DraftRequest | None:
        request = s.request
        tokens = request.all_token_ids + new
        left = request.sampling_params.max_tokens - request.num_output_tokens - len(new)
        max_len = self.config.max_model_len
        assert max_len is not None, "resolved from the model when the runner is built"
        k = min(self.k, left - 1, max_len - len(tokens) - 1)
        if k < 1:
            return None
        # the target's state at the position before the newest token: it sampled that token (after the accepted
        # drafts of a verification, whose later rows saw rejected drafts)
        row = self._row_before(s, len(new) - 1)
        return DraftRequest(
            request.request_id,
            tokens,
            s.block_ids,
            k,
            request.sampling_params.temperature,
            request.generator,
            batch.hidden_states[row],
            row,
        )
