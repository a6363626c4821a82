"""Kernels for the paged KV cache, dispatched by device.

CUDA tensors run ``kernels.triton.<name>`` where that module defines it; everything
else (and CUDA until a Triton kernel exists) runs the torch reference in
``kernels.reference``, which has the same signature. This package imports nothing
from ``engine``.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

import torch

from kernels import reference


@functools.cache
def _impl(name: str, device_type: str) -> Callable:
    if device_type == "cuda":
        try:
            module = importlib.import_module("kernels.triton")
        except ModuleNotFoundError as exc:
            if exc.name != "kernels.triton":
                raise
        else:
            if hasattr(module, name):
                return getattr(module, name)
    return getattr(reference, name)


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's key/value ``[T, Hkv, D]`` into its flat slot (-1: skip)."""
    _impl("store_kvcache", key.device.type)(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of ``q`` ``[T, Hq, D]`` over the paged cache; see ``kernels.reference``."""
    return _impl("paged_attention", q.device.type)(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale
    )


__all__ = ["paged_attention", "store_kvcache"]
