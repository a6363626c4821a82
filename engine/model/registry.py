"""The architectures the engine runs, by HF ``model_type``, and ``load_model`` that builds one from a folder.

As vLLM's model registry: each family lives in its own file (``llama.py``, ``qwen3.py``, ``qwen3_moe.py``)
and this map is the one place that says which class serves which ``model_type``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

from engine.model.hugepages import move_to_hugepages
from engine.model.llama import LlamaForCausalLM, iter_safetensors
from engine.model.qwen3 import Qwen3ForCausalLM
from engine.model.qwen3_moe import Qwen3MoeForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
}
SUPPORTED_MODEL_TYPES = tuple(MODEL_CLASSES)
"""The architectures the engine runs: the `model_type` of a config.json (of a GGUF file: its architecture)."""


def model_class(config: PretrainedConfig) -> type[LlamaForCausalLM]:
    """The class for ``config.model_type``; an unsupported type is refused naming the supported ones."""
    cls = MODEL_CLASSES.get(config.model_type)
    if cls is None:
        raise ValueError(
            f"model: model_type {config.model_type!r} is not supported ({', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    return cls


def check_weights_format(path: Path) -> None:
    """Refuse a folder whose weights exist only as pickle ``.bin`` files: unpickling a checkpoint can run any code
    it carries, so the engine reads safetensors only."""
    path = Path(path)
    if any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file():
        return
    pickles = sorted(p.name for p in path.glob("*.bin"))
    if pickles:
        raise ValueError(
            f"model: {path} holds only pickle checkpoints ({', '.join(pickles[:3])}); they are refused because "
            "unpickling can run arbitrary code. Convert them to safetensors (transformers: "
            "from_pretrained(...).save_pretrained(out, safe_serialization=True)) or pick a safetensors revision"
        )


def load_model(
    path: Path, dtype: torch.dtype, device: torch.device, quantization: str | None = None
) -> tuple[LlamaForCausalLM, PretrainedConfig]:
    """Build the model from an HF folder's config and safetensors on ``device``. On CUDA it computes and stores
    in ``dtype``; on a CPU it computes in float32 and stores the weights as ``dtype`` (or int8 with
    ``quantization="int8"``), the linears' weights also as the GEMM's panels (``pack_weights``), all on huge pages
    (engine/model/hugepages.py)."""
    config = AutoConfig.from_pretrained(path)
    cls = model_class(config)
    check_weights_format(path)
    compute = torch.float32 if device.type == "cpu" else dtype
    # Built on meta (no random init), then materialised and filled from the checkpoint.
    with torch.device("meta"):
        model = cls(config)
    model.to_empty(device=device).to(compute)
    if config.tie_word_embeddings:  # moving off meta made new parameters: tie again
        model.tie_weights()
    model.load_weights(iter_safetensors(Path(path)))
    if dtype != compute or quantization is not None:
        model.store_weights(dtype, quantization)
    if device.type == "cpu":
        model.pack_weights()
        move_to_hugepages(model)
    return model.eval().requires_grad_(False), config
