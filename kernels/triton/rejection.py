"""Rejection sampling in Triton: ``kernels.reference.rejection_sample`` on the same noise.

Two launches, as vLLM V1: a recovered-token candidate for every draft position (grid
``[B, max_spec_len]``, the exponential race over the vocabulary in chunks), then one program
per request that walks its drafts, accepts a prefix and writes the stop token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import PLACEHOLDER_TOKEN_ID

# Vocabulary chunk of the recovered-token race: a 49k-row in one block would spill registers.
BLOCK_V = 1024


@triton.jit
def _draft_range(cu_num_draft_tokens_ptr, req):
    # A masked load rather than `start = 0; if req > 0: start = tl.load(...)`: the compiler refuses a variable
    # that is int32 before the branch and int64 after it (the engine passes int64 offsets); the interpreter let
    # it pass. `other=0` takes the offsets' own dtype, whatever the caller passes.
    start = tl.load(cu_num_draft_tokens_ptr + req - 1, mask=req > 0, other=0)
    end = tl.load(cu_num_draft_tokens_ptr + req)
    return start, end


@triton.jit
def _recovered_tokens_kernel(
    recovered_ptr,  # [N] int32 out
    cu_num_draft_tokens_ptr,  # [B]
    draft_token_ids_ptr,  # [N]
    draft_probs_ptr,  # [N, V] (unused when IS_NGRAM)
    target_probs_ptr,  # [N, V]
    noise_ptr,  # [B, V] Exponential(1)
    is_greedy_ptr,  # [B] bool
    vocab_size,
    stride_draft,
    stride_target,
    stride_noise,
    IS_NGRAM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    req = tl.program_id(0)
    pos = tl.program_id(1)
    # A greedy request never uses a recovered token (it stops at the target's argmax): skip its vocabulary scan.
    if tl.load(is_greedy_ptr + req):
        return
    start, end = _draft_range(cu_num_draft_tokens_ptr, req)
    if pos >= end - start:
        return
    token = (start + pos).to(tl.int64)
    draft_id = tl.load(draft_token_ids_ptr + token)
    best_score = -1.0  # every score is >= 0, so the first chunk always wins
    best_id = 0
    for v0 in range(0, vocab_size, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        ok = offs < vocab_size
        p = tl.load(target_probs_ptr + token * stride_target + offs, mask=ok, other=0.0).to(tl.float32)
        if IS_NGRAM:
            p = tl.where(offs == draft_id, 0.0, p)
        else:
            d = tl.load(draft_probs_ptr + token * stride_draft + offs, mask=ok, other=0.0).to(tl.float32)
            p = tl.maximum(p - d, 0.0)
        q = tl.load(noise_ptr + req.to(tl.int64) * stride_noise + offs, mask=ok, other=1.0)
        score = tl.math.div_rn(p, q)  # IEEE division, as torch: `/` may lower to an approximate one
        chunk_best = tl.max(score, axis=0)
        # Strictly greater: on ties the earlier chunk (lower id) wins, as torch.argmax.
        if chunk_best > best_score:
            best_score = chunk_best
            best_id = v0 + tl.argmax(score, axis=0)
    tl.store(recovered_ptr + token, best_id)


@triton.jit
def _rejection_sample_kernel(
    out_ptr,  # [B, max_spec_len + 1] int32, pre-filled with PLACEHOLDER_TOKEN_ID
    cu_num_draft_tokens_ptr,
    draft_token_ids_ptr,
    draft_probs_ptr,
    target_probs_ptr,
    target_argmax_ptr,  # [N] int32
    recovered_ptr,  # [N] int32
    bonus_token_ids_ptr,  # [B]
    is_greedy_ptr,  # [B] bool
    uniform_probs_ptr,  # [N] float32
    stride_draft,
    stride_target,
    max_spec_len,
    IS_NGRAM: tl.constexpr,
):
    req = tl.program_id(0)
    start, end = _draft_range(cu_num_draft_tokens_ptr, req)
    greedy = tl.load(is_greedy_ptr + req)
    out_row = out_ptr + req.to(tl.int64) * (max_spec_len + 1)
    rejected = False
    for pos in range(end - start):
        if not rejected:
            token = (start + pos).to(tl.int64)
            draft_id = tl.load(draft_token_ids_ptr + token).to(tl.int32)
            if greedy:
                target_id = tl.load(target_argmax_ptr + token)
                accepted = draft_id == target_id
                stop_id = target_id
            else:
                p_target = tl.load(target_probs_ptr + token * stride_target + draft_id).to(tl.float32)
                if IS_NGRAM:
                    p_draft = 1.0
                else:
                    p_draft = tl.load(draft_probs_ptr + token * stride_draft + draft_id).to(tl.float32)
                uniform = tl.load(uniform_probs_ptr + token)
                accepted = uniform * p_draft < p_target
                stop_id = tl.load(recovered_ptr + token)
            if accepted:
                tl.store(out_row + pos, draft_id)
            else:
                tl.store(out_row + pos, stop_id)
                rejected = True
    if not rejected:
        tl.store(out_row + end - start, tl.load(bonus_token_ids_ptr + req).to(tl.int32))


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
    """``kernels.reference.rejection_sample`` in Triton (same arguments, same tokens on the same noise)."""
    batch_size, num_tokens = cu_num_draft_tokens.shape[0], draft_token_ids.shape[0]
    vocab_size = target_probs.shape[-1]
    device = target_probs.device
    out = torch.full((batch_size, max_spec_len + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int32, device=device)
    if batch_size == 0:
        return out
    if target_probs.stride(-1) != 1:
        target_probs = target_probs.contiguous()
    if draft_probs is not None and draft_probs.stride(-1) != 1:
        draft_probs = draft_probs.contiguous()
    recovery_noise = recovery_noise.float().contiguous()
    # The argmax in torch, as the reference: the greedy path then matches it tie for tie.
    target_argmax = target_probs.argmax(dim=-1).to(torch.int32)
    recovered = torch.zeros(num_tokens, dtype=torch.int32, device=device)
    is_ngram = draft_probs is None
    draft_arg = target_probs if draft_probs is None else draft_probs  # a valid pointer the n-gram kernels never read
    if num_tokens > 0 and max_spec_len > 0:
        _recovered_tokens_kernel[(batch_size, max_spec_len)](
            recovered,
            cu_num_draft_tokens,
            draft_token_ids,
            draft_arg,
            target_probs,
            recovery_noise,
            is_greedy,
            vocab_size,
            draft_arg.stride(0),
            target_probs.stride(0),
            recovery_noise.stride(0),
            IS_NGRAM=is_ngram,
            BLOCK=min(BLOCK_V, triton.next_power_of_2(vocab_size)),
        )
    _rejection_sample_kernel[(batch_size,)](
        out,
        cu_num_draft_tokens,
        draft_token_ids,
        draft_arg,
        target_probs,
        target_argmax,
        recovered,
        bonus_token_ids.reshape(-1),
        is_greedy,
        uniform_probs.float(),
        draft_arg.stride(0),
        target_probs.stride(0),
        max_spec_len,
        IS_NGRAM=is_ngram,
    )
    return out
