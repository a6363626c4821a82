"""The Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2) over a paged KV cache.

All tokens of a step, from any number of sequences, go through each layer at once;
attention reads and writes the paged cache through ``kernels``. Module and parameter
names follow Hugging Face's, with q/k/v fused into ``qkv_proj`` and gate/up into
``gate_up_proj`` as in vLLM. Sliding-window attention (Mistral; Qwen2/Qwen3 with ``use_sliding_window``) is
applied in the layers the config names (``layer_sliding_window``).

Tensor parallelism (vLLM's layers; the group from ``engine.distributed.parallel_state``, size 1 outside a multiproc
worker, where nothing below changes): q/k/v and gate/up hold this rank's heads and columns, o_proj and down_proj its
rows (``RowParallelLinear``: one all-reduce each), the embedding and LM head its share of the vocabulary. Each rank
reads only its slice of every checkpoint tensor (``LlamaForCausalLM._rank_slice``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import cast

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import kernels
from engine.distributed.parallel_state import get_tp_group, tp_head_split
from engine.model.attention import AttentionMetadata, sliding_window_attention
from engine.model.linear import Linear, RowParallelLinear
from engine.model.vocab_parallel_embedding import VocabParallelEmbedding, padded_vocab_per_rank

# "dynamic" matches HF while the context stays within max_position_embeddings;
# "longrope" switches frequencies with the context length and is not supported.
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")

KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class ModelShape:
    """The sizes the runner needs to allocate the KV cache and read the logits."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    sliding_window: int | None

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> ModelShape:
        """Read the shape from a Llama-family HF config."""
        return cls(
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=_head_dim(config),
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            max_position_embeddings=config.max_position_embeddings,
            sliding_window=getattr(config, "sliding_window", None),
        )


def _head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class RMSNorm(nn.Module):
    """RMS normalisation with a learned scale, computed in float32 as HF does. Given the residual stream, it adds
    the sublayer's output to it first and returns both (vLLM's fused_add_rms_norm): one pass instead of two."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return kernels.rms_norm(x, self.weight, self.eps)
        return kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Owns the RoPE inverse frequencies (with the config's scaling) and the table of cos and sin at every position
    below the model's max_position_embeddings that a step's positions index (vLLM's cos_sin_cache)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        rope = dict(getattr(config, "rope_parameters", None) or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_parameters.rope_type: {rope_type!r} is not supported ({', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("rope_parameters.partial_rotary_factor: only 1.0 is supported")
        # Plain CPU float32 attributes, not buffers: the model may be built on the meta
        # device and moved with to_empty(), which would wipe buffers.
        with torch.device("cpu"):
            if rope_type == "default":
                dim = _head_dim(config)
                base = rope["rope_theta"]
                inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
                scaling = 1.0
            else:
                inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        self.inv_freq = inv_freq.float()
        self.attention_scaling = float(scaling)
        # the table's rows (8 bytes a column each: smollm2's 8,192 x 64, 4 MB; a model of 131,072 positions and
        # head dim 128, 128 MB); a draft head that runs at its target's positions raises it to the target's
        self.max_positions: int = getattr(config, "max_position_embeddings", None) or 2048
        self.cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None  # float32 [max_positions, head_dim] each

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions ``[T]`` -> ``cos``, ``sin`` ``[T, head_dim]`` for every layer of the step: rows of the table,
        which the first call on a device fills. Two lookups where computing them took eight ops, each slow right
        after a step's weights have streamed through the caches (a bf16 decode step's, 0.091 -> 0.015 ms; AVX-512
        EPYC, 2026-12-04); the same values, computed by the same ops."""
        if self.cos_sin is None or self.cos_sin[0].device != positions.device:
            self.cos_sin = self._cos_sin(torch.arange(self.max_positions, device=positions.device))
        cos, sin = self.cos_sin
        return cos.index_select(0, positions).to(dtype), sin.index_select(0, positions).to(dtype)

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[:, None].float() * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


class LlamaAttention(nn.Module):
    """One layer's fused q/k/v projection, RoPE, paged KV write and attention, and o_proj."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        tp = get_tp_group()
        # this rank's heads (all of them outside tensor parallelism); kv_head_start is its first KV head
        self.num_heads, self.num_kv_heads, self.kv_head_start = tp_head_split(
            config.num_attention_heads, config.num_key_value_heads, tp.size, tp.rank
        )
        self.head_dim = _head_dim(config)
        self.scale = self.head_dim**-0.5
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        attention_bias = getattr(config, "attention_bias", False)
        # Qwen2 has biases on q/k/v only; Llama's attention_bias covers o_proj too.
        qkv_bias = attention_bias or config.model_type == "qwen2"
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        row_linear = RowParallelLinear if tp.size > 1 else Linear
        self.o_proj = row_linear(self.q_size, config.hidden_size, bias=attention_bias)
        self.sliding_window: int | None = None  # this layer's window, set by LlamaModel

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = kernels.rotary(
            q.view(num_tokens, self.num_heads, self.head_dim),
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
            *rope,
        )
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        kernels.store_kvcache(k, v, k_cache, v_cache, attn.slot_mapping)
        if attn.tree_mask is not None:  # a draft tree verified (SpecDecoder refuses trees with sliding windows)
            out = kernels.tree_attention(
                q, k_cache, v_cache, attn.block_tables, attn.seq_lens, attn.query_start_loc, attn.tree_mask, self.scale
            )
        elif self.sliding_window is None:
            out = kernels.paged_attention(
                q, k_cache, v_cache, attn.block_tables, attn.seq_lens, attn.query_start_loc, self.scale
            )
        else:
            out = sliding_window_attention(q, k_cache, v_cache, attn, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    """The gated MLP with gate and up fused into one projection."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        tp = get_tp_group()
        self.intermediate_size = config.intermediate_size // tp.size  # this rank's columns of gate and of up
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate_size, bias=bias)
        row_linear = RowParallelLinear if tp.size > 1 else Linear
        self.down_proj = row_linear(self.intermediate_size, config.hidden_size, bias=bias)
        self.act_fn = ACT2FN[config.hidden_act]
        self.silu = config.hidden_act == "silu"  # fused with the product in one kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.silu:
            return self.down_proj(kernels.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks. The residual stream travels beside the hidden state, as in vLLM, so
    each residual add happens inside the next norm."""

    def __init__(
        self, config: PretrainedConfig, self_attn: LlamaAttention | None = None, mlp: nn.Module | None = None
    ) -> None:
        super().__init__()
        # Other families (engine/model/qwen3.py, qwen3_moe.py) pass their own attention or MLP.
        self.self_attn = self_attn if self_attn is not None else LlamaAttention(config)
        self.mlp = mlp if mlp is not None else LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Llama's own attention and SiLU MLP over plain linears (no q/k norm, no tensor-parallel all-reduce):
        # kernels.llama_decoder_layers can run the layer, with its neighbours, in one call
        self.fusable = (
            type(self.self_attn) is LlamaAttention
            and type(self.mlp) is LlamaMLP
            and self.mlp.silu
            and all(
                type(linear) is Linear
                for linear in (
                    self.self_attn.qkv_proj,
                    self.self_attn.o_proj,
                    self.mlp.gate_up_proj,
                    self.mlp.down_proj,
                )
            )
        )

    def fused_params(self) -> list[torch.Tensor | None]:
        """The layer's tensors in the order kernels.llama_decoder_layers takes them."""
        attn, mlp = self.self_attn, cast(LlamaMLP, self.mlp)
        return [
            self.input_layernorm.weight,
            *attn.qkv_proj.parts(),
            *attn.o_proj.parts(),
            self.post_attention_layernorm.weight,
            *mlp.gate_up_proj.parts(),
            *mlp.down_proj.parts(),
        ]

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionMetadata,
        kv_cache: KVCache,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rope, attn, kv_cache)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


def layer_sliding_window(config: PretrainedConfig, index: int) -> int | None:
    """Layer `index`'s attention window: ``sliding_window`` where ``layer_types`` says "sliding_attention" (Qwen2,
    Qwen3), in every layer when the config has no ``layer_types`` (Mistral); None for full attention."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None or layer_types is None:
        return window
    return window if layer_types[index] == "sliding_attention" else None


class LlamaModel(nn.Module):
    """Embeddings, the decoder layers and the final norm."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.embed_tokens: VocabParallelEmbedding | nn.Embedding
        if get_tp_group().size > 1:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        else:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(config, i) for i in range(config.num_hidden_layers))
        for i in range(len(self.layers)):
            self.attention(i).sliding_window = layer_sliding_window(config, i)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        # EAGLE-3 (vLLM's aux_hidden_state_layers): the residual stream entering these layers, concatenated into
        # aux_hidden_states [T, len(layers) * H] by each forward; none unless a proposer asks, so nothing to pay
        self.aux_hidden_state_layers: tuple[int, ...] = ()
        self.aux_hidden_states: torch.Tensor | None = None
        self._runs: tuple[tuple[int, ...], list[tuple[int, int, bool]]] | None = None
        # each fused run's tensors, gathered at its first step (some 400 of them: a tenth of a millisecond a step),
        # and the rows up to which the fused op takes them; LlamaForCausalLM forgets them where it replaces weights
        self._run_params: dict[tuple[int, int], tuple[list[torch.Tensor | None], int]] = {}

    def forget_fused_params(self) -> None:
        """Drop the gathered tensors of the fused runs: the weights were replaced."""
        self._run_params.clear()

    def layer_runs(self) -> list[tuple[int, int, bool]]:
        """The layers as runs (start, end, fusable): a fusable run is of Llama's plain layers with full attention,
        which kernels.llama_decoder_layers takes in one call; it ends before any other layer and where EAGLE-3 reads
        the residual stream (a run starts at each of aux_hidden_state_layers)."""
        if self._runs is None or self._runs[0] != self.aux_hidden_state_layers:
            runs: list[tuple[int, int, bool]] = []
            for index in range(len(self.layers)):
                layer = cast(LlamaDecoderLayer, self.layers[index])
                fusable = layer.fusable and layer.self_attn.sliding_window is None
                if runs and fusable and runs[-1][2] and index not in self.aux_hidden_state_layers:
                    runs[-1] = (runs[-1][0], index + 1, True)
                else:
                    runs.append((index, index + 1, fusable))
            self._runs = (self.aux_hidden_state_layers, runs)
        return self._runs[1]

    def attention(self, index: int) -> LlamaAttention:
        """Layer `index`'s attention (its head counts and sizes are this rank's)."""
        return cast(LlamaDecoderLayer, self.layers[index]).self_attn  # ModuleList items are typed as Module

    def _fused_run(
        self,
        start: int,
        end: int,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        first = cast(LlamaDecoderLayer, self.layers[start])
        kept = self._run_params.get((start, end))
        if kept is None:
            params = [p for i in range(start, end) for p in cast(LlamaDecoderLayer, self.layers[i]).fused_params()]
            kept = self._run_params[(start, end)] = (params, kernels.fused_row_limit(params))
        params, row_limit = kept
        attention = first.self_attn
        return kernels.llama_decoder_layers(
            hidden,
            residual,
            params,
            [cache for pair in kv_caches[start:end] for cache in pair],
            rope,
            attn.slot_mapping,
            attn.block_tables,
            attn.seq_lens,
            attn.query_start_loc,
            attn.tree_mask,
            attention.num_heads,
            attention.num_kv_heads,
            attention.scale,
            first.input_layernorm.eps,
            row_limit,
        )

    def make_layer(self, config: PretrainedConfig, index: int) -> LlamaDecoderLayer:
        """Decoder layer `index`; a family overrides this to swap in its attention or MLP."""
        return LlamaDecoderLayer(config)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids).to(self.norm.weight.dtype)  # the embedding may be stored narrower
        rope = self.rotary_emb(positions, hidden.dtype)
        residual = None
        aux: dict[int, torch.Tensor] = {}
        fuse = True
        for start, end, fusable in self.layer_runs():
            if start in self.aux_hidden_state_layers:
                aux[start] = hidden if residual is None else hidden + residual
            if fuse and fusable:
                fused = self._fused_run(start, end, hidden, residual, rope, attn, kv_caches)
                if fused is not None:
                    hidden, residual = fused
                    continue
                fuse = False  # refused for this step's inputs (too many rows, ...): so would the other runs be
            for index in range(start, end):
                hidden, residual = self.layers[index](hidden, rope, attn, kv_caches[index], residual)
        if aux:  # in the order asked (a small model's default may name a layer twice)
            self.aux_hidden_states = torch.cat([aux[i] for i in self.aux_hidden_state_layers], dim=-1)
        return self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM over a paged KV cache: owns the weights and the forward pass."""

    # HF checkpoint names -> (our fused parameter, shard index) as in vLLM.
    stacked_params_mapping = (
        (".qkv_proj", ".q_proj", 0),
        (".qkv_proj", ".k_proj", 1),
        (".qkv_proj", ".v_proj", 2),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    )
    model_cls: type[LlamaModel] = LlamaModel  # a family's subclass names its own (engine/model/registry.py)

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.tp = get_tp_group()
        self.model = self.model_cls(config)
        attn = self.model.attention(0)
        # this rank's shape: its heads and KV heads (the cache it allocates); the whole model's outside TP
        self.shape = replace(ModelShape.from_config(config), num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads)
        self.lm_head = Linear(config.hidden_size, padded_vocab_per_rank(config.vocab_size, self.tp.size), bias=False)
        if config.tie_word_embeddings:
            self.tie_weights()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:
        """``input_ids``/``positions`` ``[T]`` of all scheduled tokens -> final-normed hidden ``[T, H]``."""
        return self.model(input_ids, positions, attn, kv_caches)

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        """Keep the residual stream entering `layers` at every forward, in ``model.aux_hidden_states`` (EAGLE-3)."""
        self.model.aux_hidden_state_layers = layers

    def get_eagle3_aux_hidden_state_layers(self) -> tuple[int, ...]:
        """vLLM's default EAGLE-3 layers (llama.py): an early, the middle and a late one."""
        num_layers = len(self.model.layers)
        return (2, num_layers // 2, num_layers - 3)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[N, hidden]`` (only rows that sample) -> float32 logits ``[N, vocab]``."""
        if self.tp.size == 1:
            return self.lm_head(hidden).float()
        # every rank gets the whole row (an all-gather, where vLLM gathers to rank 0 on CUDA), so that every rank
        # runs the runner's sampling code unchanged; padding rows past the vocabulary are cut off
        return self.tp.all_gather(self.lm_head(hidden).float())[:, : self.config.vocab_size]

    def tie_weights(self) -> None:
        """Share the input embedding as the LM head."""
        self.lm_head.weight = cast(nn.Parameter, self.model.embed_tokens.weight)  # nn.Embedding types it Tensor

    def store_weights(self, dtype: torch.dtype, quantization: str | None = None) -> None:
        """Keep the linear weights (and the embedding) as `dtype`, or the linear weights as int8; norms and
        activations stay in the compute dtype. A tied LM head shares the stored embedding, unless quantized."""
        embed = self.model.embed_tokens
        embed.weight = nn.Parameter(embed.weight.data.to(dtype), requires_grad=False)
        for module in self.modules():
            if isinstance(module, Linear) and (
                module is not self.lm_head or not self.config.tie_word_embeddings or quantization is not None
            ):
                module.store(dtype, quantization)
        if self.config.tie_word_embeddings and quantization is None:
            self.tie_weights()
            if self.lm_head.weight_packed is not None:
                self.lm_head.pack()  # panels of the embedding as it was stored before
        self.model.forget_fused_params()

    def pack_weights(self) -> None:
        """Keep every linear's weight also as the CPU GEMM's panels (Linear.pack), which a linear of a few rows or
        more (a batch of decodes, a draft's verification, a prefill) reads instead of packing the weight at each
        call: a second copy of the weights in memory for a quicker step."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        self.model.forget_fused_params()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the (possibly fused) parameters; raise if any is missing.

        A checkpoint without ``lm_head.weight`` ties the head to the embedding.
        """
        params = dict(self.named_parameters())
        missing = {name: p.numel() for name, p in params.items()}
        for hf_name, tensor in weights:
            if "rotary_emb.inv_freq" in hf_name:
                continue
            name, shard = self._param_name(hf_name)
            if name not in params:
                if name == "lm_head.weight":  # tied models may still ship a copy
                    continue
                raise ValueError(f"model: unexpected weight {hf_name!r} in checkpoint")
            target = params[name].data
            if shard is not None:
                target = self._shard(name, target, shard)
            if self.tp.size > 1:
                tensor = self._rank_slice(name, shard, tensor, target)
            if target.shape != tensor.shape:
                raise ValueError(
                    f"model: weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
                )
            target.copy_(tensor)
            missing[name] -= tensor.numel()
        if "lm_head.weight" in missing and missing["lm_head.weight"] == params["lm_head.weight"].numel():
            self.tie_weights()
            del missing["lm_head.weight"]
        for module in self.modules():
            if isinstance(module, Linear) and module.weight_packed is not None:
                module.pack()  # panels of the weights just replaced
        self.model.forget_fused_params()
        incomplete = sorted(name for name, n in missing.items() if n)
        if incomplete:
            raise ValueError(f"model: weights missing from checkpoint: {incomplete[:8]}")

    def _param_name(self, hf_name: str) -> tuple[str, int | None]:
        for fused, single, shard in self.stacked_params_mapping:
            if single in hf_name:
                return hf_name.replace(single, fused), shard
        return hf_name, None

    def _shard(self, name: str, param: torch.Tensor, shard: int) -> torch.Tensor:
        if ".qkv_proj" in name:
            attn = self.model.attention(0)
            sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        else:
            sizes = [param.shape[0] // 2] * 2  # gate and up halves (an MoE expert's are moe_intermediate_size)
        return param.split(sizes, dim=0)[shard]

    def _rank_slice(self, name: str, shard: int | None, tensor: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """This rank's part of a checkpoint tensor (vLLM's weight_loader): q rows by query heads, k/v rows by KV
        heads (a replicated KV head read whole), gate/up rows and o_proj/down_proj columns evenly, embedding and LM
        head rows by vocabulary (zero padding past its end). Norms and anything else are replicated."""
        rank = self.tp.rank
        if name.endswith((".qkv_proj.weight", ".qkv_proj.bias")):
            attn = self.model.attention(0)
            if shard == 0:
                return tensor.narrow(0, rank * attn.q_size, attn.q_size)
            return tensor.narrow(0, attn.kv_head_start * attn.head_dim, attn.kv_size)
        if name.endswith((".gate_up_proj.weight", ".gate_up_proj.bias")):
            return tensor.narrow(0, rank * target.shape[0], target.shape[0])
        if name.endswith((".o_proj.weight", ".down_proj.weight")):
            return tensor.narrow(1, rank * target.shape[1], target.shape[1])
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            rows = target.shape[0]
            part = tensor[rank * rows : (rank + 1) * rows]
            return torch.nn.functional.pad(part, (0, 0, 0, rows - part.shape[0]))
        return tensor


def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` over a folder's ``model.safetensors`` or its sharded index."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"model: no model.safetensors (or sharded index) in {path}")
    for file in files:
        with safe_open(str(path / file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
