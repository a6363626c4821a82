"""The engine's state as the dashboards see it, rebuilt from StepRecords alone (so a replayed trace needs no model):
requests with their timings and text, which request holds which KV block and what hash it carries, and what the
grammar, speculative-decoding, KV-transfer, prefix-cache and per-rank events told. Each event is handled once,
here; the views read this state and each record's StepDelta, never the events."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from engine.events import DPLoad, DPRouted, EngineSnapshot, RequestSummary, StepRecord

WAITING, RUNNING, PREEMPTED, FINISHED = "waiting", "running", "preempted", "finished"
# the engine's RequestStatus names, as the views group them (every other one is a finished status); traces recorded
# before vLLM 0.33's name say WAITING_FOR_FSM
_STATUS = {
    "WAITING": WAITING,
    "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR": WAITING,
    "WAITING_FOR_FSM": WAITING,
    "WAITING_FOR_REMOTE_KVS": WAITING,
    "RUNNING": RUNNING,
    "PREEMPTED": PREEMPTED,
}


@dataclass
class RequestState(RequestSummary):
    """One request as seen through its events: the engine's summary of it (its status grouped as the views show
    it: waiting, running, preempted or finished), its last phase, its prefix-cache lookup, its token timings."""

    status: str = WAITING
    phase: str = ""
    num_queried_tokens: int = 0  # tokens its last prefix-cache lookup covered (outputs too, after a preemption)
    first_token_ns: int | None = None
    last_token_ns: int | None = None
    itls_ms: list[float] = field(default_factory=list)

    @property
    def ttft_ms(self) -> float | None:
        """Arrival to the end of the step that produced the first token (vLLM's TTFT)."""
        if self.first_token_ns is None:
            return None
        return (self.first_token_ns - self.arrival_ns) / 1e6

    @property
    def mean_itl_ms(self) -> float | None:
        return sum(self.itls_ms) / len(self.itls_ms) if self.itls_ms else None

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens


@dataclass
class BlockState:
    """One KV block: the requests holding it (its ref count is their number) and its hash while cached."""

    holders: list[str] = field(default_factory=list)
    block_hash: str | None = None
    parent_hash: str | None = None

    @property
    def ref_cnt(self) -> int:
        return len(self.holders)

    @property
    def kind(self) -> str:
        """ "used" (held), "cached" (free but still hittable by its hash) or "free"."""
        if self.holders:
            return "used"
        return "cached" if self.block_hash is not None else "free"


@dataclass
class GrammarCompile:
    """One grammar compiled for a request: its cost in ms (queueing included) and whether the cache held it."""

    request_id: str
    ms: float
    cache_hit: bool


@dataclass
class GrammarPosition:
    """One output position of a guided request: the tokens the grammar allowed there, the token sampled (its text
    when the step gave the request that one token), whether the grammar ended, and the text it forces next."""

    request_id: str
    position: int
    num_allowed_tokens: int
    sampled_token: int
    terminated: bool
    jump_forward: str | None = None
    text: str = ""


@dataclass
class GrammarState:
    """Owns guided decoding as its events tell it: every grammar compile in order, and per guided request (in the
    order of their first grammar step) the allowed-token count at each output position."""

    compiles: list[GrammarCompile] = field(default_factory=list)
    positions: dict[str, list[GrammarPosition]] = field(default_factory=dict)


ACCEPTED, REJECTED, NOT_REACHED = "accepted", "rejected", "not reached"


@dataclass(frozen=True)
class DraftPosition:
    """One draft position of a verification, as a learner reads it: the draft token and its text, the draft's own
    probability q of it (None: n-gram, no draft distribution), the target's p, the target's most likely token, the
    uniform draw u of a sampled request, and the outcome: accepted, rejected (the first refused position) or not
    reached (after it: never judged)."""

    position: int
    token_id: int
    text: str
    q: float | None
    p: float
    target_argmax: int | None
    uniform: float | None
    outcome: str


@dataclass(frozen=True)
class Verification:
    """One spec.verified: the step and request; per draft position the draft token, accepted or not, p_target and
    p_draft; then the token emitted after the accepted prefix (the bonus token when every draft was accepted); how
    the positions were judged (`rule`, "" in older traces) with what it read, and the tokens' text where known."""

    step: int
    request_id: str
    draft_token_ids: tuple[int, ...]
    accepted: tuple[bool, ...]
    p_target: tuple[float, ...]
    p_draft: tuple[float, ...] | None
    emitted_token: int
    bonus: bool
    rule: str = ""
    target_argmax: tuple[int, ...] = ()
    uniform_probs: tuple[float, ...] = ()
    draft_texts: tuple[str, ...] = ()
    emitted_text: str = ""
    tree_parents: tuple[int, ...] = ()  # a draft tree's: each node's parent (0: the root; node i is i + 1)
    accepted_path: tuple[int, ...] = ()

    def depth(self, i: int) -> int:
        """Draft i's depth in its tree (a chain's position plus one)."""
        if not self.tree_parents:
            return i + 1
        parent = self.tree_parents[i]
        return 1 if parent == 0 else 1 + self.depth(parent - 1)

    def positions(self) -> list[DraftPosition]:
        """Each draft position (a tree's node, breadth first) with its numbers and outcome."""
        if self.tree_parents:
            return [replace(d, outcome=self._tree_outcome(d.position)) for d in self._chain_positions(0)]
        return self._chain_positions(sum(self.accepted))  # a prefix

    def _tree_outcome(self, i: int) -> str:
        """A node is judged when its parent was reached (the root, or on the path) and the walk did not stop at
        an earlier sibling: rejected unless on the path."""
        node, parent = i + 1, self.tree_parents[i]
        if node in self.accepted_path:
            return ACCEPTED
        reached = (0, *self.accepted_path)
        if parent not in reached:
            return NOT_REACHED
        kept = [c for c in self.accepted_path if self.tree_parents[c - 1] == parent]
        return REJECTED if not kept or node < kept[0] else NOT_REACHED

    def _chain_positions(self, num_accepted: int) -> list[DraftPosition]:
        return [
            DraftPosition(
                i,
                token,
                _at(self.draft_texts, i, ""),
                _at(self.p_draft, i, None),
                self.p_target[i],
                _at(self.target_argmax, i, None),
                _at(self.uniform_probs, i, None),
                ACCEPTED if i < num_accepted else REJECTED if i == num_accepted else NOT_REACHED,
            )
            for i, token in enumerate(self.draft_token_ids)
        ]


def _at(values: tuple | None, i: int, default):
    """values[i], or `default` where the event did not carry them (n-gram's q, a greedy u, older traces)."""
    return values[i] if values else default


@dataclass
class SpecState:
    """Owns speculative decoding as its events tell it: the proposer's method, every verification in order, and
    per draft position the drafts verified (`proposed`) and accepted there, and the drafts a grammar cut before
    verification (`num_cut_by_grammar`)."""

    method: str = ""
    verifications: list[Verification] = field(default_factory=list)
    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    num_cut_by_grammar: int = 0

    def rate(self, position: int) -> float:
        """Accepted over verified drafts at a draft position."""
        return self.accepted[position] / self.proposed[position]


@dataclass(frozen=True)
class Transfer:
    """One KV transfer of one instance (kind kv_transfer.save or .load) or its failure (kv_transfer.fail, which
    moves nothing and names the failure, the policy's action and the tokens recomputed); `end_ns` is the end of
    its step, `instance_mb` the MB its instance had moved once it was done."""

    kind: str
    request_id: str
    instance: str
    connector: str
    num_tokens: int
    num_bytes: int
    ms: float
    mb_per_s: float
    end_ns: int
    instance_mb: float
    failure: str = ""
    policy_action: str = ""
    num_recomputed_tokens: int = 0

    @property
    def mb(self) -> float:
        return self.num_bytes / 1e6


@dataclass
class TransferState:
    """Owns KV transfers between instances: every transfer in order, the MB each instance moved so far, and the
    start of the step of the first transfer (the origin of their time axis)."""

    transfers: list[Transfer] = field(default_factory=list)
    mb_by_instance: dict[str, float] = field(default_factory=dict)
    origin_ns: int | None = None


@dataclass(frozen=True)
class Lookup:
    """One prefix-cache lookup of a request: tokens and blocks hit, against those looked up (the tokens the request
    had then: its outputs too, after a preemption)."""

    request_id: str
    hit_tokens: int
    queried_tokens: int
    hit_blocks: int
    queried_blocks: int


@dataclass
class ChainNode:
    """A block hash ever cached: its parent's hash, the block it was last cached in, and whether it was evicted."""

    block_hash: str
    parent_hash: str | None
    block_id: int
    evicted: bool = False


@dataclass
class PrefixState:
    """Owns the prefix cache as its events tell it: each request's last lookup (requests in the order of their first
    one), hit and looked-up token totals (the cumulative hit rate, as PrefixCacheStats counts it), and every hash
    ever cached, parents before children (`chains`: hash -> ChainNode)."""

    lookups: dict[str, Lookup] = field(default_factory=dict)
    hit_tokens: int = 0
    queried_tokens: int = 0
    chains: dict[str, ChainNode] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float | None:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else None


@dataclass
class MoEState:
    """Owns a mixture-of-experts model's routing as its moe.routed events tell it: the sparse layers, the number
    of experts, the tokens each expert took in each sparse layer in the last routed step (`step_counts[layer
    row][expert]`, that step's number `step`) and since the first one (`total`), and how many steps routed."""

    layers: tuple[int, ...] = ()
    num_experts: int = 0
    step: int | None = None
    step_counts: list[list[int]] = field(default_factory=list)
    total: list[list[int]] = field(default_factory=list)
    num_steps: int = 0


@dataclass(frozen=True)
class RankStep:
    """One tensor-parallel rank in one step: its forward split into compute and the wall time inside collectives
    (waiting for a slower peer counts as communication: it is what sharding costs), its sampling, and per
    collective kind the calls and the bytes of its own tensors."""

    rank: int
    compute_ms: float
    comm_ms: float
    sample_ms: float
    counts: dict[str, int]
    bytes: dict[str, int]


@dataclass(frozen=True)
class ParallelStepRow:
    """One parallel.step: the step, the tokens it ran, and every rank's RankStep in rank order."""

    step: int
    num_tokens: int
    ranks: tuple[RankStep, ...]


@dataclass
class ParallelState:
    """Owns parallelism as its events tell it. Tensor parallelism (parallel.step): the group's size (1 until the
    first event: an unsharded engine sends none), every step's per-rank row in order, and since the first one the
    tokens run and the bytes each collective kind moved per rank (rank 0's tensors; every rank's are the same
    size). Data parallelism (a front end's dp.* events): the replicas' count (1 until the first), each replica's
    load over time and every routing decision, in order (the events themselves: frozen), and the replicas that
    died (name -> error)."""

    tensor_parallel_size: int = 1
    rows: list[ParallelStepRow] = field(default_factory=list)
    num_tokens: int = 0
    bytes: dict[str, int] = field(default_factory=dict)
    data_parallel_size: int = 1
    loads: list[DPLoad] = field(default_factory=list)
    routes: list[DPRouted] = field(default_factory=list)
    dead: dict[str, str] = field(default_factory=dict)


def _rank_step(rank: dict) -> RankStep:
    collectives = rank["collectives"]
    comm_ms = sum(c["ms"] for c in collectives.values())
    return RankStep(
        rank["rank"],
        max(rank["forward_ms"] - comm_ms, 0.0),
        comm_ms,
        rank["sample_ms"],
        {k: c["count"] for k, c in collectives.items()},
        {k: c["bytes"] for k, c in collectives.items()},
    )


def _chains(blocks: dict[int, BlockState]) -> dict[str, ChainNode]:
    """The hashes the blocks hold as chain nodes, by block id, each after its ancestors (a snapshot's cache)."""
    cached = {
        b.block_hash: ChainNode(b.block_hash, b.parent_hash, block_id)
        for block_id, b in blocks.items()
        if b.block_hash is not None
    }
    chains: dict[str, ChainNode] = {}
    walked: set[str] = set()
    for start in sorted(cached, key=lambda h: cached[h].block_id):
        chain = []  # this block and its ancestors not placed yet, child first (chains run to thousands)
        node: str | None = start
        while node is not None and node in cached and node not in walked:
            chain.append(node)
            walked.add(node)
            node = cached[node].parent_hash
        for block_hash in reversed(chain):
            chains[block_hash] = cached[block_hash]
    return chains


@dataclass
class StepDelta:
    """What one StepRecord changed in an EngineState: the views redraw only this. Lists keep event order."""

    added: list[str] = field(default_factory=list)
    requests: set[str] = field(default_factory=set)
    blocks: set[int] = field(default_factory=set)
    ttfts_ms: list[float] = field(default_factory=list)
    itls_ms: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    finished: list[str] = field(default_factory=list)  # request ids, one per request.finished
    token_texts: dict[str, str] = field(default_factory=dict)  # request id -> text of the one token it got
    grammar_compiles: list[GrammarCompile] = field(default_factory=list)
    grammar_steps: list[GrammarPosition] = field(default_factory=list)
    spec_proposed: list[str] = field(default_factory=list)  # request ids, one per spec.proposed
    verifications: list[Verification] = field(default_factory=list)
    spec_positions: set[int] = field(default_factory=set)  # draft positions whose acceptance changed
    transfers: list[Transfer] = field(default_factory=list)
    lookups: list[Lookup] = field(default_factory=list)
    cached: list[str] = field(default_factory=list)  # hashes cached (again, after an eviction, too)
    evicted: list[str] = field(default_factory=list)  # hashes of `PrefixState.chains` evicted
    moe_routed: bool = False  # the step routed tokens to experts (`EngineState.moe` changed)
    parallel: ParallelStepRow | None = None  # what each tensor-parallel rank did this step
    dp_loads: list[DPLoad] = field(default_factory=list)
    dp_routes: list[DPRouted] = field(default_factory=list)
    dp_dead: list[str] = field(default_factory=list)  # replicas that died


class EngineState:
    """Owns the event-derived model of the engine shared by the views: requests by id, KV blocks by id
    (only those that ever changed; the rest are free), each request's block table, the KV size, the last step
    applied, and the feature states `grammar`, `spec`, `kv_transfer`, `prefix`, `moe` and `parallel`."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Back to an engine that has run no step (shared views keep their reference to this object)."""
        self.requests: dict[str, RequestState] = {}
        self.blocks: dict[int, BlockState] = {}
        self.block_tables: dict[str, tuple[int, ...]] = {}
        self.total_blocks = 0
        self.step = 0
        self.grammar = GrammarState()
        self.spec = SpecState()
        self.kv_transfer = TransferState()
        self.prefix = PrefixState()
        self.moe = MoEState()
        self.parallel = ParallelState()

    def load(self, snapshot: EngineSnapshot) -> None:
        """Start from an engine's state between steps (a view attached mid-run, a trace begun mid-run)."""
        self.clear()
        self.step, self.total_blocks = snapshot.step, snapshot.kv.total
        for b in snapshot.blocks:
            self.blocks[b.block_id] = BlockState(block_hash=b.block_hash, parent_hash=b.parent_hash)
        for r in snapshot.requests:
            summary = {f.name: getattr(r, f.name) for f in fields(RequestSummary)}
            summary["status"] = _STATUS.get(r.status, FINISHED)  # a RequestStatus name -> the views' group
            self.requests[r.request_id] = RequestState(**summary)
            self.block_tables[r.request_id] = tuple(r.block_ids)
            for block_id in r.block_ids:
                self.blocks.setdefault(block_id, BlockState()).holders.append(r.request_id)
        self.prefix.chains = _chains(self.blocks)

    def block(self, block_id: int) -> BlockState:
        return self.blocks.get(block_id) or BlockState()

    def counts(self) -> dict[str, int]:
        """Blocks by kind, as KVUsage counts them (used, cached_free, free)."""
        kinds = [b.kind for b in self.blocks.values()]
        used, cached = kinds.count("used"), kinds.count("cached")
        return {"used": used, "cached_free": cached, "free": self.total_blocks - used - cached}

    def apply(self, record: StepRecord) -> StepDelta:
        """Fold one StepRecord in; return what changed."""
        delta = StepDelta()
        self.step = record.step
        self.total_blocks = record.kv.total
        for event in record.events:
            handler = _HANDLERS.get(event.kind)
            if handler is not None:
                handler(self, event, record, delta)
        for rid, phase in record.phases.items():
            if rid in self.requests:
                self.requests[rid].phase = phase
                delta.requests.add(rid)
        for position in delta.grammar_steps:  # the step's tokens may come after its grammar steps
            position.text = delta.token_texts.get(position.request_id, "")
        return delta

    # ---- event handlers ---------------------------------------------------------------------------
    def _added(self, e, record: StepRecord, delta: StepDelta) -> None:
        if e.request_id in self.requests:  # a snapshot taken after its add_request holds it already
            return
        self.requests[e.request_id] = RequestState(
            e.request_id, e.prompt, e.num_prompt_tokens, e.max_tokens, e.priority, e.arrival_ns
        )
        delta.added.append(e.request_id)

    def _scheduled(self, e, record: StepRecord, delta: StepDelta) -> None:
        req = self._touch(e.request_id, delta)
        if req is not None:
            req.status = RUNNING
            req.num_cached_tokens = e.num_cached_tokens

    def _preempted(self, e, record: StepRecord, delta: StepDelta) -> None:
        req = self._touch(e.request_id, delta)
        if req is not None:
            req.status = PREEMPTED
            req.num_preemptions += 1

    def _finished(self, e, record: StepRecord, delta: StepDelta) -> None:
        req = self._touch(e.request_id, delta)
        if req is not None:
            req.status, req.finish_reason, req.error = FINISHED, e.reason, e.error
            req.num_output_tokens = e.num_output_tokens
        delta.finished.append(e.request_id)

    def _tokens(self, e, record: StepRecord, delta: StepDelta) -> None:
        delta.num_output_tokens += len(e.token_ids)
        if len(e.token_ids) == 1:
            delta.token_texts[e.request_id] = e.text
        req = self._touch(e.request_id, delta)
        if req is None:
            return
        req.text = req.text[: e.text_offset] + e.text
        req.num_output_tokens = e.num_output_tokens
        if req.first_token_ns is None:
            req.first_token_ns = record.end_ns
            ttft = req.ttft_ms
            assert ttft is not None  # first_token_ns was just set
            delta.ttfts_ms.append(ttft)
        elif req.last_token_ns is not None:  # set with the first token
            itl = (record.end_ns - req.last_token_ns) / 1e6
            req.itls_ms.append(itl)
            delta.itls_ms.append(itl)
        req.last_token_ns = record.end_ns

    def _allocated(self, e, record: StepRecord, delta: StepDelta) -> None:
        held = set(self.block_tables.get(e.request_id, ()))
        for block_id in e.block_ids:
            if block_id not in held:
                self.blocks.setdefault(block_id, BlockState()).holders.append(e.request_id)
                delta.blocks.add(block_id)
        self.block_tables[e.request_id] = tuple(e.block_ids)
        self._touch(e.request_id, delta)

    def _freed(self, e, record: StepRecord, delta: StepDelta) -> None:
        for block_id in e.block_ids:
            block = self.blocks.get(block_id)
            if block is not None and e.request_id in block.holders:
                block.holders.remove(e.request_id)
                delta.blocks.add(block_id)
        self.block_tables.pop(e.request_id, None)
        self._touch(e.request_id, delta)

    def _lookup(self, e, record: StepRecord, delta: StepDelta) -> None:
        req = self._touch(e.request_id, delta)
        if req is not None:
            req.num_queried_tokens = req.num_tokens  # events apply in order: this step's tokens come later
        lookup = Lookup(
            e.request_id,
            e.num_hit_tokens,
            req.num_queried_tokens if req is not None else 0,
            e.num_hit_blocks,
            e.num_queried_blocks,
        )
        self.prefix.lookups[e.request_id] = lookup
        self.prefix.hit_tokens += lookup.hit_tokens
        self.prefix.queried_tokens += lookup.queried_tokens
        delta.lookups.append(lookup)

    def _cached(self, e, record: StepRecord, delta: StepDelta) -> None:
        block = self.blocks.setdefault(e.block_id, BlockState())
        block.block_hash, block.parent_hash = e.block_hash, e.parent_hash
        delta.blocks.add(e.block_id)
        node = self.prefix.chains.get(e.block_hash)
        if node is None:
            self.prefix.chains[e.block_hash] = ChainNode(e.block_hash, e.parent_hash, e.block_id)
        else:  # cached again after an eviction: the same place in its chain
            node.block_id, node.evicted = e.block_id, False
        delta.cached.append(e.block_hash)

    def _evicted(self, e, record: StepRecord, delta: StepDelta) -> None:
        block = self.blocks.get(e.block_id)
        if block is not None and block.block_hash == e.block_hash:
            block.block_hash = block.parent_hash = None
            delta.blocks.add(e.block_id)
        node = self.prefix.chains.get(e.block_hash)
        if node is not None:
            node.evicted = True
            delta.evicted.append(e.block_hash)

    def _grammar_compiled(self, e, record: StepRecord, delta: StepDelta) -> None:
        compiled = GrammarCompile(e.request_id, e.ms, e.cache_hit)
        self.grammar.compiles.append(compiled)
        delta.grammar_compiles.append(compiled)

    def _grammar_step(self, e, record: StepRecord, delta: StepDelta) -> None:
        positions = self.grammar.positions.setdefault(e.request_id, [])
        positions.append(
            GrammarPosition(
                e.request_id, len(positions), e.num_allowed_tokens, e.sampled_token, e.terminated, e.jump_forward
            )
        )
        delta.grammar_steps.append(positions[-1])

    def _spec_proposed(self, e, record: StepRecord, delta: StepDelta) -> None:
        self.spec.method = e.method
        self.spec.num_cut_by_grammar += e.num_cut_by_grammar
        delta.spec_proposed.append(e.request_id)

    def _spec_verified(self, e, record: StepRecord, delta: StepDelta) -> None:
        spec = self.spec
        verification = Verification(
            record.step,
            e.request_id,
            e.draft_token_ids,
            e.accepted,
            e.p_target,
            e.p_draft,
            e.emitted_token,
            e.bonus,
            e.rule,
            e.target_argmax,
            e.uniform_probs,
            e.draft_texts,
            e.emitted_text,
            e.tree_parents,
            e.accepted_path,
        )
        # by draft position, a tree's by depth: verified when the tree reaches it, accepted when the path does
        depth = max((verification.depth(i) for i in range(len(e.draft_token_ids))), default=0)
        for position in range(depth):
            if position == len(spec.proposed):
                spec.proposed.append(0)
                spec.accepted.append(0)
            spec.proposed[position] += 1
            spec.accepted[position] += int(position < sum(verification.accepted))
            delta.spec_positions.add(position)
        spec.verifications.append(verification)
        delta.verifications.append(verification)

    def _transfer(self, e, record: StepRecord, delta: StepDelta) -> None:
        moved = self.kv_transfer
        if moved.origin_ns is None:
            moved.origin_ns = record.start_ns
        outcome = _transfer_outcome(e)
        mb = moved.mb_by_instance.get(e.instance, 0.0) + outcome["num_bytes"] / 1e6
        moved.mb_by_instance[e.instance] = mb
        transfer = Transfer(
            kind=e.kind,
            request_id=e.request_id,
            instance=e.instance,
            connector=e.connector,
            end_ns=record.end_ns,
            instance_mb=mb,
            **outcome,
        )
        moved.transfers.append(transfer)
        delta.transfers.append(transfer)

    def _moe_routed(self, e, record: StepRecord, delta: StepDelta) -> None:
        moe = self.moe
        if (moe.layers, moe.num_experts) != (tuple(e.layers), e.num_experts):  # the first event (or a new model)
            moe.layers, moe.num_experts, moe.num_steps, moe.step = tuple(e.layers), e.num_experts, 0, None
            moe.total = [[0] * e.num_experts for _ in e.layers]
        if moe.step != record.step:  # a step's first moe.routed starts its counts; a second one adds to them
            moe.step, moe.num_steps = record.step, moe.num_steps + 1
            moe.step_counts = [[0] * e.num_experts for _ in e.layers]
        for row, counts in enumerate(e.counts):
            for expert, n in enumerate(counts):
                moe.step_counts[row][expert] += n
                moe.total[row][expert] += n
        delta.moe_routed = True

    def _parallel_step(self, e, record: StepRecord, delta: StepDelta) -> None:
        par = self.parallel
        row = ParallelStepRow(record.step, sum(record.scheduled.values()), tuple(_rank_step(r) for r in e.ranks))
        par.tensor_parallel_size = e.tensor_parallel_size
        par.rows.append(row)
        par.num_tokens += row.num_tokens
        for kind, n in row.ranks[0].bytes.items():
            par.bytes[kind] = par.bytes.get(kind, 0) + n
        delta.parallel = row

    def _dp_load(self, e, record: StepRecord, delta: StepDelta) -> None:
        par = self.parallel
        par.data_parallel_size = max(par.data_parallel_size, e.replica_index + 1)
        par.loads.append(e)
        delta.dp_loads.append(e)

    def _dp_routed(self, e, record: StepRecord, delta: StepDelta) -> None:
        par = self.parallel
        par.data_parallel_size = max(par.data_parallel_size, len(e.scores))
        par.routes.append(e)
        delta.dp_routes.append(e)

    def _dp_replica_dead(self, e, record: StepRecord, delta: StepDelta) -> None:
        self.parallel.dead[e.replica] = e.error
        delta.dp_dead.append(e.replica)

    def _touch(self, rid: str, delta: StepDelta) -> RequestState | None:
        # a trace cut at its start can name requests whose request.added it never saw
        req = self.requests.get(rid)
        if req is not None:
            delta.requests.add(rid)
        return req


def _transfer_outcome(e) -> dict:
    """What a kv_transfer.* event moved, or, for a failure, nothing and why."""
    if e.kind == "kv_transfer.fail":
        return dict(
            num_tokens=0,
            num_bytes=0,
            ms=0.0,
            mb_per_s=0.0,
            failure=e.failure,
            policy_action=e.policy_action,
            num_recomputed_tokens=e.num_recomputed_tokens,
        )
    return dict(num_tokens=e.num_tokens, num_bytes=e.num_bytes, ms=e.ms, mb_per_s=e.mb_per_s)


_HANDLERS = {
    "request.added": EngineState._added,
    "request.scheduled": EngineState._scheduled,
    "request.preempted": EngineState._preempted,
    "request.finished": EngineState._finished,
    "request.tokens": EngineState._tokens,
    "kv.allocated": EngineState._allocated,
    "kv.freed": EngineState._freed,
    "prefix.lookup": EngineState._lookup,
    "kv.cached": EngineState._cached,
    "kv.evicted": EngineState._evicted,
    "grammar.compiled": EngineState._grammar_compiled,
    "grammar.step": EngineState._grammar_step,
    "spec.proposed": EngineState._spec_proposed,
    "spec.verified": EngineState._spec_verified,
    "kv_transfer.save": EngineState._transfer,
    "kv_transfer.load": EngineState._transfer,
    "kv_transfer.fail": EngineState._transfer,
    "moe.routed": EngineState._moe_routed,
    "parallel.step": EngineState._parallel_step,
    "dp.load": EngineState._dp_load,
    "dp.routed": EngineState._dp_routed,
    "dp.replica_dead": EngineState._dp_replica_dead,
}
