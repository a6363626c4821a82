"""A KV block's life, folded from the StepRecords' events: allocated to whom, filled, hashed and cached, hit by
whom, freed by whom, its hash evicted (why, for whom), then allocated again, which ends the life; and vLLM's three
KV residency metrics (vllm/v1/core/kv_cache_metrics.py) for every block, not a 1% sample.

vLLM's definitions, kept: a block is born when it is allocated and "evicted" when it is allocated again (the
block pool hands it out anew); each prefix hit (a touch) is an access. At the end of a life: its lifetime (birth
to re-allocation), its idle time before eviction (the last access, or its birth, to re-allocation) and the gaps
between its last four accesses (its reuse gaps). Times are the start of the step the event came in (allocations
and hits happen as the step schedules), on the engine's clock. Unlike vLLM, lives are counted with prefix caching
off too (vLLM records them only with it on).

In this engine a block gets its hash when it is cached, so "hashed" and "cached" are one step; it is cached as
soon as its slots are allocated (before the forward computes them), so it may be cached a step before it is filled.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.events import KVAllocated, KVCached, KVEvicted, KVFreed, RequestScheduled, StepRecord
from engine.reasons import Eviction

MAX_ACCESS_HISTORY = 4  # vLLM's BlockMetricsState.access_history: reuse gaps between the last four accesses
MAX_LIVES_PER_BLOCK = 16  # lives kept per block for block_life (the metrics keep every one, up to MAX_SAMPLES)
MAX_SAMPLES = 100_000  # per metric: the most recent samples


@dataclass
class BlockLife:
    """One life of a KV block, from its allocation to the next: steps, with who did what. `hits` and `freed` are
    (step, request id) in order; `eviction` says why its hash went (None while it has one, or never had).
    Once ended (`ended_step`), vLLM's metrics of the life: `lifetime_s`, `idle_s`, `reuse_gaps_s`."""

    block_id: int
    allocated_step: int
    allocated_to: str
    allocated_ns: int
    filled_step: int | None = None
    cached_step: int | None = None
    block_hash: str | None = None
    hits: list[tuple[int, str]] = field(default_factory=list)
    freed: list[tuple[int, str]] = field(default_factory=list)
    evicted_step: int | None = None
    eviction: Eviction | None = None
    ended_step: int | None = None
    ended_for: str | None = None  # the request it was allocated to next
    lifetime_s: float | None = None
    idle_s: float | None = None
    reuse_gaps_s: tuple[float, ...] = ()
    # when it was hit (the start of each hit's step), the last MAX_ACCESS_HISTORY: vLLM's access history
    access_ns: deque[int] = field(default_factory=lambda: deque(maxlen=MAX_ACCESS_HISTORY), repr=False)

    def hit(self, step: int, request_id: str, now_ns: int) -> None:
        self.hits.append((step, request_id))
        self.access_ns.append(now_ns)

    def end(self, step: int, now_ns: int, for_request: str) -> None:
        """Allocated again at `now_ns`: vLLM's eviction, and its metrics."""
        self.ended_step, self.ended_for = step, for_request
        last_access = self.access_ns[-1] if self.access_ns else self.allocated_ns
        self.lifetime_s = (now_ns - self.allocated_ns) / 1e9
        self.idle_s = (now_ns - last_access) / 1e9
        history = list(self.access_ns)
        self.reuse_gaps_s = tuple((b - a) / 1e9 for a, b in zip(history, history[1:]))


@dataclass
class KVBlockMetrics:
    """vLLM's KV residency histograms' samples (vllm:kv_block_lifetime_seconds, vllm:kv_block_idle_before_evict_
    seconds, vllm:kv_block_reuse_gap_seconds), one per ended life of every block (the most recent MAX_SAMPLES)."""

    lifetime_s: deque[float] = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))
    idle_before_evict_s: deque[float] = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))
    reuse_gap_s: deque[float] = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))


class BlockLifeRecorder:
    """Owns the recent lives of every block seen in the StepRecords given to `observe` (the current one last),
    each request's block table as the events tell it (to see which blocks a step fills), and the metrics.
    `on_end` is called with each life as it ends (the Prometheus logger observes its histograms there);
    `max_lives_per_block` bounds what `life` keeps (1 where only the metrics matter)."""

    def __init__(
        self,
        block_size: int,
        on_end: Callable[[BlockLife], None] | None = None,
        max_lives_per_block: int = MAX_LIVES_PER_BLOCK,
    ) -> None:
        self.block_size = block_size
        self.lives: dict[int, deque[BlockLife]] = {}
        self.metrics = KVBlockMetrics()
        self.on_end = on_end
        self.max_lives_per_block = max_lives_per_block
        self._tables: dict[str, tuple[int, ...]] = {}

    def life(self, block_id: int) -> list[BlockLife]:
        """The block's lives seen so far, oldest first (the last MAX_LIVES_PER_BLOCK); empty if never allocated."""
        return list(self.lives.get(block_id, ()))

    def _current(self, block_id: int) -> BlockLife | None:
        lives = self.lives.get(block_id)
        return lives[-1] if lives else None

    def observe(self, record: StepRecord) -> None:
        step, now = record.step, record.start_ns
        for e in record.events:
            if isinstance(e, KVAllocated):
                self._allocated(e, step, now)
            elif isinstance(e, RequestScheduled):
                self._filled(e, step)
            elif isinstance(e, KVCached):
                life = self._current(e.block_id)
                if life is not None:
                    life.cached_step, life.block_hash = step, e.block_hash
            elif isinstance(e, KVFreed):
                self._tables.pop(e.request_id, None)
                for block_id in e.block_ids:
                    life = self._current(block_id)
                    if life is not None:
                        life.freed.append((step, e.request_id))
            elif isinstance(e, KVEvicted):
                life = self._current(e.block_id)
                if life is not None:
                    life.evicted_step, life.eviction = step, e.reason

    def _allocated(self, e: KVAllocated, step: int, now: int) -> None:
        self._tables[e.request_id] = e.block_ids
        for block_id in e.new_block_ids:
            lives = self.lives.get(block_id)
            if lives is None:
                lives = self.lives[block_id] = deque(maxlen=self.max_lives_per_block)
            if lives:
                self._end(lives[-1], step, now, e.request_id)
            lives.append(BlockLife(block_id, step, e.request_id, now))
        for block_id in e.hit_block_ids:
            life = self._current(block_id)
            if life is not None:
                life.hit(step, e.request_id, now)

    def _end(self, life: BlockLife, step: int, now: int, for_request: str) -> None:
        life.end(step, now, for_request)
        assert life.lifetime_s is not None and life.idle_s is not None
        self.metrics.lifetime_s.append(life.lifetime_s)
        self.metrics.idle_before_evict_s.append(life.idle_s)
        self.metrics.reuse_gap_s.extend(life.reuse_gaps_s)
        if self.on_end is not None:
            self.on_end(life)

    def _filled(self, e: RequestScheduled, step: int) -> None:
        """The blocks whose last slot this step computes."""
        table = self._tables.get(e.request_id, ())
        first, end = e.num_computed_tokens // self.block_size, (e.num_computed_tokens + e.num_tokens) // self.block_size
        for index in range(first, min(end, len(table))):
            life = self._current(table[index])
            if life is not None and life.filled_step is None:
                life.filled_step = step
