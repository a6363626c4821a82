"""The tiny random Llama for fast tests: SmolLM2's vocabulary and special tokens, a few small layers, and weights
drawn from a seed, so that every machine builds the same model (loader.py writes it into a folder, registry name
"tiny-llama"). Change what it builds and loader.BUILD_VERSIONS["tiny-llama"] must change with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import LlamaConfig

TINY_LLAMA_SEED = 0


def tiny_llama_config() -> LlamaConfig:
    """The tiny random Llama's config: SmolLM2's vocabulary and special tokens."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        architectures=["LlamaForCausalLM"],
    )


def tiny_llama_state_dict(config: LlamaConfig, seed: int = TINY_LLAMA_SEED) -> dict[str, torch.Tensor]:
    """Seeded weights, drawn in sorted-name order so they do not depend on HF's init order."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    shapes = {k: v.shape for k, v in skeleton.state_dict().items() if k != "lm_head.weight"}
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name in sorted(shapes):
        if name.endswith("norm.weight"):
            state[name] = torch.ones(shapes[name])
        else:
            state[name] = torch.randn(shapes[name], generator=gen) * _init_std(name, config)
    return state


def _init_std(name: str, config: LlamaConfig) -> float:
    # Tuned by hand so greedy text is varied and logits well spread (std ~4, top-2 gap
    # usually >> fp32 noise): fan-in scaled projections keep activations O(1); sharper
    # q/k make attention position-dependent (HF's std 0.02 repeats one token forever);
    # a small embedding keeps the tied head from just echoing the input token.
    if name.endswith("embed_tokens.weight"):
        return 0.5
    fan_in = config.intermediate_size if "down_proj" in name else config.hidden_size
    gain = 3.0 if name.endswith(("q_proj.weight", "k_proj.weight")) else 2.0 if ".mlp." in name else 1.0
    return gain * fan_in**-0.5
