"""LLMEngine: add_request / step / abort over the scheduler, KV cache manager and model runner."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from engine.block_life import BlockLife
from engine.clock import Clock, SimulatedClock
from engine.config import EngineConfig
from engine.core.block_hash import hash_hex
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.sched.output import SchedulerOutput
from engine.core.sched.phases import PhaseTracker
from engine.core.sched.scheduler import Scheduler
from engine.events import (
    BlockSnapshot,
    EngineSnapshot,
    Event,
    EventLog,
    RequestAdded,
    RequestSnapshot,
    RequestTokens,
    SpecVerified,
    StepRecord,
    StepTiming,
    Subscriber,
)
from engine.executor import get_executor_class
from engine.journey import Explainer, Journey
from engine.limits import check_engine_limits
from engine.output_processor import IncrementalDetokenizer, make_output
from engine.outputs import RequestOutput
from engine.parallel_sampling import ParentRequest
from engine.request import Request, RequestStatus
from engine.sample.logits_processors import bad_words_token_ids, check_token_ids, uses_logits_options
from engine.sampling_params import SamplingParams
from engine.structured_output.manager import StructuredOutputManager, xgrammar_backend

if TYPE_CHECKING:
    from engine.distributed.kv_events import EventPublisher
    from engine.executor.sim.cost_model import CostModel
    from engine.kv_transfer.base import KVCache, KVConnectorBase
    from engine.profiler import EngineProfiler
    from engine.tracing import RequestTracer


class LLMEngine:
    """Owns one engine instance: the config, tokenizer, scheduler, KV cache manager, model runner, the
    per-step event log, the subscribers, and the outputs of requests until they are taken."""

    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        if config is None:
            config = EngineConfig.from_kwargs(**kwargs)
        elif kwargs:
            raise TypeError("LLMEngine: pass either an EngineConfig or keyword arguments, not both")
        self.config = config
        self.events = EventLog()
        self.events.begin(1)  # adds and aborts between steps belong to the step that follows them
        # every stamp below (records, arrivals, request metrics) reads this clock: simulated time when simulated
        self.clock = SimulatedClock() if config.simulated else Clock()
        """The clock every stamp reads: wall time, or with the simulated executor a `SimulatedClock` that moves
        only by each step's priced time (and by `sleep_until`, to jump idle time to the next arrival)."""
        self.executor = get_executor_class(config)(config, self.events, self.clock)
        self.model_path = self.executor.model_path  # None for a simulated model without a folder
        self.runner = self.executor.runner  # the in-process ModelRunner (None when simulated)
        shape = self.executor.model_shape
        config.set_max_model_len(shape.max_position_embeddings or 2048)  # sliding windows are applied in attention
        self.tokenizer = self.executor.load_tokenizer()
        self.eos_token_id = self._eos_token_id()
        self.kv_cache_manager = KVCacheManager(
            self.executor.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            config.prefix_caching_hash_algo,
            self.events,
            max_model_len=config.max_model_len,
            enable_kv_cache_events=config.kv_events is not None and config.kv_events.enable_kv_cache_events,
        )
        self.structured = StructuredOutputManager(self.tokenizer, self.executor.vocab_size, self.events)
        self.connector = None
        if config.kv_transfer is not None:
            from engine.kv_transfer.factory import create_connector

            self.connector = create_connector(config, shape.num_layers, shape.num_kv_heads, shape.head_dim, self.events)
        self.scheduler = Scheduler(
            config, self.kv_cache_manager, self.events, self.structured, self.connector, clock=self.clock
        )
        self.phase_tracker = PhaseTracker(self.events)  # names what each scheduled request does, for the StepRecord
        # every request's journey and every block's life, folded from the records as they are made (explain)
        self.explainer = Explainer(config.block_size)
        self.step_count = 0
        self._subscribers: list[Subscriber] = []
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._requests: dict[str, Request] = {}  # every request not yet taken by pop_output
        self._parents: dict[str, ParentRequest] = {}  # requests with n > 1, by the id the user holds
        self._ids = itertools.count()
        # async_scheduling: the batch run last step, whose outputs the scheduler takes in this one (vLLM's batch
        # queue of two: schedule the next batch, then update from the one in flight)
        self._in_flight: tuple[SchedulerOutput, Any] | None = None
        # vLLM's --kv-events-config (engine/distributed/kv_events.py), made after the rest: its thread and sockets
        # need closing, which nothing would do for an engine that failed to build
        self.kv_event_publisher: EventPublisher | None = None
        if config.kv_events is not None and config.kv_events.enable_kv_cache_events:
            from engine.distributed.kv_events import create_publisher  # pyzmq and msgspec: for KV events only

            try:
                self.kv_event_publisher = create_publisher(config.kv_events, config.data_parallel_rank)
            except BaseException:
                self.executor.shutdown()
                raise
        # vLLM's --otlp-traces-endpoint: a span per request, made from the StepRecords (engine/tracing.py)
        self.tracer: RequestTracer | None = None
        if config.otlp_traces_endpoint is not None:
            from engine.tracing import RequestTracer

            self.tracer = RequestTracer(config.otlp_traces_endpoint, config.collect_detailed_traces)
            self.subscribe(self.tracer)
        # vLLM's --profiler-config: the torch profiler of /start_profile, /stop_profile (engine/profiler.py)
        self.profiler: EngineProfiler | None = None
        if config.profiler is not None:
            from engine.profiler import EngineProfiler

            self.profiler = EngineProfiler(config.profiler, config.device or "cpu")

    def _eos_token_id(self) -> int | None:
        eos = self.executor.eos_token_id
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return eos if eos is not None else self.tokenizer.eos_token_id

    # ---- requests -----------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        kv_transfer_params: dict | None = None,
        trace_headers: Mapping[str, str] | None = None,
    ) -> str:
        """Validate and queue a request; returns its id. Bad input raises ValueError/TypeError naming the field.
        `kv_transfer_params` (vLLM's names): do_remote_decode on a prefill instance, or what a prefill
        instance returned (do_remote_prefill, remote_request_id, ...) on a decode instance. `trace_headers`: the
        caller's W3C trace context (traceparent, tracestate), the parent of the request's span when
        otlp_traces_endpoint is set (ignored otherwise)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params: expected SamplingParams, got {type(params).__name__}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority: expected int, got {type(priority).__name__}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt: expected str or None, got {type(cache_salt).__name__}")
        if kv_transfer_params is not None and not isinstance(kv_transfer_params, dict):
            raise TypeError(f"kv_transfer_params: expected dict or None, got {type(kv_transfer_params).__name__}")
        token_ids = self._tokenize(prompt)
        self.executor.validate_request(params)
        if arrival_time is None:  # on the engine's clock (simulated time when simulated)
            arrival_time = self.clock.monotonic()
        self._validate_length(token_ids, params)
        check_engine_limits(params, self.config)  # n within max_num_seqs, logprobs within max_logprobs
        if params.structured_outputs is not None:  # a bad grammar is refused here; the compile stays asynchronous
            xgrammar_backend().validate_structured_outputs(params.structured_outputs)
        bad_words = self._check_logits_options(params)
        rid = str(next(self._ids)) if request_id is None else str(request_id)
        parent = None
        if params.n == 1:
            ids, children = [rid], [params]
        else:
            if kv_transfer_params is not None:
                raise ValueError("n: parallel sampling (n > 1) is not supported with kv_transfer_params")
            parent = ParentRequest(rid, params)
            ids, children = parent.child_ids, [parent.child_params(i) for i in range(params.n)]
        taken = [i for i in [rid, *ids] if i in self._requests or i in self._parents]
        if taken:
            raise ValueError(f"request_id: {taken[0]!r} is already in use")
        if parent is not None:
            self._parents[rid] = parent
        text = prompt if isinstance(prompt, str) else self.tokenizer.decode(token_ids[:200])
        if self.tracer is not None:
            self.tracer.add_request(rid, ids, params, trace_headers)
        for child_id, child_params in zip(ids, children):
            request = Request(
                child_id,
                token_ids,
                child_params,
                self.eos_token_id,
                priority,
                cache_salt,
                arrival_time,
                kv_transfer_params,
            )
            request.bad_words_token_ids = bad_words
            self._requests[child_id] = request
            self._detokenizers[child_id] = IncrementalDetokenizer(self.tokenizer, request)
            self.scheduler.add_request(request)
            self.events.emit(
                RequestAdded,
                request_id=child_id,
                num_prompt_tokens=len(token_ids),
                max_tokens=params.max_tokens,
                priority=priority,
                arrival_ns=self.clock.time_ns(),
                prompt=text[:200],
            )
        return rid

    def child_ids(self, request_id: str) -> list[str]:
        """The ids the scheduler and the events use for `request_id`: its children's with n > 1, else itself."""
        parent = self._parents.get(request_id)
        return [request_id] if parent is None else list(parent.child_ids)

    def _check_logits_options(self, params: SamplingParams) -> list[list[int]]:
        """Token ids of the logits options within the vocabulary; `bad_words` tokenized (returned)."""
        if params.min_tokens and self.config.speculative is not None:
            # the sampler bans EOS and stop ids before min_tokens; verification of drafts does not yet
            raise ValueError("min_tokens: not supported with speculative_config yet")
        if not uses_logits_options(params):
            return []
        if self.config.speculative is not None:
            # drafts are verified against the plain distribution: the options would be ignored there
            raise ValueError(
                "penalties, logit_bias, bad_words and allowed_token_ids: not supported with speculative_config yet"
            )
        check_token_ids(params, self.executor.vocab_size)
        return bad_words_token_ids(params.bad_words or [], self.tokenizer, self.executor.vocab_size)

    def _tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        elif isinstance(prompt, Sequence):
            token_ids = list(prompt)
            bad = next((t for t in token_ids if isinstance(t, bool) or not isinstance(t, int)), None)
            if bad is not None:
                raise TypeError(f"prompt: token ids must be int, got {type(bad).__name__} ({bad!r})")
            vocab = self.executor.vocab_size
            out = next((t for t in token_ids if not 0 <= t < vocab), None)
            if out is not None:
                raise ValueError(f"prompt: token id {out} is outside the vocabulary [0, {vocab})")
        else:
            raise TypeError(f"prompt: expected str or list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("prompt: must not be empty")
        return token_ids

    def _validate_length(self, token_ids: list[int], params: SamplingParams) -> None:
        cfg, max_model_len = self.config, self.config.max_model_len
        assert max_model_len is not None, "resolved from the model in __init__"
        if len(token_ids) >= max_model_len:
            raise ValueError(
                f"prompt: {len(token_ids)} tokens, but max_model_len is {max_model_len} "
                "(the prompt must leave room for at least one output token)"
            )
        # a request must fit alone in the cache, its last output token included
        max_len = min(len(token_ids) + params.max_tokens, max_model_len)
        blocks = -(-max_len // cfg.block_size)
        usable = self.kv_cache_manager.num_usable_blocks
        if blocks > usable:
            raise ValueError(
                f"prompt: with max_tokens={params.max_tokens} it needs {blocks} KV blocks, "
                f"but the cache has only {usable} (num_kv_blocks/kv_cache_memory)"
            )

    def abort(self, request_id: str) -> None:
        """Finish a request (every child of one with n > 1) in whatever state it is, freeing its blocks. Unknown or
        finished ids are ignored."""
        for rid in self.child_ids(request_id):
            request = self.scheduler.requests.get(rid)
            if request is not None:
                self.scheduler.finish_request(request, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def run(self, request_ids: str | Iterable[str] | None = None, max_steps: int | None = None) -> list[StepRecord]:
        """Step until the given requests (default: every unfinished request) have finished, or `max_steps` steps
        have run; return those steps' StepRecords in order. Each step is an ordinary step(): every subscriber
        (a Workbench's dashboard) sees it, and other requests share its batch. Outputs stay in the engine: take
        them with get_output/pop_output. Ids the engine does not hold (never added, or taken by pop_output) raise
        ValueError naming `request_ids`; `max_steps` must be a positive int or None."""
        if max_steps is not None:
            if isinstance(max_steps, bool) or not isinstance(max_steps, int):
                raise TypeError(f"max_steps: expected int or None, got {type(max_steps).__name__}")
            if max_steps < 1:
                raise ValueError(f"max_steps: must be at least 1, got {max_steps}")
        requests = None if request_ids is None else self._held_requests(request_ids)
        records: list[StepRecord] = []
        while max_steps is None or len(records) < max_steps:
            if requests is None and not self.has_unfinished_requests():
                break
            if requests is not None and all(r.is_finished for r in requests):
                break
            records.append(self.step())
        return records

    def _held_requests(self, request_ids: str | Iterable[str]) -> list[Request]:
        """The engine's requests for the ids run() was given (one id or several), checked."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        try:
            ids = list(request_ids)
        except TypeError:
            raise TypeError(
                f"request_ids: expected a request id, an iterable of them, or None, got {type(request_ids).__name__}"
            ) from None
        bad = next((rid for rid in ids if not isinstance(rid, str)), None)
        if bad is not None:
            raise TypeError(f"request_ids: ids are str, got {type(bad).__name__} ({bad!r})")
        unknown = [rid for rid in ids if rid not in self._requests and rid not in self._parents]
        if unknown:
            raise ValueError(f"request_ids: {unknown} not held by this engine (never added, or taken by pop_output)")
        return [self._requests[child] for rid in ids for child in self.child_ids(rid)]

    def get_output(self, request_id: str) -> RequestOutput:
        """The request's output so far (finished or not); with n > 1, every child's completion in `outputs`."""
        parent = self._parents.get(request_id)
        if parent is not None:
            return parent.make_output([self.get_output(child) for child in parent.child_ids])
        request = self._requests[request_id]
        out = make_output(request, self._detokenizers[request_id].text)
        out.kv_transfer_params = request.kv_transfer_params_out
        return out

    def pop_output(self, request_id: str) -> RequestOutput:
        """The output of a finished request; the engine forgets it."""
        out = self.get_output(request_id)
        if not out.finished:
            raise ValueError(f"request_id: {request_id!r} has not finished")
        for rid in self.child_ids(request_id):
            del self._requests[rid], self._detokenizers[rid]
        self._parents.pop(request_id, None)
        return out

    def subscribe(self, callback: Subscriber) -> Subscriber:
        """Call `callback(StepRecord)` after every step. Returns the callback (for unsubscribe)."""
        self._subscribers.append(callback)
        return callback

    def unsubscribe(self, callback: Subscriber) -> None:
        self._subscribers.remove(callback)

    def close(self) -> None:
        """Release what the executor holds (the tensor-parallel worker processes) and the KV events publisher (its
        thread and sockets); idempotent."""
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.shutdown()
        self.executor.shutdown()
        if self.tracer is not None:  # sends the spans still queued
            self.tracer.shutdown()

    # ---- the profiler (vLLM's LLMEngine.start_profile / stop_profile) ----------------------------------------
    def start_profile(self, profile_prefix: str | None = None) -> None:
        """Start a torch profiler session on this thread (the one that steps the engine). Refused (RuntimeError)
        without profiler_config, or while a session runs (ProfilerAlreadyActiveError)."""
        self._profiler().start(profile_prefix)

    def stop_profile(self) -> str | None:
        """Stop the session, on the thread that started it, and write its trace; returns the trace's path (None
        when no session ran)."""
        return self._profiler().stop()

    def _profiler(self) -> EngineProfiler:
        if self.profiler is None:  # vLLM's refusal
            raise RuntimeError(
                "Profiling is not enabled: set profiler_config (--profiler-config "
                '\'{"profiler": "torch", "torch_profiler_dir": "DIR"}\')'
            )
        return self.profiler

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- numbers a lesson or a view reads ----------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Rows of the model's output layer: token ids are 0 .. vocab_size - 1, and a guided request's bitmask has
        one bit per id (it may exceed len(tokenizer): padded embeddings)."""
        return self.executor.vocab_size

    @property
    def bytes_per_block(self) -> int:
        """Bytes of KV one block holds across all layers: 2 (K and V) x block_size x KV heads x head size x bytes
        per element, per layer, x layers."""
        return self.executor.bytes_per_block

    @property
    def num_kv_blocks(self) -> int:
        """Blocks in the KV cache, block 0 (the null block, never allocated) included: the config's
        `num_kv_blocks`, or as many as `kv_cache_memory` holds. Usable blocks: num_kv_blocks - 1."""
        return self.executor.num_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        """A request's block table now: the ids of the physical blocks holding its KV, in token order (entry i
        holds tokens i*block_size .. i*block_size + block_size - 1). Empty while it waits, after a preemption and
        once finished. Ids the engine does not hold (never added, or taken by pop_output) raise ValueError
        naming `request_id`."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id: expected str, got {type(request_id).__name__}")
        if request_id in self._parents:
            raise ValueError(
                f"request_id: {request_id!r} samples n={len(self.child_ids(request_id))} sequences, "
                f"each with its own block table: ask for one of {self.child_ids(request_id)}"
            )
        if request_id not in self._requests:
            raise ValueError(
                f"request_id: {request_id!r} not held by this engine (never added, or taken by pop_output)"
            )
        return self.kv_cache_manager.get_block_ids(request_id)

    @property
    def worker_pids(self) -> list[int]:
        """The ids of the processes that run the model, rank order: one per tensor-parallel rank with
        `executor="multiproc"`; empty where the model runs in this process (or, simulated, nowhere)."""
        return self.executor.pids

    @property
    def threads_per_rank(self) -> int | None:
        """Torch threads each worker process runs with (this machine's cores shared between its ranks); None
        without worker processes."""
        return self.executor.threads_per_rank

    @property
    def cost_model(self) -> CostModel | None:
        """The simulated executor's cost model: `step_cost(shapes)` prices a batch (the time the clock advances by
        for that step), `kv_capacity(...)` splits a device's memory as vLLM does. None when a real model runs."""
        from engine.executor.simulated import SimulatedExecutor

        return self.executor.cost_model if isinstance(self.executor, SimulatedExecutor) else None

    @property
    def spec_stats(self):
        """Speculative decoding statistics (SpecDecodingStats), or None without speculation."""
        return self.executor.spec_stats

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def explain(self, request_id: str) -> Journey:
        """A request's journey (engine/journey.py): each step it lived through with its state, the tokens it got and
        why not more, its prefix lookups and preemptions with their reasons, and its TTFT and latency split into
        parts that add up to them. Kept after pop_output (the last 10,000 finished requests); an id never added
        raises KeyError, one with n > 1 ValueError (ask for one of its children)."""
        ids = self.child_ids(request_id)
        if len(ids) > 1:
            raise ValueError(f"request_id: {request_id!r} samples n={len(ids)} sequences: explain one of {ids}")
        return self.explainer.explain(request_id)

    def block_life(self, block_id: int) -> list[BlockLife]:
        """A KV block's lives (engine/block_life.py), oldest first: allocated to, filled, cached, hit by whom, freed,
        evicted (why, for whom), with vLLM's lifetime, idle-before-evict and reuse-gap metrics of each ended life
        (all blocks' samples: `explainer.kv_block_metrics`)."""
        return self.explainer.block_life(block_id)

    def snapshot(self) -> EngineSnapshot:
        """The state a view attached now starts from (the next StepRecord follows on from it)."""
        wall_minus_mono = self.clock.time_ns() - round(self.clock.monotonic() * 1e9)
        requests = [self._request_snapshot(r, wall_minus_mono) for r in self._requests.values()]
        blocks = [
            BlockSnapshot(b.block_id, hash_hex(b.block_hash), hash_hex(b.parent_hash))
            for b in self.kv_cache_manager.block_pool.blocks
            if not b.is_null and (b.ref_cnt or b.block_hash is not None)
        ]
        return EngineSnapshot(self.step_count, self.kv_cache_manager.usage(), requests, blocks)

    def _request_snapshot(self, r: Request, wall_minus_mono: int) -> RequestSnapshot:
        return RequestSnapshot(
            request_id=r.request_id,
            prompt=self.tokenizer.decode(r.prompt_token_ids[:200])[:200],
            num_prompt_tokens=r.num_prompt_tokens,
            max_tokens=r.sampling_params.max_tokens,
            priority=r.priority,
            arrival_ns=int(r.arrival_time * 1e9) + wall_minus_mono,
            status=r.status.name,
            num_output_tokens=r.num_output_tokens,
            num_cached_tokens=max(r.num_cached_tokens, 0),
            num_preemptions=r.num_preemptions,
            text=self._detokenizers[r.request_id].text,
            finish_reason=r.status.finish_reason,
            error=r.error,
            block_ids=self.kv_cache_manager.get_block_ids(r.request_id),
        )

    # ---- the step -----------------------------------------------------------------------------
    def step(self) -> StepRecord:
        """Schedule, run the model, sample, update; return what happened as a StepRecord. With async_scheduling
        (vLLM's AsyncScheduler and batch queue of two): schedule the next batch, update from the batch in flight
        (its tokens fill the new batch's placeholders), then run the new batch, whose outputs the next step takes.
        While a profiling session records, the whole step sits inside its marker (`step_N`)."""
        if self.profiler is None:
            return self._step()
        with self.profiler.step_marker(self.step_count + 1):
            return self._step()

    def _step(self) -> StepRecord:
        self.step_count += 1
        start_ns = self.clock.time_ns()
        t0 = self.clock.perf_counter()
        if self.scheduler.nothing_runnable():
            self._wait_outside()
        if self.connector is not None:
            self._finish_transfers(self.connector)
        asynchronous = self.config.async_scheduling
        sched_out = (
            self.scheduler.schedule()
            if not asynchronous or self.scheduler.has_requests()
            else SchedulerOutput([], [], set())
        )
        if self.connector is not None:
            self._start_load_kv(self.connector, sched_out)
        # after the loads: a chunk they withdrew never runs, so it gets no phase (its recompute is the prefill)
        phases = self.phase_tracker.label(sched_out)
        t1 = self.clock.perf_counter()
        outputs_of_step = self.step_count
        if asynchronous:
            done, self._in_flight = self._in_flight, None
            outputs_of_step = 0 if done is None else self.step_count - 1
            t2 = self.clock.perf_counter()
            if done is not None:
                self._update(*done)
            t3 = self.clock.perf_counter()
            if sched_out.scheduled:  # what finished in that update still runs in vLLM, its output dropped: not here
                self._in_flight = (
                    sched_out,
                    self._execute(
                        replace(sched_out, scheduled=[s for s in sched_out.scheduled if not s.request.is_finished])
                    ),
                )
            runner_out = self._in_flight[1] if self._in_flight else None
        else:
            runner_out = self._execute(sched_out)
            t2 = self.clock.perf_counter()
            self._update(sched_out, runner_out)
            t3 = self.clock.perf_counter()
        timing = {
            "schedule": (t1 - t0) * 1e3,
            "forward": runner_out.forward_ms if runner_out else 0.0,
            "sample": runner_out.sample_ms if runner_out else 0.0,
            "update": (t3 - t2) * 1e3,
            "total": (self.clock.perf_counter() - t0) * 1e3,
        }
        self.events.emit(
            StepTiming,
            schedule_ms=timing["schedule"],
            forward_ms=timing["forward"],
            sample_ms=timing["sample"],
            total_ms=timing["total"],
        )
        record = StepRecord(
            step=self.step_count,
            start_ns=start_ns,
            end_ns=self.clock.time_ns(),
            scheduled=sched_out.num_scheduled_tokens,
            phases=phases,
            num_waiting=self.scheduler.num_waiting,
            num_running=self.scheduler.num_running,
            kv=self.kv_cache_manager.usage(),
            timing=timing,
            events=self._named(self.events.drain()),
            outputs_of_step=outputs_of_step,
        )
        self.events.begin(self.step_count + 1)
        self.explainer.observe(record)
        if self.kv_event_publisher is not None:
            self._publish_kv_events(self.kv_event_publisher, record.end_ns / 1e9)
        for callback in list(self._subscribers):
            callback(record)
        return record

    def _publish_kv_events(self, publisher: EventPublisher, ts: float) -> None:
        """The step's KV cache events as one batch, if it had any, as vLLM's scheduler publishes them at the end of
        update_from_output; `ts` is the step's end on the engine's clock."""
        from engine.distributed.kv_events import KVEventBatch  # loaded with the publisher

        events = self.kv_cache_manager.take_events()
        if events:
            publisher.publish(KVEventBatch(ts=ts, events=events))

    def _execute(self, sched_out: SchedulerOutput):
        """Run a scheduled batch (its grammars' bitmask, the model, its KV saves); returns the runner's output."""
        bitmask = self.structured.grammar_bitmask(
            [(s.request_id, s.spec_token_ids) for s in sched_out.scheduled if s.samples]
        )
        runner_out = self.executor.execute_model(sched_out, *bitmask)
        for rid, entries in runner_out.prompt_logprobs.items():
            kept = self._requests[rid].prompt_logprobs
            assert kept is not None, "the runner computes prompt logprobs only for requests that asked"
            kept.extend(entries)
        if self.connector is not None:
            self._save_kv(self.connector)
        return runner_out

    def _update(self, sched_out: SchedulerOutput, runner_out) -> dict[str, list[int]]:
        """The scheduler takes a batch's sampled tokens; the outputs (text, logprobs) follow."""
        appended = self.scheduler.update_from_output(sched_out, runner_out.sampled_token_ids, runner_out.spec_token_ids)
        self._process_outputs(appended, runner_out.logprobs)
        return appended

    def _named(self, events: list[Event]) -> list[Event]:
        """The step's events, each spec.verified with its tokens' text: the runner that verifies has no tokenizer."""
        if self.config.speculative is None:
            return events
        decode = self.tokenizer.decode
        return [
            replace(
                e, draft_texts=tuple(decode([t]) for t in e.draft_token_ids), emitted_text=decode([e.emitted_token])
            )
            if isinstance(e, SpecVerified)
            else e
            for e in events
        ]

    def _wait_outside(self) -> None:
        """Nothing can run: block on what the requests wait for (a grammar, a KV transfer) instead of spinning."""
        compiling = self.scheduler.compiling()
        if compiling:
            busy = self.connector is not None and self.connector.has_inflight_transfers
            self.structured.wait_for_any(compiling, timeout=0.05 if busy else 5.0)
        elif self.connector is not None:
            self.connector.wait_for_transfers(timeout=5.0)

    def _finish_transfers(self, connector: KVConnectorBase) -> None:
        """Asynchronous loads and saves that ended since the last step: their events, held blocks, waiting requests."""
        sending, recving = connector.get_finished(set())
        if sending or recving:
            self.scheduler.update_kv_xfer_finished(sending, recving, connector.get_block_ids_with_load_errors())

    def _start_load_kv(self, connector: KVConnectorBase, sched_out: SchedulerOutput) -> None:
        """The decode side of P/D: fill the blocks of external hits before the forward reads them."""
        connector.bind_connector_metadata(sched_out.kv_connector_metadata)
        connector.start_load_kv(self._kv_caches())
        failed = connector.get_block_ids_with_load_errors()
        if failed:
            self.scheduler.handle_kv_load_errors(sched_out, failed)

    def _save_kv(self, connector: KVConnectorBase) -> None:
        """The prefill side of P/D: store the KV of prompts completed this step, layer by layer."""
        for layer_index, kv_layer in enumerate(self._kv_caches()):
            connector.save_kv_layer(layer_index, kv_layer)
        connector.wait_for_save()

    def _kv_caches(self) -> list[KVCache]:
        if self.runner is None:  # EngineConfig refuses a connector with any other executor
            raise RuntimeError("kv_transfer_config: the connector needs the in-process model runner's cache")
        return self.runner.kv_caches

    def _process_outputs(self, appended: dict[str, list[int]], logprobs: dict[str, list[dict[int, float]]]) -> None:
        for rid, tokens in appended.items():
            request = self._requests[rid]
            if request.logprobs is not None and rid in logprobs:
                request.logprobs.extend(logprobs[rid])
            detok = self._detokenizers[rid]
            before = len(detok.text)
            stop = detok.update(request.output_token_ids)
            offset = min(before, len(detok.text))
            self.events.emit(
                RequestTokens,
                request_id=rid,
                token_ids=tuple(tokens),
                text=detok.text[offset:],
                text_offset=offset,
                num_output_tokens=request.num_output_tokens,
            )
            if stop is not None and not request.is_finished:
                request.stop_reason = stop
                self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)
