"""Qwen3: the Llama-family decoder with an RMSNorm over each query and key head before RoPE (vLLM's
``qwen3.py``). Everything else is Llama's: this file only supplies the q/k norm and where its weights load."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from engine.model.linear import Linear
from engine.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, RMSNorm


class QKNormLinear(Linear):
    """Owns the fused q/k/v projection and Qwen3's per-head q and k RMSNorm scales. The norms are applied to the
    projection's output, so Llama's attention forward runs unchanged around it."""

    def __init__(
        self, in_features: int, num_heads: int, num_kv_heads: int, head_dim: int, eps: float, bias: bool = False
    ) -> None:
        super().__init__(in_features, (num_heads + 2 * num_kv_heads) * head_dim, bias=bias)
        self.head_dim = head_dim
        self.sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = super().forward(x).split(self.sizes, dim=-1)
        num_tokens = x.shape[0]
        # One norm over every (token, head) row of head_dim values, as HF's q_norm(q.view(..., head_dim)).
        q = self.q_norm(q.reshape(-1, self.head_dim)).view(num_tokens, -1)
        k = self.k_norm(k.reshape(-1, self.head_dim)).view(num_tokens, -1)
        return torch.cat((q, k, v), dim=-1)


class Qwen3Attention(LlamaAttention):
    """Llama's attention with the q/k-normed projection in place of the plain one."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        # Replaces the plain projection LlamaAttention made (free: models are built on the meta device).
        self.qkv_proj = QKNormLinear(
            config.hidden_size,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            config.rms_norm_eps,
            bias=getattr(config, "attention_bias", False),
        )


class Qwen3Model(LlamaModel):
    """Llama's model whose layers use Qwen3's attention."""

    def make_layer(self, config: PretrainedConfig, index: int) -> LlamaDecoderLayer:
        return LlamaDecoderLayer(config, self_attn=Qwen3Attention(config))


class Qwen3ForCausalLM(LlamaForCausalLM):
    """A Qwen3 causal LM: Llama's weights and forward plus the q/k norms, loaded from HF's names."""

    model_cls = Qwen3Model

    def _param_name(self, hf_name: str) -> tuple[str, int | None]:
        # HF keeps q_norm/k_norm on self_attn; ours sit on the projection whose output they normalise.
        for norm in (".q_norm.", ".k_norm."):
            if f".self_attn{norm}" in hf_name:
                return hf_name.replace(f".self_attn{norm}", f".self_attn.qkv_proj{norm}"), None
        return super()._param_name(hf_name)
