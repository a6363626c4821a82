"""The C++ CPU ops with the signatures of ``kernels.reference``, each falling back to the reference for what it
does not cover (float16 or bfloat16 activations, groups of more than 8 query heads per kv head); a bfloat16 linear of
more than BF16_ROW_LIMIT rows on a CPU without AVX512-BF16 is the reference's."""

from __future__ import annotations

import torch

from kernels import reference
from kernels.cpu.build import has_isa

# Rows of input up to which a float32 linear streams its weights once (tiles of up to 8 rows over weight rows held in
# L1); from one more, kernels/cpu/linear.cpp's F32_GEMM_MIN_ROWS, our op is a GEMM over packed panels of weights, which
# ran faster than oneDNN's from 17 to 64 rows and level at 512 (both builds: linear.cpp), so it takes every float32
# linear. When oneDNN's GEMM took them past 24 rows (smollm2's 120 layer linears, same process, alternating, median
# of 9, the tiles / oneDNN, ms; AVX-512 EPYC, 2 threads, 2026-12-03): 29.7 / 53.3 at 8 rows, 41.8 / 52.4 at 16, 49.6 /
# 53.2 at 20, 57.7 / 60.3 at 24, 66.9 / 65.9 at 28, 71.9 / 63.8 at 32; the AVX2 build forced there (against oneDNN's
# AVX-512 kernels, which an AVX2-only CPU lacks) 50.5 / 60.5 at 16, 70.8 / 70.4 at 24, 92.3 / 80.5 at 32.
SMALL_M = 16
# Where the weight's panels were packed at load (kernels.pack_gemm_weight: every linear of a model that load_model
# built, Linear.pack), the GEMM needs no packing and takes float32 from PACKED_SMALL_M + 1 rows (linear.cpp's
# PACKED_F32_MIN_ROWS, where its measurements are): one row is the tiles' under AVX-512, up to 8 under AVX2.
PACKED_SMALL_M = 1 if has_isa("avx512f") else 8
# bfloat16 weights without AVX512-BF16 are widened to float32 as they are read; against the reference (which widens
# the whole weight on every call; same machine and method, 2 threads, paused: 120 linears) that took 18 / 38 / 70 /
# 275 / 577 ms at 16 / 32 / 64 / 256 / 512 rows where the reference took 33 / 48 / 117 / 307 / 532: ours up to 256
# (over panels packed at load, from 8 rows a GEMM that widens them: 423 ms at 256 rows against the reference's 472,
# level at 512, so the limit stands).
# With AVX512-BF16 (vdpbf16ps, 32 products per instruction) and int8 (W8A8 on VNNI or AVX2's vpmaddubsw) our op
# takes every size: bf16 from 25 rows as a GEMM over packed weight panels (kernels/cpu/linear.cpp), at or above
# oneDNN's bf16 GEMM, which would also round every output to bf16.
ANY_ROWS = 1 << 62
BF16_ROW_LIMIT = ANY_ROWS if has_isa("avx512_bf16") else 256


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    if x.dtype == torch.float32 and x.dim() == 2:
        if weight.dtype == torch.int8 and scale is not None:
            return torch.ops.workbench_cpu.linear_w8a8(x, weight, scale, bias, packed)
        if weight.dtype == torch.bfloat16 and scale is None and x.shape[0] <= BF16_ROW_LIMIT:
            return torch.ops.workbench_cpu.linear_bf16(x, weight, bias, packed)
        if weight.dtype == torch.float32 and scale is None:
            return torch.ops.workbench_cpu.linear_f32(x, weight, None, bias, packed)
    return reference.linear(x, weight, scale, bias)


def pack_gemm_weight(weight: torch.Tensor) -> torch.Tensor | None:
    return torch.ops.workbench_cpu.pack_gemm_weight(weight)


def store_kvcache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    if key.dtype == value.dtype == torch.float32 and k_cache.dtype in (torch.float32, torch.bfloat16):
        torch.ops.workbench_cpu.store_kvcache(key, value, k_cache, v_cache, slot_mapping)
    else:
        reference.store_kvcache(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    if (
        q.dtype == torch.float32
        and k_cache.dtype in (torch.float32, torch.bfloat16)
        and q.shape[1] // k_cache.shape[2] <= 8
    ):
        return torch.ops.workbench_cpu.paged_attention(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale
        )
    return reference.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)


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
    if q.dtype == torch.float32 and k_cache.dtype in (torch.float32, torch.bfloat16):
        return torch.ops.workbench_cpu.tree_attention(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, tree_mask, scale
        )
    return reference.tree_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, tree_mask, scale)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] > 0:
        return torch.ops.workbench_cpu.argmax_rows(x)
    return reference.argmax_rows(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32 and weight.dtype == torch.float32 and x.dim() == 2:
        return torch.ops.workbench_cpu.rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dtype == residual.dtype == weight.dtype == torch.float32 and x.dim() == 2:
        return torch.ops.workbench_cpu.fused_add_rms_norm(x, residual, weight, eps)
    return reference.fused_add_rms_norm(x, residual, weight, eps)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if (
        q.dtype == k.dtype == cos.dtype == torch.float32
        and q.stride(-1) == 1
        and k.stride(-1) == 1
        and q.stride(1) == q.shape[2]
        and k.stride(1) == k.shape[2]
    ):
        return torch.ops.workbench_cpu.rotary(q, k, cos, sin)
    return reference.rotary(q, k, cos, sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float32 and x.dim() == 2:
        return torch.ops.workbench_cpu.silu_and_mul(x)
    return reference.silu_and_mul(x)


# LlamaDecoderLayer.fused_params: two norms and four linears' (weight, scale, bias, packed panels)
PARAMS_PER_LAYER = 18
_NORMS, _WEIGHTS, _SCALES = (0, 9), (1, 5, 10, 14), (2, 6, 11, 15)  # where each sits in a layer's PARAMS_PER_LAYER


def fused_row_limit(params: list[torch.Tensor | None]) -> int:
    """Rows of float32 input up to which `linear` above sends every linear of `params` to one of the C++ linear ops
    (int8 weights with their scales and float32 ones at any rows; bfloat16 ones up to BF16_ROW_LIMIT) and the norms
    are float32; 0 where it never does. Read as sets of the dtypes
    of smollm2's 180 tensors: 29 us hot, 0.07 ms in a step, whose weights have just streamed through the caches (the
    AVX-512 EPYC, 2026-12-04); LlamaModel works it out once for the params it keeps."""

    def dtypes(slots: tuple[int, ...]) -> set[torch.dtype | None]:
        return {getattr(p, "dtype", None) for j in slots for p in params[j::PARAMS_PER_LAYER]}

    if dtypes(_NORMS) != {torch.float32}:
        return 0
    weights = dtypes(_WEIGHTS)
    scaled = {p is not None for j in _SCALES for p in params[j::PARAMS_PER_LAYER]}
    if weights == {torch.int8}:
        return ANY_ROWS if scaled == {True} else 0
    if weights <= {torch.bfloat16, torch.float32} and scaled == {False}:
        return BF16_ROW_LIMIT if torch.bfloat16 in weights else ANY_ROWS
    return 0  # a missing linear, another dtype, or int8 beside unscaled weights: the layers run op by op


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
    # the op calls the ops the functions above would pick for these inputs; where any of them would fall back to
    # the reference, the layers are left to run op by op.
    # int8 weights fuse at any batch, bfloat16 ones up to BF16_ROW_LIMIT (any, with AVX512-BF16): a bf16 step of 64
    # decodes ran its forward in 115.2 ms fused against 123.9 op by op, int8 101.1 against 111.7 (smollm2-135m,
    # alternating in one process, AVX-512 EPYC, 2026-12-03)
    cos, sin = rope
    applies = (
        hidden.dtype == cos.dtype == torch.float32
        and hidden.dim() == 2
        and {cache.dtype for cache in kv_caches} <= {torch.float32, torch.bfloat16}
        and num_heads // num_kv_heads <= 8
        and hidden.shape[0] <= (fused_row_limit(params) if row_limit is None else row_limit)
    )
    if not applies:
        return None
    return torch.ops.workbench_cpu.llama_decoder_layers.default(
        hidden,
        residual,
        params,
        kv_caches,
        cos,
        sin,
        slot_mapping,
        block_tables,
        seq_lens,
        query_start_loc,
        tree_mask,
        num_heads,
        num_kv_heads,
        scale,
        eps,
    )
