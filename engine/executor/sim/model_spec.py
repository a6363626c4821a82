"""A model as the simulated executor sees it: shapes from a config.json, no weights.

Where a config comes from: the built-in table (models.json: `llama-3.1-8b`, `llama-3.1-70b`, `qwen3-8b`,
`qwen3-32b`, `qwen3-30b-a3b`), a local folder's config.json, a registry name of the engine (its converted folder),
or a hub id (only its config.json is fetched, through the hub's cache).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BUILTIN_MODELS_PATH = Path(__file__).with_name("models.json")
_ARCHITECTURES = ("llama", "qwen3", "qwen3_moe", "qwen2", "mistral")


def builtin_models() -> dict[str, dict[str, Any]]:
    """The built-in table: name -> config.json fields."""
    table = json.loads(BUILTIN_MODELS_PATH.read_text(encoding="utf-8"))
    return {k: v for k, v in table.items() if not k.startswith("_")}


@dataclass(frozen=True)
class ModelSpec:
    """Owns one model's shapes (Hugging Face config names) and what follows from them: parameter counts, the
    linear layers of a decoder layer, KV bytes per token. A mixture-of-experts model has `num_experts` > 0."""

    name: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_id: int | list[int] | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_sparse_layers: int = 0
    sliding_window: int | None = None
    folder: Path | None = None  # where its config.json came from (a tokenizer may sit beside it)

    @classmethod
    def from_config(cls, name: str, cfg: dict[str, Any], folder: Path | None = None) -> ModelSpec:
        """From config.json's fields; ValueError names what is missing or not supported."""
        model_type = cfg.get("model_type")
        if model_type not in _ARCHITECTURES:
            raise ValueError(
                f"model: {name!r} has model_type {model_type!r}; the simulated executor knows "
                f"{', '.join(_ARCHITECTURES)}"
            )
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size") if k not in cfg]
        if missing:
            raise ValueError(f"model: {name!r}: config.json lacks {', '.join(missing)}")
        heads = cfg["num_attention_heads"]
        num_layers = cfg["num_hidden_layers"]
        experts = cfg.get("num_experts", 0) or 0
        sparse = 0
        if experts:
            step = cfg.get("decoder_sparse_step", 1) or 1
            dense_only = set(cfg.get("mlp_only_layers") or [])
            # Qwen3-MoE's rule: layer i is sparse when (i + 1) % decoder_sparse_step == 0 and not in mlp_only_layers
            sparse = sum(1 for i in range(num_layers) if (i + 1) % step == 0 and i not in dense_only)
        return cls(
            name=name,
            model_type=model_type,
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg.get("intermediate_size", 0),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab_size=cfg["vocab_size"],
            max_position_embeddings=cfg.get("max_position_embeddings") or 2048,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_id=cfg.get("eos_token_id"),
            num_experts=experts,
            num_experts_per_tok=cfg.get("num_experts_per_tok", 0) or 0,
            moe_intermediate_size=cfg.get("moe_intermediate_size", 0) or 0,
            num_sparse_layers=sparse,
            sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None,
            folder=folder,
        )

    # ---- parameters -----------------------------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_sparse_layers

    def attention_params(self) -> int:
        """q, k, v and o projections of one layer (no biases: none of the built-in models has them), plus Qwen3's
        per-head q/k RMSNorm weights."""
        params = 2 * self.hidden_size * self.q_size + 2 * self.hidden_size * self.kv_size
        return params + (2 * self.head_dim if self.model_type.startswith("qwen3") else 0)

    def expert_params(self) -> int:
        """One expert's gate, up and down projections."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size

    def num_params(self) -> int:
        """Every parameter: embeddings, layers (attention, MLP or experts with their router, two norms), the final
        norm, and the LM head unless tied."""
        layer_norms = 2 * self.hidden_size
        per_layer = self.attention_params() + layer_norms
        mlps = self.num_dense_layers * self.dense_mlp_params() + self.num_sparse_layers * (
            self.num_experts * self.expert_params() + self.hidden_size * self.num_experts
        )
        embed = self.vocab_size * self.hidden_size
        return embed * (1 if self.tie_word_embeddings else 2) + self.num_layers * per_layer + mlps + self.hidden_size

    def num_active_params(self) -> int:
        """Parameters one token uses: a MoE layer's top-k experts instead of all of them."""
        if not self.num_experts:
            return self.num_params()
        unused = self.num_sparse_layers * (self.num_experts - self.num_experts_per_tok) * self.expert_params()
        return self.num_params() - unused

    def num_replicated_params(self) -> int:
        """Parameters every tensor-parallel rank holds whole (the norms); the rest is split across ranks."""
        qk_norms = 2 * self.head_dim if self.model_type.startswith("qwen3") else 0
        return self.num_layers * (2 * self.hidden_size + qk_norms) + self.hidden_size

    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads one rank holds: split across ranks, replicated when there are fewer heads than ranks (vLLM)."""
        return max(1, self.num_kv_heads // tp)

    def to_shape_dict(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "sliding_window": self.sliding_window,
        }


def _has_config(path: Path) -> bool:
    return (path / "config.json").is_file()


def load_model_spec(name: str | os.PathLike, revision: str | None = None) -> ModelSpec:
    """The spec of `name`: a built-in table entry, a local folder with config.json, an engine registry name (its
    folder, built once), or a hub id (its config.json alone, through the hub's cache)."""
    key = str(name)
    table = builtin_models()
    if key.lower() in table:
        return ModelSpec.from_config(key.lower(), table[key.lower()])
    path = Path(key).expanduser()
    if path.is_dir():
        if not _has_config(path):
            raise ValueError(f"model: {key} has no config.json")
        return _from_folder(key, path)
    from engine.model.loader import MODEL_REGISTRY, resolve_model

    if key in MODEL_REGISTRY:
        return _from_folder(key, resolve_model(key))
    if key.count("/") == 1:
        return _from_hub(key, revision)
    raise ValueError(
        f"model: unknown model {key!r} for the simulated executor: not built in "
        f"({', '.join(table)}), not a folder with config.json, not a registry name or hub id"
    )


def _from_folder(name: str, folder: Path) -> ModelSpec:
    cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    return ModelSpec.from_config(name, cfg, folder)


def _from_hub(repo_id: str, revision: str | None) -> ModelSpec:
    """Only config.json (and the tokenizer's files, where there are) of a hub model: no weights."""
    from huggingface_hub import hf_hub_download

    try:
        config_path = Path(hf_hub_download(repo_id, "config.json", revision=revision))
    except Exception as exc:  # offline and not cached, unknown repo, gated repo: say which and why
        raise ValueError(
            f"model: {repo_id!r}: its config.json could not be fetched or found in the hub's "
            f"cache ({type(exc).__name__}: {exc})"
        ) from exc
    for extra in ("tokenizer.json", "tokenizer_config.json"):
        try:
            hf_hub_download(repo_id, extra, revision=revision)
        except Exception:  # a config without a tokenizer still simulates (byte tokenizer)
            break
    return _from_folder(repo_id, config_path.parent)
