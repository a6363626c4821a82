"""The huge-page arenas: every parameter moved into one unchanged, a tied LM head still the embedding, the KV cache
zeroed in one, and the kernel asked for huge pages where it gives them."""

from __future__ import annotations

import mmap

import pytest
import torch
from torch import nn

from engine.model import hugepages
from engine.model.attention import allocate_kv_caches
from engine.model.hugepages import move_to_hugepages, zeros_on_hugepages
from engine.model.registry import load_model

CPU = torch.device("cpu")


def _arena_range(t: torch.Tensor, arena: torch.Tensor) -> bool:
    start = arena.data_ptr()
    return start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= start + arena.numel()


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_loaded_weights_are_in_one_arena_and_unchanged(tiny_model_path, quantization):
    model, _ = load_model(tiny_model_path, torch.bfloat16, CPU, quantization)
    fresh, _ = load_model(tiny_model_path, torch.bfloat16, CPU, quantization)
    params = dict(model.named_parameters(remove_duplicate=False))
    ptrs = sorted(p.data_ptr() for p in params.values())
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # one allocation: the parameters lie end to end (64-byte aligned) within a span of their total size
    assert ptrs[-1] - ptrs[0] < nbytes + 64 * len(ptrs)
    assert all(ptr % hugepages.ALIGN == 0 for ptr in ptrs)
    for name, p in fresh.named_parameters(remove_duplicate=False):
        assert torch.equal(params[name], p), name
    assert model.lm_head.weight is model.model.embed_tokens.weight or quantization == "int8"


def test_tied_parameter_moves_once_and_stays_tied():
    embed = nn.Embedding(64, 16)
    head = nn.Linear(16, 64, bias=False)
    head.weight = embed.weight
    model = nn.ModuleDict({"embed": embed, "head": head})
    before = embed.weight.detach().clone()
    arena = move_to_hugepages(model)
    assert arena.num_tensors == 1 and arena.nbytes == 64 * 16 * 4
    assert head.weight is embed.weight and torch.equal(embed.weight, before)
    embed.weight.data[0, 0] = 7.0  # one storage: a write through either name is seen by both
    assert head.weight[0, 0] == 7.0


def test_kv_caches_are_zeroed_tensors_of_one_arena(tiny_model_path):
    model, _ = load_model(tiny_model_path, torch.float32, CPU)
    shape = model.shape
    caches = allocate_kv_caches(model, 5, 16, torch.bfloat16, CPU)
    flat = [t for pair in caches for t in pair]
    assert len(caches) == shape.num_layers
    assert all(t.shape == (5, 16, shape.num_kv_heads, shape.head_dim) and t.dtype == torch.bfloat16 for t in flat)
    assert not any(t.any() for t in flat)
    assert len({t.untyped_storage().data_ptr() for t in flat}) == 1  # one mapping, asked for huge pages
    ptrs = [t.data_ptr() for t in flat]
    assert ptrs == sorted(ptrs) and all(ptr % hugepages.ALIGN == 0 for ptr in ptrs)
    flat[1][4, 15] = 1.0  # the last row of layer 0's V: no other tensor sees it
    assert [int(t.count_nonzero()) for t in flat] == [0, shape.num_kv_heads * shape.head_dim] + [0] * (len(flat) - 2)


def test_huge_pages_asked_only_where_the_kernel_gives_them(monkeypatch, tmp_path):
    setting = tmp_path / "enabled"
    monkeypatch.setattr(hugepages, "THP_SETTING", setting)
    for text, expected in (
        ("always [madvise] never", True),
        ("[always] madvise never", True),
        ("always madvise [never]", False),
    ):
        setting.write_text(text)
        for arena in (move_to_hugepages(nn.Linear(8, 8)), zeros_on_hugepages([(4, 4)], torch.float32)[1]):
            assert arena.huge is (expected and hasattr(mmap, "MADV_HUGEPAGE"))
    setting.unlink()
    assert move_to_hugepages(nn.Linear(8, 8)).huge is False
