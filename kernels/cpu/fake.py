"""What each C++ CPU op returns, as shapes alone (fake tensors), so that torch.compile traces the ops into its graph
instead of breaking it at each call. Registered once the library is loaded (``kernels.cpu.build.available``); every
op's outputs are new tensors, and the ops that write the KV cache say so in their schemas (``Tensor(a!)``)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def _linear(x: torch.Tensor, weight: torch.Tensor, *args: object) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


def _like_first(x: torch.Tensor, *args: object) -> torch.Tensor:
    return x.new_empty(x.shape)


def _pair_like_first(x: torch.Tensor, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), x.new_empty(x.shape)


def _rotary(q: torch.Tensor, k: torch.Tensor, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape)


def _silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], x.shape[1] // 2))


def _argmax_rows(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0],), dtype=torch.long)


def _store_kvcache(*args: object) -> None:
    return None


FAKES: dict[str, Callable[..., object]] = {
    "linear_f32": _linear,
    "linear_bf16": _linear,
    "linear_w8a8": _linear,
    "paged_attention": _like_first,
    "tree_attention": _like_first,
    "store_kvcache": _store_kvcache,
    "rms_norm": _like_first,
    "fused_add_rms_norm": _pair_like_first,
    "rotary": _rotary,
    "silu_and_mul": _silu_and_mul,
    "argmax_rows": _argmax_rows,
    "llama_decoder_layers": _pair_like_first,  # the last layer's hidden and residual, both [T, hidden]
}


# ops that run when a model is loaded, never inside a step that torch.compile traces: no fake kernel
UNTRACED = frozenset({"pack_gemm_weight"})


@functools.cache  # torch refuses a second fake kernel for an op
def register() -> None:
    """Give every op in FAKES its fake kernel, once per process (the library must be loaded)."""
    for name, fake in FAKES.items():
        torch.library.register_fake(f"workbench_cpu::{name}")(fake)
