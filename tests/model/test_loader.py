"""Model resolution: the registry, local folders, the cache, and deterministic builds."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from engine.model import loader
from engine.model.loader import resolve_model


def test_unknown_name_names_the_field():
    expected = (
        "model: unknown model 'xyz': not in the registry (smollm2-135m, tiny-llama), "
        "not a folder with config.json, not a .gguf file and not a hub id (org/name)"
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        resolve_model("xyz")


def test_folder_without_config_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="not a folder with config.json"):
        resolve_model(tmp_path)


def test_local_folder_is_returned_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(tmp_path) == tmp_path
    assert resolve_model(str(tmp_path)) == tmp_path


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))
    assert loader.cache_dir() == tmp_path
    monkeypatch.delenv("WORKBENCH_CACHE")
    assert loader.cache_dir().name == "inference-workbench"


def _cache_with_smollm2(tmp_path, smollm2_path):
    """A fresh cache that reuses the converted SmolLM2 (the tiny model copies its tokenizer)."""
    (tmp_path / "models").mkdir(parents=True)
    (tmp_path / "models" / "smollm2-135m").symlink_to(smollm2_path)
    return tmp_path


def test_tiny_llama_builds_identically_in_two_caches(monkeypatch, tmp_path, smollm2_path):
    built = []
    for name in ("a", "b"):
        cache = _cache_with_smollm2(tmp_path / name, smollm2_path)
        monkeypatch.setenv("WORKBENCH_CACHE", str(cache))
        path = resolve_model("tiny-llama")
        assert path == cache / "models" / "tiny-llama"
        # Only the finished folder and its lock remain: the temporary build folder was renamed.
        assert sorted(p.name for p in path.parent.iterdir()) == ["smollm2-135m", "tiny-llama", "tiny-llama.lock"]
        built.append(load_file(path / "model.safetensors"))
    assert built[0].keys() == built[1].keys()
    for key in built[0]:
        assert torch.equal(built[0][key], built[1][key]), key
    config = json.loads((path / "config.json").read_text())
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    assert (path / "tokenizer.json").read_bytes() == (smollm2_path / "tokenizer.json").read_bytes()


def test_finished_folder_is_reused_without_building(monkeypatch, tmp_path):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))
    target = tmp_path / "models" / "tiny-llama"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    (target / ".workbench-build").write_text(loader.BUILD_VERSIONS["tiny-llama"])

    def fail(out):
        raise AssertionError("rebuilt a finished model")

    monkeypatch.setitem(loader.MODEL_REGISTRY, "tiny-llama", fail)
    assert resolve_model("tiny-llama") == target


def test_a_folder_built_by_another_version_is_rebuilt(monkeypatch, tmp_path):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))
    target = tmp_path / "models" / "tiny-llama"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # no stamp: an older builder made it
    built = []

    def build(out):
        built.append(out)
        (out / "config.json").write_text('{"rebuilt": true}')

    monkeypatch.setitem(loader.MODEL_REGISTRY, "tiny-llama", build)
    assert resolve_model("tiny-llama") == target and len(built) == 1
    assert json.loads((target / "config.json").read_text()) == {"rebuilt": True}
    assert (target / ".workbench-build").read_text() == loader.BUILD_VERSIONS["tiny-llama"]


def test_failed_build_leaves_nothing_behind(monkeypatch, tmp_path):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))

    def broken(out):
        (out / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setitem(loader.MODEL_REGISTRY, "tiny-llama", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        resolve_model("tiny-llama")
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["tiny-llama.lock"]


def test_smollm2_folder_is_plain_float32_hf(smollm2_path):
    names = {p.name for p in smollm2_path.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    config = json.loads((smollm2_path / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["vocab_size"]) == (30, 3, 49152)
    weights = load_file(smollm2_path / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.float32}
    assert "lm_head.weight" not in weights  # tied to the embedding


def test_smollm2_tokenizer_has_chat_template(smollm2_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
