"""Verification: the target's distributions at k+1 positions decide which drafts stand (rejection sampling)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import kernels
from engine.events import EventLog, SpecVerified
from engine.sample.sampler import greedy_sample
from engine.spec_decode.tree import SpecTree, walk_tree


@dataclass
class SpecDecodingStats:
    """Drafts verified, draft tokens, accepted tokens, and acceptance by position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # by depth, for a tree
    drafted_per_position: list[int] = field(default_factory=list)
    proposer_seconds: float = 0.0  # wall time spent drafting (the proposer's mirror and propose)
    # a tree's nodes by their child index under their parent (0: the best choice): verified, and accepted
    drafted_per_branch: list[int] = field(default_factory=list)
    accepted_per_branch: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification: accepted drafts plus the recovered or bonus token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def record(
        self,
        num_drafted: int,
        num_accepted: int,
        depth: int | None = None,
        drafted_branches: list[int] | None = None,
        accepted_branches: list[int] | None = None,
    ) -> None:
        """One verification of `num_drafted` drafts, `num_accepted` kept; a tree's also its `depth` and the child
        indices of its nodes and of those accepted (a chain's depth is its length)."""
        for per, n in (
            (self.drafted_per_position, num_drafted if depth is None else depth),
            (self.accepted_per_position, num_accepted),
        ):
            per.extend([0] * (n - len(per)))
            for i in range(n):
                per[i] += 1
        for per, branches in (
            (self.drafted_per_branch, drafted_branches),
            (self.accepted_per_branch, accepted_branches),
        ):
            for b in branches or ():
                per.extend([0] * (b + 1 - len(per)))
                per[b] += 1
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted


class RejectionSampler:
    """Owns the verification of one step's drafts and the acceptance statistics.

    Greedy requests keep drafts while they equal the target's argmax; random ones accept with probability
    min(1, p_target / p_draft) and, at the first rejection, draw from normalize(max(p_target - p_draft, 0));
    when every draft stands, a bonus token comes from the (k+1)-th distribution. N-gram drafts have no
    probabilities: a point mass; the draft model's, EAGLE's and Medusa's drafts come with their distributions."""

    def __init__(
        self, sampler, events: EventLog, method: str, with_draft_probs: bool = False, tree: SpecTree | None = None
    ) -> None:
        self.sampler = sampler
        self.events = events
        self.method = method
        self.with_draft_probs = with_draft_probs  # the proposer's drafts come with their distributions
        self.tree = None if tree is None or tree.is_chain else tree  # a chain's tree is the chain rule
        self.stats = SpecDecodingStats()
        self.accepted_paths: dict[str, list[int]] = {}  # the last verification's kept nodes, by request (trees)

    def __call__(
        self, logits: torch.Tensor, rows: list, first_rows: list[int], metadata_for: Callable
    ) -> dict[str, list[int]]:
        """`rows`: the ScheduledRequests with drafts; `first_rows[i]`: where request i's k+1 logits rows start;
        `metadata_for(requests)` builds SamplingMetadata for a list of ScheduledRequests."""
        if self.tree is not None:
            return self._verify_trees(self.tree, logits, rows, first_rows, metadata_for)
        counts = [len(s.spec_token_ids) for s in rows]
        target_idx = [r + j for r, n in zip(first_rows, counts) for j in range(n)]
        bonus_idx = [r + n for r, n in zip(first_rows, counts)]
        expanded = [s for s, n in zip(rows, counts) for _ in range(n)]
        target_probs = self.sampler.probs(logits[target_idx], metadata_for(expanded))
        drafts = torch.tensor([t for s in rows for t in s.spec_token_ids], device=logits.device)
        draft_probs = None
        if self.with_draft_probs:
            draft_probs = torch.cat([s.request.spec_draft_probs[:n] for s, n in zip(rows, counts)])
        bonus_meta = metadata_for(rows)
        bonus = self.sampler(logits[bonus_idx], bonus_meta).sampled_token_ids
        if all(s.request.sampling_params.greedy for s in rows):
            out = self._greedy(logits[target_idx], rows, counts, bonus.tolist())
            return self._emit(rows, counts, out, drafts, target_probs, draft_probs, torch.zeros(len(drafts)))
        # greedy rows are judged by the argmax, which temperature 1 and the filters leave where it was
        is_greedy = torch.tensor([s.request.sampling_params.greedy for s in rows], device=logits.device)
        dev, gens, default = logits.device, bonus_meta.generators, bonus_meta.default_generator
        uniform = kernels.generate_uniform_probs(counts, gens, dev, default)
        emitted = kernels.rejection_sample(
            drafts,
            torch.tensor(counts, device=dev).cumsum(0),
            draft_probs,
            target_probs,
            bonus,
            is_greedy,
            uniform,
            kernels.generate_recovery_noise(counts, logits.shape[-1], gens, dev, default),
            max(counts),
        )
        return self._emit(rows, counts, emitted.tolist(), drafts, target_probs, draft_probs, uniform)

    def _verify_trees(
        self, tree: SpecTree, logits: torch.Tensor, rows: list, first_rows: list[int], metadata_for: Callable
    ) -> dict[str, list[int]]:
        """Each request's tree walked from its root (walk_tree): its logits rows are the root's and each node's."""
        counts = [len(s.spec_token_ids) for s in rows]
        idx = [r + j for r, n in zip(first_rows, counts) for j in range(n + 1)]
        target = self.sampler.probs(logits[idx], metadata_for([s for s, n in zip(rows, counts) for _ in range(n + 1)]))
        argmax = greedy_sample(logits[idx]).tolist()
        meta = metadata_for(rows)
        uniform = kernels.generate_uniform_probs(counts, meta.generators, logits.device, meta.default_generator)
        self.accepted_paths, result, start, drawn = {}, {}, 0, 0
        for i, (s, n) in enumerate(zip(rows, counts)):
            greedy = s.request.sampling_params.greedy
            q = s.request.spec_draft_probs[:n] if self.with_draft_probs else None
            here = slice(start, start + n + 1)
            u = uniform[drawn : drawn + n].tolist()
            verdict = walk_tree(
                tree,
                s.spec_token_ids,
                target[here],
                argmax[here],
                q,
                u,
                greedy,
                meta.generators.get(i, meta.default_generator),
            )
            parents = tree.parents[1 : n + 1]
            p_draft = None if q is None else q.gather(1, torch.tensor(s.spec_token_ids, device=q.device)[:, None])
            self.stats.record(
                n,
                len(verdict.path),
                max(tree.depths[: n + 1]),
                [tree.branch(c) for c in range(1, n + 1)],
                [tree.branch(c) for c in verdict.path],
            )
            self.events.emit(
                SpecVerified,
                request_id=s.request_id,
                draft_token_ids=tuple(s.spec_token_ids),
                accepted=tuple(c in verdict.path for c in range(1, n + 1)),
                p_target=tuple(verdict.p_judged),
                p_draft=None if p_draft is None else tuple(p_draft[:, 0].tolist()),
                emitted_token=verdict.tokens[-1],
                bonus=all(c > n for c in tree.children[verdict.path[-1] if verdict.path else 0]),  # a leaf's
                method=self.method,
                rule="greedy" if greedy else "sampled",
                target_argmax=tuple(argmax[start + p] for p in parents),
                uniform_probs=() if greedy else tuple(u),
                tree_parents=tuple(parents),
                accepted_path=tuple(verdict.path),
            )
            self.accepted_paths[s.request_id] = verdict.path
            result[s.request_id] = verdict.tokens
            start, drawn = start + n + 1, drawn + n
        return result

    @staticmethod
    def _greedy(target_logits: torch.Tensor, rows: list, counts: list[int], bonus: list[int]) -> list[list[int]]:
        """Every request greedy (vLLM's all_greedy path): each keeps its drafts while they are the target's argmax,
        then emits the argmax where one was not, or its bonus token when all stand: the kernel's greedy rule,
        without its noise and its work over the [drafts, V] rows beyond the argmax."""
        best = greedy_sample(target_logits).tolist()
        out, start = [], 0
        for s, n, extra in zip(rows, counts, bonus):
            row, start = best[start : start + n], start + n
            kept = next((j for j in range(n) if s.spec_token_ids[j] != row[j]), n)
            out.append([*s.spec_token_ids[:kept], row[kept] if kept < n else extra])
        return out

    def _emit(
        self,
        rows: list,
        counts: list[int],
        out: list[list[int]],
        drafts: torch.Tensor,
        target: torch.Tensor,
        draft_probs: torch.Tensor | None,
        uniform: torch.Tensor,
    ) -> dict[str, list[int]]:
        # what a learner needs to redo each decision: p and q of the draft, the target's argmax, the uniform draw
        p_target = target.gather(1, drafts[:, None])[:, 0].tolist()
        p_draft = None if draft_probs is None else draft_probs.gather(1, drafts[:, None])[:, 0].tolist()
        argmax, drawn = target.argmax(dim=-1).tolist(), uniform.tolist()
        result, start = {}, 0
        for s, n, emitted in zip(rows, counts, out):
            tokens = [t for t in emitted if t != kernels.PLACEHOLDER_TOKEN_ID]
            accepted = len(tokens) - 1
            greedy = s.request.sampling_params.greedy
            here = slice(start, start + n)
            self.stats.record(n, accepted)
            self.events.emit(
                SpecVerified,
                request_id=s.request_id,
                draft_token_ids=tuple(s.spec_token_ids),
                accepted=tuple(i < accepted for i in range(n)),
                p_target=tuple(p_target[here]),
                p_draft=None if p_draft is None else tuple(p_draft[here]),
                emitted_token=tokens[-1],
                bonus=accepted == n,
                method=self.method,
                rule="greedy" if greedy else "sampled",
                target_argmax=tuple(argmax[here]),
                uniform_probs=() if greedy else tuple(drawn[here]),
            )
            result[s.request_id] = tokens
            start += n
        return result
