"""Fakes for the core tests: requests, configs, and a harness that drives the Scheduler without a model."""

from __future__ import annotations

from collections.abc import Callable

from engine.config import EngineConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.sched.output import SchedulerOutput
from engine.core.sched.phases import PhaseTracker
from engine.core.sched.scheduler import Scheduler
from engine.events import Event, EventLog
from engine.request import Request
from engine.sampling_params import SamplingParams

EOS = 2
# A token that is neither EOS nor a stop token in any test.
TOKEN = 7


def make_request(
    rid: str,
    prompt: list[int] | int,
    max_tokens: int = 16,
    priority: int = 0,
    arrival_time: float | None = None,
    cache_salt: str | None = None,
    **params,
) -> Request:
    """A request over `prompt` (a token list, or a length: tokens 1000, 1001, ... distinct from EOS/TOKEN)."""
    tokens = list(range(1000, 1000 + prompt)) if isinstance(prompt, int) else prompt
    return Request(
        rid,
        tokens,
        SamplingParams(max_tokens=max_tokens, **params),
        eos_token_id=EOS,
        priority=priority,
        cache_salt=cache_salt,
        arrival_time=arrival_time,
    )


def make_config(**overrides) -> EngineConfig:
    """A config that loads nothing; max_model_len is explicit because no model resolves it."""
    settings = dict(
        model="tiny-llama",
        device="cpu",
        block_size=4,
        max_model_len=4096,
        max_num_batched_tokens=64,
        enable_prefix_caching=False,
    )
    settings.update(overrides)
    return EngineConfig(**settings)


def free_ids(kv: KVCacheManager) -> list[int]:
    """Block ids in the free queue, head (evicted first) to tail."""
    return [b.block_id for b in kv.block_pool.free_block_queue.get_all_free_blocks()]


def check_usage(kv: KVCacheManager) -> None:
    """The usage figures add up and agree with the free queue and ref counts."""
    usage = kv.usage()
    pool = kv.block_pool
    free = pool.free_block_queue.get_all_free_blocks()
    assert usage.total == pool.num_blocks - 1
    assert usage.total == usage.used + usage.cached_free + usage.free
    assert usage.used == sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0)
    assert usage.cached_free == sum(1 for b in free if b.block_hash is not None)
    assert usage.free + usage.cached_free == len(free)


Sampler = Callable[[Request], int]


class SchedulerHarness:
    """Owns an EventLog, a KVCacheManager and a Scheduler, and plays the model: each `step` schedules, "computes"
    the scheduled tokens into a fake KV memory (the token id stands in for its K/V), checks that every request
    attends to exactly its own tokens, then feeds one token (from `sampler`, default TOKEN) to every request
    that samples. Labels phases as LLMEngine does; keeps the last step's events, phases ({request id: phase}, batch
    order) and which requests sampled in it."""

    def __init__(self, num_blocks: int = 64, **config_overrides) -> None:
        self.config = make_config(**config_overrides)
        self.events = EventLog()
        self.kv = KVCacheManager(
            num_blocks,
            self.config.block_size,
            self.config.enable_prefix_caching,
            self.config.prefix_caching_hash_algo,
            self.events,
        )
        self.scheduler = Scheduler(self.config, self.kv, self.events)
        self.phase_tracker = PhaseTracker(self.events)
        self.step_count = 0
        self.events.begin(1)
        self.last_events: list[Event] = []
        self.last_phases: dict[str, str] = {}
        self.sampled: list[str] = []  # ids that sampled in the last step (`samples` reads live request state)
        self.kv_memory: dict[int, list[int | None]] = {}  # block id -> the token computed into each slot

    def add(self, *requests: Request) -> None:
        for request in requests:
            self.scheduler.add_request(request)

    def step(self, sampler: Sampler | None = None) -> SchedulerOutput:
        self.step_count += 1
        self.events.begin(self.step_count)
        out = self.scheduler.schedule()
        self.last_phases = self.phase_tracker.label(out)
        self._forward(out)
        sample = sampler or (lambda request: TOKEN)
        tokens = {s.request_id: [sample(s.request)] for s in out.scheduled if s.samples}
        self.sampled = list(tokens)
        self.scheduler.update_from_output(out, tokens)
        self.last_events = self.events.drain()
        return out

    def _forward(self, out: SchedulerOutput) -> None:
        """Write every scheduled token's KV first (as a model writes the whole batch before attention), then
        check that each request's slots up to its last scheduled token hold its own tokens: a prefix hit on
        blocks nobody computed, or a block shared by mistake, fails here."""
        size = self.config.block_size
        for s in out.scheduled:
            tokens = s.request.all_token_ids
            for pos in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens):
                slots = self.kv_memory.setdefault(s.block_ids[pos // size], [None] * size)
                slots[pos % size] = tokens[pos]
        for s in out.scheduled:
            end = s.num_computed_tokens + s.num_new_tokens
            seen = [self.kv_memory.get(s.block_ids[pos // size], [None] * size)[pos % size] for pos in range(end)]
            assert seen == s.request.all_token_ids[:end], f"step {self.step_count}: {s.request_id} reads wrong KV"

    def run(self, max_steps: int = 1000, sampler: Sampler | None = None) -> int:
        """Step until nothing is left; returns the number of steps. Fails rather than loop forever."""
        for n in range(1, max_steps + 1):
            self.step(sampler)
            if not self.scheduler.has_unfinished_requests():
                return n
        raise AssertionError(f"requests still unfinished after {max_steps} steps: {self.scheduler.requests}")

    def of_kind(self, kind: str) -> list[Event]:
        return [e for e in self.last_events if e.kind == kind]
