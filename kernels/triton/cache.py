"""The KV cache write in Triton: ``kernels.reference.store_kvcache`` with one program per token."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kvcache_kernel(
    key_ptr,  # [T, Hkv, D]
    value_ptr,
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    v_cache_ptr,
    slot_mapping_ptr,  # [T]; -1: skip
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_kc_b,
    stride_kc_s,
    stride_kc_h,
    stride_vc_b,
    stride_vc_s,
    stride_vc_h,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_SIZE)[None, :]
    k = tl.load(key_ptr + token * stride_k_t + offs_h[:, None] * stride_k_h + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_v_t + offs_h[:, None] * stride_v_h + offs_d[None, :], mask=mask)
    k_dst = k_cache_ptr + block * stride_kc_b + offset * stride_kc_s + offs_h[:, None] * stride_kc_h + offs_d[None, :]
    v_dst = v_cache_ptr + block * stride_vc_b + offset * stride_vc_s + offs_h[:, None] * stride_vc_h + offs_d[None, :]
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[T, Hkv, D]`` into their flat slots; slot -1 is skipped."""
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    # Only the head dimension must be contiguous: key/value are often views into a fused qkv.
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache/v_cache: the head dimension must be contiguous")
    _store_kvcache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_size),
        BLOCK_SIZE=k_cache.shape[1],
    )
