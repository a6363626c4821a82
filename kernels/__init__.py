"""Kernels for linear layers, norms, RoPE, activations, the paged KV cache and rejection sampling, dispatched by
device.

CUDA tensors run ``kernels.triton.<name>`` where that module defines it; CPU tensors run
``kernels.cpu.ops.<name>`` (C++ ops, built once per machine) where it defines it and a compiler
was found; everything else runs the torch reference in ``kernels.reference``, which has the
same signature. The rejection sampler's noise is
drawn outside both (``generate_uniform_probs``, ``generate_recovery_noise``), so the two
emit the same tokens. This package imports nothing from ``engine``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from kernels import reference
from kernels.reference import PLACEHOLDER_TOKEN_ID, generate_recovery_noise, generate_uniform_probs

# Each (kernel, device type)'s implementation, resolved on its first call. A plain dict, not functools.cache, so that
# torch.compile traces a lookup of what eager calls have resolved (a global dict it guards on) instead of the
# resolution itself: that checks whether the C++ ops are built by reading /proc/cpuinfo, a graph break per kernel.
_IMPLS: dict[tuple[str, str], Callable] = {}


def _impl(name: str, device_type: str) -> Callable:
    impl = _IMPLS.get((name, device_type))
    if impl is None:
        impl = _IMPLS[(name, device_type)] = _resolve(name, device_type)
    return impl


def _resolve(name: str, device_type: str) -> Callable:
    if device_type == "cpu":
        from kernels.cpu import ops
        from kernels.cpu.build import available

        if hasattr(ops, name) and available():
            return getattr(ops, name)
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


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x`` ``[M, K]`` through a linear layer whose weight is stored float32, bfloat16 or int8 (``scale`` per
    output row); see ``kernels.reference``. ``packed``: the weight's panels from ``pack_gemm_weight``, which the
    C++ CPU op reads in place of packing them at each call (the same result)."""
    impl = _impl("linear", x.device.type)
    return impl(x, weight, scale, bias) if packed is None else impl(x, weight, scale, bias, packed)


def pack_gemm_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` ``[N, K]`` packed once into the panels that the C++ CPU op's GEMM otherwise packs at every call,
    over which it takes a linear from a few rows; None where no GEMM of this build takes the weight (another
    device, no C++ ops, bfloat16 of an odd width, int8 rows that are not whole blocks of 32). The panels are a
    second copy of the weight, in the layout of the build that packed them."""
    if weight.device.type != "cpu" or _impl("linear", "cpu") is reference.linear:
        return None
    from kernels.cpu import ops

    return ops.pack_gemm_weight(weight)


def reads_bf16_weights(device: torch.device) -> bool:
    """Whether ``linear`` on `device` reads bfloat16 weights beside float32 activations as they are (the C++ CPU
    op: half the bytes of float32), rather than converting them on every call (the reference)."""
    return device.type == "cpu" and _impl("linear", "cpu") is not reference.linear


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (greedy sampling), ties and NaN as ``x.max(dim=-1).indices``; see ``kernels.reference``."""
    return _impl("argmax_rows", x.device.type)(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS normalisation of ``x`` ``[T, H]`` with a learned scale; see ``kernels.reference``."""
    return _impl("rms_norm", x.device.type)(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(residual + x), residual + x)``: the residual add fused in front of the norm."""
    return _impl("fused_add_rms_norm", x.device.type)(x, residual, weight, eps)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of ``q`` and ``k`` ``[T, H, D]`` by ``cos``/``sin`` ``[T, D]``."""
    return _impl("rotary", q.device.type)(q, k, cos, sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``SiLU(gate) * up`` of ``[T, 2 * I]``."""
    return _impl("silu_and_mul", x.device.type)(x)


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
    return _impl("paged_attention", q.device.type)(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    tree_mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``paged_attention`` with each query row's mask over the keys just before it (draft trees); see
    ``kernels.reference``."""
    return _impl("tree_attention", q.device.type)(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, tree_mask, scale
    )


# Where the CPU op exists, a step runs its Llama decoder layers in one C++ call (llama_decoder_layers): of any number
# of rows with float32 and int8 weights, and with bfloat16 ones up to BF16_ROW_LIMIT (no limit where the CPU has
# AVX512-BF16); `workbench bench profile` turns it off to time the layers' ops one by one.
FUSED_LAYERS = True


def llama_decoder_layers(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    params: list[torch.Tensor | None],
    kv_caches: list[torch.Tensor],
    rope: tuple[torch.Tensor, torch.Tensor],
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    tree_mask: torch.Tensor | None,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    eps: float,
    row_limit: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A run of Llama decoder layers (in each: norms, q/k/v, RoPE, KV write, paged attention, o_proj, the SiLU MLP)
    in one call, bit for bit the layers' ops one by one, where the device has such an op for these inputs (the C++
    CPU op: float32 activations; any number of rows over float32 and int8 weights, up to BF16_ROW_LIMIT over bfloat16).
    `params`: each layer's ``LlamaDecoderLayer.fused_params``, end to end; `kv_caches`: each layer's K and V;
    `tree_mask`: a draft tree's (``tree_attention`` in each layer), or None; `row_limit`: what
    ``fused_row_limit(params)`` returned, from a caller that keeps `params` across steps (None: worked out here).
    Returns the last layer's (hidden, residual), or None where it does not apply: the caller then runs the layers'
    ops one by one."""
    if not (FUSED_LAYERS and hidden.device.type == "cpu"):
        return None
    return _impl("llama_decoder_layers", "cpu")(
        hidden,
        residual,
        params,
        kv_caches,
        rope,
        slot_mapping,
        block_tables,
        seq_lens,
        query_start_loc,
        tree_mask,
        num_heads,
        num_kv_heads,
        scale,
        eps,
        row_limit,
    )


def fused_row_limit(params: list[torch.Tensor | None]) -> int:
    """Rows of input up to which ``llama_decoder_layers`` can run layers of these `params` (each layer's
    ``LlamaDecoderLayer.fused_params``, end to end) on their device: 0 where it never can."""
    device = next((p.device.type for p in params if p is not None), "cpu")
    return _impl("fused_row_limit", device)(params)


def warm_up_paged_attention(num_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype) -> int:
    """Compile now what paged attention will compile while requests run (on CUDA: one Triton variant per split
    count); returns how many variants ran, 0 where nothing is compiled (the CPU ops are built ahead)."""
    if k_cache.device.type != "cuda":
        return 0
    from kernels.triton.attention import warm_up

    return warm_up(num_heads, k_cache, v_cache, dtype)


def rejection_sample(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    is_greedy: torch.Tensor,
    uniform_probs: torch.Tensor,
    recovery_noise: torch.Tensor,
    max_spec_len: int,
) -> torch.Tensor:
    """Speculative decoding's accept/recover/bonus step, ``[B, max_spec_len + 1]``; see ``kernels.reference``."""
    return _impl("rejection_sample", target_probs.device.type)(
        draft_token_ids,
        cu_num_draft_tokens,
        draft_probs,
        target_probs,
        bonus_token_ids,
        is_greedy,
        uniform_probs,
        recovery_noise,
        max_spec_len,
    )


__all__ = [
    "PLACEHOLDER_TOKEN_ID",
    "fused_add_rms_norm",
    "linear",
    "generate_recovery_noise",
    "generate_uniform_probs",
    "paged_attention",
    "reads_bf16_weights",
    "rejection_sample",
    "rms_norm",
    "rotary",
    "silu_and_mul",
    "store_kvcache",
    "tree_attention",
    "warm_up_paged_attention",
]
