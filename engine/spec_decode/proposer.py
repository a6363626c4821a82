"""The interface every proposer implements, and what it is given: a new method is a subclass of Proposer plus one
entry in `PROPOSERS` (engine/spec_decode/__init__.py), under its speculative_config.method. Also what the proposers
that run a network share: decode-step attention metadata over the target's block ids, and drawing drafts."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

from engine.config import EngineConfig, SpeculativeConfig
from engine.model.attention import AttentionMetadata
from engine.sample.sampler import exponential_noise, greedy_sample

if TYPE_CHECKING:
    from engine.model.llama import LlamaForCausalLM
    from engine.spec_decode.draft_heads import DraftVocab
    from engine.spec_decode.tree import SpecTree

# drafts by request id, with their draft distributions [len(drafts), V], or None where the method has none
# (the rejection sampler then takes the drafts as certain)
Drafts = dict[str, tuple[list[int], torch.Tensor | None]]


@dataclass(frozen=True)
class TargetModel:
    """What a proposer may know of the target model it drafts for: the engine config, and the model runner's
    KV cache size (a draft model's cache shares its block ids), vocabulary, device and default generator; and the
    model itself, whose embedding and LM head EAGLE and Medusa read through."""

    config: EngineConfig
    num_blocks: int
    vocab_size: int
    device: torch.device
    default_generator: torch.Generator
    model: LlamaForCausalLM | None = None

    @property
    def speculative(self) -> SpeculativeConfig:
        """The speculative config: a proposer is built only for an engine that has one."""
        if self.config.speculative is None:
            raise ValueError("speculative_config: a proposer needs one")
        return self.config.speculative

    @property
    def causal_lm(self) -> LlamaForCausalLM:
        """The target model, whose embedding and LM head EAGLE and Medusa read (a simulated target has none)."""
        if self.model is None:
            raise ValueError(f"speculative_config.method: {self.speculative.method} needs the target's weights")
        return self.model


@dataclass(frozen=True)
class TargetBatch:
    """This step's flattened batch as the target ran it: its inputs and attention metadata, its final hidden state
    at every position (what the LM head reads), and the token that follows each position: the next one in the
    same request; at the end of a prompt chunk, the next prompt token; at the rows that drew this step's tokens,
    the tokens drawn (after a verification: the accepted drafts and the recovered or bonus token; the rows of
    rejected drafts keep those drafts, which later steps overwrite)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    hidden_states: torch.Tensor
    next_token_ids: torch.Tensor
    aux_hidden_states: torch.Tensor | None = None  # the residual streams EAGLE-3 reads, where it asked for them


@dataclass(frozen=True)
class DraftRequest:
    """One request that just sampled: its tokens (the new ones included), its block ids, how many drafts it may
    take (capped by max_tokens and max_model_len), and how to sample them; and the target's final hidden state at
    the position before its newest token (the state that sampled that token) with that position's row in the
    step's TargetBatch, for proposers that read them."""

    request_id: str
    token_ids: list[int]
    block_ids: list[int]
    num_drafts: int
    temperature: float
    generator: torch.Generator | None
    hidden_state: torch.Tensor | None = None
    batch_row: int | None = None

    @property
    def target_state(self) -> torch.Tensor:
        """The target's hidden state before the newest token, which EAGLE and Medusa draft from."""
        if self.hidden_state is None:
            raise ValueError(f"request {self.request_id}: drafted without the target's hidden state")
        return self.hidden_state


class Proposer(ABC):
    """A way to draft tokens for the target to verify. Each owns what it drafts with (nothing but the requests'
    tokens for n-gram; a model and its KV cache for a draft model)."""

    method: ClassVar[str]  # its speculative_config.method
    # True where drafts come with their draft distributions (the rejection sampler then uses them)
    drafts_have_probs: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def from_config(cls, target: TargetModel) -> Proposer:
        """Build it from `target.config.speculative` (num_speculative_tokens and the method's own keys)."""

    @abstractmethod
    def propose(self, requests: list[DraftRequest]) -> Drafts:
        """Drafts for the requests that just sampled (never an empty list); a request without drafts is left out."""

    def mirror(self, batch: TargetBatch) -> None:
        """See the target's batch of this step, after the target ran it and its tokens were drawn (just before
        `propose`): a proposer with its own KV cache runs it too, so that cache holds the same tokens. Nothing to
        do for the others."""


def decode_metadata(
    inputs: list[DraftRequest], positions: list[int], block_size: int, device: torch.device
) -> AttentionMetadata:
    """Attention metadata for one new token per request at `positions`, over each request's own block ids (the
    target's: a proposer's cache shares them, and the scheduler allocated the lookahead slots drafts write)."""
    max_blocks = max(len(inp.block_ids) for inp in inputs)
    tables = np.zeros((len(inputs), max_blocks), dtype=np.int32)
    for i, inp in enumerate(inputs):
        tables[i, : len(inp.block_ids)] = inp.block_ids
    slots = [int(tables[i, p // block_size]) * block_size + p % block_size for i, p in enumerate(positions)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        block_tables=torch.from_numpy(tables).to(device),
        seq_lens=torch.tensor([p + 1 for p in positions], dtype=torch.int32, device=device),
        query_start_loc=torch.arange(len(inputs) + 1, dtype=torch.int32, device=device),
    )


def draft_distributions(logits: torch.Tensor, inputs: list[DraftRequest]) -> torch.Tensor:
    """softmax(logits / temperature) per row of `logits` [N, V'] (row i for inputs[i]); a greedy row at 1."""
    temps = [1.0 if inp.temperature < 1e-5 else inp.temperature for inp in inputs]
    return torch.softmax(logits / torch.tensor(temps, device=logits.device)[:, None], dim=-1)


def sample_drafts(
    logits: torch.Tensor, inputs: list[DraftRequest], default_generator: torch.Generator
) -> tuple[list[int], torch.Tensor]:
    """One draft per row of `logits` [N, V'] (row i for inputs[i]): the argmax for a greedy request, else a draw
    from softmax(logits / temperature) with the request's generator; and those distributions [N, V'], which the
    rejection sampler needs to keep the target's distribution. A greedy row's distribution is at temperature 1, as
    the target's that verifies it: only the argmaxes decide there, and spec.verified shows the draft's confidence."""
    flags = [inp.temperature < 1e-5 for inp in inputs]
    if all(flags):  # no draws: the argmaxes, and the drafts' confidence
        return greedy_sample(logits).tolist(), torch.softmax(logits, dim=-1)
    greedy = torch.tensor(flags, device=logits.device)
    dist = draft_distributions(logits, inputs)
    generators = {i: inp.generator for i, inp in enumerate(inputs) if inp.generator is not None}
    sampled = (dist / exponential_noise(dist, generators, default_generator)).argmax(dim=-1)
    return torch.where(greedy, logits.argmax(dim=-1), sampled).tolist(), dist


def chain_drafts(
    inputs: list[DraftRequest], draft: Callable[[list[int], list[int], int], tuple[list[int], torch.Tensor]]
) -> Drafts:
    """Autoregressive drafting: round j calls `draft(live, tokens, j)` for the requests that may take more than j
    drafts (their indices into `inputs`, and each one's newest token: its last sampled one, then its last draft),
    which returns one draft per live request and the distributions [len(live), V] they were drawn from."""
    drafted: list[list[int]] = [[] for _ in inputs]
    probs: list[list[torch.Tensor]] = [[] for _ in inputs]
    live = list(range(len(inputs)))
    for step in range(max(inp.num_drafts for inp in inputs)):
        live = [i for i in live if inputs[i].num_drafts > step]
        newest = [drafted[i][-1] if drafted[i] else inputs[i].token_ids[-1] for i in live]
        tokens, dist = draft(live, newest, step)
        for row, i in enumerate(live):
            drafted[i].append(tokens[row])
            probs[i].append(dist[row])
    return {inp.request_id: (t, torch.stack(p)) for inp, t, p in zip(inputs, drafted, probs)}


# step(depth, nodes, tokens) -> logits [len(nodes), V'] over the draft vocabulary: for each node (index into the
# inputs, tree index) at `depth` (0: the roots), every one of each request's first num_drafts nodes there, in order,
# the distribution its children are drawn from; `tokens`: each input's drafts so far (target ids, by tree index - 1)
TreeStep = Callable[[int, list[tuple[int, int]], list[list[int]]], torch.Tensor]


def tree_drafts(
    inputs: list[DraftRequest],
    tree: SpecTree,
    step: TreeStep,
    vocab: DraftVocab,
    default_generator: torch.Generator,
) -> Drafts:
    """Expand a draft tree level by level, one `step` per depth for all requests: each node's children are its
    distribution's most likely tokens for a greedy request (top-c, c its children in the tree), independent draws
    from it for a sampled one (what the sibling-by-sibling rejection rule needs). A request's nodes are the tree's
    first num_drafts, breadth first (still a tree); each comes with the distribution it was drawn from."""
    tokens = [[-1] * inp.num_drafts for inp in inputs]
    probs: list[list[torch.Tensor]] = [[] for _ in inputs]
    for depth in range(tree.depth):
        start, end = (0, 1) if depth == 0 else tree.levels[depth - 1]
        nodes = [(i, c) for i, inp in enumerate(inputs) for c in range(start, min(end, inp.num_drafts + 1))]
        kids = [[k for k in tree.children[c] if k <= inputs[i].num_drafts] for i, c in nodes]
        if not any(kids):
            break
        dist = draft_distributions(step(depth, nodes, tokens), [inputs[i] for i, _ in nodes])
        target_dist = vocab.to_target_probs(dist)
        for row, ((i, _), children) in enumerate(zip(nodes, kids)):
            if not children:
                continue
            inp = inputs[i]
            if inp.temperature < 1e-5:
                picks = dist[row].topk(len(children)).indices.tolist()
            else:
                generator = inp.generator or default_generator
                picks = torch.multinomial(dist[row], len(children), replacement=True, generator=generator).tolist()
            for child, token in zip(children, vocab.to_target(picks)):
                tokens[i][child - 1] = token
            probs[i] += [target_dist[row]] * len(children)  # children come breadth first: in this order
    return {inp.request_id: (t, torch.stack(p)) for inp, t, p in zip(inputs, tokens, probs)}


def tree_level_metadata(
    inputs: list[DraftRequest], nodes: list[tuple[int, int]], tree: SpecTree, block_size: int, device: torch.device
) -> AttentionMetadata:
    """Attention metadata for a drafting network's pass over one depth of the tree (`nodes` as a TreeStep gets
    them), over a cache of its own on the target's block ids: node c of a request whose newest token is at
    position P writes its K/V at the slot of P - 1 + c (the root's state is the mirror's row, P - 1; a depth's
    nodes come last, so each is its sequence's newest) and sees the context, its ancestors and itself."""
    by_input: dict[int, list[int]] = {}
    for i, c in nodes:
        by_input.setdefault(i, []).append(c)
    requests = [inputs[i] for i in by_input]
    max_blocks = max(len(inp.block_ids) for inp in requests)
    tables = np.zeros((len(requests), max_blocks), dtype=np.int32)
    slots, seq_lens, cu = [], [], [0]
    for row, (i, cs) in enumerate(by_input.items()):
        tables[row, : len(inputs[i].block_ids)] = inputs[i].block_ids
        base = len(inputs[i].token_ids) - 2
        slots += [int(tables[row, (base + c) // block_size]) * block_size + (base + c) % block_size for c in cs]
        seq_lens.append(base + cs[-1] + 1)
        cu.append(cu[-1] + len(cs))
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        block_tables=torch.from_numpy(tables).to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(cu, dtype=torch.int32, device=device),
        tree_mask=torch.tensor([tree.masks[c] for _, c in nodes], dtype=torch.int64, device=device),
    )
