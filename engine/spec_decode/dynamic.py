"""Dynamic speculative decoding (vLLM 0.33's ``num_speculative_tokens_per_batch_size``, v1/spec_decode/dynamic/):
how many drafts each step proposes, chosen by the step's batch size.

Drafts pay when verification is cheap: at batch 1 a step is bound by reading the weights, and k more rows per
request cost little; as the batch grows the verification's extra rows cost compute, and a draft that is rejected
costs a row for nothing. The schedule says, for ranges of batch sizes, how many drafts to take: vLLM's
``[(range_start, range_end, num_speculative_tokens), ...]``, inclusive ranges sorted from 1, K at most
num_speculative_tokens (0: no drafts at that size). The scheduler looks the step's K up by the number of requests it
scheduled (vLLM's Scheduler.schedule), and the proposer drafts that many for the next step.
"""

from __future__ import annotations

from collections.abc import Sequence

FIELD = "speculative_config.num_speculative_tokens_per_batch_size"


def parse_schedule(schedule: object) -> list[tuple[int, int, int]]:
    """The schedule's entries, sorted; ValueError naming the field unless each is a (start, end, k) of ints with
    1 <= start <= end and k >= 0, the ranges do not overlap, and the first starts at 1 (every batch size has a K)."""
    if not isinstance(schedule, (list, tuple)) or not schedule:
        raise ValueError(f"{FIELD}: must be a non-empty list of (range_start, range_end, num_speculative_tokens)")
    entries = []
    for entry in schedule:
        if not isinstance(entry, (list, tuple)) or len(entry) != 3 or not all(type(v) is int for v in entry):
            raise ValueError(f"{FIELD}: each entry is (range_start, range_end, num_speculative_tokens), got {entry!r}")
        start, end, k = entry
        if not 1 <= start <= end:
            raise ValueError(f"{FIELD}: a batch-size range must have 1 <= start <= end, got ({start}, {end})")
        if k < 0:
            raise ValueError(f"{FIELD}: num_speculative_tokens must be >= 0, got {k} for ({start}, {end})")
        entries.append((start, end, k))
    entries.sort()
    for (_, prev_end, _), (start, end, _) in zip(entries, entries[1:]):
        if start <= prev_end:
            raise ValueError(f"{FIELD}: batch-size ranges overlap at ({start}, {end})")
    if entries[0][0] != 1:
        raise ValueError(f"{FIELD}: the first range must start at 1 (every batch size needs a K), got {entries[0][0]}")
    return entries


def schedule_lookup(schedule: Sequence[Sequence[int]], max_batch_size: int, max_k: int) -> list[int]:
    """The dense table ``lookup[batch_size] -> K`` for batch sizes 1..max_batch_size (index 0 unused), each K at most
    max_k; a batch size between or after the ranges takes the K of the range before it (vLLM's
    build_dynamic_sd_schedule_lookup)."""
    lookup = [0] * (max_batch_size + 1)
    entries = parse_schedule(schedule)
    for i, (start, _, k) in enumerate(entries):
        stop = entries[i + 1][0] - 1 if i + 1 < len(entries) else max_batch_size  # up to the next range
        for size in range(start, min(stop, max_batch_size) + 1):
            lookup[size] = min(k, max_k)
    return lookup
