"""Draft trees: the shape (vLLM's ``speculative_token_tree``), the tree attention mask and positions, and the walk
that verifies a tree.

A tree is a string of a list of tuples, each a node's path of child indices from the root: ``"[(0,), (1,), (0, 0)]"``
is the root's best and second-best children, and the best child of the first. Child index c means the (c+1)-th
choice under its parent: the (c+1)-th most likely token for a greedy request, the (c+1)-th draw for a sampled one.
Nodes are listed breadth first (vLLM sorts them so; we ask for it, so that a request's nodes can be cut to a prefix
of the list and stay a tree). Tree index 0 is the root (the request's newest sampled token); node i of the list is
tree index i + 1, which is also its row in the request's verification: the root and the nodes are scheduled as one
token and its spec tokens, each node's K/V written at the slot of row i (context_len + i) and its RoPE position
context_len + depth.

The mask: row i attends to the context, its ancestors and itself. It travels as one int64 per query row
(``AttentionMetadata.tree_mask``): bit b set means the key b slots before the row's own slot is visible; keys 64 or
more slots back are always visible, and -1 (every bit) is plain causal attention. So prefills, decodes and trees of
different sizes share one kernel launch, and a tree has at most 63 nodes.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cached_property

import torch

MASK_BITS = 64  # keys this close to a query row are masked by its bits; farther ones are context


@dataclass(frozen=True)
class SpecTree:
    """Owns a draft tree's shape: each node's path, parent and depth, in breadth-first order (root excluded)."""

    paths: tuple[tuple[int, ...], ...]

    @classmethod
    def parse(cls, text: str) -> SpecTree:
        """A tree from vLLM's ``speculative_token_tree`` string; ValueError unless each node's parent is listed
        before it, the nodes are breadth first (by depth, then path) and there are 1..63 of them."""
        name = "speculative_config.speculative_token_tree"
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError) as exc:
            raise ValueError(f"{name}: must be a list of tuples of child indices, got {text!r}") from exc
        if not isinstance(value, (list, tuple)) or not value:
            raise ValueError(f"{name}: must be a non-empty list of tuples, got {text!r}")
        paths = []
        for path in value:
            ok = isinstance(path, tuple) and path and all(type(c) is int and c >= 0 for c in path)
            if not ok:
                raise ValueError(f"{name}: each node is a non-empty tuple of child indices >= 0, got {path!r}")
            paths.append(path)
        if len(set(paths)) != len(paths):
            raise ValueError(f"{name}: a node is listed twice")
        if len(paths) >= MASK_BITS:
            raise ValueError(f"{name}: at most {MASK_BITS - 1} nodes (the tree mask's bits), got {len(paths)}")
        if paths != sorted(paths, key=lambda p: (len(p), p)):
            raise ValueError(f"{name}: nodes must be breadth first (by depth, then path), got {text!r}")
        seen: set[tuple[int, ...]] = set()
        for path in paths:
            if len(path) > 1 and path[:-1] not in seen:
                raise ValueError(f"{name}: node {path} has no parent {path[:-1]} before it")
            seen.add(path)
        return cls(tuple(paths))

    @classmethod
    def chain(cls, k: int) -> SpecTree:
        """A chain of k drafts (vLLM's default tree)."""
        return cls(tuple((0,) * (d + 1) for d in range(k)))

    def __len__(self) -> int:
        return len(self.paths)

    @cached_property
    def parents(self) -> tuple[int, ...]:
        """Each tree index's parent's tree index (the root's is -1)."""
        index = {path: i + 1 for i, path in enumerate(self.paths)}
        return (-1, *(index.get(path[:-1], 0) for path in self.paths))

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """Each tree index's depth (the root's is 0)."""
        return (0, *(len(path) for path in self.paths))

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """Each tree index's children's tree indices, in child-index order."""
        kids: list[list[int]] = [[] for _ in range(len(self.paths) + 1)]
        for i in range(1, len(self.paths) + 1):
            kids[self.parents[i]].append(i)
        return tuple(tuple(k) for k in kids)

    @cached_property
    def levels(self) -> tuple[tuple[int, int], ...]:
        """The tree indices [start, end) of each depth 1, 2, ...: breadth first, each depth is one range."""
        out, start = [], 1
        for d in range(1, max(self.depths) + 1):
            end = start + self.depths.count(d)
            out.append((start, end))
            start = end
        return tuple(out)

    @property
    def depth(self) -> int:
        return len(self.levels)

    @property
    def is_chain(self) -> bool:
        return all(path == (0,) * len(path) for path in self.paths)

    def branch(self, i: int) -> int:
        """Tree index i's child index under its parent (0: the best choice)."""
        return self.paths[i - 1][-1]

    def path_to(self, i: int) -> list[int]:
        """The tree indices from depth 1 down to i."""
        out = []
        while i > 0:
            out.append(i)
            i = self.parents[i]
        return out[::-1]

    @cached_property
    def masks(self) -> tuple[int, ...]:
        """Each tree index's mask row (see the module docstring), as a signed int64: bits for its ancestors and
        itself, and every bit beyond its own index (the context before the root)."""
        out = []
        for i in range(len(self.paths) + 1):
            bits = (~0 << (i + 1)) & ((1 << MASK_BITS) - 1)
            j = i
            while j >= 0:
                bits |= 1 << (i - j)
                j = self.parents[j]
            out.append(bits - (1 << MASK_BITS) if bits >> (MASK_BITS - 1) else bits)
        return tuple(out)


def move_kv(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy the K/V at flat slots `src` to `dst` in every layer (all reads before any write: a source may be
    another's destination): an accepted path's nodes to the slots after their root's."""
    for cache in (c for layer in kv_caches for c in layer):
        flat = cache.view(-1, *cache.shape[2:])
        flat[dst] = flat[src]


@dataclass(frozen=True)
class TreeVerdict:
    """A verified tree: the tokens emitted (the accepted path's drafts, then the recovered or bonus token), the
    accepted nodes' tree indices, and the p each node was judged with (its parent's target probability of it, or
    what the rejected earlier siblings left of it)."""

    tokens: list[int]
    path: list[int]
    p_judged: list[float]


def walk_tree(
    tree: SpecTree,
    drafts: list[int],
    target_probs: torch.Tensor,
    target_argmax: list[int],
    draft_probs: torch.Tensor | None,
    uniform: list[float],
    greedy: bool,
    generator: torch.Generator,
) -> TreeVerdict:
    """Keep the longest accepted path of a request's first n = len(drafts) nodes. `target_probs` [n + 1, V] and
    `target_argmax` are the target's at the root and at each node; `draft_probs` [n, V] the distribution each node
    was drawn from (its parent's draft distribution; None: the drafts are certain, q = 1); `uniform` one draw per
    node.

    Greedy: at each node, the child that is the target's argmax, if any; else the argmax is emitted. Sampled: the
    children of a node were drawn independently from its draft distribution q, and are judged in order (SpecInfer's
    multi-step speculative sampling, the rule vLLM's tree verification is meant to keep): child x is accepted when
    u * q(x) < p(x); if not, p becomes normalize(max(p - q, 0)) for the next sibling; when every child is rejected
    the token is drawn from what is left of p, and at a leaf (all accepted) from p itself. Each step keeps the
    target's distribution exactly, as the chain rule does, so the emitted tokens are the target's."""
    n = len(drafts)
    probs = target_probs.to(torch.float64)
    p_judged = [float(probs[tree.parents[i + 1], t]) for i, t in enumerate(drafts)]
    tokens: list[int] = []
    path: list[int] = []
    node = 0
    while True:
        kids = [c for c in tree.children[node] if c <= n]
        if greedy:
            hit = next((c for c in kids if drafts[c - 1] == target_argmax[node]), None)
            if hit is None:
                return TreeVerdict([*tokens, target_argmax[node]], path, p_judged)
        else:
            p, hit = probs[node], None
            for c in kids:
                x = drafts[c - 1]
                q = None if draft_probs is None else draft_probs[c - 1].to(torch.float64)
                p_judged[c - 1] = float(p[x])
                if uniform[c - 1] * (1.0 if q is None else float(q[x])) < float(p[x]):
                    hit = c
                    break
                if q is None:  # a certain draft: what is left is p without it
                    residual = p.clone()
                    residual[x] = 0
                else:
                    residual = (p - q).clamp(min=0)
                if float(residual.sum()) > 0:  # nothing left only by rounding (p == q accepts surely)
                    p = residual / residual.sum()
            if hit is None:
                token = int(torch.multinomial(p.to(torch.float32), 1, generator=generator))
                return TreeVerdict([*tokens, token], path, p_judged)
        path.append(hit)
        tokens.append(drafts[hit - 1])
        node = hit
