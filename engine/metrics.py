"""Prometheus metrics of a serving engine under vLLM's names (`vllm/v1/metrics/loggers.py`), so dashboards built
for vLLM read them: counters and histograms computed from the StepRecords alone, gauges from the engine's state at
scrape time (an abort between steps changes the state without a step to record it).

Why the engine decided what it did (engine/reasons.py), where vLLM 0.33 has a name for it, under that name:
`vllm:num_requests_waiting_by_reason` (its two reasons: "deferred", held by a transient status such as a grammar
compiling or remote KV loading, and "capacity", every other waiting request), `vllm:request_num_preemptions` and
the KV block residency histograms (`vllm:kv_block_lifetime_seconds`, `vllm:kv_block_idle_before_evict_seconds`,
`vllm:kv_block_reuse_gap_seconds`, for every block rather than vLLM's sample). Where vLLM has none, `workbench:`
names: `workbench:num_requests_waiting_by_reason` by this engine's reason codes, `workbench:num_preemptions_by_reason`
by the victim's rule."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine.block_life import BlockLife, BlockLifeRecorder
from engine.events import StepRecord
from engine.journey import PREEMPTED, waiting_by_reason

# vLLM's buckets (loggers.py), so histograms line up with a real vLLM's
TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
ITL_BUCKETS = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
REQUEST_LATENCY_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000]
REQUEST_NUM_PREEMPTIONS_BUCKETS = [1, 2, 3, 4, 5, 10, 20]  # vllm/v1/metrics/buckets.py
KV_CACHE_RESIDENCY_BUCKETS = [
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1,
    2,
    5,
    10,
    20,
    30,
    60,
    120,
    300,
    600,
    1200,
    1800,
]
# vLLM's two waiting reasons (loggers.py): "deferred" for a request its status holds back (in this engine: its
# grammar compiling, its remote KV not there yet, its outputs in flight), "capacity" for every other one
WAITING_REASON_CAPACITY, WAITING_REASON_DEFERRED = "capacity", "deferred"
DEFERRED_CODES = frozenset({"grammar", "remote_kv", "outputs_in_flight"})
# the codes a waiting request can be held by (request.deferred's reasons), and a preemption in the step
WAITING_CODES = (
    "budget_spent",
    "unchunked_prompt",
    "max_num_seqs",
    "kv_blocks",
    "grammar",
    "remote_kv",
    "outputs_in_flight",
    "head_of_line",
    "lower_priority",
    "memory_pressure",
    PREEMPTED,
)
PREEMPTION_RULES = ("last_running", "lowest_priority")  # engine/reasons.py's Preemption.rule
FINISH_REASONS = ("stop", "length", "abort", "error")
HISTOGRAMS = {  # key in `histograms`: vLLM's name, its help, its buckets
    "request_prompt_tokens": ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", TOKEN_BUCKETS),
    "request_generation_tokens": (
        "vllm:request_generation_tokens",
        "Number of generation tokens processed.",
        TOKEN_BUCKETS,
    ),
    "ttft": ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS),
    "itl": ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS),
    "e2e": (
        "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        REQUEST_LATENCY_BUCKETS,
    ),
    "queue_time": (
        "vllm:request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        REQUEST_LATENCY_BUCKETS,
    ),
    "request_num_preemptions": (
        "vllm:request_num_preemptions",
        "Histogram of the number of times a request was preempted.",
        REQUEST_NUM_PREEMPTIONS_BUCKETS,
    ),
    "kv_block_lifetime": (
        "vllm:kv_block_lifetime_seconds",
        "Histogram of KV cache block lifetime from allocation to eviction. Every block (not sampled).",
        KV_CACHE_RESIDENCY_BUCKETS,
    ),
    "kv_block_idle_before_evict": (
        "vllm:kv_block_idle_before_evict_seconds",
        "Histogram of idle time before KV cache block eviction. Every block (not sampled).",
        KV_CACHE_RESIDENCY_BUCKETS,
    ),
    "kv_block_reuse_gap": (
        "vllm:kv_block_reuse_gap_seconds",
        "Histogram of time gaps between consecutive KV cache block accesses. Only the most recent accesses are "
        "recorded (ring buffer). Every block (not sampled).",
        KV_CACHE_RESIDENCY_BUCKETS,
    ),
}


@dataclass
class _RequestTimes:
    """What the logger keeps of one unfinished request: its arrival, prompt length and last token's time (ns)."""

    arrival_ns: int
    num_prompt_tokens: int
    num_output_tokens: int = 0
    scheduled: bool = False
    last_token_ns: int | None = None
    num_preemptions: int = 0


class PrometheusStatLogger:
    """Owns the Prometheus registry of one served model and the per-request times the histograms need. Call it
    with every StepRecord (it is an engine subscriber); `render()` gives the text exposition format. It folds the
    records' KV events into block lives of its own (engine/block_life.py) for the residency histograms, and keeps
    which requests run, to tell waiting requests from running ones the budget did not reach."""

    def __init__(
        self, model_name: str, stats: Callable[[], dict[str, Any]], registry: CollectorRegistry | None = None
    ) -> None:
        self.registry = registry or CollectorRegistry()
        self._stats = stats
        self._requests: dict[str, _RequestTimes] = {}
        self._running: set[str] = set()  # as of the last step's end
        self._waiting_by_reason: dict[str, int] = {}  # the last step's (workbench:num_requests_waiting_by_reason)
        self._waiting_labels = set(WAITING_CODES)  # every label shown so far: a reason gone from a step reads 0
        # the residency metrics need no block table: any block size does (it only dates when a block is filled)
        self._blocks = BlockLifeRecorder(block_size=1, on_end=self._block_ended, max_lives_per_block=1)
        labels = {"model_name": model_name, "engine": "0"}
        names = list(labels)

        def make(cls: type, name: str, doc: str, extra: list[str] | None = None, **kwargs: Any) -> Any:
            # with extra labels the caller picks the child per sample; without, the one child is bound here
            metric = cls(name, doc, labelnames=names + (extra or []), registry=self.registry, **kwargs)
            return metric if extra else metric.labels(**labels)

        self._labels = labels
        self.num_requests_running = make(
            Gauge, "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.num_requests_waiting = make(
            Gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.kv_cache_usage = make(Gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_cache_queries = make(
            Counter, "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_cache_hits = make(
            Counter, "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.num_preemptions = make(Counter, "vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.num_requests_waiting_by_reason = make(
            Gauge,
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; "
            "'deferred' = deferred by transient constraints (grammar compiling, KV transfer, outputs in flight). "
            "Sum of all reasons equals vllm:num_requests_waiting.",
            extra=["reason"],
        )
        self.workbench_waiting_by_reason = make(
            Gauge,
            "workbench:num_requests_waiting_by_reason",
            "Number of waiting requests at the end of the last step, by the reason code that held each "
            "(engine/reasons.py; 'preempted': preempted in that step).",
            extra=["reason"],
        )
        self.num_preemptions_by_reason = make(
            Counter,
            "workbench:num_preemptions_by_reason",
            "Cumulative number of preemptions, by how the victim was picked: 'last_running' (FCFS: the most recently "
            "admitted running request) or 'lowest_priority'.",
            extra=["reason"],
        )
        self.prompt_tokens = make(Counter, "vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = make(Counter, "vllm:generation_tokens", "Number of generation tokens processed.")
        self.request_success = make(
            Counter, "vllm:request_success", "Count of successfully processed requests.", extra=["finished_reason"]
        )
        self.histograms = {
            attr: make(Histogram, name, doc, buckets=buckets) for attr, (name, doc, buckets) in HISTOGRAMS.items()
        }
        self.spec_num_drafts = make(Counter, "vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_num_draft_tokens = make(Counter, "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_num_accepted_tokens = make(
            Counter, "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."
        )
        self.spec_accepted_per_pos = make(
            Counter,
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            extra=["position"],
        )
        for reason in FINISH_REASONS:  # present at 0 from the start, as vLLM's are
            self.request_success.labels(**labels, finished_reason=reason)
        for reason in (WAITING_REASON_CAPACITY, WAITING_REASON_DEFERRED):
            self.num_requests_waiting_by_reason.labels(**labels, reason=reason)
        for code in WAITING_CODES:
            self.workbench_waiting_by_reason.labels(**labels, reason=code)
        for rule in PREEMPTION_RULES:
            self.num_preemptions_by_reason.labels(**labels, reason=rule)

    # ---- from the records ----------------------------------------------------------------------------------
    def __call__(self, record: StepRecord) -> None:
        # a request's last tokens are emitted after its request.finished (the stop check comes first): finishes go
        # last, so the last token still counts towards its latencies
        events = record.events
        # waiting as of this step's end, told from running by who ran before it (the handlers update _running)
        self._waiting_by_reason = waiting_by_reason(record, self._running.__contains__)
        for event in [e for e in events if e.kind != "request.finished"] + record.of_kind("request.finished"):
            handler = self._HANDLERS.get(event.kind)
            if handler is not None:
                handler(self, event, record)
        self._blocks.observe(record)
        self._waiting_labels.update(self._waiting_by_reason)
        for code in self._waiting_labels:
            self.workbench_waiting_by_reason.labels(**self._labels, reason=code).set(
                self._waiting_by_reason.get(code, 0)
            )

    def _block_ended(self, life: BlockLife) -> None:
        self.histograms["kv_block_lifetime"].observe(life.lifetime_s)
        self.histograms["kv_block_idle_before_evict"].observe(life.idle_s)
        for gap in life.reuse_gaps_s:
            self.histograms["kv_block_reuse_gap"].observe(gap)

    def _added(self, e: Any, record: StepRecord) -> None:
        self._requests[e.request_id] = _RequestTimes(e.arrival_ns or record.start_ns, e.num_prompt_tokens)

    def _scheduled(self, e: Any, record: StepRecord) -> None:
        self._running.add(e.request_id)
        r = self._requests.get(e.request_id)
        if r is not None and not r.scheduled:
            r.scheduled = True
            self.histograms["queue_time"].observe(max(record.start_ns - r.arrival_ns, 0) / 1e9)

    def _lookup(self, e: Any, record: StepRecord) -> None:
        r = self._requests.get(e.request_id)
        if r is not None:
            self.prefix_cache_queries.inc(r.num_prompt_tokens)
        self.prefix_cache_hits.inc(e.num_hit_tokens)

    def _tokens(self, e: Any, record: StepRecord) -> None:
        self.generation_tokens.inc(len(e.token_ids))
        r = self._requests.get(e.request_id)
        if r is None:
            return
        if r.last_token_ns is None:  # its prefill completed this step: the first token
            self.prompt_tokens.inc(r.num_prompt_tokens)
            self.histograms["ttft"].observe(max(record.end_ns - r.arrival_ns, 0) / 1e9)
        else:
            self.histograms["itl"].observe((record.end_ns - r.last_token_ns) / 1e9)
        r.last_token_ns = record.end_ns
        r.num_output_tokens = e.num_output_tokens

    def _finished(self, e: Any, record: StepRecord) -> None:
        self.request_success.labels(**self._labels, finished_reason=e.reason).inc()
        self._running.discard(e.request_id)
        r = self._requests.pop(e.request_id, None)
        if r is None:
            return
        self.histograms["request_num_preemptions"].observe(r.num_preemptions)
        # an abort between steps is recorded with the step after it: its latency ends with that step
        self.histograms["e2e"].observe(max(record.end_ns - r.arrival_ns, 0) / 1e9)
        self.histograms["request_prompt_tokens"].observe(r.num_prompt_tokens)
        self.histograms["request_generation_tokens"].observe(e.num_output_tokens)

    def _preempted(self, e: Any, record: StepRecord) -> None:
        self.num_preemptions.inc()
        self._running.discard(e.request_id)
        r = self._requests.get(e.request_id)
        if r is not None:
            r.num_preemptions += 1
        if e.reason is not None:
            self.num_preemptions_by_reason.labels(**self._labels, reason=e.reason.rule).inc()

    def _verified(self, e: Any, record: StepRecord) -> None:
        self.spec_num_drafts.inc()
        self.spec_num_draft_tokens.inc(len(e.draft_token_ids))
        # accepted tokens are the accepted prefix: positions after the first rejection do not count
        prefix = next((i for i, ok in enumerate(e.accepted) if not ok), len(e.accepted))
        self.spec_num_accepted_tokens.inc(prefix)
        for position in range(prefix):
            self.spec_accepted_per_pos.labels(**self._labels, position=str(position)).inc()

    _HANDLERS = {
        "request.added": _added,
        "request.scheduled": _scheduled,
        "prefix.lookup": _lookup,
        "request.tokens": _tokens,
        "request.finished": _finished,
        "request.preempted": _preempted,
        "spec.verified": _verified,
    }

    # ---- at scrape time ------------------------------------------------------------------------------------
    def render(self) -> bytes:
        """The Prometheus text format, gauges read from the engine now."""
        stats = self._stats()
        self.num_requests_running.set(stats["num_running"])
        self.num_requests_waiting.set(stats["num_waiting"])
        # vLLM's split of the waiting requests now: those the last step deferred for a transient status, the rest
        # (arrived since, or held for capacity); never more deferred than are waiting (an abort since)
        deferred = min(sum(self._waiting_by_reason.get(code, 0) for code in DEFERRED_CODES), stats["num_waiting"])
        self.num_requests_waiting_by_reason.labels(**self._labels, reason=WAITING_REASON_DEFERRED).set(deferred)
        self.num_requests_waiting_by_reason.labels(**self._labels, reason=WAITING_REASON_CAPACITY).set(
            stats["num_waiting"] - deferred
        )
        kv = stats["kv"]
        self.kv_cache_usage.set(kv.used / kv.total if kv.total else 0.0)
        return generate_latest(self.registry)
