"""AsyncLLM: one background thread owns an LLMEngine and steps it while requests arrive from any thread or event
loop (vLLM's `vllm/v1/engine/async_llm.py`, at our size: the engine runs in a thread of this process, not in an
engine-core process).

`async for out in llm.generate(prompt, params, request_id)` yields the request's output as it grows (each a
cumulative RequestOutput, as vLLM's default output kind; steps that ran while the consumer was busy coalesce into
one). Leaving the loop early, or the task being cancelled (an HTTP client that disconnected), aborts the request:
its blocks are freed before the next step. A request with n > 1 streams under its own id: each output holds every
child's completion in `outputs` (the engine's children "{i}_{id}" step and finish apart; the stream follows them all).

The loop can be held between steps: `pause()` (requests still queue), `step(n)` (run exactly n steps while paused),
`resume()`. The dashboard's Pause / Step / Play buttons and the server's `/pause`, `/step`, `/resume` call these.
`start_profile()` / `stop_profile()` (the server's `/start_profile`, `/stop_profile`) run the engine's torch profiler
on this thread, between two steps: the profiler records the thread that starts it.

With data_parallel_size > 1 the thread drives a DPLBClient (engine/entrypoints/dp_client.py) in place of the
engine, as vLLM's AsyncLLM drives its DP client: each "step" takes what the replicas sent (their processes step on
their own), so there is no hold; a replica that dies fails only its own requests.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from engine.config import EngineConfig
from engine.events import StepRecord
from engine.limits import check_engine_limits
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.tracing import log_tracing_disabled_warning

T = TypeVar("T")


class QueueFullError(RuntimeError):
    """A request refused because `max_num_queued_reqs` requests are already in flight, waiting or running (vLLM's
    setting; a server answers 503): a flood is turned away at the door instead of growing the waiting queue, and
    the memory, without bound."""


class _Collector:
    """One request's latest output, handed from the engine thread to the event loop that awaits it. Outputs are
    cumulative, so a newer one replaces an older one nobody read yet (vLLM's RequestOutputCollector)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.output: RequestOutput | None = None
        self.ready = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        """From the engine thread: hand the output over on the collector's loop (asyncio is not thread-safe)."""

        def deliver() -> None:
            self.output = output
            self.ready.set()

        try:
            self.loop.call_soon_threadsafe(deliver)
        except RuntimeError:  # the consumer's loop has closed: nobody is left to read it
            pass

    async def get(self) -> RequestOutput:
        await self.ready.wait()
        self.ready.clear()
        output, self.output = self.output, None
        assert output is not None, "ready is set only once an output is delivered"
        return output


class RequestStream:
    """One request's outputs as an async iterator (each cumulative; the last finished). Closing it, or cancelling
    the task that awaits it, before the last output aborts the request."""

    def __init__(self, llm: AsyncLLM, request_id: str, collector: _Collector) -> None:
        self.llm = llm
        self.request_id = request_id
        self._collector = collector
        self.finished = False
        self._closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self._closed:
            raise StopAsyncIteration
        try:
            output = await self._collector.get()
        except BaseException:  # cancelled while waiting (a client that disconnected): nobody will read on
            self.close()
            raise
        self.finished = output.finished
        return output

    def close(self) -> None:
        """Abort the request unless it has finished; idempotent."""
        if not self.finished and not self._closed:
            self.llm.abort(self.request_id)
        self._closed = True


def build_engine(config: EngineConfig) -> Any:
    """What AsyncLLM drives for `config`: an LLMEngine in this process, or with data_parallel_size > 1 a started
    DPLBClient over that many engine processes."""
    if config.data_parallel_size > 1:
        from engine.entrypoints.dp_client import DPLBClient

        return DPLBClient(config).start()
    from engine.llm_engine import LLMEngine  # heavy: the model code

    return LLMEngine(config)


class AsyncLLM:
    """Owns the thread that steps its engine (`engine-loop`; an LLMEngine given or built, or the DPLBClient of a
    data-parallel config), the lock held around every engine call (`lock`, which a dashboard shares), the
    collectors of requests awaited through `generate`, the aborts not yet applied, the calls waiting to run on the
    loop's thread (the profiler's), and the hold (paused, steps granted while paused). An engine it built from
    `config` or keyword arguments it closes at `shutdown()` (worker and replica processes with it). Every public
    method is safe from any thread."""

    def __init__(
        self,
        engine: Any = None,
        *,
        config: EngineConfig | None = None,
        start_paused: bool = False,
        max_num_queued_reqs: int | None = None,
        **kwargs: Any,
    ) -> None:
        if engine is not None and (config is not None or kwargs):
            raise TypeError("AsyncLLM: pass either an engine, a config or engine keyword arguments, not several")
        if config is not None and kwargs:
            raise TypeError("AsyncLLM: pass either a config or engine keyword arguments, not both")
        if max_num_queued_reqs is not None and (
            isinstance(max_num_queued_reqs, bool) or not isinstance(max_num_queued_reqs, int) or max_num_queued_reqs < 1
        ):
            raise ValueError(f"max_num_queued_reqs: must be an int >= 1 or None, got {max_num_queued_reqs!r}")
        # the queue bound: past it, add_request/open raise QueueFullError (None: unbounded, as an offline batch)
        self.max_num_queued_reqs = max_num_queued_reqs
        self._owns_engine = engine is None
        config = engine.config if engine is not None else config or EngineConfig.from_kwargs(**kwargs)
        self.data_parallel_size = config.data_parallel_size
        if start_paused:
            self._check_hold("start_paused")  # before any replica starts
        self.engine = engine if engine is not None else build_engine(config)
        self.lock = threading.RLock()  # every engine call (the loop's step, add_request, a dashboard's snapshot)
        # control state and wake-ups; never held while the engine lock is awaited inside it (no lock-order cycle)
        self._cond = threading.Condition()
        self._paused = start_paused
        self._granted = 0  # steps Step asked for while paused, not yet run
        self._aborts: list[str] = []
        self._calls: list[tuple[Callable[[], Any], Future]] = []  # to run on the loop's thread (_on_loop)
        self._stopped = False
        self._collectors: dict[str, _Collector] = {}  # under self.lock
        # n > 1: the engine's events name the children; their outputs go to the parent's collector (under self.lock)
        self._parent_of: dict[str, str] = {}
        self._ids = itertools.count()
        self.errors: list[str] = []  # steps that raised: the loop goes on, their requests finish with an error
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    # ---- requests --------------------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> str:
        """Queue a request whose output stays in the engine (a dashboard's form, `--prompt`); returns its id.
        Bad input raises the engine's ValueError/TypeError naming the field."""
        return self._add(prompt, params, request_id, priority, cache_salt, None)

    def _add(
        self,
        prompt: Any,
        params: SamplingParams | None,
        request_id: str | None,
        priority: int,
        cache_salt: str | None,
        collector: _Collector | None,
        trace_headers: Mapping[str, str] | None = None,
    ) -> str:
        if isinstance(params, SamplingParams):  # before the lock: a refusal never waits for a step to end
            check_engine_limits(params, self.engine.config)
        # the caller's trace context goes to the engine only where a span will carry it (never with data
        # parallelism, which the config refuses tracing with); otherwise dropped with vLLM's warning
        traced = {}
        if trace_headers and self.engine.config.otlp_traces_endpoint is not None:
            traced = {"trace_headers": trace_headers}
        elif trace_headers:
            log_tracing_disabled_warning()
        with self.lock:
            self._check_queue(params.n if isinstance(params, SamplingParams) else 1)
            if request_id is None:
                request_id = f"req-{next(self._ids)}"
            rid = self.engine.add_request(
                prompt, params, request_id=request_id, priority=priority, cache_salt=cache_salt, **traced
            )
            if collector is not None:  # registered before the loop can step it: no output is missed
                self._collectors[rid] = collector
                for child in self.engine.child_ids(rid):
                    self._parent_of[child] = rid
        self._notify()
        return rid

    def _check_queue(self, num_new: int) -> None:
        """Refuse (QueueFullError) a request whose sequences would take the requests in flight (waiting or running,
        as vLLM counts them) past the bound."""
        if self.max_num_queued_reqs is None:
            return
        stats = self.stats()
        in_flight = stats["num_waiting"] + stats["num_running"]
        if in_flight + num_new > self.max_num_queued_reqs:
            raise QueueFullError(
                f"the server is overloaded: {in_flight} requests are in flight (max_num_queued_reqs="
                f"{self.max_num_queued_reqs}); retry later"
            )

    async def open(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        trace_headers: Mapping[str, str] | None = None,
    ) -> RequestStream:
        """Queue a request and return the stream of its outputs. Bad input raises ValueError/TypeError here,
        before anything is streamed (a server answers 400 then). `trace_headers`: the caller's W3C trace context
        (traceparent, tracestate; vLLM's name), the parent of the request's span when tracing is on."""
        collector = _Collector(asyncio.get_running_loop())
        # add_request waits for the engine lock (a step may hold it): off the event loop, which keeps serving
        rid = await asyncio.to_thread(
            self._add, prompt, params, request_id, priority, cache_salt, collector, trace_headers
        )
        return RequestStream(self, rid, collector)

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        trace_headers: Mapping[str, str] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its output each time it grows, the last one finished. Bad input raises
        ValueError/TypeError before anything is yielded. Closing or cancelling the iterator early aborts it."""
        stream = await self.open(prompt, params, request_id, priority, cache_salt, trace_headers)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Abort a request; its blocks are freed before the next step (at once when the loop is idle or paused).
        Does not wait for the engine lock, so it is cheap from an event loop. Unknown ids are ignored."""
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify_all()

    # ---- the hold: pause, step, resume ----------------------------------------------------------------------
    @property
    def is_paused(self) -> bool:
        return self._paused

    def _check_hold(self, name: str) -> None:
        if self.data_parallel_size > 1:
            raise ValueError(
                f"{name}: the loop cannot be held with data_parallel_size={self.data_parallel_size} "
                "(each replica steps on its own process)"
            )

    def pause(self) -> None:
        """Hold the loop between steps: the step running finishes; requests still queue; aborts still apply.
        Refused (ValueError) with data parallelism."""
        self._check_hold("pause")
        with self._cond:
            self._paused, self._granted = True, 0
            self._cond.notify_all()

    def resume(self) -> None:
        """Let the loop step again while there is work (Play)."""
        with self._cond:
            self._paused, self._granted = False, 0
            self._cond.notify_all()

    def step(self, num_steps: int = 1, timeout: float | None = None) -> int:
        """Hold the loop (if it was not) and let it run exactly `num_steps` more steps. Returns how many were
        granted: 0 when nothing is left to run. With `timeout`, waits until they ran (or the work ran out)."""
        if isinstance(num_steps, bool) or not isinstance(num_steps, int):
            raise TypeError(f"num_steps: expected int, got {type(num_steps).__name__}")
        if num_steps < 1:
            raise ValueError(f"num_steps: must be at least 1, got {num_steps}")
        self._check_hold("step")
        with self.lock:
            if not self.engine.has_unfinished_requests():
                return 0
            target = self.engine.step_count + num_steps
        with self._cond:
            self._paused = True
            self._granted += num_steps
            self._cond.notify_all()
            if timeout is not None:
                self._cond.wait_for(lambda: self._granted == 0 or self.engine.step_count >= target, timeout)
        return num_steps

    @property
    def step_count(self) -> int:
        """Steps the engine has run."""
        return self.engine.step_count

    def wait_until_idle(self, timeout: float) -> bool:
        """Block until no request is unfinished and no abort is pending; False on timeout (a test's check)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._aborts and not self.engine.has_unfinished_requests(), timeout)

    # ---- the profiler: /start_profile, /stop_profile (vLLM's names) ------------------------------------------
    def start_profile(self, profile_prefix: str | None = None, timeout: float = 60.0) -> None:
        """Start the engine's torch profiler session on the loop's thread, between two steps (Kineto records the
        thread that starts it). Refused (RuntimeError) without profiler_config, ProfilerAlreadyActiveError while a
        session runs, ValueError for a bad `profile_prefix`."""
        self._on_loop(lambda: self.engine.start_profile(profile_prefix), timeout)

    def stop_profile(self, timeout: float = 60.0) -> str | None:
        """Stop the session on the loop's thread and write its trace; returns the trace's path (None when no
        session ran)."""
        return self._on_loop(self.engine.stop_profile, timeout)

    def _on_loop(self, call: Callable[[], T], timeout: float) -> T:
        """Run `call` on the loop's thread between two steps, under the engine lock, also while paused; returns
        its result or raises its exception. TimeoutError when the loop does not get to it within `timeout`
        seconds (a step that long: the call still runs after it)."""
        future: Future[T] = Future()
        with self._cond:
            if self._stopped:
                raise RuntimeError("the engine loop has stopped")
            self._calls.append((call, future))
            self._cond.notify_all()
        return future.result(timeout)

    # ---- what /metrics and a dashboard read -----------------------------------------------------------------
    def subscribe(self, callback: Callable[[StepRecord], None]) -> Callable[[StepRecord], None]:
        """Call `callback(StepRecord)` on the engine thread after every step."""
        with self.lock:
            return self.engine.subscribe(callback)

    def unsubscribe(self, callback: Callable[[StepRecord], None]) -> None:
        with self.lock:
            self.engine.unsubscribe(callback)

    def stats(self) -> dict[str, Any]:
        """The engine now, between steps: requests running and waiting, KV blocks (a KVUsage), steps run."""
        with self.lock:
            if self.data_parallel_size > 1:  # the replicas' sums, as they last reported
                return {**self.engine.stats(), "step": self.engine.step_count, "paused": False}
            scheduler = self.engine.scheduler
            return {
                "num_running": scheduler.num_running,
                "num_waiting": scheduler.num_waiting,
                "kv": self.engine.kv_cache_manager.usage(),
                "step": self.engine.step_count,
                "paused": self._paused,
            }

    # ---- the loop -------------------------------------------------------------------------------------------
    def _notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _runnable(self) -> bool:
        # read without the engine lock: a request added after this check notifies under _cond, so none is missed
        return self.engine.has_unfinished_requests() and (not self._paused or self._granted > 0)

    def _loop(self) -> None:
        pending: list[tuple[Callable[[], Any], Future]] = []  # the calls left when the loop stops
        while True:
            with self._cond:
                while not (self._stopped or self._aborts or self._calls or self._runnable()):
                    if self._paused and self._granted and not self.engine.has_unfinished_requests():
                        self._granted = 0  # steps granted for work that finished or was aborted: none to run
                        self._cond.notify_all()
                    self._cond.wait()
                if self._stopped:
                    pending, self._calls = self._calls, []
                    break
                aborts, self._aborts = self._aborts, []
                calls, self._calls = self._calls, []
                run = self._runnable()
                if run and self._paused:
                    self._granted -= 1
            if aborts:
                self._apply_aborts(aborts)
            if calls:
                self._run_calls(calls)
            if run:
                self._step()
            with self._cond:
                self._cond.notify_all()  # step() and wait_until_idle() wait on what this iteration changed
        for _, future in pending:
            future.set_exception(RuntimeError("the engine loop has stopped"))
        if self.engine.config.profiler is not None:  # a session still recording is written, as vLLM's shutdown
            with self.lock:
                self.engine.stop_profile()

    def _run_calls(self, calls: list[tuple[Callable[[], Any], Future]]) -> None:
        with self.lock:
            for call, future in calls:
                try:
                    future.set_result(call())
                except Exception as exc:  # the caller's to raise, in its own thread
                    future.set_exception(exc)

    def _apply_aborts(self, request_ids: list[str]) -> None:
        with self.lock:
            for rid in request_ids:
                self.engine.abort(rid)
                if self._collectors.pop(rid, None) is not None:
                    self._forget(rid)
                    self.engine.pop_output(rid)  # its consumer left: nobody will take the output

    def _step(self) -> None:
        with self.lock:
            try:
                record = self.engine.step()
            except Exception as exc:  # the loop must outlive one bad step; its requests end with the error
                self._fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
                return
            if record is None:  # the DP front end: nothing arrived from the replicas
                return
            touched = {
                self._parent_of.get(e.request_id, e.request_id)
                for e in record.events
                if e.kind in ("request.tokens", "request.finished")
            }
            for rid in touched:
                collector = self._collectors.get(rid)
                if collector is None:
                    continue  # not awaited here (a dashboard's request): its output stays in the engine
                output = self.engine.get_output(rid)
                if output is None:  # the DP front end: shown whole when it finishes (n > 1, logprobs)
                    continue
                if output.finished:
                    self._forget(rid)
                    self.engine.pop_output(rid)
                    del self._collectors[rid]
                collector.put(output)

    def _forget(self, request_id: str) -> None:
        for child in self.engine.child_ids(request_id):
            self._parent_of.pop(child, None)

    def _fail_all(self, message: str) -> None:
        self.errors.append(message)
        for rid, collector in list(self._collectors.items()):
            self.engine.abort(rid)
            output = self.engine.pop_output(rid)
            output.finish_reason, output.error = "error", message
            collector.put(output)
        self._collectors.clear()
        self._parent_of.clear()
        if self.data_parallel_size == 1:
            for rid in list(self.engine.scheduler.requests):  # the dashboard's requests, too: nothing runs on
                self.engine.abort(rid)

    # ---- lifetime -------------------------------------------------------------------------------------------
    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop after the step running; the thread is joined; an engine this AsyncLLM built is closed.
        Idempotent."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._owns_engine:
            with self.lock:
                self.engine.close()

    def __enter__(self) -> AsyncLLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
