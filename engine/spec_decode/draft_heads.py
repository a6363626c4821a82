"""What the learned proposers (EAGLE, Medusa) share: a draft head's folder on disk, where a target's default heads
are found, and the draft vocabulary they read out through the target's own LM head.

A head folder holds ``config.json`` (``method``, ``target``, ``hidden_size``, the head's own sizes),
``model.safetensors`` (its weights, fp16 on disk, and ``draft_id_to_target_id``: the target token id of each draft
vocabulary entry, as EAGLE-3's draft vocabulary) and ``manifest.json`` (how it was made: command, seed, data, steps,
loss, held-out acceptance). ``workbench train-draft`` writes them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

import kernels
from engine.model.linear import Linear
from engine.model.loader import cache_dir

# Default heads made by `workbench train-draft` and committed: heads/<target>/<method>/
BUNDLED_HEADS = Path(__file__).resolve().parent / "heads"
WEIGHTS, CONFIG, MANIFEST = "model.safetensors", "config.json", "manifest.json"
# A head is written in shards of at most this many bytes (model-0000i-of-0000n.safetensors, as HF shards): no file
# of a committed head passes the repository's 5 MB limit on a tracked file; all of a target's heads stay under 16 MB.
SHARD_BYTES = 4 << 20


def weight_files(folder: Path) -> list[Path]:
    """A head folder's safetensors: one file, or its shards in order."""
    return sorted(folder.glob("model*.safetensors"))


DRAFT_IDS = "draft_id_to_target_id"


def trained_heads_dir() -> Path:
    """Where `workbench train-draft` writes heads by default: the workbench cache's ``draft_heads/``."""
    return cache_dir() / "draft_heads"


def default_head_path(target: str | os.PathLike, method: str) -> Path:
    """The head of `method` for a registry target: one trained here (the cache) first, else the committed default.
    Raises ValueError naming speculative_config.model and the command that makes one."""
    name = str(target)
    for root in (trained_heads_dir(), BUNDLED_HEADS):
        folder = root / name / method
        if weight_files(folder):
            return folder
    raise ValueError(
        f"speculative_config.model: no {method} head for {name!r} (looked in {trained_heads_dir()} and "
        f"{BUNDLED_HEADS}); give a head folder, or train one (a few minutes on a CPU): "
        f"workbench train-draft --method {method} --model {name}"
    )


def head_path(model: str | None, target: str | os.PathLike, method: str) -> Path:
    """speculative_config.model as a head folder: the folder given, or the target's default head."""
    if model is None:
        return default_head_path(target, method)
    folder = Path(model).expanduser()
    if not weight_files(folder) or not (folder / CONFIG).is_file():
        raise ValueError(f"speculative_config.model: {model!r} is not a draft head folder ({CONFIG} and {WEIGHTS})")
    return folder


def load_head(folder: Path, method: str, target_hidden_size: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """A head folder's config and tensors, refused (naming speculative_config.model) when it is another method's
    head or was made for a target of another hidden size."""
    from safetensors.torch import load_file

    config = json.loads((folder / CONFIG).read_text())
    if config.get("method") != method:
        raise ValueError(f"speculative_config.model: {folder} holds a {config.get('method')!r} head, not {method!r}")
    if config.get("hidden_size") != target_hidden_size:
        raise ValueError(
            f"speculative_config.model: the head's hidden size ({config.get('hidden_size')}) differs "
            f"from the target's ({target_hidden_size}); it was made for {config.get('target')!r}"
        )
    return config, {name: t for file in weight_files(folder) for name, t in load_file(str(file)).items()}


def save_head(folder: Path, config: dict, tensors: dict[str, torch.Tensor], manifest: dict) -> Path:
    """Write a head folder: float weights as fp16 (small enough to commit), ids as int64."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    stored = {
        k: (v.detach().to(torch.float16) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()
    }
    shards: list[dict[str, torch.Tensor]] = [{}]
    for name, t in stored.items():
        if shards[-1] and sum(x.nbytes for x in shards[-1].values()) + t.nbytes > SHARD_BYTES:
            shards.append({})
        shards[-1][name] = t
    for old in weight_files(folder):
        old.unlink()
    for i, shard in enumerate(shards, 1):
        file = folder / (WEIGHTS if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors")
        save_file(shard, str(file), metadata={"format": "pt"})
        file.chmod(0o644)  # safetensors writes owner-only; a shared cache or a commit wants it readable
    (folder / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return folder


def head_ops():
    """The kernels a head runs on: ours when drafting; their torch references when training, which needs autograd
    (the C++/Triton kernels have none)."""
    return kernels.reference if torch.is_grad_enabled() else kernels


def narrowed(weight: torch.Tensor) -> torch.Tensor:
    """A float32 matrix a head drafts with, in bfloat16 where `kernels.linear` reads it so (the C++ CPU op): drafting
    streams it every step, and after the target's forward has swept the caches it comes from memory, at half the
    bytes. Activations, norms and the draft distributions stay float32. A draft is a guess the target verifies, so
    the output keeps the target's distribution (greedy: the same tokens)."""
    if weight.dtype == torch.float32 and kernels.reads_bf16_weights(weight.device):
        return weight.to(torch.bfloat16)
    return weight


M = TypeVar("M", bound=nn.Module)


def narrow_matrices(module: M) -> M:
    """Every matrix of a head `narrowed`."""
    for p in module.parameters():
        if p.dim() == 2:
            p.data = narrowed(p.data)
    return module


class DraftVocab:
    """Owns a head's draft vocabulary: the target token ids it may draft, and a copy of those rows of the target's
    LM head (`narrowed`). Reading a few thousand rows instead of the whole vocabulary is most
    of why drafting is cheap on a CPU; tokens outside it get draft probability 0, which the rejection sampler
    handles exactly (they are never drafted, and the residual max(p - q, 0) keeps all of the target's mass on
    them)."""

    def __init__(self, token_ids: torch.Tensor, lm_head: Linear, vocab_size: int) -> None:
        if token_ids.numel() == 0 or int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab_size:
            raise ValueError(
                f"speculative_config.model: the head's draft vocabulary is not within the target's {vocab_size} tokens"
            )
        device = lm_head.weight.device
        self.token_ids = token_ids.to(device=device, dtype=torch.long)
        self.vocab_size = vocab_size
        self.weight = narrowed(lm_head.weight.data[self.token_ids].contiguous())
        scale = getattr(lm_head, "weight_scale", None)
        self.weight_scale = None if scale is None else scale[self.token_ids].contiguous()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states [N, H] -> float32 logits over the draft vocabulary [N, V_draft]."""
        return kernels.linear(hidden, self.weight, self.weight_scale).float()

    def to_target(self, draft_ids: list[int]) -> list[int]:
        return self.token_ids[torch.tensor(draft_ids, dtype=torch.long, device=self.token_ids.device)].tolist()

    def to_target_probs(self, dist: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary distributions [N, V_draft] -> over the target's vocabulary [N, V] (0 elsewhere)."""
        full = torch.zeros(dist.shape[0], self.vocab_size, dtype=dist.dtype, device=dist.device)
        return full.index_copy_(1, self.token_ids, dist)
