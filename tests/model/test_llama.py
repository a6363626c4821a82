"""Our paged Llama-family model against transformers' on the same weights (fp32)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

import kernels
from engine.model.attention import AttentionMetadata
from engine.model.llama import LlamaForCausalLM, RotaryEmbedding
from engine.model.registry import load_model
from kernels.cpu.build import available

BLOCK_SIZE = 4
NUM_BLOCKS = 48
# Two fp32 computations of the same logits (ours and transformers') each sit up to ~8e-5 from the float64 logits
# (measured on the random families below, logits up to |17|: transformers' fp32 3.0e-5 to 5.6e-5, ours 1.8e-5 to
# 8.2e-5 by schedule, with the linear's dot products 16 wide on an AVX-512 CPU), so they may disagree by their sum: on
# mistral_head_dim_32's decode by 1.1e-4. A RoPE, masking or cache-layout bug moves logits by 1e-2 or more.
ATOL = 2e-4
RTOL = 1e-5
CPU = torch.device("cpu")


class PagedSequences:
    """A minimal stand-in for the runner: scrambled blocks, slot mapping, metadata per step."""

    def __init__(self, model: LlamaForCausalLM, seed: int = 0) -> None:
        shape = model.shape
        cache_shape = (NUM_BLOCKS, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim)
        self.model = model
        self.kv_caches = [(torch.zeros(cache_shape), torch.zeros(cache_shape)) for _ in range(shape.num_layers)]
        self.free = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()
        self.blocks: dict[int, list[int]] = {}
        self.num_computed: dict[int, int] = {}

    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Run one forward over ``{seq: new token ids}``; return each sequence's logits rows."""
        ids, positions, slots, seq_lens, q_lens = [], [], [], [], []
        for seq, tokens in chunks.items():
            start = self.num_computed.get(seq, 0)
            end = start + len(tokens)
            blocks = self.blocks.setdefault(seq, [])
            while len(blocks) * BLOCK_SIZE < end:
                blocks.append(self.free.pop())
            ids += tokens
            positions += range(start, end)
            slots += [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]
            seq_lens.append(end)
            q_lens.append(len(tokens))
            self.num_computed[seq] = end
        max_blocks = max(len(self.blocks[s]) for s in chunks)
        tables = [self.blocks[s] + [0] * (max_blocks - len(self.blocks[s])) for s in chunks]
        attn = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            query_start_loc=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
        )
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), attn, self.kv_caches)
            logits = self.model.compute_logits(hidden)
        return dict(zip(chunks, logits.split(q_lens)))


def run_schedule(model: LlamaForCausalLM, prompts: dict[int, list[int]], steps: list[dict[int, int]]):
    """Feed ``prompts`` by ``steps`` ({seq: number of tokens}); return each sequence's logits."""
    paged = PagedSequences(model)
    done = dict.fromkeys(prompts, 0)
    rows: dict[int, list[torch.Tensor]] = {s: [] for s in prompts}
    for step in steps:
        chunks = {s: prompts[s][done[s] : done[s] + n] for s, n in step.items()}
        for s, out in paged.step(chunks).items():
            rows[s].append(out)
            done[s] += len(chunks[s])
    assert done == {s: len(p) for s, p in prompts.items()}
    return {s: torch.cat(r) for s, r in rows.items()}


def hf_logits(hf_model, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([prompt])).logits[0].float()


def schedules(n: int) -> dict[str, list[dict[int, int]]]:
    third = math.ceil(n / 3)
    return {
        "prefill": [{0: n}],
        "three_chunks": [{0: third}, {0: third}, {0: n - 2 * third}],
        "decode": [{0: 1}] * n,
    }


def check_model(path, prompt: list[int], other: list[int]) -> None:
    """Single-sequence schedules, then two sequences mixed in one batch, against HF."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    model, _ = load_model(path, torch.float32, CPU)
    expected = hf_logits(hf, prompt)
    for name, steps in schedules(len(prompt)).items():
        got = run_schedule(model, {0: prompt}, steps)[0]
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL, msg=lambda m, name=name: f"{name}: {m}")
    # A decode beside a whole prefill, then two multi-token chunks over cached context.
    n = len(prompt)
    mixed = [{0: n - 4}, {0: 1, 1: 5}, {0: 3, 1: len(other) - 5}]
    got = run_schedule(model, {0: prompt, 1: other}, mixed)
    torch.testing.assert_close(got[0], expected, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(got[1], hf_logits(hf, other), atol=ATOL, rtol=RTOL)


def random_prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_tiny_llama_matches_transformers(tiny_model_path):
    check_model(tiny_model_path, random_prompt(49152, 19, 0), random_prompt(49152, 10, 1))


def test_smollm2_matches_transformers(smollm2_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    prompt = tok("The capital of France is Paris, and the capital of Italy is").input_ids
    check_model(smollm2_path, prompt, tok("Hello there, how are").input_ids)


SMALL = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

CONFIGS = {
    "qwen2_bias_untied": lambda: Qwen2Config(**SMALL, tie_word_embeddings=False),
    "llama3_rope_biases": lambda: LlamaConfig(
        **SMALL,
        attention_bias=True,
        mlp_bias=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "llama_yarn": lambda: LlamaConfig(
        **SMALL,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "llama_linear_mha": lambda: LlamaConfig(
        **{**SMALL, "num_key_value_heads": 4},
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    ),
    "mistral_head_dim_32": lambda: MistralConfig(**SMALL, head_dim=32),
}


def spread_init(model: torch.nn.Module, seed: int) -> None:
    """Replace HF's std-0.02 init: with it attention is near uniform and RoPE bugs hide."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() == 1:  # norms around 1, biases around 0
                base = 1.0 if "norm" in name else 0.0
                p.copy_(base + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                gain = 3.0 if ("q_proj" in name or "k_proj" in name) else 1.0
                std = 0.5 if "embed" in name or "lm_head" in name else gain * p.shape[1] ** -0.5
                p.copy_(std * torch.randn(p.shape, generator=gen))


@pytest.fixture(scope="module", params=CONFIGS.keys())
def random_model_path(request, tmp_path_factory):
    config = CONFIGS[request.param]()
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config)
    spread_init(hf, 0)
    path = tmp_path_factory.mktemp(request.param)
    # Small shards exercise the sharded index.
    hf.save_pretrained(path, max_shard_size="200KB")
    return path


def test_random_families_match_transformers(random_model_path):
    check_model(random_model_path, random_prompt(256, 19, 2), random_prompt(256, 10, 3))


def test_sharded_checkpoint_was_exercised(random_model_path):
    assert (random_model_path / "model.safetensors.index.json").is_file()


def test_tied_model_shares_head_and_embedding(tiny_model_path):
    model, _ = load_model(tiny_model_path, torch.float32, CPU)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert (model.shape.num_layers, model.shape.num_kv_heads, model.shape.head_dim) == (4, 2, 16)


@pytest.mark.skipif(not available(), reason="the C++ CPU ops are not built here (no compiler?)")
def test_the_linears_keep_gemm_panels_that_follow_their_weights(tiny_model_path):
    """load_model packs every linear's weight for the CPU GEMM once (Linear.pack, the tied head's from the
    embedding); where the weights are replaced (load_weights, store_weights) the panels are packed again, so a
    batch never reads panels of weights gone."""
    from engine.model.linear import Linear
    from engine.model.llama import iter_safetensors

    model, _ = load_model(tiny_model_path, torch.float32, CPU)
    linears = [m for m in model.modules() if isinstance(m, Linear)]

    def follow() -> bool:
        fresh = [kernels.pack_gemm_weight(m.weight) for m in linears]
        return all(
            f is None and m.weight_packed is None or torch.equal(f, m.weight_packed) for f, m in zip(fresh, linears)
        )

    assert all(m.weight_packed is not None for m in linears) and follow()
    model.load_weights((name, tensor * 2) for name, tensor in iter_safetensors(tiny_model_path))
    assert follow()
    model.store_weights(torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16 and follow()
    model.store_weights(torch.float32, "int8")
    assert model.lm_head.weight.dtype == torch.int8 and follow()


def test_unsupported_model_type_is_rejected(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        load_model(tmp_path, torch.float32, CPU)


def test_missing_weight_is_reported(tmp_path, tiny_model_path):
    from safetensors.torch import load_file, save_file

    weights = load_file(tiny_model_path / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_bytes((tiny_model_path / "config.json").read_bytes())
    with pytest.raises(ValueError, match="model.layers.1.self_attn.qkv_proj.weight"):
        load_model(tmp_path, torch.float32, CPU)


def test_rope_looks_positions_up_in_a_table_of_their_cos_and_sin():
    """RotaryEmbedding keeps the cos and sin of every position below max_position_embeddings (vLLM's
    cos_sin_cache): a step's rows are exactly what computing them at its positions gives."""
    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=2,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    rope = RotaryEmbedding(config)
    positions = torch.tensor([0, 7, 255, 3])
    cos, sin = rope(positions, torch.float32)
    assert rope.cos_sin is not None and rope.cos_sin[0].shape == (256, 32)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 32, 2).float() / 32))
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    assert torch.equal(cos, emb.cos()) and torch.equal(sin, emb.sin())
    assert rope(positions, torch.bfloat16)[0].dtype == torch.bfloat16
    with pytest.raises(IndexError):  # past the model's positions: no row
        rope(torch.tensor([256]), torch.float32)
