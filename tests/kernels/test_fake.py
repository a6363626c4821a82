"""The C++ CPU ops' fake kernels (kernels/cpu/fake.py), which torch.compile traces them by: every op has one, and
torch.library.opcheck runs each op beside its fake over the shapes the model gives it and compares the outputs'
shapes, dtypes and strides, and the tensors the op writes against those its schema declares (the KV cache).
llama_decoder_layers is checked in tests/model/test_decoder_layer.py, on a model's own layers."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu.build import available
from kernels.cpu.fake import FAKES, UNTRACED
from tests.kernels.test_cpu import paged_case, quantized
from tests.kernels.test_tree_attention import tree_case

pytestmark = pytest.mark.skipif(not available(), reason="the C++ CPU ops are not built here (no compiler?)")

OPS = torch.ops.workbench_cpu


def test_every_op_has_a_fake_kernel():
    names = {
        name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("workbench_cpu::")
    }
    assert names == set(FAKES) | UNTRACED and not UNTRACED & set(FAKES)


def _cases() -> dict[str, tuple]:
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 64, generator=gen), torch.randn(96, 64, generator=gen)
    q8, scale = quantized(w)
    q, k_cache, v_cache, tables, seq_lens, qsl, attn_scale = paged_case(9, 3, 64, 16, [(1, 17), (4, 29)])
    cache_args = (k_cache, v_cache, tables, seq_lens, qsl)
    qkv = torch.randn(5, 15, 64, generator=gen)  # q and k read in place from the fused projection, as the model does
    cos, sin = torch.randn(5, 64, generator=gen), torch.randn(5, 64, generator=gen)
    tree = tree_case()
    return {
        "linear_f32": (x, w, None, torch.randn(96, generator=gen)),
        "linear_bf16": (x, w.bfloat16(), None),
        "linear_w8a8": (x, q8, scale, None),
        "paged_attention": (q, *cache_args, attn_scale),
        "tree_attention": (*tree, tree[0].shape[-1] ** -0.5),
        "store_kvcache": (
            torch.randn(5, 3, 64),
            torch.randn(5, 3, 64),
            k_cache,
            v_cache,
            torch.tensor([3, -1, 0, 40, 7]),
        ),
        "rms_norm": (x, torch.randn(64, generator=gen), 1e-5),
        "fused_add_rms_norm": (x, torch.randn(5, 64, generator=gen), torch.randn(64, generator=gen), 1e-5),
        "rotary": (qkv[:, :9], qkv[:, 9:12], cos, sin),
        "silu_and_mul": (torch.randn(5, 256, generator=gen),),
        "argmax_rows": (torch.randn(5, 1000, generator=gen),),
    }


@pytest.mark.parametrize("name", [name for name in FAKES if name != "llama_decoder_layers"])
def test_the_fake_kernel_agrees_with_the_op(name):
    torch.library.opcheck(getattr(OPS, name).default, _cases()[name])


@torch.library.custom_op("workbench_test::copy_with_a_wrong_fake", mutates_args=())
def _copy(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_copy.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0] + 1, *x.shape[1:]))


def test_a_fake_kernel_with_the_wrong_shape_is_caught():
    wrong = _copy
    with pytest.raises(Exception, match="test_faketensor failed.*Shapes"):
        torch.library.opcheck(wrong, (torch.randn(3, 4),))
