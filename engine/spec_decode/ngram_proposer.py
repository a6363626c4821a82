"""The n-gram proposer (prompt lookup): drafts are the tokens that followed an earlier occurrence of the
sequence's last n tokens."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.spec_decode.proposer import DraftRequest, Drafts, Proposer, TargetModel


class NgramProposer(Proposer):
    """Stateless: proposes from a request's own tokens (prompt plus output)."""

    method = "ngram"

    def __init__(self, num_speculative_tokens: int, prompt_lookup_max: int, prompt_lookup_min: int) -> None:
        self.k = num_speculative_tokens
        self.max_n = prompt_lookup_max
        self.min_n = prompt_lookup_min

    @classmethod
    def from_config(cls, target: TargetModel) -> NgramProposer:
        spec = target.speculative
        return cls(spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min)

    def propose(self, requests: list[DraftRequest]) -> Drafts:
        drafts = {r.request_id: self.lookup(r.token_ids, r.num_drafts) for r in requests}
        return {rid: (tokens, None) for rid, tokens in drafts.items() if tokens}

    def lookup(self, token_ids: list[int] | np.ndarray, k: int | None = None) -> list[int]:
        """Up to k tokens that followed the earliest earlier match of the last n tokens, n shrinking
        from prompt_lookup_max to prompt_lookup_min; [] when nothing matches."""
        k = self.k if k is None else k
        tokens = np.asarray(token_ids, dtype=np.int64)
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # windows starting at 0 .. length-n-1: each is followed by at least one token
            windows = sliding_window_view(tokens[: length - 1], n)
            hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
            if hits.size:
                start = int(hits[0]) + n
                return tokens[start : start + k].tolist()
        return []
