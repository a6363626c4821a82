"""Paged attention in Triton: one launch for decodes, prefill chunks over cached context and
multi-token verification, in the style of vLLM's ``unified_attention`` (our own code).

A program owns one *query block* (up to ``BLOCK_Q`` new tokens of one sequence) and one KV
head: the ``BLOCK_Q x group`` query rows sharing that KV head are one ``[BLOCK_M, D]`` tile,
so each K/V tile is read once for the whole group. It walks the sequence's KV positions in
tiles of ``TILE_SIZE``, through the block table, with an online softmax. Query blocks are
numbered so that sequence ``s`` owns global blocks from ``query_start_loc[s] // BLOCK_Q + s``;
each program finds its sequence by binary search, so the grid needs no host-side mapping.

The split-KV variant (flash-decoding) adds a third grid axis: each program covers a slice of
the KV tiles and writes an unnormalised partial result (accumulator, running max and sum);
``_reduce_splits_kernel`` merges the slices. It pays for decode batches with few KV heads and
long contexts, where ``sequences x KV heads`` programs alone would leave most SMs idle.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

TILE_SIZE = 32
# A split should cover at least this many KV positions, or the reduce costs more than it saves.
MIN_TOKENS_PER_SPLIT = 256
MAX_KV_SPLITS = 16
# Each split count is a compile-time constant, so each is a kernel variant compiled the first time it is chosen,
# in the middle of serving. Any count of 1..16 would be up to 16 unified and 15 reduce variants over a decode loop
# whose contexts grow (~0.5-1 s each); three counts bound that (vLLM fixes 16 segments for the same reason).
KV_SPLIT_COUNTS = (1, 4, MAX_KV_SPLITS)
# exp(x) = exp2(x * log2(e)): exp2 is the cheaper instruction; scores are kept in log2 units.
LOG2E = 1.4426950408889634


@triton.jit
def _find_seq_idx(query_start_loc_ptr, q_block_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence ``s`` whose first query block ``qsl[s] // BLOCK_Q + s`` is <= ``q_block_idx``."""
    left: tl.int32 = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block_idx:
            left = mid + 1
        else:
            right = mid
    return left - 1


# Specialising on these would compile new variants as the batch changes, for no faster code: `num_seqs` only
# bounds a binary search (Triton makes a variant for the value 1) and `stride_bt` (the block table's width this
# step) only offsets a row (a variant when it is a multiple of 16); the query start locations and block ids are
# read a scalar or two at a time, and the runner packs them after the sequence lengths, so their 16-byte
# alignment follows the number of sequences.
@triton.jit(
    do_not_specialize=["num_seqs", "stride_bt"],
    do_not_specialize_on_alignment=["query_start_loc_ptr", "block_tables_ptr"],
)
def _unified_attention_kernel(
    out_ptr,  # [T, Hq, D]; unused when NUM_SPLITS > 1
    partial_acc_ptr,  # [T, Hq, NUM_SPLITS, HEAD_SIZE_PADDED] fp32; unused when NUM_SPLITS == 1
    partial_max_ptr,  # [T, Hq, NUM_SPLITS] fp32, log2 units
    partial_sum_ptr,  # [T, Hq, NUM_SPLITS] fp32
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    v_cache_ptr,
    block_tables_ptr,  # [S, max_blocks] int32
    seq_lens_ptr,  # [S]
    query_start_loc_ptr,  # [S + 1]
    qk_scale,  # softmax scale * log2(e)
    num_seqs,
    num_heads,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_k_b,
    stride_k_s,
    stride_k_h,
    stride_v_b,
    stride_v_s,
    stride_v_h,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_Q: tl.constexpr,  # new tokens per program
    BLOCK_M: tl.constexpr,  # power of two >= BLOCK_Q * GROUP (>= 16 for tl.dot)
    BLOCK_SIZE: tl.constexpr,  # the cache's block size
    TILE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr,  # compute the dots in fp32 (the interpreter's bf16/fp16 dots are unreliable)
    DOT_PRECISION: tl.constexpr,
):
    q_block_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = _find_seq_idx(query_start_loc_ptr, q_block_idx, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block_local = q_block_idx - (q_start // BLOCK_Q + seq)
    if q_block_local * BLOCK_Q >= q_len:
        return  # the grid is an upper bound on the number of query blocks
    context_len = tl.load(seq_lens_ptr + seq) - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_SIZE_PADDED)
    offs_t = tl.arange(0, TILE)
    q_pos = q_block_local * BLOCK_Q + offs_m // GROUP  # index among the sequence's new tokens
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_pos < q_len)
    d_ok = offs_d < HEAD_SIZE
    token = (q_start + q_pos).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    # The last row of this block sees the most keys; no tile beyond them is read.
    kv_end = context_len + tl.minimum((q_block_local + 1) * BLOCK_Q, q_len)
    num_tiles = tl.cdiv(kv_end, TILE)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE_PADDED], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        kv_pos = tile * TILE + offs_t
        kv_ok = kv_pos < kv_end
        block = tl.load(table + kv_pos // BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
        slot_in_block = kv_pos % BLOCK_SIZE
        k = tl.load(  # [D, TILE]
            k_cache_ptr
            + block[None, :] * stride_k_b
            + slot_in_block[None, :] * stride_k_s
            + kv_head * stride_k_h
            + offs_d[:, None],
            mask=d_ok[:, None] & kv_ok[None, :],
            other=0.0,
        )
        v = tl.load(  # [TILE, D]
            v_cache_ptr
            + block[:, None] * stride_v_b
            + slot_in_block[:, None] * stride_v_s
            + kv_head * stride_v_h
            + offs_d[None, :],
            mask=kv_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        # Causal rule: new token i sees kv_pos < context_len + i + 1 (this also bounds kv_pos < kv_end).
        visible = row_ok[:, None] & (kv_pos[None, :] < context_len + q_pos[:, None] + 1)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row with nothing visible yet keeps max -inf; subtract 0 there instead to avoid NaN.
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        part = (token * num_heads + head) * NUM_SPLITS + split
        tl.store(partial_max_ptr + part, m_i, mask=row_ok)
        tl.store(partial_sum_ptr + part, l_i, mask=row_ok)
        tl.store(
            partial_acc_ptr + part[:, None] * HEAD_SIZE_PADDED + offs_d[None, :],
            acc,
            mask=row_ok[:, None] & d_ok[None, :],
        )


@triton.jit
def _reduce_splits_kernel(
    out_ptr,
    partial_acc_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    num_heads,
    stride_o_t,
    stride_o_h,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PADDED: tl.constexpr,
):
    """Merge one (token, head)'s split partials: rescale each by exp2(max - global max)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PADDED)
    offs_d = tl.arange(0, HEAD_SIZE_PADDED)
    s_ok = offs_s < NUM_SPLITS
    d_ok = offs_d < HEAD_SIZE
    part = (token * num_heads + head) * NUM_SPLITS + offs_s
    m = tl.load(partial_max_ptr + part, mask=s_ok, other=float("-inf"))
    l_s = tl.load(partial_sum_ptr + part, mask=s_ok, other=0.0)
    acc = tl.load(
        partial_acc_ptr + part[:, None] * HEAD_SIZE_PADDED + offs_d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    m_max = tl.max(m, axis=0)  # finite: key 0 is visible to every query
    weight = tl.exp2(m - m_max)  # empty splits (max -inf) weigh 0
    out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(l_s * weight, axis=0)
    tl.store(out_ptr + token * stride_o_t + head * stride_o_h + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def choose_num_kv_splits(num_tokens: int, num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """How many KV splits a launch should use; 1 = the plain unified kernel.

    Only decode-only batches split (``num_tokens == num_seqs``), and only when the
    ``sequences x KV heads`` programs would not fill the GPU twice over; the count is rounded down to one of
    ``KV_SPLIT_COUNTS``, so a serving loop compiles a few variants, not one per count. Everything is
    known on the host (``max_context`` is the block table's capacity), so choosing never
    synchronises with the device.
    """
    programs = num_seqs * num_kv_heads
    if num_tokens != num_seqs or programs >= 2 * num_sms:
        return 1
    wanted = min(triton.cdiv(2 * num_sms, programs), max_context // MIN_TOKENS_PER_SPLIT)
    return max(n for n in KV_SPLIT_COUNTS if n <= max(wanted, 1))


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: splitting only adds work
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``kernels.reference.paged_attention`` in Triton; split-KV for decode batches where it pays."""
    num_splits = choose_num_kv_splits(
        q.shape[0],
        seq_lens.shape[0],
        k_cache.shape[2],
        block_tables.shape[1] * k_cache.shape[1],
        _num_sms(q.device),
    )
    return unified_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, num_splits)


def warm_up(num_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype) -> int:
    """Compile, before any request, the variant for each split count ``paged_attention`` can choose, with the
    index dtypes the runner passes (int32 tables, lengths and query starts): a serving loop then never stalls on a
    compile when a growing context changes the split choice. Reads block 0 only; returns the variants launched."""
    device, head_dim = k_cache.device, k_cache.shape[-1]
    q = torch.zeros(1, num_heads, head_dim, dtype=dtype, device=device)
    tables = torch.zeros(1, 1, dtype=torch.int32, device=device)
    seq_lens = torch.ones(1, dtype=torch.int32, device=device)
    query_start_loc = torch.arange(2, dtype=torch.int32, device=device)
    for num_splits in KV_SPLIT_COUNTS:
        unified_attention(q, k_cache, v_cache, tables, seq_lens, query_start_loc, 1.0, num_splits)
    return len(KV_SPLIT_COUNTS)


def unified_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    num_kv_splits: int = 1,
) -> torch.Tensor:
    """Paged attention with an explicit number of KV splits (1: no reduce pass)."""
    num_tokens, num_heads, head_size = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache/v_cache: the head dimension must be contiguous")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    block_m = max(16, triton.next_power_of_2(group))
    block_q = block_m // group
    head_padded = triton.next_power_of_2(head_size)
    num_seqs = seq_lens.shape[0]
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_kv_splits)
    partial_acc = partial_max = partial_sum = out  # placeholders, never touched with one split
    if num_kv_splits > 1:
        partial_acc = torch.empty(
            num_tokens, num_heads, num_kv_splits, head_padded, dtype=torch.float32, device=q.device
        )
        partial_max = torch.empty(num_tokens, num_heads, num_kv_splits, dtype=torch.float32, device=q.device)
        partial_sum = torch.empty_like(partial_max)
    _unified_attention_kernel[grid](
        out,
        partial_acc,
        partial_max,
        partial_sum,
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale * LOG2E,
        num_seqs,
        num_heads,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_SIZE=block_size,
        TILE=TILE_SIZE,
        HEAD_SIZE=head_size,
        HEAD_SIZE_PADDED=head_padded,
        NUM_SPLITS=num_kv_splits,
        UPCAST=q.device.type != "cuda" or q.dtype == torch.float32,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    if num_kv_splits > 1:
        _reduce_splits_kernel[(num_tokens, num_heads)](
            out,
            partial_acc,
            partial_max,
            partial_sum,
            num_heads,
            out.stride(0),
            out.stride(1),
            HEAD_SIZE=head_size,
            HEAD_SIZE_PADDED=head_padded,
            NUM_SPLITS=num_kv_splits,
            SPLITS_PADDED=triton.next_power_of_2(num_kv_splits),
        )
    return out
