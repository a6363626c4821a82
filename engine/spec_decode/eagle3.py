"""EAGLE-3 (as vLLM's llama_eagle3.py and its EagleProposer with method "eagle3"): the head reads three target layers.

The target keeps the residual stream entering three of its layers (vLLM's default: 2, L // 2 and L - 3;
``LlamaForCausalLM.set_aux_hidden_state_layers``), ``fc`` fuses them (3H -> H) into the head's input state. The
head's one decoder layer attends over ``[input_layernorm(embed(x_{t+1})); hidden_norm(state)]`` (2H wide, vLLM's
"midlayer"), its own final ``norm`` and ``lm_head`` read out over the draft vocabulary, and ``d2t`` maps each draft
id back to the target's (``target_id = draft_id + d2t[draft_id]``). Unlike EAGLE-1 it does not imitate the target's
final state: it only has to predict the next token, so it may use any features the three layers offer.

Drafting is EAGLE-1's (engine/spec_decode/eagle.py, whose proposer this one extends): ``mirror`` runs the head over
the step's whole batch into its own paged cache (that pass is the first draft step), and each later step of a chain
or depth of a tree feeds the head's own pre-norm state back in, as vLLM does (no ``fc`` then: the fused target
features exist only where the target ran).

A head folder is vLLM's EAGLE-3 checkpoint layout: ``config.json`` (``architectures: ["LlamaForCausalLMEagle3"]``,
``draft_vocab_size``, ``target_hidden_size``, Llama's keys) and safetensors named ``midlayer.*``, ``fc.weight``,
``norm.weight``, ``lm_head.weight``, ``d2t`` and ``t2d``, so that a head trained elsewhere drops in and ours loads in
vLLM. ``workbench train-draft --method eagle3`` writes one, with its manifest.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import cast

import torch
from torch import nn
from transformers import LlamaConfig

from engine.model.llama import ModelShape, RotaryEmbedding
from engine.spec_decode.draft_heads import CONFIG, DraftVocab, head_ops, head_path, narrow_matrices, weight_files
from engine.spec_decode.eagle import Attend, EagleLayer, EagleProposer
from engine.spec_decode.proposer import TargetBatch, TargetModel

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")  # config.json's (vLLM reads either)


class Eagle3Layer(EagleLayer):
    """Owns the head's decoder layer (vLLM's eagle3 LlamaDecoderLayer): EAGLE-1's, but q/k/v read 2H (the normed
    embedding beside the normed state) and the state has its own ``hidden_norm``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        hidden = config.hidden_size
        self.qkv_proj = nn.Parameter(torch.empty(self.q_size + 2 * self.kv_size, 2 * hidden))
        self.hidden_norm = nn.Parameter(torch.ones(hidden))
        # vLLM's norm_before_residual: the residual stream starts from the normed state instead of the state
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def forward(  # type: ignore[override]  # the layer reads the embedding and the state apart
        self, embeds: torch.Tensor, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attend: Attend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (the MLP's output, the residual stream before it), as vLLM's layer returns them."""
        ops, n = head_ops(), hidden.shape[0]
        normed = ops.rms_norm(hidden, self.hidden_norm, self.eps)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat((ops.rms_norm(embeds, self.input_layernorm, self.eps), normed), dim=-1)
        q, k, v = ops.linear(x, self.qkv_proj).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = ops.rotary(
            q.reshape(n, self.num_heads, self.head_dim), k.reshape(n, self.num_kv_heads, self.head_dim), *rope
        )
        out = attend(q, k, v.reshape(n, self.num_kv_heads, self.head_dim))
        h, residual = ops.fused_add_rms_norm(
            ops.linear(out.reshape(n, self.q_size), self.o_proj), residual, self.post_attention_layernorm, self.eps
        )
        return ops.linear(ops.silu_and_mul(ops.linear(h, self.gate_up_proj)), self.down_proj), residual


class Eagle3Head(nn.Module):
    """Owns an EAGLE-3 head's weights: ``fc`` over the three target layers' states, one decoder layer, the final
    ``norm`` and ``lm_head`` over the draft vocabulary. The token embedding is the target's (vLLM shares it when a
    checkpoint has none)."""

    def __init__(self, config: LlamaConfig, draft_vocab_size: int, num_aux_layers: int = 3) -> None:
        super().__init__()
        self.config = config
        self.eps = config.rms_norm_eps
        self.fc = nn.Parameter(torch.empty(config.hidden_size, num_aux_layers * config.hidden_size))
        self.layers = nn.ModuleList([Eagle3Layer(config)])
        self.norm = nn.Parameter(torch.ones(config.hidden_size))
        self.lm_head = nn.Parameter(torch.empty(draft_vocab_size, config.hidden_size))
        self.rotary_emb = RotaryEmbedding(config)
        self.shape = ModelShape.from_config(config)  # what allocate_kv_caches reads

    @staticmethod
    def llama_config(config: dict) -> LlamaConfig:
        """The decoder layer's config from a head's config.json (ours or one trained elsewhere: Llama's keys, any it
        omits at LlamaConfig's defaults, as vLLM reads it)."""
        return LlamaConfig(**{**config, "num_hidden_layers": 1})

    def combine(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """The target's aux states [N, 3H] -> the head's input states [N, H] (vLLM's combine_hidden_states)."""
        return head_ops().linear(aux_hidden_states, self.fc)

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, attend: Attend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token embeddings and input states [N, H] at `positions` -> (the normed states the LM head reads, the
        pre-norm states the next draft step reads), [N, H] each."""
        layer = cast(Eagle3Layer, self.layers[0])  # ModuleList items are typed as Module
        x, residual = layer(embeds, hidden, self.rotary_emb(positions, hidden.dtype), attend)
        return head_ops().fused_add_rms_norm(x, residual, self.norm, self.eps)


# Our parameter -> its name in vLLM's EAGLE-3 checkpoint layout (llama_eagle3.py's load_weights: "midlayer." is read
# as layers.0., q/k/v and gate/up are stacked into qkv_proj and gate_up_proj, "d2t" is draft_id_to_target_id, "t2d"
# is skipped, and every name but lm_head's is prefixed "model."). A fused parameter is split into its parts.
CHECKPOINT_NAMES: dict[str, tuple[str, ...]] = {
    "fc": ("fc.weight",),
    "layers.0.input_layernorm": ("midlayer.input_layernorm.weight",),
    "layers.0.hidden_norm": ("midlayer.hidden_norm.weight",),
    "layers.0.qkv_proj": (
        "midlayer.self_attn.q_proj.weight",
        "midlayer.self_attn.k_proj.weight",
        "midlayer.self_attn.v_proj.weight",
    ),
    "layers.0.o_proj": ("midlayer.self_attn.o_proj.weight",),
    "layers.0.post_attention_layernorm": ("midlayer.post_attention_layernorm.weight",),
    "layers.0.gate_up_proj": ("midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight"),
    "layers.0.down_proj": ("midlayer.mlp.down_proj.weight",),
    "norm": ("norm.weight",),
    "lm_head": ("lm_head.weight",),
}
D2T, T2D, EMBED = "d2t", "t2d", "embed_tokens.weight"


def checkpoint_tensors(head: Eagle3Head, draft_ids: torch.Tensor, vocab_size: int) -> dict[str, torch.Tensor]:
    """A head's tensors under vLLM's names: fused matrices split, ``d2t`` (the offset from each draft id to its
    target id) and ``t2d`` (which target ids are in the draft vocabulary)."""
    layer = cast(Eagle3Layer, head.layers[0])
    sizes = {"layers.0.qkv_proj": [layer.q_size, layer.kv_size, layer.kv_size]}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in head.state_dict().items():
        names = CHECKPOINT_NAMES[name]
        parts = (
            tensor.split(sizes.get(name, [tensor.shape[0] // len(names)] * len(names))) if len(names) > 1 else [tensor]
        )
        out.update({n: p.detach().clone() for n, p in zip(names, parts)})
    ids = draft_ids.to(torch.long)
    out[D2T] = ids - torch.arange(len(ids))
    out[T2D] = torch.zeros(vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
    return out


def load_eagle3(folder: Path, target_hidden_size: int, vocab_size: int) -> tuple[dict, Eagle3Head, torch.Tensor, dict]:
    """A head folder in vLLM's EAGLE-3 layout -> (its config, the head, the target id of each draft id, other
    tensors: ``embed_tokens.weight`` where the checkpoint has its own). Refused, naming speculative_config.model,
    when it is not an EAGLE-3 head for a target of this hidden size and vocabulary."""
    from safetensors.torch import load_file

    config = json.loads((folder / CONFIG).read_text())
    where = f"speculative_config.model: {folder}"
    if not set(config.get("architectures") or ()) & set(ARCHITECTURES):
        raise ValueError(f"{where} is not an EAGLE-3 head (config.json's architectures: {config.get('architectures')})")
    for key, want in (
        ("target_hidden_size", target_hidden_size),
        ("hidden_size", target_hidden_size),
        ("vocab_size", vocab_size),
        ("num_hidden_layers", 1),
    ):
        got = config.get(key, config.get("hidden_size")) if key == "target_hidden_size" else config.get(key)
        if got != want:
            raise ValueError(f"{where}: config.json's {key} is {got}, this target needs {want}")
    tensors = {
        name.removeprefix("model.").replace("layers.0.", "midlayer."): t
        for file in weight_files(folder)
        for name, t in load_file(str(file)).items()
    }
    draft_vocab_size = config.get("draft_vocab_size") or vocab_size
    head = Eagle3Head(Eagle3Head.llama_config(config), draft_vocab_size)
    state = {}
    for param, names in CHECKPOINT_NAMES.items():
        missing = [n for n in names if n not in tensors]
        if missing:
            raise ValueError(f"{where}: the checkpoint has no {missing[0]}")
        state[param] = torch.cat([tensors.pop(n) for n in names])
    head.load_state_dict(state)  # raises naming any tensor of the wrong shape
    d2t = tensors.pop(D2T, torch.zeros(draft_vocab_size, dtype=torch.long))  # no d2t: the whole vocabulary
    tensors.pop(T2D, None)
    extra = {name: tensors.pop(name) for name in (EMBED,) if name in tensors}
    if tensors:
        raise ValueError(f"{where}: unexpected tensors {sorted(tensors)[:4]}")
    return config, head.requires_grad_(False), torch.arange(draft_vocab_size) + d2t.to(torch.long), extra


class HeadVocab(DraftVocab):
    """Owns an EAGLE-3 head's draft vocabulary: the target ids of its draft ids and the head's own LM head."""

    def __init__(self, token_ids: torch.Tensor, lm_head: torch.Tensor, vocab_size: int) -> None:
        if token_ids.numel() != lm_head.shape[0] or int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab_size:
            raise ValueError(
                f"speculative_config.model: the head's d2t does not map its {lm_head.shape[0]} draft ids into "
                f"the target's {vocab_size} tokens"
            )
        self.token_ids = token_ids.to(device=lm_head.device, dtype=torch.long)
        self.vocab_size = vocab_size
        self.weight, self.weight_scale = lm_head, None


class Eagle3Proposer(EagleProposer):
    """Owns an EAGLE-3 head, its KV cache (the target's block ids), its draft vocabulary and what its last mirror
    pass made; reads the target's embedding (unless the head has its own) and its aux hidden states. Drafting,
    chains and trees, is EAGLE-1's; only the head's inputs and outputs differ."""

    method = "eagle3"

    def __init__(  # the base's __init__ builds EAGLE-1's vocabulary: this one sets up its own
        self,
        head: Eagle3Head,
        token_ids: torch.Tensor,
        target: TargetModel,
        aux_layers: tuple[int, ...] | None = None,
        embed_tokens: torch.Tensor | None = None,
    ) -> None:
        model = target.causal_lm
        layers = aux_layers or model.get_eagle3_aux_hidden_state_layers()
        num_layers = model.shape.num_layers
        if head.fc.shape[1] != len(layers) * model.shape.hidden_size or not all(0 <= i < num_layers for i in layers):
            raise ValueError(
                f"speculative_config.model: the head's fc reads {head.fc.shape[1]} features, not the target's "
                f"layers {layers} of {num_layers} (hidden size {model.shape.hidden_size})"
            )
        model.set_aux_hidden_state_layers(tuple(layers))
        self._init_drafting(head, HeadVocab(token_ids, head.lm_head, target.vocab_size), target)
        if embed_tokens is not None:  # the checkpoint's own embedding
            self.embed = functools.partial(nn.functional.embedding, weight=embed_tokens)

    @classmethod
    def from_config(cls, target: TargetModel) -> Eagle3Proposer:
        config, model = target.config, target.causal_lm
        folder = head_path(target.speculative.model, config.model, cls.method)
        head_config, head, token_ids, extra = load_eagle3(folder, model.shape.hidden_size, target.vocab_size)
        head = narrow_matrices(head.to(device=target.device, dtype=config.torch_dtype))
        embed = extra.get(EMBED)
        layers = head_config.get("eagle_aux_hidden_state_layer_ids")
        return cls(
            head,
            token_ids,
            target,
            None if layers is None else tuple(layers),
            None if embed is None else embed.to(device=target.device, dtype=config.torch_dtype),
        )

    def _target_states(self, batch: TargetBatch) -> torch.Tensor:
        """The head's input states where the target ran: the three aux layers' states, fused by ``fc``."""
        aux = batch.aux_hidden_states
        if aux is None or aux.shape[0] != batch.input_ids.shape[0]:
            raise RuntimeError("EAGLE-3 mirror: the target kept no aux hidden states for this batch")
        return cast(Eagle3Head, self.head).combine(aux.to(self.dtype))
