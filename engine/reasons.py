"""Why the engine decided what it did: small frozen records that ride on the events (engine/events.py).

Every decision that leaves a request with less than it wants carries one: a waiting request not admitted
(`request.deferred`), a request given fewer tokens than it wants (`request.scheduled`'s `limit`), a preemption
(`request.preempted`'s `reason`), a prefix lookup that missed part of the prompt (`prefix.lookup`'s `miss`, or
`prefix.skipped`), an eviction (`kv.evicted`'s `reason`). Each reason is a `code` (a short name, stable in traces)
and the numbers behind it; `describe()` says it in a sentence. They serialise with the events (`to_dict`,
`Reason.from_dict`), so a replayed trace explains as the live engine does.

A leaf: it imports nothing of the engine, so the events, the scheduler and the KV cache all use it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

REASON_TYPES: dict[str, type[Reason]] = {}  # by code
_CLASS_NAMES: set[str] = {"Reason"}  # every reason class, with or without a code of its own


def json_fields(obj: Any) -> dict[str, Any]:
    """A dataclass's fields as JSON-safe data: tuples as lists, reasons as their dicts (events and reasons share
    this spelling)."""
    d: dict[str, Any] = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        d[f.name] = list(value) if isinstance(value, tuple) else value.to_dict() if isinstance(value, Reason) else value
    return d


@dataclass(frozen=True, kw_only=True)
class Reason:
    """Base of all reasons: owns the registry of codes, the dict spelling and the sentence."""

    code: ClassVar[str] = "reason"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _CLASS_NAMES.add(cls.__name__)
        if "code" in cls.__dict__:  # a shared base without its own code (TokenLimit) is not a reason type
            REASON_TYPES[cls.code] = cls

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, **json_fields(self)}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Reason:
        d = dict(d)
        cls = REASON_TYPES[d.pop("code")]
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})

    def describe(self) -> str:
        """The reason in one sentence."""
        raise NotImplementedError


def _count(n: int, noun: str) -> str:
    """ "1 block", "2 blocks": the sentences' numbers."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def is_reason_field(annotation: object) -> bool:
    """Whether a dataclass field's annotation (a string, under `from __future__ import annotations`) holds a
    reason: events read theirs back with `Reason.from_dict`."""
    return isinstance(annotation, str) and annotation.split(" ", 1)[0] in _CLASS_NAMES


# ---- a request that got no tokens this step (request.deferred) ------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class TokenBudgetSpent(Reason):
    """The step's token budget was spent on requests ahead of it before its turn came."""

    code: ClassVar[str] = "budget_spent"
    budget: int  # max_num_batched_tokens

    def describe(self) -> str:
        return f"the token budget ({self.budget}) was spent before its turn"


@dataclass(frozen=True, kw_only=True)
class PromptExceedsBudget(Reason):
    """Chunked prefill is off: its prompt runs whole or not at all, and it needs more than the budget left."""

    code: ClassVar[str] = "unchunked_prompt"
    num_new_tokens: int
    budget_left: int

    def describe(self) -> str:
        return (
            f"needs {_count(self.num_new_tokens, 'token')} at once (chunked prefill off), only {self.budget_left} "
            "left in the budget"
        )


@dataclass(frozen=True, kw_only=True)
class MaxNumSeqs(Reason):
    """`max_num_seqs` requests were already running."""

    code: ClassVar[str] = "max_num_seqs"
    max_num_seqs: int

    def describe(self) -> str:
        return f"max_num_seqs ({self.max_num_seqs}) requests already running"


@dataclass(frozen=True, kw_only=True)
class NotEnoughBlocks(Reason):
    """allocate_slots refused: it needs more free blocks than the free queue holds. `num_free_blocks` counts every
    block in the free queue, `num_cached_free_blocks` those of them that still hold a cached prefix (they are
    evicted when taken). `whole_sequence`: the admission gate asked room for its whole sequence
    (scheduler_reserve_full_isl), not only this chunk."""

    code: ClassVar[str] = "kv_blocks"
    num_blocks_needed: int
    num_free_blocks: int
    num_cached_free_blocks: int
    whole_sequence: bool = False

    def describe(self) -> str:
        whole = " for its whole sequence" if self.whole_sequence else ""
        return (
            f"needs {_count(self.num_blocks_needed, 'KV block')}{whole}, {self.num_free_blocks} free "
            f"({self.num_cached_free_blocks} of them cached-free)"
        )


@dataclass(frozen=True, kw_only=True)
class WaitingForGrammar(Reason):
    """Its grammar is still compiling (WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR); the others go on."""

    code: ClassVar[str] = "grammar"

    def describe(self) -> str:
        return "its grammar is still compiling"


@dataclass(frozen=True, kw_only=True)
class WaitingForRemoteKV(Reason):
    """Its KV comes from another instance: `stored` False while the producer has not stored it yet, True while it
    loads into its blocks (WAITING_FOR_REMOTE_KVS)."""

    code: ClassVar[str] = "remote_kv"
    stored: bool

    def describe(self) -> str:
        return "its remote KV is loading" if self.stored else "its producer has not stored its KV yet"


@dataclass(frozen=True, kw_only=True)
class OutputsInFlight(Reason):
    """Asynchronous scheduling: `num_tokens` of its outputs are still in flight (a preempted request resumes only
    once they are back; a running one whose outputs in flight already end it gets no more)."""

    code: ClassVar[str] = "outputs_in_flight"
    num_tokens: int

    def describe(self) -> str:
        return f"waits for {_count(self.num_tokens, 'output')} still in flight"


@dataclass(frozen=True, kw_only=True)
class HeadOfLine(Reason):
    """FCFS: the request ahead of it (`blocked_by`) could not be scheduled, and nobody passes it."""

    code: ClassVar[str] = "head_of_line"
    blocked_by: str

    def describe(self) -> str:
        return f"behind request {self.blocked_by}, which could not be scheduled (head of line)"


@dataclass(frozen=True, kw_only=True)
class LowerPriority(Reason):
    """Priority scheduling: a request ranked ahead of it (`blocked_by`, of priority `blocker_priority`; lower runs
    first, then earlier arrival) could not be scheduled, and nobody ranked after it is admitted."""

    code: ClassVar[str] = "lower_priority"
    blocked_by: str
    blocker_priority: int

    def describe(self) -> str:
        return f"behind request {self.blocked_by} (priority {self.blocker_priority}), which could not be scheduled"


@dataclass(frozen=True, kw_only=True)
class MemoryPressure(Reason):
    """A running request was preempted this step: nobody new is admitted while the cache is short."""

    code: ClassVar[str] = "memory_pressure"
    preempted: tuple[str, ...]

    def describe(self) -> str:
        return f"no admissions: {', '.join(self.preempted)} preempted this step"


# ---- a request given fewer tokens than it wants (request.scheduled's limit, or request.deferred) -------------------


@dataclass(frozen=True, kw_only=True)
class TokenLimit(Reason):
    """What cut a request's tokens this step: it wanted `num_wanted` (drafts included); `num_drafts_cut` of its
    draft tokens fell off the end."""

    num_wanted: int
    num_drafts_cut: int = 0

    def _drafts(self) -> str:
        return f"; {_count(self.num_drafts_cut, 'draft token')} cut" if self.num_drafts_cut else ""


@dataclass(frozen=True, kw_only=True)
class BudgetLeft(TokenLimit):
    """Only `budget_left` tokens of the step's budget were left when its turn came."""

    code: ClassVar[str] = "budget_left"
    budget_left: int

    def describe(self) -> str:
        return f"wanted {_count(self.num_wanted, 'token')}, {self.budget_left} left in the budget{self._drafts()}"


@dataclass(frozen=True, kw_only=True)
class LongPrefillThreshold(TokenLimit):
    """`long_prefill_token_threshold` caps a prefill chunk while others share the step."""

    code: ClassVar[str] = "long_prefill"
    threshold: int

    def describe(self) -> str:
        wanted = _count(self.num_wanted, "token")
        return f"wanted {wanted}, long_prefill_token_threshold is {self.threshold}{self._drafts()}"


@dataclass(frozen=True, kw_only=True)
class MaxModelLen(TokenLimit):
    """No input position reaches past `max_model_len` - 1."""

    code: ClassVar[str] = "max_model_len"
    max_model_len: int

    def describe(self) -> str:
        return f"wanted {_count(self.num_wanted, 'token')}, max_model_len is {self.max_model_len}{self._drafts()}"


# ---- a preemption (request.preempted's reason) -------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Preemption(Reason):
    """Why this victim: `rule` "last_running" (FCFS: the most recently admitted running request) or
    "lowest_priority" (the highest priority value, then the latest arrival); `needed_by` the request whose
    allocation failed (the victim itself when it was the last one), needing `num_blocks_needed` with
    `num_free_blocks` free. `kept_block_ids`: the victim's leading blocks that stay cached after it is freed, which
    its resume hits unless they are evicted first (`num_kept_tokens` tokens it need not recompute)."""

    code: ClassVar[str] = "preempted"
    rule: str
    needed_by: str
    num_blocks_needed: int
    num_free_blocks: int
    kept_block_ids: tuple[int, ...]
    num_kept_tokens: int

    def describe(self) -> str:
        rule = "the last running request" if self.rule == "last_running" else "the lowest priority, latest arrival"
        kept = (
            f"; cached for its resume: {_count(len(self.kept_block_ids), 'block')} "
            f"({_count(self.num_kept_tokens, 'token')})"
        )
        return (
            f"{rule}: request {self.needed_by} needed {_count(self.num_blocks_needed, 'block')}, "
            f"{self.num_free_blocks} free{kept if self.kept_block_ids else ''}"
        )


# ---- a prefix lookup: where the hit stopped (prefix.lookup's miss, prefix.skipped) ----------------------------------


@dataclass(frozen=True, kw_only=True)
class PartialBlock(Reason):
    """What is left past the hits (`num_tokens`) is shorter than one block: only full blocks are cached."""

    code: ClassVar[str] = "partial_block"
    num_tokens: int
    block_size: int

    def describe(self) -> str:
        return f"{_count(self.num_tokens, 'token')} past the hit, less than one block ({self.block_size})"


@dataclass(frozen=True, kw_only=True)
class CappedAtLastToken(Reason):
    """Every block the lookup could take hit; block `block_index` is full but holds the last of `num_tokens`
    tokens, which must be computed to sample: the hit stops at num_tokens - 1."""

    code: ClassVar[str] = "last_token"
    num_tokens: int
    block_index: int

    def describe(self) -> str:
        return f"block {self.block_index} holds the last token (of {self.num_tokens}), computed to sample"


@dataclass(frozen=True, kw_only=True)
class TokenDiffers(Reason):
    """Block `block_index` is not cached; the nearest cached chain (cached block `cached_block_id`, after the same
    prefix) first differs at token position `position`: `token_id` here, `cached_token_id` there."""

    code: ClassVar[str] = "token_differs"
    block_index: int
    position: int
    token_id: int
    cached_token_id: int
    cached_block_id: int

    def describe(self) -> str:
        return (
            f"block {self.block_index} differs from cached block {self.cached_block_id} at token {self.position} "
            f"({self.token_id} vs {self.cached_token_id})"
        )


@dataclass(frozen=True, kw_only=True)
class OtherSalt(Reason):
    """The same tokens are cached (block `cached_block_id`) under another cache salt (None: no salt), which starts
    another chain."""

    code: ClassVar[str] = "cache_salt"
    block_index: int
    cache_salt: str | None
    cached_salt: str | None
    cached_block_id: int

    def describe(self) -> str:
        return (
            f"block {self.block_index} is cached (block {self.cached_block_id}) under salt {self.cached_salt!r}, "
            f"this request's is {self.cache_salt!r}"
        )


@dataclass(frozen=True, kw_only=True)
class Evicted(Reason):
    """Block `block_index` was cached (in block `block_id`) and evicted at step `step`: `cause` "reused" (taken
    for request `for_request`), "uncomputed" (its request was preempted before computing it) or "reset"."""

    code: ClassVar[str] = "evicted"
    block_index: int
    block_id: int
    step: int
    cause: str
    for_request: str | None

    def describe(self) -> str:
        why = f"for request {self.for_request}" if self.for_request is not None else f"({self.cause})"
        return f"block {self.block_index} was cached in block {self.block_id}, evicted at step {self.step} {why}"


@dataclass(frozen=True, kw_only=True)
class NotCached(Reason):
    """Nothing cached continues the hit chain at block `block_index`: no cached block has the same parent."""

    code: ClassVar[str] = "not_cached"
    block_index: int

    def describe(self) -> str:
        return f"nothing cached continues the prefix at block {self.block_index}"


@dataclass(frozen=True, kw_only=True)
class PromptLogprobs(Reason):
    """It asks for prompt logprobs: its whole prompt is computed (a hit has no logits), so the cache is not read."""

    code: ClassVar[str] = "prompt_logprobs"

    def describe(self) -> str:
        return "prompt_logprobs: the prefix cache is not read"


# ---- an eviction (kv.evicted's reason) --------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Eviction(Reason):
    """Why a cached block lost its hash: `cause` "reused" (popped from the free queue's head for request
    `for_request`), "uncomputed" (its request was preempted before computing it) or "reset" (reset_prefix_cache);
    `last_used_step` / `last_used_by`: when and by whom it was last released (None if it never was)."""

    code: ClassVar[str] = "eviction"
    cause: str
    for_request: str | None
    last_used_step: int | None
    last_used_by: str | None

    def describe(self) -> str:
        used = (
            f"last used by request {self.last_used_by} at step {self.last_used_step}"
            if self.last_used_by is not None
            else "never released"
        )
        taken = f"taken for request {self.for_request}" if self.for_request is not None else self.cause
        return f"{taken}; {used}"
