"""Typed events: every decision the engine makes inside a step, and the StepRecord that gathers them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, TypeVar

from engine.reasons import Eviction, Preemption, Reason, TokenLimit, is_reason_field, json_fields

EVENT_TYPES: dict[str, type[Event]] = {}


@dataclass(frozen=True)
class Event:
    """Base of all events: a dotted `kind`, the `step` it happened in, and a JSON-safe payload."""

    step: int
    kind: ClassVar[str] = "event"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "kind" in cls.__dict__:  # a shared base without its own kind is not an event type
            EVENT_TYPES[cls.kind] = cls

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **json_fields(self)}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Event:
        d = dict(d)
        cls = EVENT_TYPES[d.pop("kind")]
        tuple_fields = {f.name for f in fields(cls) if f.type.startswith("tuple[")}
        reason_fields = {f.name for f in fields(cls) if is_reason_field(f.type)}
        kwargs: dict[str, Any] = {k: tuple(v) if k in tuple_fields and v is not None else v for k, v in d.items()}
        for k in reason_fields & kwargs.keys():
            if kwargs[k] is not None:
                kwargs[k] = Reason.from_dict(kwargs[k])
        return cls(**kwargs)


E = TypeVar("E", bound=Event)


@dataclass(frozen=True)
class RequestAdded(Event):
    kind: ClassVar[str] = "request.added"
    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    priority: int
    arrival_ns: int = 0  # wall clock (time.time_ns), comparable with StepRecord.start_ns / end_ns
    prompt: str = ""  # the prompt's text (decoded when given as token ids), cut to 200 characters


@dataclass(frozen=True)
class RequestTokens(Event):
    """Tokens a request received this step and the text they added: the output text is now
    text_so_far[:text_offset] + text (a stop string can trim text shown before)."""

    kind: ClassVar[str] = "request.tokens"
    request_id: str
    token_ids: tuple[int, ...]
    text: str
    text_offset: int
    num_output_tokens: int


@dataclass(frozen=True)
class RequestScheduled(Event):
    """A request got `num_tokens` of this step's budget. For phase "chunk", this is chunk `chunk_index` of
    `num_chunks` (projected at this chunk's size; exact on the last chunk)."""

    kind: ClassVar[str] = "request.scheduled"
    request_id: str
    num_tokens: int
    phase: str  # "prefill" | "chunk" | "decode" | "verify"
    num_computed_tokens: int  # before this step
    chunk_index: int = 0
    num_chunks: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit counted when it left the waiting queue
    limit: TokenLimit | None = None  # why it got fewer tokens than it wanted (None: it got them all)


@dataclass(frozen=True)
class RequestDeferred(Event):
    """Requests that got no tokens this step, all for one `reason` (engine/reasons.py): waiting ones not admitted,
    running ones the budget did not reach. Together with request.scheduled, request.preempted and request.finished
    it accounts for every live request in every step the scheduler ran."""

    kind: ClassVar[str] = "request.deferred"
    request_ids: tuple[str, ...]
    reason: Reason


@dataclass(frozen=True)
class RequestPreempted(Event):
    kind: ClassVar[str] = "request.preempted"
    request_id: str
    num_computed_tokens: int  # thrown away: recomputed when it resumes
    num_freed_blocks: int
    reason: Preemption | None = None  # why this victim, for whom, and what stays cached


@dataclass(frozen=True)
class RequestFinished(Event):
    kind: ClassVar[str] = "request.finished"
    request_id: str
    reason: str
    num_output_tokens: int
    error: str | None = None


@dataclass(frozen=True)
class KVAllocated(Event):
    kind: ClassVar[str] = "kv.allocated"
    request_id: str
    new_block_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    hit_block_ids: tuple[int, ...] = ()  # prefix-cache hits it took now (touched: shared, or back from the free queue)


@dataclass(frozen=True)
class KVFreed(Event):
    kind: ClassVar[str] = "kv.freed"
    request_id: str
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class KVCached(Event):
    kind: ClassVar[str] = "kv.cached"
    block_id: int
    block_hash: str
    parent_hash: str | None


@dataclass(frozen=True)
class KVEvicted(Event):
    kind: ClassVar[str] = "kv.evicted"
    block_id: int
    block_hash: str
    reason: Eviction | None = None  # why, for whom, and when it was last used


@dataclass(frozen=True)
class PrefixLookup(Event):
    kind: ClassVar[str] = "prefix.lookup"
    request_id: str
    num_queried_blocks: int
    num_hit_blocks: int
    num_hit_tokens: int
    hit_block_ids: tuple[int, ...] = ()
    miss: Reason | None = None  # where and why the hit stopped (None: every full block it could take hit)


@dataclass(frozen=True)
class PrefixSkipped(Event):
    """A request that does not read the prefix cache (`reason`: prompt_logprobs): no lookup, no hit, and, as in
    vLLM, no query counted."""

    kind: ClassVar[str] = "prefix.skipped"
    request_id: str
    reason: Reason


@dataclass(frozen=True)
class GrammarCompiled(Event):
    kind: ClassVar[str] = "grammar.compiled"
    request_id: str
    ms: float  # from submission to ready, queueing included
    cache_hit: bool


@dataclass(frozen=True)
class GrammarStep(Event):
    """The grammar's view of one sampled position: how many tokens it allowed, what was sampled."""

    kind: ClassVar[str] = "grammar.step"
    request_id: str
    num_allowed_tokens: int
    sampled_token: int
    terminated: bool
    jump_forward: str | None = None  # the text the grammar forces next, where it forces any


@dataclass(frozen=True)
class SpecProposed(Event):
    """Drafts set for the next step's verification. For a guided request, the grammar checks them first and cuts
    them at the first token it refuses: `draft_token_ids` is what is left (maybe nothing), `num_cut_by_grammar`
    how many the proposer made past that point."""

    kind: ClassVar[str] = "spec.proposed"
    request_id: str
    method: str
    draft_token_ids: tuple[int, ...]
    num_cut_by_grammar: int = 0


@dataclass(frozen=True)
class SpecScheduled(Event):
    """Dynamic speculative decoding (speculative_config.num_speculative_tokens_per_batch_size): this step's batch of
    `batch_size` requests takes `num_spec_tokens` drafts per request for the next step, out of `max_spec_tokens`
    (num_speculative_tokens); 0: no drafts. Emitted each step only where a schedule is set."""

    kind: ClassVar[str] = "spec.scheduled"
    batch_size: int
    num_spec_tokens: int
    max_spec_tokens: int


@dataclass(frozen=True)
class SpecVerified(Event):
    """One verification of a request's drafts. Per draft position: the draft token, accepted or not, the target's
    probability of it (`p_target`, p) and the draft's own (`p_draft`, q; None for a proposer without a draft
    distribution, n-gram, whose drafts count as certain: q = 1); then the token emitted after the accepted prefix.

    `rule` says how positions were judged: "greedy" (accepted iff the draft is the target's most likely token,
    `target_argmax`) or "sampled" (accepted iff u * q < p, u from `uniform_probs`: with probability min(1, p / q)).
    Only a prefix is accepted: positions after the first rejection are never judged (accepted False there).
    A greedy request's p and q are at temperature 1 (each side's confidence; only the argmax decides), a sampled
    one's after its temperature and filters. `draft_texts` and `emitted_text` are the tokens' text. Traces written
    before a field existed read back with its default.

    A draft tree (speculative_token_tree) lists its nodes breadth first: `tree_parents` gives each node's parent
    (0: the root, the request's newest token; node i is i + 1), `accepted_path` the nodes kept, root to leaf;
    `accepted` marks them. The tree is walked from the root: a node's children are judged in order against the
    parent's target distribution, each later sibling against what is left of it after the earlier ones were
    rejected (the residual, SpecInfer's rule), which is the `p_target` shown; `target_argmax` is the parent's
    argmax. Empty for a chain."""

    kind: ClassVar[str] = "spec.verified"
    request_id: str
    draft_token_ids: tuple[int, ...]
    accepted: tuple[bool, ...]
    p_target: tuple[float, ...]
    p_draft: tuple[float, ...] | None
    emitted_token: int  # the recovered token after a rejection, or the bonus token when all were accepted
    bonus: bool
    method: str = ""  # the proposer's speculative_config.method
    rule: str = ""  # "greedy" | "sampled"
    target_argmax: tuple[int, ...] = ()
    uniform_probs: tuple[float, ...] = ()  # "sampled" only
    draft_texts: tuple[str, ...] = ()
    emitted_text: str = ""
    tree_parents: tuple[int, ...] = ()
    accepted_path: tuple[int, ...] = ()


@dataclass(frozen=True)
class MoERouted(Event):
    """A mixture-of-experts model's router decisions in this step's forward: for each sparse layer (`layers`),
    how many tokens chose each expert (`counts[layer][expert]`), and for each request the top-k expert ids of
    each of its tokens in each sparse layer (`token_experts[request_id][layer][token]`)."""

    kind: ClassVar[str] = "moe.routed"
    layers: tuple[int, ...]
    num_experts: int
    counts: tuple[tuple[int, ...], ...]
    token_experts: dict[str, list[list[list[int]]]]


@dataclass(frozen=True)
class ParallelStep(Event):
    """What each tensor-parallel rank did in this step (the multiproc executor): one dict per rank, rank order, with
    `rank`, `forward_ms` (its forward and logits, collectives included), `sample_ms`, and `collectives`:
    {kind ("all_reduce", "all_gather"): {"count", "bytes" (this rank's tensor), "ms" (wall time inside it, waiting
    for a slower peer included)}}."""

    kind: ClassVar[str] = "parallel.step"
    tensor_parallel_size: int
    ranks: tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class DPRouted(Event):
    """The data-parallel front end sent a request to a replica (engine/entrypoints/dp_client.py). `step` numbers
    the front end's events (dp.routed and dp.replica_dead: 1, 2, ...); `time_ns` is the wall clock (comparable
    with StepRecord.end_ns). `rule`: "load" (the least `scores`, waiting * 4 + running, as vLLM's DP load
    balancer; ties: the lowest index) or "prefix" (the most `prefix_hit_blocks`, the request's leading full
    blocks the replica is known to cache; ties and no hit: the score). Per replica, in index order: `waiting`
    (reported waiting plus requests sent it has not taken yet), `running`, `scores`, `prefix_hit_blocks` (zeros
    under "load") and `alive`; a dead replica is never chosen."""

    kind: ClassVar[str] = "dp.routed"
    request_id: str
    replica: str  # "dp-0", "dp-1", ...
    replica_index: int
    rule: str
    scores: tuple[int, ...]
    waiting: tuple[int, ...]
    running: tuple[int, ...]
    prefix_hit_blocks: tuple[int, ...]
    alive: tuple[bool, ...]
    time_ns: int = 0


@dataclass(frozen=True)
class DPReplicaDead(Event):
    """A data-parallel replica's process is gone: the requests it held (`failed_request_ids`) finished with
    finish_reason "error" and `error`, and the front end sends it nothing more. `step` as in dp.routed."""

    kind: ClassVar[str] = "dp.replica_dead"
    replica: str
    replica_index: int
    error: str
    failed_request_ids: tuple[str, ...]
    time_ns: int = 0


@dataclass(frozen=True)
class DPLoad(Event):
    """A data-parallel replica's load as the front end counts it at the end of one of its records (only when it
    changed): `waiting` (reported waiting plus requests sent it has not taken yet, as the score counts them),
    `running`, and KV blocks in use out of `kv_total`. `step` is the front end's record."""

    kind: ClassVar[str] = "dp.load"
    replica: str
    replica_index: int
    waiting: int
    running: int
    kv_used: int
    kv_total: int
    alive: bool
    time_ns: int = 0


@dataclass(frozen=True)
class StepTiming(Event):
    kind: ClassVar[str] = "step.timing"
    schedule_ms: float
    forward_ms: float
    sample_ms: float
    total_ms: float


@dataclass(frozen=True)
class KVTransferDone(Event):
    """What a completed save or load moved: a request's KV blocks under `key` (the sha256 prompt-prefix key)."""

    request_id: str
    instance: str
    connector: str
    key: str
    num_blocks: int
    num_tokens: int
    num_bytes: int
    ms: float
    mb_per_s: float


@dataclass(frozen=True)
class KVTransferSave(KVTransferDone):
    """A prefill instance stored a request's prompt KV."""

    kind: ClassVar[str] = "kv_transfer.save"


@dataclass(frozen=True)
class KVTransferLoad(KVTransferDone):
    """A decode instance loaded a request's KV into its blocks; `remote_request_id` is the producer's id."""

    kind: ClassVar[str] = "kv_transfer.load"
    remote_request_id: str | None = None


@dataclass(frozen=True)
class KVTransferFail(Event):
    """A transfer that did not happen: `failure` (missing, corrupt, mismatch, timeout, save_error) and what
    the policy did about it (`policy_action`: recompute, fail, none) with the tokens recomputed."""

    kind: ClassVar[str] = "kv_transfer.fail"
    request_id: str
    instance: str
    connector: str
    failure: str
    policy_action: str
    num_recomputed_tokens: int
    detail: str = ""


class EventLog:
    """The events of the step in progress. The engine opens it per step; every subsystem appends to it."""

    def __init__(self) -> None:
        self.step = 0
        self.events: list[Event] = []

    def begin(self, step: int) -> None:
        self.step = step
        self.events = []

    def emit(self, cls: type[Event], **payload: Any) -> None:
        self.events.append(cls(step=self.step, **payload))

    def drain(self) -> list[Event]:
        events, self.events = self.events, []
        return events


@dataclass
class KVUsage:
    """Blocks by state. total = used + cached_free + free (the null block is not counted)."""

    total: int
    used: int
    cached_free: int
    free: int


@dataclass
class StepRecord:
    """Everything one engine step did: what it scheduled, its KV state after, its timings and its events."""

    step: int
    start_ns: int
    end_ns: int
    scheduled: dict[str, int]
    phases: dict[str, str]
    num_waiting: int
    num_running: int
    kv: KVUsage
    timing: dict[str, float]
    events: list[Event] = field(default_factory=list)
    # the step whose batch's sampled tokens this step's update took: this step, or with async_scheduling the one
    # before (its batch ran while this step was scheduled), or 0 when none came back; None in traces from before
    outputs_of_step: int | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("kv", "events")}
        d["kv"] = asdict(self.kv)
        d["events"] = [e.to_dict() for e in self.events]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepRecord:
        d = dict(d)
        d["kv"] = KVUsage(**d["kv"])
        d["events"] = [Event.from_dict(e) for e in d["events"]]
        return cls(**d)

    def of_kind(self, kind: str) -> list[Event]:
        return [e for e in self.events if e.kind == kind]

    def of_type(self, cls: type[E]) -> list[E]:
        """This step's events of one type, typed as that type (`of_kind` takes the kind's name)."""
        return [e for e in self.events if isinstance(e, cls)]


@dataclass
class RequestSummary:
    """One request as the engine's events describe it: what `request.added` said of it, then its status, counts,
    text so far and finish. The one definition that RequestSnapshot (between steps, from the engine) and the views'
    RequestState (workbench/state.py, folded from events) extend."""

    request_id: str
    prompt: str
    num_prompt_tokens: int
    max_tokens: int
    priority: int
    arrival_ns: int
    status: str
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class RequestSnapshot(RequestSummary):
    """One request as it stands between steps: its summary, its status a RequestStatus name, and the KV blocks it
    holds, in block-table order."""

    block_ids: list[int] = field(default_factory=list)


@dataclass
class BlockSnapshot:
    """A KV block that is not plain free: its hash (hex) while cached and its parent's; holders come from the
    requests' block lists (a hit block is held by each request that shares it)."""

    block_id: int
    block_hash: str | None
    parent_hash: str | None


@dataclass
class EngineSnapshot:
    """The engine between two steps, as a view attached now must draw it: the last step's number, the KV
    usage, every request the engine still knows (finished ones until their output is taken) and every held
    or cached block. A view starts from it, then follows StepRecords; a trace's header carries one."""

    step: int
    kv: KVUsage
    requests: list[RequestSnapshot] = field(default_factory=list)
    blocks: list[BlockSnapshot] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineSnapshot:
        return cls(
            step=d["step"],
            kv=KVUsage(**d["kv"]),
            requests=[RequestSnapshot(**r) for r in d["requests"]],
            blocks=[BlockSnapshot(**b) for b in d["blocks"]],
        )


Subscriber = Callable[[StepRecord], None]
