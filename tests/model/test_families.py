"""Qwen3 and Qwen3-MoE against transformers on seeded tiny random models of each type (fp32): logits under
every schedule, then greedy generation through the whole engine."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

from engine import LLM, SamplingParams
from engine.model.qwen3 import QKNormLinear
from engine.model.qwen3_moe import SparseMoeBlock, is_sparse_layer
from engine.model.registry import SUPPORTED_MODEL_TYPES, load_model
from tests.model.test_llama import CPU, SMALL, check_model, random_prompt, spread_init
from tests.reference import hf_greedy

MOE = dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
CONFIGS = {
    # head_dim 32 != hidden / heads: Qwen3 sets it explicitly.
    "qwen3": lambda: Qwen3Config(**SMALL, head_dim=32, tie_word_embeddings=True),
    "qwen3_moe": lambda: Qwen3MoeConfig(**SMALL, **MOE, head_dim=16, norm_topk_prob=True),
    # Layer 0 dense (mlp_only_layers), layer 1 sparse; top-k weights not renormalised.
    "qwen3_moe_mixed": lambda: Qwen3MoeConfig(**SMALL, **MOE, head_dim=16, mlp_only_layers=[0], norm_topk_prob=False),
    # Sliding windows shorter than the prompts: every layer (Mistral), or the layers past max_window_layers (Qwen2).
    "mistral_window_6": lambda: MistralConfig(**SMALL, sliding_window=6),
    "qwen2_window_5_layer_1": lambda: Qwen2Config(
        **SMALL, use_sliding_window=True, sliding_window=5, max_window_layers=1
    ),
}


@pytest.fixture(scope="module", params=CONFIGS.keys())
def family_path(request, tmp_path_factory, tiny_model_path):
    config = CONFIGS[request.param]()
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config)
    spread_init(hf, 0)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    # A tokenizer so the engine can run it (prompts are token ids below the tiny vocabulary).
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_model_path / name).is_file():
            shutil.copy2(tiny_model_path / name, path / name)
    return path


def test_family_logits_match_transformers(family_path):
    check_model(family_path, random_prompt(256, 19, 2), random_prompt(256, 10, 3))


def test_family_greedy_matches_transformers(family_path):
    prompts = [random_prompt(256, n, 10 + n) for n in (3, 17, 40)]
    expected = hf_greedy(family_path, prompts, 12)
    llm = LLM(model=str(family_path), block_size=4, max_num_batched_tokens=24, seed=0)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs] == expected


def test_qwen3_norms_load_into_the_projection(family_path):
    model, config = load_model(family_path, torch.float32, CPU)
    if not config.model_type.startswith("qwen3"):
        pytest.skip("no q/k norm")
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QKNormLinear)
    hf = AutoModelForCausalLM.from_pretrained(family_path, dtype=torch.float32)
    torch.testing.assert_close(qkv.q_norm.weight, hf.model.layers[0].self_attn.q_norm.weight, rtol=0, atol=0)
    torch.testing.assert_close(qkv.k_norm.weight, hf.model.layers[0].self_attn.k_norm.weight, rtol=0, atol=0)
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers]
    assert sparse == [is_sparse_layer(config, i) and config.model_type == "qwen3_moe" for i in range(2)]


def test_router_records_top_k_per_token(family_path):
    model, config = load_model(family_path, torch.float32, CPU)
    if config.model_type != "qwen3_moe":
        pytest.skip("dense model")
    block = model.moe_blocks()[-1][1]
    x = torch.randn(5, config.hidden_size, generator=torch.Generator().manual_seed(0))
    block(x)
    ids = block.last_expert_ids
    assert ids.shape == (5, config.num_experts_per_tok)
    expected = (x @ block.gate.weight.T).topk(config.num_experts_per_tok, dim=-1).indices
    assert torch.equal(ids, expected)


def test_windows_are_set_per_layer(family_path):
    model, config = load_model(family_path, torch.float32, CPU)
    windows = [layer.self_attn.sliding_window for layer in model.model.layers]
    expected = {"mistral": [6, 6], "qwen2": [None, 5]}.get(config.model_type, [None, None])
    assert windows == expected


def test_unsupported_type_names_the_supported_ones(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported") as info:
        load_model(tmp_path, torch.float32, CPU)
    for name in SUPPORTED_MODEL_TYPES:
        assert name in str(info.value)


def test_pickle_checkpoint_is_refused(tmp_path, tiny_model_path):
    (tmp_path / "config.json").write_bytes((tiny_model_path / "config.json").read_bytes())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin.*refused because unpickling can run arbitrary code"):
        load_model(tmp_path, torch.float32, CPU)


def test_router_decisions_are_events_equal_to_transformers_routing(family_path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(family_path)
    if config.model_type != "qwen3_moe":
        pytest.skip("dense model")
    prompts = [random_prompt(256, 13, 20), random_prompt(256, 6, 21)]
    llm = LLM(model=str(family_path), block_size=4, max_num_batched_tokens=8, seed=0)
    records = []
    llm.engine.subscribe(records.append)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    events = [e for r in records for e in r.of_kind("moe.routed")]
    assert len(events) == len(records)  # one per step that ran the model
    sparse = [i for i in range(config.num_hidden_layers) if is_sparse_layer(config, i)]
    k = config.num_experts_per_tok
    for record, event in zip(records, events):
        assert list(event.layers) == sparse and event.num_experts == config.num_experts
        tokens = sum(record.scheduled.values())
        assert all(sum(row) == tokens * k for row in event.counts)
        assert {rid: len(choice[0]) for rid, choice in event.token_experts.items()} == record.scheduled
    # Each request's tokens, concatenated over steps, chose the experts transformers' router chooses.
    hf = AutoModelForCausalLM.from_pretrained(family_path, dtype=torch.float32).eval()
    for out in outs:
        ids = (out.prompt_token_ids + out.token_ids)[:-1]  # the last token was sampled, never fed
        with torch.inference_mode():
            router_logits = hf(torch.tensor([ids]), output_router_logits=True).router_logits
        per_layer = [[] for _ in sparse]
        for event in events:
            for layer, tokens in enumerate(event.token_experts.get(out.request_id, [[]] * len(sparse))):
                per_layer[layer] += tokens
        assert len(router_logits) == len(sparse)
        for layer, logits in enumerate(router_logits):
            assert per_layer[layer] == logits.topk(k, dim=-1).indices.tolist()
