"""Torch reference kernels (the oracle for the Triton and C++ CPU kernels, and the fallback where neither
runs): linear layers over stored weights, the per-layer norm, RoPE and activation, the paged KV cache and
rejection sampling.

KV cache layout, one pair per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
A token's flat slot is ``block_id * block_size + offset``.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

QBLOCK = 32  # columns of x per quantization scale (llama.cpp's Q8_0 block)


def quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., K]`` as int8-valued floats with one scale per QBLOCK columns of a row (symmetric, dynamic; the
    last block of a row may be shorter): ``sx = max(max|x|, 1e-12) / 127``, ``xq = round-half-even(x / sx)``.
    Returns ``(xq, sx)``, ``sx`` repeated over its block's columns, so ``xq * sx`` is the dequantized ``x``."""
    K = x.shape[-1]
    blocks = torch.nn.functional.pad(x, (0, -K % QBLOCK)).unflatten(-1, (-1, QBLOCK))
    sx = blocks.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 127
    sx = sx.expand(blocks.shape).flatten(-2)[..., :K]
    return torch.round(x / sx).clamp(-127, 127), sx


def linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x`` ``[M, K]`` times the stored ``weight`` ``[N, K]`` transposed, plus ``bias``. What each storage means:
    float32 exact; bfloat16 weights meet the input rounded to bfloat16, products summed in x's dtype (what
    AVX512-BF16's dot product computes); int8 with a per-row ``scale`` ``[N]`` is W8A8: the input quantized to int8
    in blocks of QBLOCK columns (``quantize_blocks``, as llama.cpp quantizes activations for Q8_0), each block's
    integer products scaled by its block's scale, then by the weight row's."""
    if weight.dtype == torch.int8:
        assert scale is not None, "int8 weights need their per-row scale"
        xq, sx = quantize_blocks(x)
        out = ((xq * sx) @ weight.to(x.dtype).T) * scale.to(x.dtype)
        return out if bias is None else out + bias.to(x.dtype)
    if weight.dtype == torch.bfloat16 and x.dtype != torch.bfloat16:
        x = x.to(torch.bfloat16).to(x.dtype)
    w = weight.to(x.dtype)
    if scale is not None:
        w = w * scale.to(x.dtype)[:, None]
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS normalisation of ``x`` ``[T, H]`` with a learned scale, computed in float32 as Hugging Face does."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add in front of a norm: ``(rms_norm(residual + x), residual + x)``."""
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's rotate-half RoPE of ``q`` ``[T, Hq, D]`` and ``k`` ``[T, Hk, D]`` by each token's
    ``cos``/``sin`` ``[T, D]``."""
    return _rotate_half(q, cos, sin), _rotate_half(k, cos, sin)


def _rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``SiLU(gate) * up`` of the fused gate/up projection's output ``[T, 2 * I]``."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax [N] (int64): the first index of the largest value, or of the first NaN."""
    return x.max(dim=-1).indices


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[T, Hkv, D]`` into their flat slots; slot -1 is skipped."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    slots = slot_mapping.to(torch.int64)
    valid = slots >= 0
    if not bool(valid.all()):
        slots, key, value = slots[valid], key[valid], value[valid]
    flat_k.index_copy_(0, slots, key.to(k_cache.dtype))
    flat_v.index_copy_(0, slots, value.to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged context.

    ``q`` ``[T, Hq, D]`` holds the new tokens of all sequences back to back
    (``query_start_loc`` ``[S+1]``); ``seq_lens`` ``[S]`` counts each sequence's whole
    context, new tokens included, which must already be in the cache. New token ``i``
    of a sequence with ``q_len`` new tokens sees the keys at positions
    ``< seq_len - q_len + i + 1``. Returns ``[T, Hq, D]``.
    """
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decodes = [s for s in range(len(lens)) if starts[s + 1] - starts[s] == 1]
    if decodes:
        _decode_batch(q, k_cache, v_cache, block_tables, lens, starts, decodes, scale, out)
    for s in range(len(lens)):
        q_len = starts[s + 1] - starts[s]
        if q_len > 1:
            rows = slice(starts[s], starts[s + 1])
            out[rows] = _prefill_one(q[rows], k_cache, v_cache, block_tables[s], lens[s], scale)
    return out


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` block ids -> ``[..., n * block_size, Hkv, D]`` contiguous K or V."""
    _, block_size, num_kv_heads, head_dim = cache.shape
    picked = cache.index_select(0, block_ids.reshape(-1).to(torch.int64))
    return picked.view(*block_ids.shape[:-1], block_ids.shape[-1] * block_size, num_kv_heads, head_dim)


def _decode_batch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lens: list[int],
    starts: list[int],
    decodes: list[int],
    scale: float,
    out: torch.Tensor,
) -> None:
    """All single-token sequences in one padded SDPA.

    The query heads sharing a KV head are folded into the query-length axis
    (``[B, Hkv, group, D]``): with one query token there is no causal structure,
    so this is exact and avoids repeating K/V per query head.
    """
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    group = q.shape[1] // num_kv_heads
    max_len = max(lens[s] for s in decodes)
    num_blocks = -(-max_len // block_size)
    seq_idx = torch.tensor(decodes, dtype=torch.int64, device=block_tables.device)
    tables = block_tables.index_select(0, seq_idx)[:, :num_blocks]
    # a cache stored narrower than q (bf16 beside float32 arithmetic) is widened here
    k = _gather(k_cache, tables)[:, :max_len].transpose(1, 2).to(q.dtype)
    v = _gather(v_cache, tables)[:, :max_len].transpose(1, 2).to(q.dtype)
    tok_idx = torch.tensor([starts[s] for s in decodes], dtype=torch.int64, device=q.device)
    qd = q.index_select(0, tok_idx).view(len(decodes), num_kv_heads, group, head_dim)
    mask = None
    dec_lens = [lens[s] for s in decodes]
    if min(dec_lens) != max_len:
        lens_t = torch.tensor(dec_lens, device=q.device)
        mask = torch.arange(max_len, device=q.device)[None, :] < lens_t[:, None]
        mask = mask[:, None, None, :]
    o = F.scaled_dot_product_attention(qd, k, v, attn_mask=mask, scale=scale)
    out.index_copy_(0, tok_idx, o.reshape(len(decodes), -1, head_dim))


def _prefill_one(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
) -> torch.Tensor:
    """One sequence with several new tokens (prefill, chunk over cache, or verify)."""
    q_len = q.shape[0]
    num_blocks = -(-seq_len // k_cache.shape[1])
    k = _gather(k_cache, block_table[:num_blocks])[:seq_len].to(q.dtype)
    v = _gather(v_cache, block_table[:num_blocks])[:seq_len].to(q.dtype)
    mask = None
    if q_len != seq_len:
        # New token i sits at absolute position seq_len - q_len + i.
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
    # A leading batch axis: 4-D inputs take the fused CPU kernel (2x faster than 3-D).
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1)


def llama_decoder_layers(*args: object) -> None:
    """No fused decoder stack here: None tells the model to run its layers' kernels one by one (the C++ CPU op,
    ``kernels.cpu.ops.llama_decoder_layers``, takes the same arguments and returns what those would)."""
    return None


def fused_row_limit(params: list[torch.Tensor | None]) -> int:
    """No fused decoder stack here: it runs no rows."""
    return 0


TREE_MASK_BITS = 64  # keys this close to a query row are masked by its tree_mask bits; farther ones are context


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
    """``paged_attention`` in which each query row also carries a mask of the keys just before it (a draft tree:
    a node sees the context, its ancestors and itself).

    New token i of a sequence sits at slot position ``seq_len - q_len + i`` and sees the key at position j when
    ``j <= its position`` and either ``its position - j >= 64`` or bit ``its position - j`` of ``tree_mask[row]``
    (int64 ``[T]``) is set; a row of -1 is plain causal attention. Returns ``[T, Hq, D]``."""
    out = torch.empty_like(q)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    bits = torch.arange(TREE_MASK_BITS, device=q.device)
    for s, seq_len in enumerate(lens):
        rows = slice(starts[s], starts[s + 1])
        q_len = starts[s + 1] - starts[s]
        if q_len == 0:
            continue
        num_blocks = -(-seq_len // k_cache.shape[1])
        k = _gather(k_cache, block_tables[s, :num_blocks])[:seq_len].to(q.dtype)
        v = _gather(v_cache, block_tables[s, :num_blocks])[:seq_len].to(q.dtype)
        # offset of each key behind each query row; a row's bits, unpacked, say which of the nearest it sees
        offset = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None] - torch.arange(
            seq_len, device=q.device
        )
        row_bits = (tree_mask[rows, None] >> bits[None, :]) & 1 == 1  # [q_len, 64]
        near = row_bits.gather(1, offset.clamp(0, TREE_MASK_BITS - 1))
        mask = (offset >= 0) & ((offset >= TREE_MASK_BITS) | near)
        o = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[rows] = o[0].transpose(0, 1)
    return out


# ---------------------------------------------------------------------------------------------
# Rejection sampling (speculative decoding), vLLM V1's layout and names.
#
# Drafts of all requests are flattened: request b owns draft rows
# ``cu_num_draft_tokens[b-1]:cu_num_draft_tokens[b]`` (inclusive cumulative counts, as vLLM).
# ``target_probs`` has one row per draft token (the target's distribution at that position);
# the bonus token, drawn from the target's (k+1)-th distribution, is sampled outside and
# passed in as ``bonus_token_ids``. For greedy requests only the argmax of their target rows
# is used, so those rows may hold logits. All randomness is drawn outside (see
# ``generate_uniform_probs`` / ``generate_recovery_noise``), so the torch and Triton versions
# consume the same noise and emit the same tokens.
# ---------------------------------------------------------------------------------------------

PLACEHOLDER_TOKEN_ID = -1


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
    """Accept a prefix of each request's drafts, then emit one recovered or bonus token.

    Shapes: ``draft_token_ids`` ``[N]``; ``cu_num_draft_tokens`` ``[B]``; ``draft_probs``
    ``[N, V]`` or None (n-gram: the draft is a point mass); ``target_probs`` ``[N, V]``;
    ``bonus_token_ids`` ``[B]``; ``is_greedy`` ``[B]`` bool; ``uniform_probs`` ``[N]``;
    ``recovery_noise`` ``[B, V]`` Exponential(1). Returns ``[B, max_spec_len + 1]`` int32,
    ``PLACEHOLDER_TOKEN_ID`` after each request's last emitted token.

    Greedy requests accept while the draft equals the target's argmax and then emit the
    argmax. Random requests accept with probability ``min(1, p_target / p_draft)``; at the
    first rejection they emit ``argmax(r / q)`` with ``r = max(p_target - p_draft, 0)`` and
    ``q`` the request's noise: a draw from ``normalize(r)`` (the exponential race). A request
    whose drafts are all accepted emits its bonus token.
    """
    batch_size, num_tokens = cu_num_draft_tokens.shape[0], draft_token_ids.shape[0]
    device = target_probs.device
    counts = torch.diff(cu_num_draft_tokens.long(), prepend=cu_num_draft_tokens.new_zeros(1).long())
    req = torch.repeat_interleave(torch.arange(batch_size, device=device), counts, output_size=num_tokens)
    pos = torch.arange(num_tokens, device=device) - (cu_num_draft_tokens.long() - counts)[req]
    drafts = draft_token_ids.long()
    target_argmax = target_probs.argmax(dim=-1)
    p_target = target_probs.gather(1, drafts[:, None])[:, 0].float()
    p_draft = torch.ones_like(p_target) if draft_probs is None else draft_probs.gather(1, drafts[:, None])[:, 0].float()
    greedy = is_greedy[req]
    accepted = torch.where(greedy, drafts == target_argmax, _accept(p_target, p_draft, uniform_probs))
    recovered = (_recovered_probs(target_probs, draft_probs, drafts) / recovery_noise[req]).argmax(dim=-1)
    stop_token = torch.where(greedy, target_argmax, recovered)
    return _emit(batch_size, max_spec_len, req, pos, counts, drafts, accepted, stop_token, bonus_token_ids)


def _accept(p_target: torch.Tensor, p_draft: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Accept with probability min(1, p_target / p_draft) for uniform in [0, 1); never a token the target rules out."""
    return uniform * p_draft < p_target


def _recovered_probs(
    target_probs: torch.Tensor, draft_probs: torch.Tensor | None, drafts: torch.Tensor
) -> torch.Tensor:
    """Unnormalised ``max(p_target - p_draft, 0)``; for a point-mass draft, p_target without the draft token."""
    if draft_probs is None:
        return target_probs.float().scatter(1, drafts[:, None], 0.0)
    return (target_probs.float() - draft_probs.float()).clamp_(min=0.0)


def _emit(
    batch_size: int,
    max_spec_len: int,
    req: torch.Tensor,
    pos: torch.Tensor,
    counts: torch.Tensor,
    drafts: torch.Tensor,
    accepted: torch.Tensor,
    stop_token: torch.Tensor,
    bonus_token_ids: torch.Tensor,
) -> torch.Tensor:
    """Per-token decisions -> ``[B, max_spec_len + 1]``: accepted drafts, then the stop token, then -1."""
    device = drafts.device
    width = max_spec_len + 1
    grid_accepted = torch.ones(batch_size, width, dtype=torch.int32, device=device)
    grid_accepted[req, pos] = accepted.int()
    grid_drafts = torch.zeros(batch_size, width, dtype=torch.int64, device=device)
    grid_drafts[req, pos] = drafts
    grid_stop = torch.zeros_like(grid_drafts)
    grid_stop[req, pos] = stop_token
    # Leading run of accepted drafts; padding past a request's drafts counts as accepted, so cap it.
    num_accepted = torch.minimum(grid_accepted.cumprod(dim=1).sum(dim=1), counts)
    last = torch.where(
        num_accepted == counts,
        bonus_token_ids.reshape(-1).long(),
        grid_stop.gather(1, num_accepted[:, None])[:, 0],
    )
    cols = torch.arange(width, device=device)[None, :]
    out = torch.where(cols < num_accepted[:, None], grid_drafts, PLACEHOLDER_TOKEN_ID)
    out.scatter_(1, num_accepted[:, None], last[:, None])
    return out.to(torch.int32)


def generate_uniform_probs(
    num_draft_tokens: list[int],
    generators: dict[int, torch.Generator],
    device: torch.device | str,
    default_generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``[N]`` float32 uniforms in [0, 1) for the acceptance tests.

    A request with its own generator draws its slice from it alone, and one with no drafts
    draws nothing, so a seeded request's tokens do not depend on the rest of the batch.
    """
    uniform = torch.empty(sum(num_draft_tokens), dtype=torch.float32, device=device)
    uniform.uniform_(generator=default_generator)
    starts = [0, *itertools.accumulate(num_draft_tokens)]
    for b, generator in generators.items():
        if num_draft_tokens[b] > 0:
            uniform[starts[b] : starts[b + 1]].uniform_(generator=generator)
    return uniform


def generate_recovery_noise(
    num_draft_tokens: list[int],
    vocab_size: int,
    generators: dict[int, torch.Generator],
    device: torch.device | str,
    default_generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``[B, V]`` Exponential(1) noise, one row per request, for the recovered-token race.

    One row serves all of a request's positions: only the first rejection emits a token.
    Drawn as -log(U), U in [0, 1), as the engine's sampler draws its noise.
    """
    noise = torch.empty(len(num_draft_tokens), vocab_size, dtype=torch.float32, device=device)
    noise.uniform_(generator=default_generator)
    for b, generator in generators.items():
        if num_draft_tokens[b] > 0:
            noise[b].uniform_(generator=generator)
    return noise.log_().neg_()
