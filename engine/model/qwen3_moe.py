"""Qwen3-MoE: Qwen3's attention with a sparse mixture-of-experts MLP (a router picks each token's top-k experts)
in place of the dense one, as vLLM's ``qwen3_moe.py``. The experts are Llama MLPs; the router's last decisions
stay on each block for the runner to report as events."""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import PretrainedConfig

from engine.model.linear import Linear
from engine.model.llama import LlamaDecoderLayer, LlamaMLP
from engine.model.qwen3 import Qwen3Attention, Qwen3ForCausalLM, Qwen3Model


class SparseMoeBlock(nn.Module):
    """Owns one layer's router (``gate``) and its experts' MLPs, and the routing of the last forward
    (``last_expert_ids`` ``[T, top_k]``)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = Linear(config.hidden_size, self.num_experts, bias=False)
        # Each expert is a gated MLP of moe_intermediate_size: Llama's MLP on a config that says so.
        expert_config = copy.copy(config)
        expert_config.intermediate_size = config.moe_intermediate_size
        self.experts = nn.ModuleList(LlamaMLP(expert_config) for _ in range(self.num_experts))
        self.last_expert_ids: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # HF's order: softmax over all experts in float32, top-k, optionally renormalise the k weights.
        probs = self.gate(x).float().softmax(dim=-1)
        weights, expert_ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        self.last_expert_ids = expert_ids
        out = torch.zeros_like(x)
        # One batched MLP call per expert over the tokens that chose it (no work for idle experts).
        for expert in expert_ids.unique().tolist():
            tokens, slot = (expert_ids == expert).nonzero(as_tuple=True)
            out.index_add_(0, tokens, self.experts[expert](x[tokens]) * weights[tokens, slot, None])
        return out


def is_sparse_layer(config: PretrainedConfig, index: int) -> bool:
    """Qwen3-MoE's rule: a layer is sparse unless listed in ``mlp_only_layers``, every ``decoder_sparse_step``."""
    step = getattr(config, "decoder_sparse_step", 1)
    return index not in (getattr(config, "mlp_only_layers", None) or []) and step > 0 and (index + 1) % step == 0


class Qwen3MoeModel(Qwen3Model):
    """Qwen3's model whose sparse layers carry a ``SparseMoeBlock`` as their MLP."""

    def make_layer(self, config: PretrainedConfig, index: int) -> LlamaDecoderLayer:
        mlp = SparseMoeBlock(config) if is_sparse_layer(config, index) else None
        return LlamaDecoderLayer(config, self_attn=Qwen3Attention(config), mlp=mlp)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """A Qwen3-MoE causal LM: experts load from HF's per-expert names (``mlp.experts.<e>.gate_proj`` ...)."""

    model_cls = Qwen3MoeModel

    def moe_blocks(self) -> list[tuple[int, SparseMoeBlock]]:
        """``(layer index, block)`` of every sparse layer, in order."""
        return [(i, layer.mlp) for i, layer in enumerate(self.model.layers) if isinstance(layer.mlp, SparseMoeBlock)]
