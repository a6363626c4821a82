"""EAGLE (EAGLE-1, as vLLM's EagleProposer and llama_eagle.py): a light network drafts with the target's features.

At position t the head reads ``fc([embed(x_{t+1}); h_t])`` - the target's embedding of the next token beside the
target's final hidden state at t - through one Llama decoder layer, and predicts the next hidden state, which the
target's own LM head reads out (over the head's draft vocabulary). Drafting chains it: the first step uses the
target's state before the newest token, each later step the head's own prediction and the draft it just made.

The head's attention keeps a paged KV cache of its own on the target's block ids. Every step, once the step's
tokens are drawn, it runs over the target's whole batch (``mirror``: position t paired with the token after it), so
its cache holds the same context, prompt chunks and prefix hits included. That same pass is the first draft step
(as in vLLM's EagleProposer): its output at the row that drew a request's newest token predicts the state after it.
Slots written past a rejection are overwritten later, as the draft model's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import nn
from transformers import LlamaConfig

import kernels
from engine.model.attention import AttentionMetadata, allocate_kv_caches
from engine.model.llama import ModelShape, RotaryEmbedding
from engine.spec_decode.draft_heads import DRAFT_IDS, DraftVocab, head_ops, head_path, load_head, narrow_matrices
from engine.spec_decode.proposer import (
    DraftRequest,
    Drafts,
    Proposer,
    TargetBatch,
    TargetModel,
    TreeStep,
    chain_drafts,
    decode_metadata,
    sample_drafts,
    tree_drafts,
    tree_level_metadata,
)
from engine.spec_decode.tree import SpecTree

# q [N, Hq, D], k and v [N, Hkv, D] of the N tokens -> attention output [N, Hq, D]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class EagleLayer(nn.Module):
    """Owns the head's one Llama decoder layer (pre-norm attention and gated MLP, q/k/v and gate/up fused). Its
    attention is given: over the paged cache when drafting, causal over whole sequences when training."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        # LlamaConfig derives both from the heads and hidden size when a config omits them: never None here
        assert config.num_key_value_heads is not None and config.head_dim is not None
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim: int = config.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.eps = config.rms_norm_eps
        hidden = config.hidden_size
        self.input_layernorm = nn.Parameter(torch.ones(hidden))
        self.qkv_proj = nn.Parameter(torch.empty(self.q_size + 2 * self.kv_size, hidden))
        self.o_proj = nn.Parameter(torch.empty(hidden, self.q_size))
        self.post_attention_layernorm = nn.Parameter(torch.ones(hidden))
        self.gate_up_proj = nn.Parameter(torch.empty(2 * config.intermediate_size, hidden))
        self.down_proj = nn.Parameter(torch.empty(hidden, config.intermediate_size))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attend: Attend) -> torch.Tensor:
        ops, n = head_ops(), x.shape[0]
        h = ops.rms_norm(x, self.input_layernorm, self.eps)
        q, k, v = ops.linear(h, self.qkv_proj).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = ops.rotary(
            q.reshape(n, self.num_heads, self.head_dim), k.reshape(n, self.num_kv_heads, self.head_dim), *rope
        )
        out = attend(q, k, v.reshape(n, self.num_kv_heads, self.head_dim))
        x = x + ops.linear(out.reshape(n, self.q_size), self.o_proj)
        h = ops.rms_norm(x, self.post_attention_layernorm, self.eps)
        return x + ops.linear(ops.silu_and_mul(ops.linear(h, self.gate_up_proj)), self.down_proj)


class EagleHead(nn.Module):
    """Owns EAGLE's own weights: ``fc`` over [token embedding; target hidden state] and one decoder layer. Its
    output is the predicted next hidden state (no final norm: it imitates the target's normed state, which the
    target's LM head reads)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Parameter(torch.empty(config.hidden_size, 2 * config.hidden_size))
        self.layers = nn.ModuleList([EagleLayer(config)])
        self.rotary_emb = RotaryEmbedding(config)
        self.shape = ModelShape.from_config(config)  # what allocate_kv_caches reads

    @staticmethod
    def llama_config(config: dict) -> LlamaConfig:
        """The decoder layer's config from a head's config.json."""
        keys = (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "rms_norm_eps",
            "rope_parameters",
            "max_position_embeddings",
            "vocab_size",
        )
        return LlamaConfig(num_hidden_layers=1, **{k: config[k] for k in keys})

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """Token embeddings and target (or predicted) hidden states [N, H] at `positions` -> predicted next
        hidden states [N, H]."""
        x = head_ops().linear(torch.cat((embeds, hidden), dim=-1), self.fc)
        return self.layers[0](x, self.rotary_emb(positions, x.dtype), attend)


def paged_attention(attn: AttentionMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor], scale: float) -> Attend:
    """Attention over the head's paged cache: write this step's K/V at the slots, attend over each context (with
    the tree mask when drafting a tree)."""
    k_cache, v_cache = kv_cache

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kernels.store_kvcache(k, v, k_cache, v_cache, attn.slot_mapping)
        if attn.tree_mask is not None:
            return kernels.tree_attention(
                q, k_cache, v_cache, attn.block_tables, attn.seq_lens, attn.query_start_loc, attn.tree_mask, scale
            )
        return kernels.paged_attention(
            q, k_cache, v_cache, attn.block_tables, attn.seq_lens, attn.query_start_loc, scale
        )

    return attend


class EagleProposer(Proposer):
    """Owns an EAGLE head, its KV cache (the target's block ids), its draft vocabulary and what its last mirror
    pass made; reads the target's embedding and LM head. EAGLE-3's proposer is this one with another head."""

    method = "eagle"
    drafts_have_probs = True

    def __init__(self, head: EagleHead, draft_ids: torch.Tensor, target: TargetModel) -> None:
        model = target.causal_lm
        self._init_drafting(head, DraftVocab(draft_ids, model.lm_head, target.vocab_size), target)

    def _init_drafting(self, head: nn.Module, vocab: DraftVocab, target: TargetModel) -> None:
        """What every EAGLE proposer keeps: the head, its draft vocabulary, its own cache on the target's block ids,
        the target's embedding, and the tree each proposal expands (None: a chain)."""
        config = target.config
        self.head = head
        # the head runs at the target's positions, which its own config may declare fewer of
        rope = cast(RotaryEmbedding, head.rotary_emb)
        rope.max_positions = max(rope.max_positions, target.causal_lm.shape.max_position_embeddings)
        self.vocab = vocab
        self.embed: Callable[[torch.Tensor], torch.Tensor] = target.causal_lm.model.embed_tokens
        self.block_size = config.block_size
        self.device = target.device
        self.default_generator = target.default_generator
        self.scale = cast(EagleLayer, cast(nn.ModuleList, head.layers)[0]).head_dim ** -0.5  # items typed Module
        self.dtype = config.torch_dtype  # of the states (the head's matrices may be narrower)
        self.kv_caches = allocate_kv_caches(
            head, target.num_blocks, config.block_size, config.kv_cache_torch_dtype, target.device
        )
        # what the last mirror made, one row per batch row: the states read out, and the states the next draft
        # step reads (EAGLE-1's are the same: its head predicts the target's final state, which both are)
        self.mirrored: tuple[torch.Tensor, torch.Tensor] | None = None
        spec = config.speculative  # None where a test builds a proposer by hand
        self.tree = None if spec is None else spec.tree

    @classmethod
    def from_config(cls, target: TargetModel) -> EagleProposer:
        config = target.config
        folder = head_path(target.speculative.model, config.model, cls.method)
        head_config, tensors = load_head(folder, cls.method, target.causal_lm.shape.hidden_size)
        head = EagleHead(EagleHead.llama_config(head_config))
        draft_ids = tensors.pop(DRAFT_IDS)
        head.load_state_dict(tensors)
        head.requires_grad_(False)
        return cls(narrow_matrices(head.to(device=target.device, dtype=config.torch_dtype)), draft_ids, target)

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(token_ids).to(self.dtype)  # the embedding may be stored narrower

    def _run_head(
        self, token_ids: torch.Tensor, states: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over tokens and the states before them -> (the states read out, the states the next step
        reads): EAGLE-3's head returns both (normed, pre-norm), EAGLE-1's one state that serves as both."""
        out = self.head(self._embed(token_ids), states, positions, paged_attention(attn, self.kv_caches[0], self.scale))
        return out if isinstance(out, tuple) else (out, out)

    def _target_states(self, batch: TargetBatch) -> torch.Tensor:
        """The head's input states where the target ran: its final hidden states."""
        return batch.hidden_states.to(self.dtype)

    def mirror(self, batch: TargetBatch) -> None:
        """Pair each position of the target's batch with the token after it, into the head's cache; keep what the
        head made: at the rows that drew the newest tokens, the first drafts' states."""
        self.mirrored = self._run_head(
            batch.next_token_ids.clamp(min=0), self._target_states(batch), batch.positions, batch.attn
        )

    def propose(self, inputs: list[DraftRequest]) -> Drafts:
        """Chain the head `num_drafts` times per request (or expand the tree): the first draft read from `mirror`'s
        pass (the target's state before the newest token, paired with it), each next one from the state before and
        the draft just made, one position on."""
        if self.mirrored is None:
            raise RuntimeError("propose before mirror: no predicted states")
        if self.tree is not None:
            return tree_drafts(
                inputs, self.tree, self._tree_step(inputs, self.tree), self.vocab, self.default_generator
            )
        batch_rows = [inp.batch_row for inp in inputs]
        readout, states = self.mirrored[0][batch_rows], self.mirrored[1][batch_rows]

        def draft(live: list[int], tokens: list[int], step: int) -> tuple[list[int], torch.Tensor]:
            live_inputs = [inputs[i] for i in live]
            rows = torch.tensor(live, device=self.device)
            if step:
                positions = [len(inp.token_ids) - 2 + step for inp in live_inputs]
                readout[rows], states[rows] = self._run_head(
                    torch.tensor(tokens, device=self.device),
                    states[rows],
                    torch.tensor(positions, device=self.device),
                    decode_metadata(live_inputs, positions, self.block_size, self.device),
                )
            drafted, dist = sample_drafts(self.vocab.logits(readout[rows]), live_inputs, self.default_generator)
            return self.vocab.to_target(drafted), self.vocab.to_target_probs(dist)

        return chain_drafts(inputs, draft)

    def _tree_step(self, inputs: list[DraftRequest], tree: SpecTree) -> TreeStep:
        """A tree's depth d: the roots' states are the mirror's; a node at depth d >= 1 pairs its token with its
        parent's state, through the head at its parent's position plus one, seeing its ancestors' entries."""
        states: dict[tuple[int, int], torch.Tensor] = {}
        mirrored = self.mirrored
        assert mirrored is not None, "propose checked it"

        def step(depth: int, nodes: list[tuple[int, int]], tokens: list[list[int]]) -> torch.Tensor:
            if depth == 0:
                rows = [inputs[i].batch_row for i, _ in nodes]
                readout, carried = mirrored[0][rows], mirrored[1][rows]
            else:
                readout, carried = self._run_head(
                    torch.tensor([tokens[i][c - 1] for i, c in nodes], device=self.device),
                    torch.stack([states[(i, tree.parents[c])] for i, c in nodes]),
                    torch.tensor([len(inputs[i].token_ids) - 2 + depth for i, _ in nodes], device=self.device),
                    tree_level_metadata(inputs, nodes, tree, self.block_size, self.device),
                )
            states.update(zip(nodes, carried))
            return self.vocab.logits(readout)

        return step
