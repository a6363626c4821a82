"""Where a model comes from: a hub id (from a hub cache built here in the hub's layout, offline) and a GGUF file
(every weight type equal to gguf's own dequantization; the shipped SmolLM2 GGUF equal to the registry model)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.model import loader
from engine.model.loader import gguf_config, gguf_state_dict, resolve_model

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

# ---- hub ids -------------------------------------------------------------------------------------------------


def _hub_snapshot(hub: Path, repo_id: str, commit: str, source: Path, refs: tuple[str, ...] = ("main",)) -> Path:
    """One snapshot of `repo_id` in huggingface_hub's cache layout: models--org--name/{refs,snapshots}."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in source.iterdir():
        if f.is_file() and not f.name.startswith("."):
            shutil.copy2(f, snapshot / f.name)
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no network here: the cache is all there is
    return tmp_path / "hf" / "hub"


def test_hub_id_resolves_to_its_cached_snapshot(hub, tiny_model_path):
    main = _hub_snapshot(hub, "acme/tiny-llama", "a" * 40, tiny_model_path)
    assert resolve_model("acme/tiny-llama") == main


def test_hub_revision_picks_a_tag_or_a_commit(hub, tiny_model_path, tmp_path):
    main = _hub_snapshot(hub, "acme/tiny-llama", "a" * 40, tiny_model_path)
    older = _hub_snapshot(hub, "acme/tiny-llama", "b" * 40, tiny_model_path, refs=("v1",))
    assert resolve_model("acme/tiny-llama", revision="v1") == older
    assert resolve_model("acme/tiny-llama", revision="b" * 40) == older
    assert resolve_model("acme/tiny-llama") == main


def test_hub_id_runs_like_the_registry_model(hub, tiny_model_path):
    _hub_snapshot(hub, "acme/tiny-llama", "c" * 40, tiny_model_path)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [100, 200, 300]]
    by_hub = LLM(model="acme/tiny-llama", revision="main", num_kv_blocks=64).generate(prompts, params, use_tqdm=False)
    by_name = LLM(model="tiny-llama", num_kv_blocks=64).generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in by_hub] == [o.token_ids for o in by_name]


def test_offline_and_not_cached_says_so_and_how_to_fix_it(hub):
    with pytest.raises(ValueError) as info:
        resolve_model("acme/never-downloaded")
    message = str(info.value)
    assert "acme/never-downloaded is not in the Hugging Face cache" in message
    assert "HF_HUB_OFFLINE is set" in message and "hf download acme/never-downloaded" in message
    assert str(hub) in message  # the cache it looked in, from HF_HOME


def test_hub_cache_follows_env_at_call_time(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    assert loader.hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "direct"))
    assert loader.hub_cache_dir() == tmp_path / "direct"


def test_a_name_that_is_nothing_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not a .gguf file and not a hub id"):
        resolve_model("no such model!")


# ---- GGUF ----------------------------------------------------------------------------------------------------

HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 256, 256, 4, 2, 256  # K-quants pack rows of 256
HEAD_DIM = HIDDEN // HEADS
# Types gguf can write from floats; the K-quants it can only read are written as random blocks.
WRITABLE = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]
K_QUANTS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}  # offsets of f16 scales


def _tensor_data(rng: np.random.Generator, shape: tuple[int, int], qtype) -> np.ndarray:
    if qtype in K_QUANTS:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (shape[0], shape[1] // block, size), dtype=np.uint8)
        for offset in K_QUANTS[qtype]:  # small finite scales, so no block dequantizes to inf or NaN
            raw[..., offset : offset + 2] = np.frombuffer(np.float16(rng.uniform(0.001, 0.01)).tobytes(), np.uint8)
        return raw.reshape(shape[0], -1)
    data = (rng.standard_normal(shape) * 0.1).astype(np.float32)
    if qtype == Q.F32:
        return data
    if qtype == Q.F16:
        return data.astype(np.float16)
    return gguf.quants.quantize(data, qtype)


def write_tiny_llama_gguf(path: Path, qtype, seed: int = 0) -> None:
    """A one-layer Llama in GGUF's names and layout, its 2-D weights at `qtype`, norms in F32 (as llama.cpp)."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(1)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(VOCAB)
    matrices = {
        "token_embd.weight": (VOCAB, HIDDEN),
        "output.weight": (VOCAB, HIDDEN),
        "blk.0.attn_q.weight": (HIDDEN, HIDDEN),
        "blk.0.attn_k.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        "blk.0.attn_v.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        "blk.0.attn_output.weight": (HIDDEN, HIDDEN),
        "blk.0.ffn_gate.weight": (FFN, HIDDEN),
        "blk.0.ffn_up.weight": (FFN, HIDDEN),
        "blk.0.ffn_down.weight": (HIDDEN, FFN),
    }
    for name, shape in matrices.items():
        data = _tensor_data(rng, shape, qtype)
        raw = qtype if qtype not in (Q.F32, Q.F16) else None
        w.add_tensor(name, data, raw_dtype=raw)
    for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


HF_NAMES = {
    "token_embd": "model.embed_tokens",
    "output": "lm_head",
    "output_norm": "model.norm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp stores q/k rows interleaved per head for its RoPE; HF keeps the halves apart.
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_reference(path: Path) -> dict[str, np.ndarray]:
    """Every tensor by gguf's own reader and dequantization, under its HF name."""
    out = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        parts = t.name.split(".")
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if parts[0] == "blk":
            name = f"model.layers.{parts[1]}.{HF_NAMES[parts[2]]}.weight"
            if parts[2] in ("attn_q", "attn_k"):
                values = _unpermute(values, HEADS if parts[2] == "attn_q" else KV_HEADS)
        else:
            name = f"{HF_NAMES[parts[0]]}.weight"
        out[name] = values
    return out


@pytest.mark.parametrize("qtype", WRITABLE + list(K_QUANTS), ids=lambda q: q.name)
def test_gguf_weights_equal_ggufs_dequantization(tmp_path, qtype):
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_tiny_llama_gguf(path, qtype)
    config = gguf_config(path)
    assert (config.model_type, config.hidden_size, config.num_key_value_heads) == ("llama", HIDDEN, KV_HEADS)
    ours = gguf_state_dict(path, config)
    expected = gguf_reference(path)
    assert ours.keys() == expected.keys()
    for name, values in expected.items():
        assert np.isfinite(values).all(), name
        assert torch.equal(ours[name], torch.from_numpy(values)), name


def test_unsupported_gguf_architecture_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))  # its lock file stays out of the user's cache
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_context_length(16)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_head_count(2)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="gpt2.gguf"):
        resolve_model(path)


@pytest.mark.slow
def test_smollm2_gguf_by_path_equals_the_registry_model(smollm2_path):
    """Converted once into the cache (about 30 s the first time on a machine), then token for token the same."""
    path = resolve_model(loader.smollm2_gguf_path())
    assert path.parent == loader.cache_dir() / "models" / "gguf"
    for name in ("config.json", "tokenizer.json", "chat_template.jinja", "model.safetensors"):
        assert (path / name).read_bytes() == (smollm2_path / name).read_bytes(), name
    params = SamplingParams(temperature=0.0, max_tokens=12)
    prompts = ["The capital of France is", "Write a haiku about the sea."]
    by_path = LLM(model=str(loader.smollm2_gguf_path()), num_kv_blocks=64).generate(prompts, params, use_tqdm=False)
    by_name = LLM(model="smollm2-135m", num_kv_blocks=64).generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in by_path] == [o.token_ids for o in by_name]
    assert by_path[0].text == by_name[0].text
