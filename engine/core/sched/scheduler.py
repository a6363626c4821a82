"""The scheduler: each step, spend the token budget on running requests first, then on waiting ones.

Chunked prefill falls out of the budget: a request gets min(its remaining tokens, the long-prefill threshold,
what is left of the budget), and the runner samples only when a request's computed tokens reach its end.
When the KV cache is short, a running request is preempted (its blocks freed, recomputed later).
A waiting request is admitted through named checks, in the order the seed gives them (`_admission`).
Every decision that leaves a request with less than it wants says why (engine/reasons.py): a request that gets no
tokens in a step is in a `request.deferred` event, one given fewer than it wants carries a `limit`, a preemption
names its victim rule, its beneficiary and what stays cached.
The scheduler decides only: naming what each request does in a step is phases.py's, for display.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from itertools import takewhile
from typing import TYPE_CHECKING

from engine.clock import Clock
from engine.config import EngineConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.sched.output import ScheduledRequest, SchedulerOutput
from engine.core.sched.request_queue import RequestQueue, create_request_queue
from engine.core.sched.utils import check_stop
from engine.events import EventLog, RequestDeferred, RequestFinished, RequestPreempted, SpecProposed, SpecScheduled
from engine.kv_transfer.base import KVLoadError
from engine.reasons import (
    BudgetLeft,
    HeadOfLine,
    LongPrefillThreshold,
    LowerPriority,
    MaxModelLen,
    MaxNumSeqs,
    MemoryPressure,
    OutputsInFlight,
    Preemption,
    PromptExceedsBudget,
    Reason,
    TokenBudgetSpent,
    TokenLimit,
    WaitingForGrammar,
    WaitingForRemoteKV,
)
from engine.request import Request, RequestStatus
from engine.spec_decode.dynamic import schedule_lookup

if TYPE_CHECKING:
    from engine.kv_transfer.base import KVConnectorBase
    from engine.structured_output.manager import StructuredOutputManager


_COMPILING = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
_BLOCKED = (_COMPILING, RequestStatus.WAITING_FOR_REMOTE_KVS)  # waiting on something outside the step
_DRAFTS_WRITE_KV = ("draft_model", "eagle", "eagle3")  # speculative methods whose proposer fills lookahead slots


class Verdict(enum.Enum):
    """What the waiting loop does with the request at the head of the waiting queue."""

    SKIP = "skip"  # not ready (its grammar compiles, its KV loads or is not stored yet): passed over this step
    STOP = "stop"  # no room (the budget, without chunking; the KV cache): nobody else is admitted this step
    FINISH = "finish"  # it can never run (its KV load failed): finished with the error
    PARK = "park"  # its KV loads asynchronously into the blocks just allocated: WAITING_FOR_REMOTE_KVS until then
    SCHEDULE = "schedule"  # admitted: `num_new` tokens run this step


@dataclass
class Admission:
    """One waiting request on its way through the admission checks: what they found, and the verdict of the
    first check that decided (None while every check so far let it through), with its reason when it holds the
    request back; `limit`: why it gets fewer tokens than it wants once admitted."""

    request: Request
    budget: int
    verdict: Verdict | None = None
    reason: Reason | None = None
    limit: TokenLimit | None = None
    error: str | None = None
    hit_blocks: list = field(default_factory=list)  # local prefix-cache hits
    num_hit: int = 0
    num_external: int = 0  # tokens whose KV the connector loads from another instance
    load_async: bool = False
    num_new: int = 0  # tokens computed this step

    @property
    def num_computed(self) -> int:
        """Tokens whose KV is there (or loading) once it is admitted."""
        return self.request.num_computed_tokens + self.num_hit + self.num_external


class Scheduler:
    """Owns the waiting queue, the running list and every live request's status and computed-token count."""

    def __init__(
        self,
        config: EngineConfig,
        kv_cache_manager: KVCacheManager,
        events: EventLog,
        structured: StructuredOutputManager | None = None,
        connector: KVConnectorBase | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.config = config
        self.clock = Clock() if clock is None else clock  # request metrics on the engine's (maybe simulated) clock
        self.connector = connector
        self.structured = structured
        self.kv = kv_cache_manager
        self.events = events
        self.policy = config.scheduling_policy
        self.waiting = create_request_queue(self.policy)
        # waiting requests that hold KV blocks (an asynchronous load, loaded or not yet): vLLM 0.33 drains them before
        # the others, so that a block holder never waits behind a request whose refused allocation ends the loop
        self.kv_holding = create_request_queue(self.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.finished_req_ids: set[str] = set()
        # P/D with asynchronous transfers: requests whose KV is loading (-> their computed tokens once it lands),
        # requests whose producer's KV is not stored yet, and finished requests whose blocks a transfer still uses
        self.remote_loads: dict[str, int] = {}
        self.awaiting_kv: set[str] = set()
        self.held: dict[str, Request] = {}
        # loads that landed: their requests leave WAITING_FOR_REMOTE_KVS when the waiting loop reaches them (vLLM's
        # finished_recving_kv_req_ids), which caches their blocks then, not before
        self.finished_recving: set[str] = set()
        # requests whose prompt is not all computed yet, loading ones included: an asynchronous load is admitted only
        # if the blocks these still need stay free (vLLM's _inflight_prefills)
        self.inflight_prefills: dict[str, Request] = {}
        # grammars found failed while scheduling: their requests finish at the end of the step (vLLM's
        # grammar_compile_error_reqs, finished in update_from_output after the step's outputs)
        self.grammar_errors: dict[str, str] = {}
        spec = config.speculative
        # room for the next drafts where a draft model (or EAGLE's head) writes their KV before they are scheduled;
        # n-gram and Medusa write none (vLLM 0.33's VllmConfig.num_lookahead_tokens)
        self.num_lookahead_tokens = spec.num_speculative_tokens if spec and spec.method in _DRAFTS_WRITE_KV else 0
        self.num_spec_tokens = spec.num_speculative_tokens if spec else 0
        # dynamic speculative decoding: the drafts a step takes by its number of requests (vLLM's dynamic_sd_lookup)
        schedule = spec.num_speculative_tokens_per_batch_size if spec else None
        self.dynamic_sd_lookup = (
            None if schedule is None else schedule_lookup(schedule, config.max_num_seqs, self.num_spec_tokens)
        )
        self.spec_method = spec.method if spec else None
        # vLLM's AsyncScheduler: step N+1 is scheduled before step N's tokens are known, one placeholder per token
        # a decode will sample (engine/llm_engine.py keeps one step in flight)
        self.async_scheduling = config.async_scheduling
        self.long_prefill_token_threshold = config.long_prefill_token_threshold  # this step's: 0 for a lone request

    @property
    def max_model_len(self) -> int:
        """The longest sequence: EngineConfig resolves it from the model before an engine builds its scheduler."""
        assert self.config.max_model_len is not None, "resolved before the scheduler runs"
        return self.config.max_model_len

    def _structured(self) -> StructuredOutputManager:
        if self.structured is None:
            raise ValueError("structured_outputs: this scheduler was built without a structured output manager")
        return self.structured

    def _kv_load_fails(self) -> bool:
        """kv_transfer_config.kv_load_failure_policy is "fail" (only a connector's transfers end or fail)."""
        transfer = self.config.kv_transfer
        return transfer is not None and transfer.kv_load_failure_policy == "fail"

    # ---- queue management ---------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.sampling_params.structured_outputs is not None:
            # compiles off the loop; WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR until ready
            self._structured().add_request(request)
        self.waiting.add_request(request)
        self.requests[request.request_id] = request

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self.held)

    def has_requests(self) -> bool:
        """Work for a schedule() call: unfinished requests, or finished ones the next output must still name."""
        return self.has_unfinished_requests() or bool(self.finished_req_ids)

    def nothing_runnable(self) -> bool:
        """Work remains, but nothing runs and every waiting request waits on something outside the step (its
        grammar, its KV load, its producer's save): the engine blocks then, rather than spin through empty steps."""
        return (
            self.has_unfinished_requests() and not self.running and all(self._blocked(r) for r in self._all_waiting())
        )

    def _blocked(self, request: Request) -> bool:
        """Waiting on its grammar, its load (not landed yet) or its producer's save."""
        rid = request.request_id
        return (request.status in _BLOCKED and rid not in self.finished_recving) or rid in self.awaiting_kv

    def _all_waiting(self) -> list[Request]:
        """Every waiting request, block holders first, each queue in its order."""
        return [*self.kv_holding, *self.waiting]

    def _queue_of(self, request: Request) -> RequestQueue:
        return self.kv_holding if any(r is request for r in self.kv_holding) else self.waiting

    def compiling(self) -> list[str]:
        """Waiting requests whose grammar was still compiling when last looked at."""
        return [r.request_id for r in self._all_waiting() if r.status == _COMPILING]

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.kv_holding)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---- scheduling ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        # vLLM 0.33: the long-prefill threshold keeps a long prompt from starving the others; with one request
        # (running or waiting) there is nobody to starve, and it is not applied
        alone = len(self.running) + self.num_waiting <= 1
        self.long_prefill_token_threshold = 0 if alone else self.config.long_prefill_token_threshold
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        budget = self._schedule_running(scheduled, preempted, budget)
        if not preempted:
            self._schedule_waiting(scheduled, budget)
        else:  # under memory pressure, admit nobody new this step
            victims = tuple(r.request_id for r in preempted)
            held = tuple(r.request_id for r in self._all_waiting() if r.request_id not in victims)
            if held:
                self.events.emit(RequestDeferred, request_ids=held, reason=MemoryPressure(preempted=victims))
        for s in scheduled:
            self._update_after_schedule(s)
        k = None
        if self.dynamic_sd_lookup is not None and scheduled:
            k = self.dynamic_sd_lookup[len(scheduled)]
            self.events.emit(
                SpecScheduled, batch_size=len(scheduled), num_spec_tokens=k, max_spec_tokens=self.num_spec_tokens
            )
        out = SchedulerOutput(
            scheduled, [r.request_id for r in preempted], self.finished_req_ids, num_spec_tokens_to_schedule=k
        )
        self.finished_req_ids = set()
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        return out

    def _update_after_schedule(self, s: ScheduledRequest) -> None:
        """A scheduled request's tokens count as computed at once (the next schedule() may already follow them);
        asynchronously, a request that samples this step gets a placeholder for its token."""
        request = s.request
        request.num_computed_tokens += s.num_new_tokens
        request.num_in_flight_tokens += s.num_new_tokens
        request.is_prefill_chunk = request.num_computed_tokens < request.num_tokens + request.num_output_placeholders
        if not request.is_prefill_chunk:
            self.inflight_prefills.pop(request.request_id, None)
        if self.async_scheduling and not request.is_prefill_chunk:
            request.num_output_placeholders += 1 + len(s.spec_token_ids)

    @staticmethod
    def _num_wanted(request: Request, num_computed: int) -> int:
        """Tokens the request has left to compute (drafts and in-flight outputs included)."""
        return request.num_tokens_with_spec + request.num_output_placeholders - num_computed

    def _num_new_tokens(self, num_wanted: int) -> int:
        """`num_wanted` cut by the long-prefill threshold (which, as in vLLM, cuts with chunked prefill off too)."""
        threshold = self.long_prefill_token_threshold
        return threshold if 0 < threshold < num_wanted else num_wanted

    def _limit(self, request: Request, num_wanted: int, num_new: int, budget: int, room: int | None) -> TokenLimit:
        """Why a request gets `num_new` < `num_wanted` tokens: the binding cap among `room` (max_model_len, for a
        running request), the long-prefill threshold and the `budget` left (ties named in that order). Drafts are
        the last tokens it wants, so they are cut first."""
        num_drafts_cut = min(len(request.spec_token_ids), num_wanted - num_new)
        if num_new == room:
            return MaxModelLen(num_wanted=num_wanted, num_drafts_cut=num_drafts_cut, max_model_len=self.max_model_len)
        if num_new == self.long_prefill_token_threshold:
            return LongPrefillThreshold(num_wanted=num_wanted, num_drafts_cut=num_drafts_cut, threshold=num_new)
        return BudgetLeft(num_wanted=num_wanted, num_drafts_cut=num_drafts_cut, budget_left=budget)

    def _defer(self, request_ids: tuple[str, ...], reason: Reason) -> None:
        self.events.emit(RequestDeferred, request_ids=request_ids, reason=reason)

    def _schedule_running(self, scheduled: list[ScheduledRequest], preempted: list[Request], budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_computed = request.num_computed_tokens
            if (
                request.num_output_placeholders
                and num_computed + 2 - request.num_output_placeholders
                >= request.num_prompt_tokens + request.sampling_params.max_tokens
            ):
                # asynchronous: the tokens in flight already reach max_tokens; no step past them
                self._defer((request.request_id,), OutputsInFlight(num_tokens=request.num_output_placeholders))
                index += 1
                continue
            # no input position past max_model_len - 1: the token sampled there is the last one the model holds
            room = self.max_model_len - num_computed - 1
            num_wanted = self._num_wanted(request, num_computed)
            num_new = min(self._num_new_tokens(num_wanted), budget, room)
            if num_new <= 0:
                index += 1
                continue
            limit = None if num_new == num_wanted else self._limit(request, num_wanted, num_new, budget, room)
            while self.kv.allocate_slots(request, num_new, num_lookahead_tokens=self.num_lookahead_tokens) is None:
                victim = self._pick_victim()
                victim_index = self.running.index(victim)
                self.running.pop(victim_index)
                budget += self._unschedule(scheduled, victim)
                self._preempt(victim, request)
                preempted.append(victim)
                if victim_index < index:
                    index -= 1
                if victim is request:
                    break
            else:
                scheduled.append(self._scheduled(request, num_new, num_computed, limit))
                budget -= num_new
                index += 1
                continue
            if self.policy != "priority":
                break  # FCFS preempted the request itself: it was the last one
            # priority: the request was the lowest-priority one and preempted itself; those after it rank higher and
            # may fit in the blocks it freed (vLLM 0.33 goes on with them)
        if index < len(self.running):  # the budget ran out before their turn
            self._defer(
                tuple(r.request_id for r in self.running[index:]),
                TokenBudgetSpent(budget=self.config.max_num_batched_tokens),
            )
        return budget

    def _pick_victim(self) -> Request:
        if self.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    @staticmethod
    def _unschedule(scheduled: list[ScheduledRequest], victim: Request) -> int:
        for i, s in enumerate(scheduled):
            if s.request is victim:
                scheduled.pop(i)
                return s.num_new_tokens
        return 0

    def _preempt(self, request: Request, needed_by: Request) -> None:
        """Preempt `request` for `needed_by`, whose allocation was just refused."""
        blocks = self.kv.req_to_blocks.get(request.request_id, [])
        # its leading blocks that keep their hash once freed (computed ones: kv.free forgets the others), up to
        # where its resume's lookup stops (num_tokens - 1): the tokens it will not recompute, unless evicted first
        num_hittable = min(request.num_computed_tokens, request.num_tokens - 1) // self.kv.block_size
        kept = tuple(b.block_id for b in takewhile(lambda b: b.block_hash is not None, blocks[:num_hittable]))
        refusal = self.kv.refusal
        assert refusal is not None, "a preemption follows a refused allocate_slots"
        self.events.emit(
            RequestPreempted,
            request_id=request.request_id,
            num_computed_tokens=request.num_computed_tokens,
            num_freed_blocks=len(blocks),
            reason=Preemption(
                rule="lowest_priority" if self.policy == "priority" else "last_running",
                needed_by=needed_by.request_id,
                num_blocks_needed=refusal.num_blocks_needed,
                num_free_blocks=refusal.num_free_blocks,
                kept_block_ids=kept,
                num_kept_tokens=len(kept) * self.kv.block_size,
            ),
        )
        self.kv.free(request)
        self.inflight_prefills.pop(request.request_id, None)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        # outputs still in flight come back to a request that starts over: appended, but they move no counter
        request.num_stale_output_tokens = request.num_in_flight_tokens
        request.num_output_placeholders = 0
        request.spec_token_ids = []
        request.spec_draft_probs = None
        request.num_preemptions += 1
        self.waiting.prepend_request(request)

    def _schedule_waiting(self, scheduled: list[ScheduledRequest], budget: int) -> None:
        skipped: list[Request] = []  # passed over, not blocking the others: back at the head of their queue after
        deferred: dict[Reason, list[str]] = {}  # the skipped ones by reason
        stop: Admission | None = None
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            queue = self.kv_holding if len(self.kv_holding) else self.waiting
            if not len(queue):
                break
            request = queue.peek_request()
            admission = self._admission(request, budget)
            if admission.verdict is Verdict.STOP:
                stop = admission
                break
            if admission.verdict is Verdict.FINISH:
                self.finish_request(request, RequestStatus.FINISHED_ERROR, admission.error)
            elif admission.verdict is Verdict.SCHEDULE:
                queue.pop_request()
                budget -= self._admit(admission, scheduled)
            else:
                if admission.verdict is Verdict.PARK:
                    self._wait_for_remote_kvs(admission)
                skipped.append(queue.pop_request())
                assert admission.reason is not None, "a check that skips says why"
                deferred.setdefault(admission.reason, []).append(request.request_id)
        for reason, ids in deferred.items():
            self._defer(tuple(ids), reason)
        if self.num_waiting:
            self._defer_not_reached(stop, budget)
        for request in reversed(skipped):  # a request that holds blocks now waits with the block holders
            holds = request.num_computed_tokens > 0 or request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            (self.kv_holding if holds else self.waiting).prepend_request(request)

    def _defer_not_reached(self, stop: Admission | None, budget: int) -> None:
        """Say why the requests still queued were not admitted: the one a check stopped at (`stop`) says its own
        reason, and those after it wait behind it; else the budget or max_num_seqs ended the loop."""
        rest = (*self.kv_holding.request_ids(), *self.waiting.request_ids())
        behind: Reason
        if stop is not None:
            head = stop.request
            assert stop.reason is not None, "a check that stops says why"
            self._defer((head.request_id,), stop.reason)
            rest = tuple(rid for rid in rest if rid != head.request_id)
            behind = (
                LowerPriority(blocked_by=head.request_id, blocker_priority=head.priority)
                if self.policy == "priority"
                else HeadOfLine(blocked_by=head.request_id)
            )
        elif budget <= 0:
            behind = TokenBudgetSpent(budget=self.config.max_num_batched_tokens)
        else:
            behind = MaxNumSeqs(max_num_seqs=self.config.max_num_seqs)
        if rest:
            self._defer(rest, behind)

    def _admission(self, request: Request, budget: int) -> Admission:
        """The seed's steps for a waiting request, in its order, until one decides: is its KV still loading, is
        its grammar compiled (WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR), its prefix-cache hits, the connector's
        external tokens, its new
        tokens (chunked by the budget and the long-prefill threshold), then allocate_slots (PARK or SCHEDULE)."""
        admission = Admission(request, budget)
        for check in (
            self._check_remote_kvs,
            self._check_grammar,
            self._check_stale_output,
            self._lookup_prefix_cache,
            self._lookup_external_tokens,
            self._count_new_tokens,
            self._allocate_slots,
        ):
            admission.verdict = check(admission)
            if admission.verdict is not None:
                break
        return admission

    def _check_remote_kvs(self, a: Admission) -> Verdict | None:
        if a.request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            return None
        if a.request.request_id not in self.finished_recving:
            a.reason = WaitingForRemoteKV(stored=True)
            return Verdict.SKIP
        self._promote_loaded(a.request)
        return None

    def _promote_loaded(self, request: Request) -> None:
        """Its load landed (update_kv_xfer_finished): cache the blocks it filled, or free them if none is good, and
        make it WAITING (PREEMPTED if it was preempted before) from its first missing token, as vLLM 0.33's
        _update_waiting_for_remote_kv does when the waiting loop reaches it."""
        self.finished_recving.discard(request.request_id)
        if request.num_computed_tokens:
            self.kv.cache_blocks(request, request.num_computed_tokens)
        else:  # every block came back bad: allocated again from the prefix cache's hits
            self.kv.free(request)
        if request.num_computed_tokens == request.num_tokens:  # the whole prompt loaded: its last token is computed
            request.num_computed_tokens -= 1  # again, so that the first output is sampled
        request.status = RequestStatus.PREEMPTED if request.num_preemptions else RequestStatus.WAITING

    def _check_grammar(self, a: Admission) -> Verdict | None:
        """A grammar still compiling holds its request back (the others go on); one that failed holds it back too,
        and finishes it at the end of the step."""
        if a.request.status != _COMPILING or self._structured().check_ready(a.request):
            return None
        a.error = self._structured().error(a.request.request_id)
        if a.error is not None:
            self.grammar_errors[a.request.request_id] = a.error
        a.reason = WaitingForGrammar()
        return Verdict.SKIP

    @staticmethod
    def _check_stale_output(a: Admission) -> Verdict | None:
        # asynchronous: a preempted request resumes only once the outputs it had in flight are back, or a resumed
        # step could sample a position those outputs fill
        if not a.request.num_stale_output_tokens:
            return None
        a.reason = OutputsInFlight(num_tokens=a.request.num_stale_output_tokens)
        return Verdict.SKIP

    def _lookup_prefix_cache(self, a: Admission) -> Verdict | None:
        if a.request.num_computed_tokens == 0:  # else its KV came from a finished asynchronous load
            a.hit_blocks, a.num_hit = self.kv.get_computed_blocks(a.request)
        return None

    def _lookup_external_tokens(self, a: Admission) -> Verdict | None:
        """Tokens past the local hits whose KV another instance stored (P/D, decode side)."""
        if self.connector is None or a.request.num_computed_tokens != 0:
            return None
        try:
            num_external, a.load_async = self.connector.get_num_new_matched_tokens(a.request, a.num_hit)
        except KVLoadError as exc:
            a.error = str(exc)
            return Verdict.FINISH
        if num_external is None:  # its producer's KV is not stored yet: look again next step
            self.awaiting_kv.add(a.request.request_id)
            a.reason = WaitingForRemoteKV(stored=False)
            return Verdict.SKIP
        self.awaiting_kv.discard(a.request.request_id)
        a.num_external = num_external
        return None

    def _count_new_tokens(self, a: Admission) -> Verdict | None:
        if a.load_async:  # nothing is computed until the load lands
            return None
        num_wanted = self._num_wanted(a.request, a.num_computed)
        a.num_new = self._num_new_tokens(num_wanted)
        if not self.config.enable_chunked_prefill and a.num_new > a.budget:
            a.reason = PromptExceedsBudget(num_new_tokens=a.num_new, budget_left=a.budget)
            return Verdict.STOP  # without chunking, a prompt waits until it fits whole
        a.num_new = min(a.num_new, a.budget)
        if a.num_new < num_wanted:
            a.limit = self._limit(a.request, num_wanted, a.num_new, a.budget, None)
        return None

    def _allocate_slots(self, a: Admission) -> Verdict:
        """Blocks for the hits, the external tokens (they need blocks, the load fills them, but no share of the
        budget) and the new tokens; STOP when the cache is short. Blocks an asynchronous load fills enter the
        prefix cache only when it lands: nobody may hit KV that is not there yet."""
        lookahead = 0 if a.load_async else self.num_lookahead_tokens
        # a load holds its blocks for the whole transfer, unpreemptible: admitted only if the blocks the prompts in
        # flight still need (and one speculative step's) stay free, as vLLM 0.33 reserves them
        reserved = self._num_reserved_blocks() if a.load_async else 0
        if (
            self.kv.allocate_slots(
                a.request,
                a.num_external + a.num_new,
                a.num_hit,
                a.hit_blocks,
                lookahead,
                delay_cache_blocks=a.load_async,
                full_sequence_must_fit=self.config.scheduler_reserve_full_isl,
                reserved_blocks=reserved,
            )
            is None
        ):
            a.reason = self.kv.refusal
            return Verdict.STOP
        if self.connector is not None:
            self.connector.update_state_after_alloc(
                a.request, self.kv.get_block_ids(a.request.request_id), a.num_external
            )
        if a.load_async:
            a.reason = WaitingForRemoteKV(stored=True)
            return Verdict.PARK
        return Verdict.SCHEDULE

    def _num_reserved_blocks(self) -> int:
        """Blocks the requests whose prompt is not all computed still need for their whole sequence, and one
        speculative step's (vLLM 0.33's _inflight_prefill_reserved_blocks and _spec_decode_step_blocks)."""
        extra = 1 + self.num_spec_tokens + self.num_lookahead_tokens if self.num_spec_tokens else 0
        block_size = self.kv.block_size
        reserved = -(-extra // block_size)
        for rid, r in self.inflight_prefills.items():
            num_blocks = -(-(min(r.num_tokens, self.max_model_len) + extra) // block_size)
            reserved += max(num_blocks - len(self.kv.req_to_blocks.get(rid, ())), 0)
        return reserved

    def _admit(self, a: Admission, scheduled: list[ScheduledRequest]) -> int:
        """Move the request (popped from its queue) to running; returns the budget its new tokens take."""
        request, num_computed = a.request, a.num_computed
        if num_computed + a.num_new < request.num_tokens:
            self.inflight_prefills[request.request_id] = request
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = a.num_hit + a.num_external
        if request.metrics.first_scheduled_time is None:
            request.metrics.first_scheduled_time = self.clock.monotonic()
        scheduled.append(self._scheduled(request, a.num_new, num_computed, a.limit))
        return a.num_new

    def _wait_for_remote_kvs(self, a: Admission) -> None:
        """Park a request whose blocks are allocated until its asynchronous load lands."""
        request = a.request
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.num_computed_tokens = a.num_hit + a.num_external  # as vLLM: what it will have once the load lands
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = a.num_hit + a.num_external
        self.remote_loads[request.request_id] = a.num_hit + a.num_external
        self.inflight_prefills[request.request_id] = request

    def update_kv_xfer_finished(
        self, finished_sending: set[str], finished_recving: set[str], failed_block_ids: set[int]
    ) -> None:
        """Asynchronous transfers ended: release held blocks, and mark loaded requests to leave
        WAITING_FOR_REMOTE_KVS from their first missing token when the waiting loop reaches them (_promote_loaded), or,
        under policy "fail", finish those whose KV came back bad."""
        for rid in (*finished_recving, *finished_sending):  # vLLM 0.33's order: loads, then sends
            if rid in self.held:
                self.kv.free(self.held.pop(rid))
        fail = self._kv_load_fails()
        for rid in finished_recving:
            request = self.requests.get(rid)
            if request is None or rid not in self.remote_loads:
                continue
            num_computed = self.remote_loads.pop(rid)
            bad = [i for i, b in enumerate(self.kv.get_block_ids(rid)) if b in failed_block_ids]
            if bad and fail:
                self.finish_request(
                    request, RequestStatus.FINISHED_ERROR, f"kv_transfer: the KV loaded for request {rid} is bad"
                )
                continue
            if bad:
                request.num_computed_tokens = min(num_computed, min(bad) * self.kv.block_size)
            self.finished_recving.add(rid)

    def _scheduled(
        self, request: Request, num_new: int, num_computed: int, limit: TokenLimit | None = None
    ) -> ScheduledRequest:
        num_known = request.num_tokens + request.num_output_placeholders  # tokens in flight are known by then
        num_spec = max(0, num_computed + num_new - num_known)
        samples = num_computed + num_new - num_spec >= num_known
        return ScheduledRequest(
            request,
            num_new,
            num_computed,
            self.kv.get_block_ids(request.request_id),
            samples,
            request.spec_token_ids[:num_spec],
            limit,
        )

    def handle_kv_load_errors(self, output: SchedulerOutput, failed_block_ids: set[int]) -> None:
        """Requests whose loaded KV is bad in some block leave this step: by the policy, they resume computing
        from their first bad block, or finish with an error."""
        fail = self._kv_load_fails()
        for s in list(output.scheduled):
            block_ids = s.block_ids
            bad = [i for i, b in enumerate(block_ids) if b in failed_block_ids]
            if not bad:
                continue
            output.scheduled.remove(s)
            request = s.request
            request.num_computed_tokens = min(bad) * self.kv.block_size  # blocks from here on are recomputed
            if fail:
                self.finish_request(
                    request,
                    RequestStatus.FINISHED_ERROR,
                    f"kv_transfer: the KV loaded for request {request.request_id} is bad",
                )

    # ---- results ------------------------------------------------------------------------------
    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled: dict[str, list[int]],
        drafts: dict[str, tuple[list[int], object]] | None = None,
    ) -> dict[str, list[int]]:
        """Append sampled tokens (rolling back the slots of rejected drafts), apply token-level stop rules,
        free what finished, and hand the next drafts to the requests that go on.
        Returns the tokens each request actually took (up to its stop), by request id."""
        appended: dict[str, list[int]] = {}
        now = self.clock.monotonic()
        for s in output.scheduled:
            request = s.request
            request.num_in_flight_tokens -= s.num_new_tokens
            stale = request.num_stale_output_tokens > 0  # scheduled before a preemption: counters moved on
            if stale:
                request.num_stale_output_tokens -= s.num_new_tokens
            tokens = sampled.get(request.request_id)
            if not tokens or request.is_finished:
                continue
            # verified k drafts, kept len(tokens) - 1 of them: the rest of the step's slots are reused later
            request.num_computed_tokens -= len(s.spec_token_ids) + 1 - len(tokens)
            request.spec_token_ids, request.spec_draft_probs = [], None
            running, had_placeholders = request.status == RequestStatus.RUNNING, request.num_output_placeholders > 0
            appended[request.request_id], status = self._append(request, tokens, stale)
            # blocks its output filled, now that it is known (in flight, or accepted drafts: vLLM caches blocks
            # after every step once speculative decoding is on)
            if not stale and running and (had_placeholders or self.num_spec_tokens):
                self.kv.cache_blocks(request, request.num_computed_tokens - request.num_in_flight_tokens)
            if status is not None:  # freed after the caching above, as vLLM: its cached blocks go to the LRU tail
                self.finish_request(request, status)
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            request.metrics.last_token_time = now
            if not request.is_finished and drafts and request.request_id in drafts:
                self._set_drafts(request, *drafts[request.request_id])
        for rid in sorted(self.grammar_errors):  # vLLM finishes them from a set, in no order of its own
            failed = self.requests.get(rid)
            if failed is not None:
                self.finish_request(failed, RequestStatus.FINISHED_ERROR, self.grammar_errors[rid])
        self.grammar_errors.clear()
        return appended

    def _append(
        self, request: Request, tokens: list[int], stale: bool = False
    ) -> tuple[list[int], RequestStatus | None]:
        """Append sampled tokens up to a stop; returns those taken and the finished status the stop gives."""
        taken, status = [], None
        for token in tokens:
            request.append_output_token_ids(token)
            taken.append(token)
            status = check_stop(request, token, self.max_model_len)
            if status is not None:
                break
        if not stale:
            request.num_computed_tokens -= len(tokens) - len(taken)  # as vLLM: computed covers all but the stop
            request.num_output_placeholders = max(0, request.num_output_placeholders - len(tokens))
        if self.structured is not None and self.structured.is_guided(request.request_id):
            if self.structured.accept_tokens(request, taken) and status is None:
                status = RequestStatus.FINISHED_STOPPED  # the grammar is complete
        return taken, status

    def _set_drafts(self, request: Request, tokens: list[int], probs) -> None:
        num_proposed = len(tokens)
        if self.structured is not None and self.structured.is_guided(request.request_id):
            tokens = tokens[: self.structured.validate_tokens(request, tokens)]  # drafts the grammar allows
        if tokens:
            request.spec_token_ids = tokens
            request.spec_draft_probs = None if probs is None else probs[: len(tokens)]
        # reported even when the grammar cut every draft: the proposer's work is visible, and what it cost
        if num_proposed:
            self.events.emit(
                SpecProposed,
                request_id=request.request_id,
                method=self.spec_method,
                draft_token_ids=tuple(tokens),
                num_cut_by_grammar=num_proposed - len(tokens),
            )

    def finish_request(self, request: Request, status: RequestStatus, error: str | None = None) -> None:
        """End a request in any state: leave its queue, free its blocks, record why."""
        if request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request.status != RequestStatus.RUNNING:
            self._queue_of(request).remove_request(request)
        # a load still writing into its blocks: they stay held until it ends (vLLM 0.33's finish_requests)
        loading = request.request_id in self.remote_loads
        request.status = status
        request.error = error
        request.metrics.finished_time = self.clock.monotonic()
        delay_free = False
        self.inflight_prefills.pop(request.request_id, None)
        if self.connector is not None:
            delay_free, request.kv_transfer_params_out = self.connector.request_finished(
                request, self.kv.get_block_ids(request.request_id)
            )
            delay_free |= loading
            self.remote_loads.pop(request.request_id, None)
            self.finished_recving.discard(request.request_id)
            self.awaiting_kv.discard(request.request_id)
        if delay_free:  # a transfer thread still reads or writes them: freed when get_finished says it ended
            self.held[request.request_id] = request
        else:
            self.kv.free(request)
        if self.structured is not None:
            self.structured.remove(request.request_id)
        self.requests.pop(request.request_id, None)
        self.finished_req_ids.add(request.request_id)
        self.events.emit(
            RequestFinished,
            request_id=request.request_id,
            reason=status.finish_reason,
            num_output_tokens=request.num_output_tokens,
            error=error,
        )
