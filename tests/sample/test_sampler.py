"""Sampler: greedy exactness, sampled distributions against exact targets, seeds, logprobs."""

import math

import pytest
import torch

from engine.sample.sampler import Sampler, SamplingMetadata, apply_top_p

# Distinct logits over a small vocabulary, so every filter has a unique answer.
LOGITS = [2.0, 1.5, 1.0, 0.6, 0.3, 0.0, -0.5, -1.2]
DRAWS = 20_000

# (temperature, top_k, top_p, min_p). The comments give the kept set and why the case is there;
# each one is at least ~2% away from a filter boundary.
CASES = [
    (1.0, 0, 1.0, 0.0),  # all; off values in tensors other rows use
    (0.5, 0, 1.0, 0.0),  # all, sharp
    (2.0, 0, 1.0, 0.0),  # all, flat
    (1.0, 3, 1.0, 0.0),  # {0,1,2}
    (1.0, 0, 0.8, 0.0),  # {0..3}
    (1.0, 0, 1.0, 0.2),  # {0..3}
    (2.0, 0, 1.0, 0.3),  # {0..5}; min-p before temperature would keep {0,1,2}
    (3.0, 0, 0.45, 0.0),  # {0,1,2}; top-p before temperature would keep {0,1}
    (0.8, 5, 0.83, 0.0),  # {0,1,2}; top-p on the mass before top-k would keep {0..3}
    (1.5, 6, 0.9, 0.25),  # {0..4}: min-p keeps 6, top-k 6, top-p on those 6
    (2.0, 1, 1.0, 0.0),  # {0}
]


def softmax(z: list[float]) -> list[float]:
    top = max(z)
    e = [math.exp(x - top) for x in z]
    return [x / sum(e) for x in e]


def target_distribution(logits: list[float], t: float, k: int, p: float, min_p: float) -> list[float]:
    """The exact distribution vLLM's rules define, in float64 and plain Python."""
    z = [x / t for x in logits]
    if min_p > 0:
        probs = softmax(z)
        z = [zi if pi >= min_p * max(probs) else -math.inf for zi, pi in zip(z, probs)]
    if 0 < k < len(z):
        kth = sorted(z, reverse=True)[k - 1]
        z = [zi if zi >= kth else -math.inf for zi in z]
    if p < 1:
        probs = softmax(z)
        keep, mass = set(), 0.0
        for i in sorted(range(len(z)), key=lambda i: -probs[i]):
            if mass >= p:
                break
            keep.add(i)
            mass += probs[i]
        z = [zi if i in keep else -math.inf for i, zi in enumerate(z)]
    return softmax(z)


def chi_square(counts: list[int], target: list[float]) -> tuple[float, int]:
    """(statistic, degrees of freedom) over the tokens the target allows."""
    n = sum(counts)
    support = [(c, q * n) for c, q in zip(counts, target) if q > 0]
    return sum((c - e) ** 2 / e for c, e in support), len(support) - 1


def chi_square_critical(df: int, z: float = 4.753) -> float:
    """Upper 1e-6 quantile of chi-square(df) (Wilson-Hilferty): conservative, as the draws are seeded."""
    if df == 0:
        return 0.0
    h = 2 / (9 * df)
    return df * (1 - h + z * math.sqrt(h)) ** 3


def make_metadata(
    temperature: list[float],
    top_k: list[int] | None = None,
    top_p: list[float] | None = None,
    min_p: list[float] | None = None,
    generators: dict[int, torch.Generator] | None = None,
    default_generator: torch.Generator | None = None,
    max_num_logprobs: int | None = None,
) -> SamplingMetadata:
    greedy = [t < 1e-5 for t in temperature]
    return SamplingMetadata(
        temperature=torch.tensor(temperature, dtype=torch.float32),
        top_k=None if top_k is None else torch.tensor(top_k, dtype=torch.int64),
        top_p=None if top_p is None else torch.tensor(top_p, dtype=torch.float32),
        min_p=None if min_p is None else torch.tensor(min_p, dtype=torch.float32),
        generators=generators or {},
        default_generator=default_generator,
        all_greedy=all(greedy),
        all_random=not any(greedy),
        max_num_logprobs=max_num_logprobs,
    )


def sample_counts(cases: list[tuple], sampler: Sampler, with_filters: bool = True) -> list[list[int]]:
    """DRAWS samples of every case, all cases in one batched call; counts per token."""
    rows = [case for case in cases for _ in range(DRAWS)]
    columns = list(zip(*rows))
    md = make_metadata(
        list(columns[0]),
        top_k=list(columns[1]) if with_filters else None,
        top_p=list(columns[2]) if with_filters else None,
        min_p=list(columns[3]) if with_filters else None,
        default_generator=torch.Generator().manual_seed(1234),
    )
    logits = torch.tensor(LOGITS).repeat(len(rows), 1)
    tokens = sampler(logits, md).sampled_token_ids.view(len(cases), DRAWS)
    return [torch.bincount(row, minlength=len(LOGITS)).tolist() for row in tokens]


@pytest.fixture(scope="module")
def filtered_counts() -> dict[int, list[list[int]]]:
    """Counts for CASES with the nucleus found among 8 candidates, and among 2 (most rows then sort)."""
    return {n: sample_counts(CASES, Sampler(top_p_candidates=n)) for n in (8, 2)}


@pytest.mark.parametrize("candidates", [8, 2])
@pytest.mark.parametrize("case", CASES, ids=[f"T{t}-k{k}-p{p}-minp{m}" for t, k, p, m in CASES])
def test_sampled_distribution_matches_target(filtered_counts, candidates, case):
    counts = filtered_counts[candidates][CASES.index(case)]
    target = target_distribution(LOGITS, *case)
    outside = [i for i, (c, q) in enumerate(zip(counts, target)) if q == 0 and c > 0]
    assert not outside, f"tokens outside the kept set were drawn: {outside}, counts {counts}"
    stat, df = chi_square(counts, target)
    assert stat <= chi_square_critical(df), f"chi2 {stat:.1f} (df {df}); counts {counts}, target {target}"


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_only_without_filter_tensors(temperature):
    counts = sample_counts([(temperature, 0, 1.0, 0.0)], Sampler(), with_filters=False)[0]
    stat, df = chi_square(counts, target_distribution(LOGITS, temperature, 0, 1.0, 0.0))
    assert stat <= chi_square_critical(df)


def test_chi_square_rejects_a_slightly_wrong_target(filtered_counts):
    """The check above has power: T=1 draws against the T=1.1 target, or top-p taken before top-k, fail."""
    counts = filtered_counts[8]
    stat, df = chi_square(counts[0], target_distribution(LOGITS, 1.1, 0, 1.0, 0.0))
    assert stat > chi_square_critical(df)
    top_p_first = target_distribution(LOGITS, 0.8, 0, 0.83, 0.0)  # CASES[8] without its top-k
    assert any(c == 0 for c, q in zip(counts[8], top_p_first) if q > 0)


def test_greedy_equals_argmax_with_ties_to_lowest_index():
    logits = torch.randn(16, 1000, generator=torch.Generator().manual_seed(0))
    logits[3, [7, 500]] = 50.0  # a tie
    out = Sampler()(logits, make_metadata([0.0] * 16))
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.sampled_token_ids[3] == 7
    assert out.logprobs is None


def test_greedy_rows_stay_greedy_in_a_mixed_batch():
    gen = torch.Generator().manual_seed(1)
    temperature = [0.0, 1.0, 0.0, 2.0, 1e-6, 0.7]
    # Row 4 (T = 1e-6, no filters) would sample at T = 1 if it were taken for a random row.
    md = make_metadata(
        temperature,
        top_k=[5, 20, 0, 3, 0, 0],
        top_p=[0.1, 0.9, 1.0, 0.5, 1.0, 0.95],
        min_p=[0.5, 0.0, 0.1, 0.0, 0.0, 0.05],
        default_generator=gen,
    )
    greedy = torch.tensor([t < 1e-5 for t in temperature])
    random_rows_left_argmax = False
    for _ in range(30):
        logits = torch.randn(6, 500, generator=gen)
        before = logits.clone()
        sampled = Sampler()(logits, md).sampled_token_ids
        assert torch.equal(logits, before)  # the caller's logits are left alone
        assert torch.equal(sampled[greedy], logits.argmax(dim=-1)[greedy])
        random_rows_left_argmax |= bool((sampled[~greedy] != logits.argmax(dim=-1)[~greedy]).any())
    assert random_rows_left_argmax  # the random rows really were random


def test_filtered_tokens_are_never_drawn_on_a_large_vocab():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(256, 4096, generator=gen) * 3
    k = torch.randint(1, 40, (256,), generator=gen)
    p = torch.rand(256, generator=gen) * 0.9 + 0.05
    md = make_metadata([1.3] * 256, top_k=k.tolist(), top_p=p.tolist(), default_generator=gen)
    sampled = Sampler()(logits, md).sampled_token_ids
    rank = (logits > logits.gather(1, sampled.unsqueeze(1))).sum(dim=1)  # 0 = the most likely
    assert (rank < k).all()
    probs = (
        (logits / 1.3).topk(40).values.masked_fill(torch.arange(40) >= k.unsqueeze(1), float("-inf")).softmax(dim=-1)
    )
    mass_before = (probs.cumsum(dim=-1) - probs).gather(1, rank.unsqueeze(1)).squeeze(1)
    assert (mass_before < p).all()


def test_top_p_candidates_and_full_sort_agree():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 3000, generator=gen) * torch.linspace(0.5, 6, 64).unsqueeze(1)
    p = torch.rand(64, generator=gen) * 0.98 + 0.01
    from_candidates = apply_top_p(logits.clone(), p, top_p_candidates=64)
    from_sort = apply_top_p(logits.clone(), p, top_p_candidates=1)
    covered = logits.softmax(-1).topk(64).values.sum(-1) >= p
    assert 0 < covered.sum() < 64  # both paths were taken
    assert torch.equal(from_candidates.isinf(), from_sort.isinf())


def seeded_tokens(batch_size: int, row: int, seed: int, steps: int = 25, others_seeded: bool = False) -> list[int]:
    """Tokens sampled for one fixed request (own generator) at `row` of batches of other requests."""
    target = torch.randn(2048, generator=torch.Generator().manual_seed(7)) * 2
    own = torch.Generator().manual_seed(seed)
    others = torch.Generator().manual_seed(100 + batch_size)
    temperature = [0.0 if i % 3 == 0 else 1.0 + i / 10 for i in range(batch_size)]
    top_p = [0.5 + 0.4 * (i % 2) for i in range(batch_size)]
    top_k = [0 if i % 2 else 50 for i in range(batch_size)]
    temperature[row], top_p[row], top_k[row] = 0.9, 0.95, 0
    generators = {row: own}
    if others_seeded:
        generators |= {i: torch.Generator().manual_seed(i) for i in range(batch_size) if i != row}
    md = make_metadata(
        temperature,
        top_k=top_k,
        top_p=top_p,
        generators=generators,
        default_generator=others,
        max_num_logprobs=2 if others_seeded else None,
    )
    tokens = []
    for _ in range(steps):
        logits = torch.randn(batch_size, 2048, generator=others) * 3
        logits[row] = target
        tokens.append(int(Sampler()(logits, md).sampled_token_ids[row]))
    return tokens


def test_seeded_row_samples_the_same_tokens_in_any_batch():
    alone = seeded_tokens(batch_size=1, row=0, seed=42)
    assert len(set(alone)) > 10  # a real random sequence, not a constant
    assert seeded_tokens(batch_size=7, row=3, seed=42) == alone
    assert seeded_tokens(batch_size=17, row=16, seed=42, others_seeded=True) == alone
    assert seeded_tokens(batch_size=7, row=3, seed=43) != alone


def test_logprobs_are_raw_with_ranks_and_sorted_top_k():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 500, generator=gen) * 2
    md = make_metadata(
        [0.0, 2.0, 1.0, 0.5, 3.0, 0.0], top_k=[0, 100, 0, 10, 0, 0], default_generator=gen, max_num_logprobs=4
    )
    out = Sampler()(logits, md)
    ids, lps, ranks = out.logprobs
    raw = torch.log_softmax(logits, dim=-1)
    sampled = out.sampled_token_ids
    assert ids.shape == lps.shape == (6, 5)
    assert torch.equal(ids[:, 0], sampled)
    torch.testing.assert_close(lps[:, 0], raw.gather(1, sampled.unsqueeze(1)).squeeze(1))
    order = raw.argsort(dim=-1, descending=True)
    assert torch.equal(ranks, (order == sampled.unsqueeze(1)).int().argmax(dim=-1) + 1)
    assert (ranks[[0, 5]] == 1).all()
    assert torch.equal(ids[:, 1:], order[:, :4])
    torch.testing.assert_close(lps[:, 1:], raw.gather(1, order[:, :4]))
    assert (lps[:, 1:-1] >= lps[:, 2:]).all()


def test_zero_logprobs_returns_only_the_sampled_token():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(5))
    out = Sampler()(logits, make_metadata([0.0] * 3, max_num_logprobs=0))
    assert out.logprobs.logprob_token_ids.shape == (3, 1)
    assert torch.equal(out.logprobs.selected_token_ranks, torch.ones(3, dtype=torch.int64))
