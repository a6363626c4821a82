"""Medusa (Medusa-1, as vLLM's MedusaProposer and medusa.py): k heads on the target's last hidden state.

Head i is a residual block, ``h + SiLU(W_i h + b_i)``, read out by the target's own LM head (over the head's draft
vocabulary); from the target's state at the position before the newest token x_L (the state that sampled it), head i
predicts x_{L+1+i}. All heads read the same state, at once: no chain, no KV cache, a draft costs one small matrix
and a slice of the LM head. The price is that head 0 does not see x_L itself, so drafts agree less than EAGLE's.
Drafts are drawn from each head's distribution independently, which is a valid proposal for exact rejection
sampling (each draft's distribution is known and does not depend on the target's randomness).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.spec_decode.draft_heads import DRAFT_IDS, DraftVocab, head_ops, head_path, load_head, narrow_matrices
from engine.spec_decode.proposer import DraftRequest, Drafts, Proposer, TargetModel, sample_drafts, tree_drafts


class ResidualBlock(nn.Module):
    """Owns one head's block: ``x + SiLU(layer(x))`` per layer (vLLM's ResidualBlock)."""

    def __init__(self, hidden_size: int, num_layers: int = 1) -> None:
        super().__init__()
        layers = [nn.Linear(hidden_size, hidden_size, bias=True) for _ in range(num_layers)]
        for layer in layers:
            nn.init.zeros_(layer.weight)  # Medusa's init: each head starts as the identity (the LM head's guess)
            nn.init.zeros_(layer.bias)
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = head_ops()
        for layer in self.layers:
            x = x + F.silu(ops.linear(x, layer.weight, None, layer.bias))
        return x


class MedusaHeads(nn.Module):
    """Owns the k residual blocks (``blocks.i``); the readout is the target's LM head."""

    def __init__(self, hidden_size: int, num_heads: int, num_layers: int = 1) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ResidualBlock(hidden_size, num_layers) for _ in range(num_heads))

    def forward(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """[N, H] -> [num_heads, N, H]: each of the first `num_heads` heads' state."""
        return torch.stack([block(hidden) for block in self.blocks[:num_heads]])


class MedusaProposer(Proposer):
    """Owns Medusa's heads and their draft vocabulary; reads the target's LM head."""

    method = "medusa"
    drafts_have_probs = True

    def __init__(self, heads: MedusaHeads, draft_ids: torch.Tensor, target: TargetModel) -> None:
        self.tree = target.speculative.tree  # None, or the draft tree: head d drafts the nodes at depth d + 1
        # a tree's drafts of one depth come from one head: it needs as many heads as it is deep
        k = target.speculative.num_speculative_tokens if self.tree is None else self.tree.depth
        if k > len(heads.blocks):
            raise ValueError(
                f"speculative_config.num_speculative_tokens: {k} drafts need {k} Medusa heads, the head "
                f"folder has {len(heads.blocks)}"
            )
        self.heads = heads
        self.vocab = DraftVocab(draft_ids, target.causal_lm.lm_head, target.vocab_size)
        self.default_generator = target.default_generator

    @classmethod
    def from_config(cls, target: TargetModel) -> MedusaProposer:
        config = target.config
        folder = head_path(target.speculative.model, config.model, cls.method)
        head_config, tensors = load_head(folder, cls.method, target.causal_lm.shape.hidden_size)
        heads = MedusaHeads(head_config["hidden_size"], head_config["num_heads"], head_config["num_hidden_layers"])
        draft_ids = tensors.pop(DRAFT_IDS)
        heads.load_state_dict(tensors)
        heads.requires_grad_(False)
        return cls(narrow_matrices(heads.to(device=target.device, dtype=config.torch_dtype)), draft_ids, target)

    def propose(self, inputs: list[DraftRequest]) -> Drafts:
        """Every head at once over the requests' states, one LM-head readout for all; head i's draft for each
        request that may take more than i drafts."""
        tree = self.tree
        k = max(inp.num_drafts for inp in inputs) if tree is None else tree.depth
        hidden = torch.stack([inp.target_state for inp in inputs])
        logits = self.vocab.logits(self.heads(hidden, k).flatten(0, 1)).view(k, len(inputs), -1)
        if tree is not None:  # every node at depth d draws its children from head d: each head's top-k
            return tree_drafts(
                inputs, tree, lambda d, nodes, _: logits[d, [i for i, _ in nodes]], self.vocab, self.default_generator
            )
        drafts: Drafts = {}
        per_head = [sample_drafts(logits[i], inputs, self.default_generator) for i in range(k)]
        for row, inp in enumerate(inputs):
            n = inp.num_drafts
            tokens = self.vocab.to_target([per_head[i][0][row] for i in range(n)])
            drafts[inp.request_id] = (
                tokens,
                self.vocab.to_target_probs(torch.stack([per_head[i][1][row] for i in range(n)])),
            )
        return drafts
