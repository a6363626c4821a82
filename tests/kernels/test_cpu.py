"""The C++ CPU ops (kernels/cpu/*.cpp) against their torch references in kernels.reference, on every shape
class the engine sends them: decodes at block boundaries, prefill chunks over cached context, verification
batches, grouped-query heads (SmolLM2's 9/3, Llama's 32/8, Qwen2's 14/2, none), float32 and bfloat16 caches;
linear layers over float32, bfloat16 and int8 (W8A8) weights for 1 to 8 rows, tiles past 8, and the fallbacks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kernels import reference
from kernels.cpu import ops
from kernels.cpu.build import available, has_isa
from kernels.cpu.cpuinfo import cpu_info

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not available(), reason="the C++ CPU ops are not built here (no compiler?)")

ATOL = 2e-5  # float32 over a few hundred keys: reductions in another order


def paged_case(num_heads, num_kv_heads, head_dim, block_size, specs, dtype=torch.float32, seed=0):
    """Random K/V in a cache of scrambled blocks; specs: (new tokens, whole context) per sequence."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-seq // block_size) for _, seq in specs)
    num_blocks = 2 + len(specs) * max_blocks
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1)[: len(specs) * max_blocks]
    tables = ids.view(len(specs), max_blocks).to(torch.int32)
    q = torch.randn(sum(n for n, _ in specs), num_heads, head_dim, generator=gen)
    seq_lens = torch.tensor([seq for _, seq in specs], dtype=torch.int32)
    qsl = torch.tensor([0, *torch.tensor([n for n, _ in specs]).cumsum(0).tolist()], dtype=torch.int32)
    return q, k_cache, v_cache, tables, seq_lens, qsl, head_dim**-0.5


SHAPES = {  # (query heads, kv heads, head dim, block size)
    "smollm2_9_3x64": (9, 3, 64, 16),
    "llama_32_8x128": (32, 8, 128, 16),
    "qwen2_14_2x64": (14, 2, 64, 32),
    "mha_4_4x64": (4, 4, 64, 16),
    "odd_head_dim_6_2x20": (6, 2, 20, 8),
}
MIXES = {
    "decodes_at_block_boundaries": [(1, 1), (1, 15), (1, 16), (1, 17), (1, 32), (1, 33)],
    "prefill_whole": [(40, 40), (16, 16)],
    "chunks_over_cached_context": [(12, 60), (33, 100), (1, 70)],
    "verification_batch": [(4, 29), (5, 80), (1, 9), (3, 3)],
    "long_decode": [(1, 700)],
}


@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
@pytest.mark.parametrize("mix", MIXES, ids=list(MIXES))
def test_paged_attention_equals_the_reference(shape, mix):
    case = paged_case(*SHAPES[shape], MIXES[mix])
    got = torch.ops.workbench_cpu.paged_attention(*case)
    torch.testing.assert_close(got, reference.paged_attention(*case), atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
def test_paged_attention_over_a_bfloat16_cache_equals_the_reference_widened(shape):
    """bf16 rows are read as their even and odd elements: head dims of whole chunks (64 and 128: 16 lanes with
    AVX-512), and 20 (8 lanes on every CPU: a chunk of 16, then 4 columns one by one)."""
    case = paged_case(
        *SHAPES[shape], MIXES["chunks_over_cached_context"] + MIXES["decodes_at_block_boundaries"], dtype=torch.bfloat16
    )
    got = torch.ops.workbench_cpu.paged_attention(*case)
    torch.testing.assert_close(got, reference.paged_attention(*case), atol=ATOL, rtol=1e-5)


SPLIT_SHAPES = [name for name, (_, kv_heads, _, _) in SHAPES.items() if kv_heads < 4]  # one decode's tasks < 2 x 2


@pytest.mark.parametrize("shape", SPLIT_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_lone_decode_split_between_threads_equals_the_reference(shape, dtype):
    """With fewer decode tasks than twice the threads (one decode over 2 or 3 kv heads, on 2 threads), each
    sequence's blocks are split in a part per thread and the parts' softmaxes merged; a part may hold no block
    (one block of keys). The test workers run one thread each: this test asks for two."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for specs in ([(1, 1)], [(1, 16)], [(1, 17)], [(1, 33)], [(1, 700)]):
            case = paged_case(*SHAPES[shape], specs, dtype=dtype)
            got = torch.ops.workbench_cpu.paged_attention(*case)
            torch.testing.assert_close(got, reference.paged_attention(*case), atol=ATOL, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)


def test_the_cpu_attention_fails_when_the_causal_rule_is_off():
    """The comparison can fail: queries that see the whole context (no causal rule) differ, except the last."""
    q, kc, vc, tables, seq_lens, qsl, scale = paged_case(9, 3, 64, 16, [(6, 40)])
    got = torch.ops.workbench_cpu.paged_attention(q, kc, vc, tables, seq_lens, qsl, scale)
    each_alone = torch.arange(7, dtype=torch.int32)
    sees_all = reference.paged_attention(q, kc, vc, tables.expand(6, -1), seq_lens.expand(6), each_alone, scale)
    assert not torch.allclose(got[:5], sees_all[:5], atol=1e-3)
    torch.testing.assert_close(got[5], sees_all[5], atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("op", ["paged_attention", "tree_attention"])
def test_block_tables_that_do_not_cover_their_sequences_are_refused_naming_them(op):
    """The ops read wherever a table points: a table too short for its sequence, or a block that is not in the cache,
    is an error naming the sequence, never a read past the table (a one-block table under 33 tokens crashed a test
    process now and then)."""
    q, kc, vc, tables, seq_lens, qsl, scale = paged_case(9, 3, 64, 16, [(1, 20), (1, 40)])

    def call(tables=tables, seq_lens=seq_lens, qsl=qsl):
        if op == "tree_attention":  # masks of -1: plain causal attention
            mask = torch.full((q.shape[0],), -1, dtype=torch.long)
            return torch.ops.workbench_cpu.tree_attention(q, kc, vc, tables, seq_lens, qsl, mask, scale)
        return torch.ops.workbench_cpu.paged_attention(q, kc, vc, tables, seq_lens, qsl, scale)

    assert call().shape == q.shape
    with pytest.raises(RuntimeError, match="sequence 1 of 40 tokens needs 3 blocks; block_tables has 2 a row"):
        call(tables=tables[:, :2])
    bad = tables.clone()
    bad[1, 2] = kc.shape[0]
    with pytest.raises(RuntimeError, match=f"sequence 1 block 2 is {kc.shape[0]}, not one of the cache's"):
        call(tables=bad)
    with pytest.raises(RuntimeError, match="sequence 0 has 2 new tokens of 1"):
        call(seq_lens=torch.tensor([1, 40], dtype=torch.int32), qsl=torch.tensor([0, 2, 2], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="query_start_loc must run from 0 to q's 2 rows"):
        call(qsl=torch.tensor([0, 1, 3], dtype=torch.int32))


def quantized(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = weight.abs().amax(dim=1) / 127
    return torch.round(weight / scale[:, None]).to(torch.int8), scale


# past 8: tiles of 8 rows and a shorter last one; float32 from 17 rows: the GEMM over packed panels (8 x 48 or, AVX2,
# 6 x 16: (7, 13) a lone short panel of 13 columns); bf16 from 25 rows: the GEMM over packed panels of 48 weight rows,
# (100, 46) a last panel of 4 rows and 23 column pairs (one block of 16 pairs transposed, 7 packed one by one);
# int8 from 17 rows likewise where the columns are whole blocks of 32: (100, 96), 24 quads (16 transposed, 8 not)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 16, 21, 25])
@pytest.mark.parametrize(
    "out_features, in_features",
    [(960, 576), (3072, 576), (576, 1536), (49152, 576), (7, 13), (100, 46), (100, 96)],
)
def test_linear_equals_the_reference_for_each_stored_dtype(rows, out_features, in_features):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    tolerance = dict(atol=1e-4 * in_features**0.5, rtol=1e-5)
    for stored, scale in ((weight, None), (weight.to(torch.bfloat16), None), quantized(weight)):
        torch.testing.assert_close(
            ops.linear(x, stored, scale, bias), reference.linear(x, stored, scale, bias), **tolerance
        )


@pytest.mark.parametrize("rows", [17, 25, 64, 300])
def test_linear_past_small_m_rows_equals_the_reference_for_each_stored_dtype(rows):
    """Past SMALL_M rows float32 weights go to our GEMM over packed panels (tiles of 8 or 6 rows, and a last one of
    fewer: 17, 25 and 300 rows leave one), bf16 stays on our op to 256 rows (300: the reference where the CPU lacks
    AVX512-BF16), int8 at every size: each equals the reference."""
    gen = torch.Generator().manual_seed(rows)
    x, weight, bias = torch.randn(rows, 576, generator=gen), torch.randn(960, 576, generator=gen), torch.randn(960)
    for stored, scale in ((weight, None), (weight.to(torch.bfloat16), None), quantized(weight)):
        for b in (None, bias):
            torch.testing.assert_close(
                ops.linear(x, stored, scale, b), reference.linear(x, stored, scale, b), atol=1e-4 * 576**0.5, rtol=1e-5
            )
    assert rows > ops.SMALL_M


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9, 17, 25, 64])
@pytest.mark.parametrize("out_features, in_features", [(960, 576), (100, 96), (7, 64), (100, 46)])
def test_linear_over_panels_packed_at_load_equals_the_reference(rows, out_features, in_features):
    """Over pack_gemm_weight's panels (made once at load: Linear.pack) the GEMM takes a linear from a few rows (a
    last tile of fewer rows at 3, 5, 9, 17, 25), and equals the reference; from 25 rows, where the GEMM packs its
    panels at each call too, bit for bit that: a last panel of fewer rows (100, 7), pairs and quads left over by
    the 16 x 16 transposes (46, 96). Without AVX512-BF16 bf16 pairs are widened to float32 in the GEMM, over panels
    packed at load only. A weight that no GEMM of this build takes gets no panels: bf16 of an odd width, int8 rows
    not whole blocks of 32."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    for stored, scale in ((weight, None), (weight.to(torch.bfloat16), None), quantized(weight)):
        packed = ops.pack_gemm_weight(stored)
        has_gemm = {
            torch.float32: True,
            # vdpbf16ps's pairs, or pairs widened to float32 (bf16w_gemm)
            torch.bfloat16: in_features % 2 == 0,
            # VNNI's vpdpbusd under AVX-512 (with BW), AVX2's vpmaddubsw otherwise
            torch.int8: in_features % 32 == 0 and (has_isa("avx512_vnni") or not has_isa("avx512f")),
        }[stored.dtype]
        assert (packed is not None) == has_gemm
        if packed is None:
            continue
        got = ops.linear(x, stored, scale, bias, packed)
        want = reference.linear(x, stored, scale, bias)
        torch.testing.assert_close(got, want, atol=1e-4 * in_features**0.5, rtol=1e-5)
        if rows >= 25 and (stored.dtype != torch.bfloat16 or has_isa("avx512_bf16")):  # the widened: panels only
            assert torch.equal(got, ops.linear(x, stored, scale, bias))


def test_panels_of_another_weight_are_refused():
    x, weight = torch.randn(64, 96), torch.randn(100, 96)
    with pytest.raises(RuntimeError, match="packed: expected"):
        ops.linear(x, weight, None, None, ops.pack_gemm_weight(weight[:50]))
    with pytest.raises(RuntimeError, match="packed: expected"):
        ops.linear(x, weight, None, None, ops.pack_gemm_weight(torch.randn(100, 64)))


@pytest.mark.parametrize("rows", [1, 3, 25])
def test_linear_bf16_rounds_its_input_as_torch_does(rows):
    """The op rounds x to bfloat16 itself (8 at a time, then one by one): through an identity weight the output is
    that rounding, which must be torch's, ties to even included (1 + 2^-8 down to 1, 1 + 3 * 2^-8 up to 1 + 2^-6);
    25 rows take the GEMM path. Denormals are left out: AVX512-BF16's dot product flushes them."""
    gen = torch.Generator().manual_seed(rows)
    ties = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), -(1 + 3 * 2**-8), 3.0e38, -3.0e38, 0.0, -0.0])
    x = torch.randn(rows, 30, generator=gen) * 10
    x[:, : len(ties)] = ties
    eye = torch.eye(30).to(torch.bfloat16)
    got = ops.linear(x, eye, None, None)
    assert torch.equal(got, x.to(torch.bfloat16).float())
    assert got[0, 0] == 1.0 and got[0, 1] == 1 + 2**-6


def test_a_float16_weight_falls_back_to_the_reference():
    x, half = torch.randn(2, 64), torch.randn(32, 64).to(torch.float16)
    torch.testing.assert_close(ops.linear(x, half), reference.linear(x, half))


@pytest.mark.parametrize("rows, hidden", [(1, 576), (3, 960), (37, 64), (2, 13)])
def test_rms_norm_with_and_without_the_residual_equals_the_reference(rows, hidden):
    gen = torch.Generator().manual_seed(rows)
    x, residual = (torch.randn(rows, hidden, generator=gen) for _ in range(2))
    weight = torch.randn(hidden, generator=gen)
    torch.testing.assert_close(
        torch.ops.workbench_cpu.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5), atol=1e-5, rtol=1e-5
    )
    got = torch.ops.workbench_cpu.fused_add_rms_norm(x, residual, weight, 1e-5)
    want = reference.fused_add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(got[1], want[1])  # the residual add is one rounding either way


@pytest.mark.parametrize(
    "tokens, heads, kv_heads, head_dim", [(1, 9, 3, 64), (20, 32, 8, 128), (5, 2, 1, 6), (3, 4, 2, 24)]
)
def test_rotary_reads_q_and_k_in_place_in_the_fused_projection_and_equals_the_reference(
    tokens, heads, kv_heads, head_dim
):
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)  # strided views, not copies
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 100
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    for got, want in zip(torch.ops.workbench_cpu.rotary(q, k, cos, sin), reference.rotary(q, k, cos, sin)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_silu_and_mul_equals_the_reference_over_both_signs_and_large_magnitudes():
    x = torch.cat((torch.linspace(-90, 90, 3 * 1536).view(3, 1536), torch.randn(3, 1536)), dim=1)
    torch.testing.assert_close(torch.ops.workbench_cpu.silu_and_mul(x), reference.silu_and_mul(x), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("vocab", [1, 5, 8, 13, 49152, 49157])
def test_argmax_rows_equals_torchs_max_indices_with_ties_nan_and_infinities(vocab):
    """Greedy sampling's argmax: the first index of the largest value (a tie between lanes, within a lane, and in
    the columns past the last whole vector), the first NaN where a row has one, rows of -inf; 70 rows split over the
    threads."""
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(70, vocab, generator=gen)
    x[1] = 0.0  # all equal: index 0
    x[2] = -torch.inf
    x[3, -1] = x[3, vocab // 2] = 9.0  # a tie: the lower index
    x[4, vocab - 1] = 9.0  # in the tail
    x[5, vocab // 3] = torch.nan  # NaN wins, wherever it is
    x[6, -1] = torch.nan
    x[7, 0] = x[7, -1] = torch.inf
    x[8, : min(vocab, 16)] = 5.0  # the same value in every lane: index 0
    got, want = torch.ops.workbench_cpu.argmax_rows(x), reference.argmax_rows(x)
    assert got.dtype == torch.long and torch.equal(got, want)
    assert torch.equal(ops.argmax_rows(x[:, :0].T), reference.argmax_rows(x[:, :0].T))  # [0, 70]: no rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 6])  # rows of 192 values (whole vectors of 16) and of 18 (2 left over)
def test_store_kvcache_writes_each_slot_skips_minus_one_and_equals_the_reference(dtype, head_dim):
    """Exactly the reference's conversion: bf16's ties to even, NaN and infinities, in the vectors and after; rows
    read at their own token stride, and a layout whose heads are not side by side (a transposed view) copied first."""
    gen = torch.Generator().manual_seed(0)
    # key whole, value a view into a fused projection's rows (read in place), as a decoder layer passes them
    key = torch.randn(5, 3, head_dim, generator=gen)
    value = torch.randn(5, 4 * 3 * head_dim, generator=gen)[:, 3 * head_dim : 6 * head_dim].view(5, 3, head_dim)
    special = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), torch.nan, torch.inf, -torch.inf])
    key[0, 0, : len(special)] = special
    key[0, 2, -len(special) :] = special  # the last values of a row: past the last whole vector where head_dim is 6
    slots = torch.tensor([17, -1, 0, 63, 40])
    caches = [[torch.zeros(4, 16, 3, head_dim, dtype=dtype) for _ in range(2)] for _ in range(2)]
    torch.ops.workbench_cpu.store_kvcache(key, value, *caches[0], slots)
    reference.store_kvcache(key, value, *caches[1], slots)
    for a, b in zip(caches[0], caches[1]):  # a NaN stays a NaN (torch's own conversions differ in its bits)
        torch.testing.assert_close(a, b, atol=0, rtol=0, equal_nan=True)
    assert caches[0][1].view(-1, 3, head_dim)[[17, 0, 63, 40]].abs().sum(dim=(1, 2)).all()  # written
    assert caches[0][1].view(-1, 3, head_dim).abs().sum(dim=(1, 2)).count_nonzero() == 4  # the -1 token nowhere
    transposed = key.transpose(0, 1).contiguous().transpose(0, 1)  # token stride head_dim, head stride 5 * head_dim
    torch.ops.workbench_cpu.store_kvcache(transposed, value, *caches[0], slots)
    torch.testing.assert_close(caches[0][0], caches[1][0], atol=0, rtol=0, equal_nan=True)
    with pytest.raises(RuntimeError, match="slot 64 is past the cache's 64 slots"):
        torch.ops.workbench_cpu.store_kvcache(key[:1], value[:1], *caches[0], torch.tensor([64]))


@pytest.mark.parametrize("finished", [True, False], ids=["finished_build", "unfinished_build"])
def test_a_lock_left_by_a_killed_process_blocks_no_later_one(tmp_path, finished):
    # torch's load() takes a lock file on every call; a process killed holding it left it behind, and every later
    # process waited on it (a notebook kernel for 15 minutes): a copy of this machine's build, with such a lock
    import shutil
    import subprocess
    import sys

    from kernels.cpu import build

    if not build.available():
        pytest.skip("the C++ ops are not built here")
    name = build.build_name()
    folder = tmp_path / name
    shutil.copytree(build.build_directory(name), folder, ignore=shutil.ignore_patterns("lock", "built"))
    (folder / "lock").touch()
    if finished:
        (folder / "built").write_text(name)
    code = "from kernels.cpu.build import available; import torch; print(available(), torch.ops.workbench_cpu.rms_norm)"
    # the copy keeps ninja's logs, so the unfinished build is normally a no-op (2 s here); where ninja judges the copy
    # stale it compiles every source (104 s on an idle 2-core machine; a CI run beside another worker timed out at
    # 120 s): the limit only tells a dead lock waited on forever from a build
    run = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)},
        cwd=ROOT,
    )
    assert run.returncode == 0 and run.stdout.startswith("True"), run.stderr
    assert (folder / "built").is_file() and (folder / "lock").exists() == finished  # a build clears a dead lock


@pytest.mark.skipif("avx512f" not in cpu_info().flags, reason="an AVX2-only CPU runs the AVX2 kernels in every test")
def test_the_avx2_kernels_equal_the_reference_on_this_avx512_cpu():
    """WORKBENCH_CPU_ISA=avx2 builds the ops without AVX-512 (what an AVX2-only CPU runs: the linears' 8-wide float
    dots, bf16 widened to float32, int8 through vpmaddubsw; attention 8 lanes wide); the linear and attention tests
    above pass on that build too."""
    import subprocess
    import sys

    from kernels.cpu import build

    here = Path(__file__).relative_to(ROOT)
    code = (
        "from kernels.cpu import build; assert build.available() and build.has_isa('avx2'); print(build.build_name())"
    )
    env = {**os.environ, "WORKBENCH_CPU_ISA": "avx2"}
    name = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert name.returncode == 0 and name.stdout.strip().endswith("_avx2"), name.stderr
    assert (
        "zmm"
        not in subprocess.run(
            ["objdump", "-d", str(build.build_directory(name.stdout.strip()) / f"{name.stdout.strip()}.so")],
            capture_output=True,
            text=True,
        ).stdout
    ), "the AVX2 build holds AVX-512 instructions"
    pytest_args = ["-q", "-p", "no:cacheprovider", "-n", "0", str(here), "-k", "linear or attention"]
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", *pytest_args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert tests.returncode == 0 and " passed" in tests.stdout, tests.stdout[-3000:]
