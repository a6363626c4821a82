"""SpecDecoder: the proposer of the configured method, the rejection sampler, and the drafts they exchange."""

from __future__ import annotations

import importlib
import itertools
import time

import numpy as np
import torch

from engine.config import EngineConfig, SpeculativeConfig
from engine.core.sched.output import ScheduledRequest
from engine.events import EventLog
from engine.model.attention import AttentionMetadata
from engine.sample.rejection_sampler import RejectionSampler
from engine.sample.sampler import Sampler
from engine.spec_decode import PROPOSERS, method_names
from engine.spec_decode.proposer import DraftRequest, Drafts, Proposer, TargetBatch, TargetModel
from engine.spec_decode.tree import move_kv


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
        self.tree = spec.tree
        model = target.model
        windows = (
            [] if model is None else [model.model.attention(i).sliding_window for i in range(len(model.model.layers))]
        )
        if self.tree is not None and any(windows):
            raise ValueError("speculative_config.speculative_token_tree: not with sliding-window attention")
        self.rejection_sampler = RejectionSampler(sampler, events, spec.method, cls.drafts_have_probs, self.tree)
        self._batch: TargetBatch | None = None  # this step's, between mirror and propose
        self._first_rows: dict[str, int] = {}  # each request's first row in that batch
        self._scheduled: list[ScheduledRequest] = []  # that batch's requests

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
        aux_hidden_states: torch.Tensor | None = None,
    ) -> None:
        """Keep the step's batch as the target ran it (with the target's final hidden states, and the aux layers'
        where EAGLE-3 asked for them) for the proposer. It
        sees the batch once the step's tokens are drawn (in `propose`), so that each position is paired with the
        token really after it; a step where no request samples shows it now."""
        t0 = time.perf_counter()
        self._keep_batch(scheduled, input_ids, positions, attn, hidden_states, aux_hidden_states)
        if not any(s.samples for s in scheduled):
            self.proposer.mirror(self._kept_batch())
        self.stats.proposer_seconds += time.perf_counter() - t0

    def _keep_batch(
        self,
        scheduled: list[ScheduledRequest],
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        hidden_states: torch.Tensor,
        aux_hidden_states: torch.Tensor | None,
    ) -> None:
        starts = attn.query_start_loc.tolist()
        next_ids = input_ids.roll(-1)
        ends = [b - 1 for b in starts[1:]]
        # the token after each request's last position: the next prompt token mid-prefill; not drawn yet otherwise
        following = [
            -1 if s.samples else s.request.all_token_ids[s.num_computed_tokens + s.num_new_tokens] for s in scheduled
        ]
        next_ids[ends] = torch.tensor(following, dtype=next_ids.dtype, device=next_ids.device)
        self._batch = TargetBatch(input_ids, positions, attn, hidden_states, next_ids, aux_hidden_states)
        self._scheduled = scheduled
        self._first_rows = {s.request_id: start for s, start in zip(scheduled, starts)}

    def tree_inputs(
        self, scheduled: list[ScheduledRequest], positions: np.ndarray, ends: np.ndarray
    ) -> np.ndarray | None:
        """A draft tree's verification rows: each node's position becomes its root's plus its depth (in place in
        `positions`, the step's flat positions; `ends`: each request's end row), and the tree mask of every row
        (-1, causal, outside the trees); None when no request verifies a tree this step."""
        verify = [(len(s.spec_token_ids), int(end)) for s, end in zip(scheduled, ends) if s.spec_token_ids]
        if self.tree is None or self.tree.is_chain or not verify:
            return None
        mask = np.full(len(positions), -1, dtype=np.int64)
        depths, masks = np.array(self.tree.depths), np.array(self.tree.masks, dtype=np.int64)
        for n, end in verify:
            root = end - n - 1
            positions[root:end] = positions[root] + depths[: n + 1]
            mask[root:end] = masks[: n + 1]
        return mask

    def _keep_accepted_paths(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """After a tree's verification, the accepted path's K/V move to the slots after the root's (context_len + 1
        ... + d, where a chain's would be), in every layer; the kept batch becomes the step as if only that path
        had been scheduled (the proposer mirrors it). The rejected branches' slots lie past the request's computed
        tokens: no later step reads them before overwriting them."""
        paths, batch = self.rejection_sampler.accepted_paths, self._kept_batch()
        starts = batch.attn.query_start_loc.tolist()
        rows: list[int] = []  # the batch rows kept: each request's, less its rejected nodes
        slots: list[int] = []  # the rows whose slots they take: the accepted path's, the ones after its root
        counts: list[int] = []  # rows kept per request
        lens, src, dst = batch.attn.seq_lens.clone(), [], []
        for i, s in enumerate(self._scheduled):
            a, b = starts[i], starts[i + 1]
            path = paths.get(s.request_id)
            if path is None:
                rows += range(a, b)
                slots += range(a, b)
            else:
                root = b - len(s.spec_token_ids) - 1
                rows += [*range(a, root + 1), *(root + c for c in path)]
                slots += range(a, root + len(path) + 1)
                for j, c in enumerate(path, 1):
                    if c != j:
                        src.append(root + c)
                        dst.append(root + j)
                lens[i] -= b - root - 1 - len(path)
            counts.append(len(rows) - sum(counts))
        mapping = batch.attn.slot_mapping
        if src:
            move_kv(kv_caches, mapping[src], mapping[dst])
        device = batch.input_ids.device
        kept = torch.tensor(rows, device=device)
        attn = AttentionMetadata(
            slot_mapping=mapping[torch.tensor(slots, device=device)],
            block_tables=batch.attn.block_tables,
            seq_lens=lens,
            query_start_loc=torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int32, device=device),
        )
        aux = None if batch.aux_hidden_states is None else batch.aux_hidden_states[kept]
        self._keep_batch(
            self._scheduled, batch.input_ids[kept], batch.positions[kept], attn, batch.hidden_states[kept], aux
        )

    def propose(
        self,
        rows: list[ScheduledRequest],
        sampled: dict[str, list[int]],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        num_spec_tokens: int | None = None,
    ) -> Drafts:
        """Show the proposer the step's batch with the drawn tokens, then drafts for every request that just
        sampled, capped so that drafts plus the bonus token stay within max_tokens and max_model_len. After a
        tree's verification, `kv_caches` (the target's) get the accepted paths' K/V where later steps read them."""
        t0 = time.perf_counter()
        if self.rejection_sampler.accepted_paths:
            assert kv_caches is not None, "a tree's verification moves the target's K/V"
            self._keep_accepted_paths(kv_caches)
            self.rejection_sampler.accepted_paths = {}
        batch = self._kept_batch()
        # each drawn token follows the row that drew it: after a verification, the accepted drafts' rows
        drew = [(self._row_before(s, j), t) for s in rows for j, t in enumerate(sampled[s.request_id])]
        next_ids = batch.next_token_ids
        next_ids[[r for r, _ in drew]] = torch.tensor(
            [t for _, t in drew], dtype=next_ids.dtype, device=next_ids.device
        )
        self.proposer.mirror(batch)
        k = self.k if num_spec_tokens is None else num_spec_tokens  # the step's, by its batch size (at most self.k)
        requests = [r for s in rows if (r := self._draft_request(batch, s, sampled[s.request_id], k)) is not None]
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

    def _draft_request(self, batch: TargetBatch, s: ScheduledRequest, new: list[int], k: int) -> DraftRequest | None:
        request = s.request
        tokens = request.all_token_ids + new
        left = request.sampling_params.max_tokens - request.num_output_tokens - len(new)
        max_len = self.config.max_model_len
        assert max_len is not None, "resolved from the model when the runner is built"
        k = min(k, left - 1, max_len - len(tokens) - 1)
        # a guided request's grammar reads drafts as one sequence, which a tree's are not: it verifies alone
        if k < 1 or (self.tree is not None and request.sampling_params.structured_outputs is not None):
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
