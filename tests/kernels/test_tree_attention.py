"""Tree attention (a draft tree verified in one pass): the torch reference against attention over each node's own
path, then the C++ CPU op and the Triton kernel (interpreted on CPU) against the reference, over a batch that mixes
a prefill chunk, a decode and trees of different sizes."""

from __future__ import annotations

import pytest
import torch

from engine.spec_decode.tree import SpecTree
from kernels import reference
from kernels.cpu import ops as cpu_ops
from kernels.cpu.build import available as cpu_available
from tests.kernels.test_triton import BLOCK_SIZE, TOLERANCES, paged_case

TREE = SpecTree.parse("[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)]")


def tree_case(dtype=torch.float32, group=3, head_dim=16, seed=0):
    """Sequences: a prefill chunk (mask -1), a tree of 9 rows over 13 context keys, a decode, the same tree cut to
    its first 5 rows (a request given fewer drafts) over 70 context keys (past the mask's 64 bits)."""
    q_lens, contexts = [12, 9, 1, 5], [20, 13, 30, 70]
    case = paged_case(q_lens, [c + n for c, n in zip(contexts, q_lens)], 2, group, head_dim, dtype, seed)
    masks = [-1] * 12 + list(TREE.masks) + [-1] + list(TREE.masks[:5])
    return (*case, torch.tensor(masks, dtype=torch.int64))


def test_tree_masks_see_the_context_the_ancestors_and_themselves():
    # row 7 is (0, 0, 0): tree indices 7 -> 4 -> 1 -> 0; bits are offsets back from row 7, beyond 7 the context
    bits = TREE.masks[7] & ((1 << 64) - 1)
    seen = {7 - b for b in range(8) if bits >> b & 1}
    assert seen == {7, 4, 1, 0}
    assert all(bits >> b & 1 for b in range(8, 64))
    assert TREE.masks[0] == -1  # the root: plain causal
    assert SpecTree.chain(4).masks == (-1,) * 5  # a chain's tree is causal attention


def test_reference_equals_attention_over_each_nodes_own_path():
    """Each tree row's output is causal attention over the context followed by its path alone (a cache laid out as
    if only that path had been drafted): the mask lets nothing else in."""
    q, kc, vc, bt, sl, qsl, masks = tree_case()
    scale = q.shape[-1] ** -0.5
    out = reference.tree_attention(q, kc, vc, bt, sl, qsl, masks, scale)
    s, context = 1, 13  # the 9-row tree
    flat_k, flat_v = kc.flatten(0, 1), vc.flatten(0, 1)
    slots = [int(bt[s, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in range(context + 9)]
    for i in range(9):
        keep = list(range(context)) + [context + j for j in (0, *TREE.path_to(i))]
        keys = torch.tensor([slots[p] for p in keep])
        n = len(keep)
        chain_k, chain_v = torch.zeros(1, n, *kc.shape[2:]), torch.zeros(1, n, *vc.shape[2:])
        chain_k[0], chain_v[0] = flat_k[keys], flat_v[keys]
        row = int(qsl[s]) + i
        expected = reference.paged_attention(
            q[row : row + 1],
            chain_k,
            chain_v,
            torch.zeros(1, 1, dtype=torch.int32),
            torch.tensor([n], dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32),
            scale,
        )
        torch.testing.assert_close(out[row], expected[0])
    # rows of -1 are paged attention's causal rule
    causal = reference.paged_attention(q, kc, vc, bt, sl, qsl, scale)
    torch.testing.assert_close(out[:12], causal[:12])
    torch.testing.assert_close(out[21], causal[21])


def test_reference_fails_when_a_sibling_is_made_visible():
    q, kc, vc, bt, sl, qsl, masks = tree_case()
    scale = q.shape[-1] ** -0.5
    wrong = masks.clone()
    wrong[12 + 2] |= 1 << 1  # tree index 2 also sees its sibling 1
    good = reference.tree_attention(q, kc, vc, bt, sl, qsl, masks, scale)
    bad = reference.tree_attention(q, kc, vc, bt, sl, qsl, wrong, scale)
    assert not torch.allclose(good[14], bad[14])
    torch.testing.assert_close(good[15:], bad[15:])


@pytest.mark.skipif(not cpu_available(), reason="the C++ CPU ops are not built here (no compiler?)")
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_cpu_op_equals_the_reference(cache_dtype):
    q, kc, vc, bt, sl, qsl, masks = tree_case()
    kc, vc = kc.to(cache_dtype), vc.to(cache_dtype)
    scale = q.shape[-1] ** -0.5
    out = cpu_ops.tree_attention(q, kc, vc, bt, sl, qsl, masks, scale)
    expected = reference.tree_attention(q, kc.float(), vc.float(), bt, sl, qsl, masks, scale)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3])
def test_triton_kernel_equals_the_reference(triton_kernels, dtype, group):
    q, kc, vc, bt, sl, qsl, masks = tree_case(dtype, group=group)
    scale = q.shape[-1] ** -0.5
    out = triton_kernels.tree_attention(q, kc, vc, bt, sl, qsl, masks, scale)
    expected = reference.tree_attention(q.float(), kc.float(), vc.float(), bt, sl, qsl, masks, scale)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), expected, **TOLERANCES[dtype])
