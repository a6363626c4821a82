"""Attach the workbench to a running vLLM server (or `workbench serve`): its KV cache, as its KV cache events tell it,
and its load, as its Prometheus /metrics tell it; nothing else is asked of it.

    vllm serve MODEL --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
                                          "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'
    workbench attach --kv-events tcp://HOST:5557 --replay tcp://HOST:5558 --metrics http://HOST:8000/metrics

`AttachedState` owns what those two sources say (fed decoded batches and scraped samples, testable alone);
`Attachment` owns the connection (the subscriber's sockets, the /metrics URL, the threads that feed the state).
The view of it, `attach()` for a notebook and `serve_attach()` for `workbench attach`: workbench/views/attached.py.

The stream carries block hashes, never block ids, nor the request that stored a block, nor the blocks a request holds
that are not full yet: what the view shows is what the cache could hit, as a KV-aware router sees it.
"""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from engine.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, ExternalBlockHash
from workbench.kv_events import KVEventMessage, KVEventSubscriber

# vLLM's metric names as its /metrics exposes them (a counter's samples end in _total): gauges, then counters
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
COUNTERS = (
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
)
# each engine (data-parallel rank) reports its own share of the cache: its usage is averaged, everything else summed
_MEAN_OVER_ENGINES = ("vllm:kv_cache_usage_perc",)

# the statuses of a block hash on the map
HITTABLE = "hit-able"  # stored, and so is every block before it: a request with that prefix hits it
ORPHANED = "stored, prefix gone"  # stored, but a block before it is not: vLLM's lookup stops before reaching it
REMOVED = "removed"  # a BlockRemoved took its last copy
CLEARED = "cleared"  # AllBlocksCleared (a prefix-cache reset) took it

UNKNOWABLE = (
    "What KV events and /metrics cannot tell: which request stored or holds a block (the events name no request); "
    "block ids (they carry hashes: a cell here is a hash, in the order first stored, not a slot of the pool); blocks "
    "allocated to a running request but not full yet (they have no hash, so no event); whether a stored block is "
    "in use or free-but-cached (both can be hit; vllm:kv_cache_usage_perc counts the blocks in use, not which); "
    "what the scheduler decided each step (scheduled tokens, preemptions, chunking); and per-request prefix hits "
    "(/metrics only has the totals)."
)


def format_hash(block_hash: ExternalBlockHash | None) -> str:
    """A hash as the views show it: 16 hex digits (an int hash is 64 bits; a bytes one, its first 8 bytes)."""
    if block_hash is None:
        return ""
    if isinstance(block_hash, bytes):
        return block_hash[:8].hex()
    return f"{block_hash:016x}"


@dataclass
class HashNode:
    """One block hash the stream has named: its parent's hash (None at a sequence's start), the tokens of its block,
    how many blocks hold it now (`copies`: stores minus removals; vLLM does not de-duplicate, so two requests that
    computed the same block at once store it twice), where it sits in its chain (`depth`, blocks before it; None
    where the stream never named an ancestor), the tokens up to and including it (`prefix_tokens`), its status
    (stored, REMOVED, CLEARED), its place on the map (`slot`: the order first stored) and the batches that stored and
    last changed it."""

    block_hash: ExternalBlockHash
    parent: ExternalBlockHash | None
    token_ids: tuple[int, ...]
    slot: int
    depth: int | None
    prefix_tokens: int | None
    medium: str | None
    group_idx: int | None
    stored_seq: int
    changed_seq: int
    copies: int = 0
    status: str = "stored"

    @property
    def resident(self) -> bool:
        return self.copies > 0


@dataclass(frozen=True)
class Prefix:
    """A longest hit-able prefix: the chain from a sequence's first block to `leaf`, every block of it stored."""

    leaf: ExternalBlockHash
    root: ExternalBlockHash
    num_blocks: int
    num_tokens: int
    first_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class MetricsSample:
    """One scrape of /metrics: seconds since the state began (monotonic), and the followed samples' values."""

    t: float
    values: dict[str, float]


def parse_metrics(text: str) -> dict[str, float]:
    """The followed metrics (GAUGES, COUNTERS) in a Prometheus text exposition, each summed over its labels (engines,
    finish reasons), the KV usage averaged over engines. Raises ValueError where none of vLLM's is present."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in GAUGES or sample.name in COUNTERS:
                    sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
                    counts[sample.name] = counts.get(sample.name, 0) + 1
    except ValueError as exc:
        raise ValueError(f"not a Prometheus text exposition ({exc})") from None
    if not sums:
        raise ValueError("no vllm:* metric in it (is it a vLLM server's /metrics?)")
    for name in _MEAN_OVER_ENGINES:
        if name in sums:
            sums[name] /= counts[name]
    return sums


class AttachedState:
    """Owns what an attached server has told: every block hash its KV events named (`nodes`, in the order first
    stored, with copies, chain and status), the last batch applied (`last_seq`), the gaps and restarts seen in its
    sequence and other things worth saying (`notes`), event counts, the data-parallel ranks seen, and the /metrics
    samples (the last `max_samples`; `num_samples` counts them all). Fed with `apply(message)` and
    `add_metrics(values)`; readers and the feeding threads share `lock`. `version` moves on every change, so a view
    redraws only when it has; `epoch` when the hashes are forgotten."""

    def __init__(self, block_size: int | None = None, num_blocks: int | None = None, max_samples: int = 3600) -> None:
        for name, value in (("block_size", block_size), ("num_blocks", num_blocks)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"--{name.replace('_', '-')}: expected an int >= 1, got {value!r}")
        self.block_size, self.num_blocks = block_size, num_blocks
        self.lock = threading.RLock()
        self.nodes: dict[ExternalBlockHash, HashNode] = {}
        self.last_seq = -1
        self.num_batches = 0
        self.event_counts = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}
        self.unknown_removed = 0  # BlockRemoved of hashes never stored in what was seen (stored before attaching)
        self.ranks: set[int] = set()
        self.lost_batches = 0
        self.notes: list[str] = []
        self.samples: deque[MetricsSample] = deque(maxlen=max_samples)
        self.num_samples = 0  # every scrape added, those the deque no longer holds too
        self.metrics_error: str | None = None
        self._num_resident = 0  # blocks holding a stored hash: the copies, summed
        self._sizes_said: set[int] = set()
        self._over_said = False
        self.version = 0
        self.epoch = 0  # moves when the nodes are forgotten (a restarted server): a view draws them anew
        self._t0 = time.monotonic()

    # ---- the KV events ----------------------------------------------------------------------------------------
    def apply(self, message: KVEventMessage) -> None:
        """One batch, in sequence order. A batch after a gap notes the batches lost; a sequence that starts again
        (a restarted server, whose cache starts empty) notes it and forgets what was stored."""
        seq = message.seq
        with self.lock:
            if self.last_seq < 0 and seq > 0:
                self.notes.append(
                    f"Attached at batch {seq}: blocks stored before it are unknown here, and a removal of one is "
                    "counted, not shown (give the replay endpoint to read from batch 0, while the server still "
                    "holds it)."
                )
            elif self.last_seq >= 0 and seq > self.last_seq + 1:
                self.lost_batches += seq - self.last_seq - 1
                self.notes.append(
                    f"Batches {self.last_seq + 1}..{seq - 1} were lost (not received, and not in the replay): what "
                    f"they stored or removed is unknown, so the map may be wrong from batch {seq} on."
                )
            elif 0 <= seq <= self.last_seq:
                self.notes.append(
                    f"The sequence started again at batch {seq} after {self.last_seq}: a restarted server, whose "
                    "cache starts empty; what was stored before is forgotten."
                )
                self.nodes.clear()
                self._num_resident = 0
                self.epoch += 1
            self.last_seq = seq
            self.num_batches += 1
            if message.batch.data_parallel_rank is not None:
                self.ranks.add(message.batch.data_parallel_rank)
            for event in message.batch.events:
                self.event_counts[type(event).__name__] += 1
                if isinstance(event, BlockStored):
                    self._stored(event, seq)
                elif isinstance(event, BlockRemoved):
                    self._removed(event.block_hashes, seq)
                elif isinstance(event, AllBlocksCleared):
                    for node in self.nodes.values():
                        if node.resident:
                            node.copies, node.status, node.changed_seq = 0, CLEARED, seq
                    self._num_resident = 0
            self.version += 1

    def _stored(self, event: BlockStored, seq: int) -> None:
        parent = event.parent_block_hash
        size = event.block_size
        if self.block_size is not None and size != self.block_size and size not in self._sizes_said:
            self._sizes_said.add(size)  # a partial block (hybrid models) is smaller: said, once per size
            self.notes.append(f"Batch {seq} stores blocks of {size} tokens; --block-size says {self.block_size}.")
        for i, block_hash in enumerate(event.block_hashes):
            node = self.nodes.get(block_hash)
            if node is None:
                above = self.nodes.get(parent) if parent is not None else None
                depth = 0 if parent is None else (None if above is None or above.depth is None else above.depth + 1)
                before = 0 if parent is None else (None if above is None else above.prefix_tokens)
                tokens = tuple(event.token_ids[i * size : (i + 1) * size])
                node = self.nodes[block_hash] = HashNode(
                    block_hash,
                    parent,
                    tokens,
                    slot=len(self.nodes),
                    depth=depth,
                    prefix_tokens=None if before is None else before + len(tokens),
                    medium=event.medium,
                    group_idx=event.group_idx,
                    stored_seq=seq,
                    changed_seq=seq,
                )
            node.copies += 1
            node.status, node.changed_seq = "stored", seq
            parent = block_hash
        self._num_resident += len(event.block_hashes)
        if self.num_blocks is not None and self._num_resident > self.num_blocks and not self._over_said:
            self._over_said = True
            self.notes.append(
                f"Batch {seq} leaves {self._num_resident} blocks stored, more than --num-blocks ({self.num_blocks}): "
                "is --num-blocks the server's, or were removals lost?"
            )

    def _removed(self, block_hashes: Iterable[ExternalBlockHash], seq: int) -> None:
        for block_hash in block_hashes:
            node = self.nodes.get(block_hash)
            if node is None or not node.resident:
                self.unknown_removed += 1
                continue
            node.copies -= 1
            self._num_resident -= 1
            node.changed_seq = seq
            if not node.resident:
                node.status = REMOVED

    def note(self, text: str) -> None:
        """Something worth saying in the view (a gap filled from the replay, a failed read)."""
        with self.lock:
            self.notes.append(text)
            self.version += 1

    # ---- what the events give -----------------------------------------------------------------------------
    def resident(self) -> dict[ExternalBlockHash, int]:
        """Every stored hash and the blocks that hold it (as the server's prefix cache holds them)."""
        with self.lock:
            return {h: n.copies for h, n in self.nodes.items() if n.resident}

    @property
    def num_resident_blocks(self) -> int:
        """Blocks that hold a stored hash (the copies of every stored hash)."""
        return self._num_resident

    def hittable(self) -> set[ExternalBlockHash]:
        """The stored hashes a request can hit: those whose chain back to its sequence's first block is all stored
        (vLLM's lookup walks a prompt's blocks from the first and stops at the first miss). A chain through a hash
        the stream never named (stored before attaching) is not known to be whole: not counted."""
        with self.lock:
            found: dict[ExternalBlockHash, bool] = {}
            for start in self.nodes:
                chain: list[HashNode] = []  # the ancestors not settled yet, child first
                at: ExternalBlockHash | None = start
                while at is not None and at not in found and at in self.nodes:
                    chain.append(self.nodes[at])
                    at = chain[-1].parent
                whole = True if at is None else found.get(at, False)  # a first block, settled, or never named
                for node in reversed(chain):
                    whole = whole and node.resident
                    found[node.block_hash] = whole
            return {h for h, whole in found.items() if whole}

    def status(self, block_hash: ExternalBlockHash, hittable: set[ExternalBlockHash]) -> str:
        """A hash's status on the map: HITTABLE, ORPHANED, REMOVED or CLEARED."""
        node = self.nodes[block_hash]
        if node.resident:
            return HITTABLE if block_hash in hittable else ORPHANED
        return node.status

    def children(self) -> dict[ExternalBlockHash, int]:
        """For each stored hash, how many stored hashes follow it: more than one is a prefix shared by several
        sequences (a branch of the prefix tree)."""
        with self.lock:
            counts: dict[ExternalBlockHash, int] = {}
            for node in self.nodes.values():
                if node.resident and node.parent is not None:
                    counts[node.parent] = counts.get(node.parent, 0) + 1
            return counts

    def prefixes(self) -> list[Prefix]:
        """The longest hit-able prefixes (a hit-able hash no hit-able hash follows), longest first."""
        with self.lock:
            hittable = self.hittable()
            inner = {self.nodes[h].parent for h in hittable}
            found = []
            for leaf in hittable - inner:
                chain = [self.nodes[leaf]]
                while chain[-1].parent is not None:
                    chain.append(self.nodes[chain[-1].parent])
                found.append(
                    Prefix(
                        leaf,
                        chain[-1].block_hash,
                        len(chain),
                        sum(len(n.token_ids) for n in chain),
                        chain[-1].token_ids,
                    )
                )
            return sorted(found, key=lambda p: (-p.num_tokens, self.nodes[p.leaf].slot))

    # ---- what /metrics gives ------------------------------------------------------------------------------
    def add_metrics(self, values: dict[str, float], t: float | None = None) -> None:
        """One scrape (`t`: seconds since the state began; now when None)."""
        with self.lock:
            self.samples.append(MetricsSample(time.monotonic() - self._t0 if t is None else t, dict(values)))
            self.num_samples += 1
            self.metrics_error = None
            self.version += 1

    def metrics_failed(self, error: str) -> None:
        with self.lock:
            if error != self.metrics_error:
                self.metrics_error = error
                self.version += 1

    def metric(self, name: str) -> float | None:
        """The last scrape's value of a followed metric (None: not scraped, or not exposed)."""
        with self.lock:
            return self.samples[-1].values.get(name) if self.samples else None

    def rate(self, name: str, a: MetricsSample | None = None, b: MetricsSample | None = None) -> float | None:
        """A counter's increase per second between two samples (the last two by default)."""
        with self.lock:
            if a is None or b is None:
                if len(self.samples) < 2:
                    return None
                a, b = self.samples[-2], self.samples[-1]
            if name not in a.values or name not in b.values or b.t <= a.t:
                return None
            return max(b.values[name] - a.values[name], 0.0) / (b.t - a.t)

    def hit_rate(self, a: MetricsSample | None = None, b: MetricsSample | None = None) -> float | None:
        """The prefix cache's hit rate, hit over queried tokens (vLLM's vllm:prefix_cache_hits / _queries):
        between two samples, or since the server started (b alone, or the last sample)."""
        with self.lock:
            if b is None:
                if not self.samples:
                    return None
                b = self.samples[-1]
            hits, queries = (
                b.values.get("vllm:prefix_cache_hits_total"),
                b.values.get("vllm:prefix_cache_queries_total"),
            )
            if hits is None or queries is None:
                return None
            if a is not None:
                hits -= a.values.get("vllm:prefix_cache_hits_total", 0.0)
                queries -= a.values.get("vllm:prefix_cache_queries_total", 0.0)
            return hits / queries if queries > 0 else None


# ---- the connection -------------------------------------------------------------------------------------------
_TCP = re.compile(r"^tcp://(?P<host>\[[0-9A-Fa-f:.]+\]|[^:/\[\]]+):(?P<port>\d+)$")
_HTTP = re.compile(r"^https?://[^/\s]+(/\S*)?$")


def check_zmq_endpoint(flag: str, endpoint: str) -> tuple[str, int] | None:
    """A subscriber's endpoint, refused naming `flag` where malformed; (host, port) for a tcp:// one (None for
    ipc:// and inproc://)."""
    if not isinstance(endpoint, str):
        raise TypeError(f"{flag}: expected a str, got {type(endpoint).__name__}")
    if endpoint.startswith(("ipc://", "inproc://")) and len(endpoint.split("://", 1)[1]) > 0:
        return None
    match = _TCP.match(endpoint)
    if match is None:
        raise ValueError(f"{flag}: expected tcp://HOST:PORT (or ipc://PATH), got {endpoint!r}")
    host, port = match["host"], int(match["port"])
    if host in ("*", "0.0.0.0", "[::]"):
        raise ValueError(
            f"{flag}: {endpoint!r} is where vLLM binds (every interface); give the server's address, tcp://HOST:{port}"
        )
    if not 1 <= port <= 65535:
        raise ValueError(f"{flag}: the port must be 1 to 65535, got {port}")
    return host.strip("[]"), port


def probe_zmq_endpoint(flag: str, endpoint: str, timeout_s: float) -> None:
    """Fail within `timeout_s`, naming `flag`, when nothing listens at the endpoint: a ZeroMQ socket would connect
    and wait for ever, silently."""
    address = check_zmq_endpoint(flag, endpoint)
    if endpoint.startswith("ipc://") and not os.path.exists(endpoint.removeprefix("ipc://")):
        raise ConnectionError(f"{flag}: nothing listens at {endpoint!r} (no such socket file)")
    if address is None:
        return
    try:
        socket.create_connection(address, timeout=timeout_s).close()
    except OSError as exc:
        raise ConnectionError(
            f"{flag}: nothing listens at {endpoint!r} ({exc.strerror or exc}): is the server started with "
            "--kv-events-config, its endpoint a wildcard (tcp://*:PORT, which it binds) and the port reachable?"
        ) from None


def scrape(url: str, timeout_s: float, flag: str = "--metrics") -> dict[str, float]:
    """GET a /metrics URL and parse it (`parse_metrics`); errors name `flag`: ConnectionError when nothing answers
    within `timeout_s`, ValueError when the answer is not vLLM's metrics."""
    import httpx

    try:
        response = httpx.get(url, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise ConnectionError(f"{flag}: nothing answers at {url!r} ({exc or type(exc).__name__})") from None
    if response.status_code != 200:
        raise ValueError(f"{flag}: {url!r} answered HTTP {response.status_code}")
    try:
        return parse_metrics(response.text)
    except ValueError as exc:
        raise ValueError(f"{flag}: {url!r}: {exc}") from None


def check_metrics_url(url: str) -> str:
    """A /metrics URL, refused naming --metrics where malformed; a server's root gets /metrics."""
    if not isinstance(url, str):
        raise TypeError(f"--metrics: expected a str, got {type(url).__name__}")
    if _HTTP.match(url) is None:
        raise ValueError(f"--metrics: expected http://HOST:PORT/metrics, got {url!r}")
    scheme, rest = url.split("://", 1)
    return url if "/" in rest.rstrip("/") else f"{scheme}://{rest.rstrip('/')}/metrics"


class Attachment:
    """Owns the connection to a running server: a KVEventSubscriber on its KV events endpoint (and its replay
    endpoint, from which it first reads every batch the server still holds, from batch 0), the /metrics URL, the
    AttachedState (`state`) they feed, and two threads (one reads batches, and asks the replay for any it missed
    when the stream has been quiet for QUIET_REPLAY_S; one scrapes /metrics every `metrics_interval_s`). Every
    endpoint is checked first: a malformed one is a ValueError naming its flag, one where nothing answers a
    ConnectionError naming it, within `connect_timeout_s`. `close()` (or `with`) stops the threads and closes the
    sockets."""

    QUIET_REPLAY_S = 2.0  # a stream quiet this long is asked of the replay socket for a tail it may have missed

    def __init__(
        self,
        kv_events: str,
        metrics: str | None = None,
        replay: str | None = None,
        block_size: int | None = None,
        num_blocks: int | None = None,
        topic: str = "",
        metrics_interval_s: float = 1.0,
        connect_timeout_s: float = 5.0,
    ) -> None:
        self.kv_events, self.replay = kv_events, replay
        check_zmq_endpoint("--kv-events", kv_events)
        if replay is not None:
            check_zmq_endpoint("--replay", replay)
        self.metrics = check_metrics_url(metrics) if metrics is not None else None
        self.state = AttachedState(block_size, num_blocks)
        self.metrics_interval_s = metrics_interval_s
        probe_zmq_endpoint("--kv-events", kv_events, connect_timeout_s)
        if replay is not None:
            probe_zmq_endpoint("--replay", replay, connect_timeout_s)
        if self.metrics is not None:
            self.state.add_metrics(scrape(self.metrics, connect_timeout_s))
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._sub = KVEventSubscriber(kv_events, replay, topic)
        # the live batches the replay also gave (the SUB socket listens from its connection on): skipped once
        self._replayed: dict[int, float] = {}
        try:
            if replay is not None:
                self._catch_up(connect_timeout_s)
        except BaseException:
            self._sub.close()
            raise
        self._threads = [
            threading.Thread(target=self._read_events, name="attach-kv-events", daemon=True),
            *(
                [threading.Thread(target=self._scrape_metrics, name="attach-metrics", daemon=True)]
                if self.metrics is not None
                else []
            ),
        ]
        for thread in self._threads:
            thread.start()

    def _catch_up(self, timeout_s: float) -> None:
        try:
            messages = self._sub.replay(0, timeout_s=timeout_s)
        except TimeoutError:
            raise ConnectionError(
                f"--replay: {self.replay!r} did not answer a replay within {timeout_s} s (is it the server's "
                "replay_endpoint?)"
            ) from None
        if messages and messages[0].seq > 0:
            self.state.note(
                f"The replay began at batch {messages[0].seq} (the server keeps its last buffer_steps batches): "
                "what earlier batches stored is unknown."
            )
            self.state.last_seq = messages[0].seq - 1  # said once, not again as a gap
        for message in messages:
            self.state.apply(message)
            self._replayed[message.seq] = message.batch.ts
        if messages:
            self._sub.last_seq = messages[-1].seq

    def _read_events(self) -> None:
        seen_gaps = 0
        quiet_since = time.monotonic()
        while not self._stop.is_set():
            try:
                message = self._sub.recv(timeout_s=0.1)
            except (ValueError, TimeoutError) as exc:  # a malformed message; a replay that did not answer
                self.state.note(f"KV events: {exc}")
                continue
            for gap in self._sub.gaps[seen_gaps:]:
                self.state.note(
                    f"Batches {gap.start}..{gap.end - 1} did not come live: {gap.replayed} read from the replay"
                    + (f", {gap.end - gap.start - gap.replayed} lost." if gap.replayed < gap.end - gap.start else ".")
                )
            seen_gaps = len(self._sub.gaps)
            if message is None:
                if self.replay is not None and time.monotonic() - quiet_since > self.QUIET_REPLAY_S:
                    quiet_since = time.monotonic()
                    self._replay_tail()
                continue
            quiet_since = time.monotonic()
            if self._replayed:
                if self._replayed.get(message.seq) == message.batch.ts:
                    continue
                self._replayed = {}
            self.state.apply(message)

    def _replay_tail(self) -> None:
        """What the server published after the last batch read, from its replay socket: a SUB socket receives
        nothing sent before its subscription reached the server, and a gap shows only with the next batch, so a
        quiet stream is checked for a missed tail."""
        last = self.state.last_seq
        try:
            tail = [m for m in self._sub.replay(last + 1, timeout_s=1.0) if m.seq > last]
        except TimeoutError:
            return  # a server gone quiet or gone: the next live batch, or the next check, says more
        for message in tail:
            self.state.apply(message)
            self._replayed[message.seq] = message.batch.ts
        if tail:
            self._sub.last_seq = tail[-1].seq

    def _scrape_metrics(self) -> None:
        assert self.metrics is not None
        while not self._stop.wait(self.metrics_interval_s):
            try:
                self.state.add_metrics(scrape(self.metrics, timeout_s=max(self.metrics_interval_s, 1.0)))
            except (ConnectionError, ValueError) as exc:
                self.state.metrics_failed(str(exc))

    @property
    def closed(self) -> bool:
        return self._stop.is_set()

    def close(self) -> None:
        """Stop both threads (each within a read's timeout) and close the sockets; idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        for thread in self._threads:
            thread.join(10.0)
        self._sub.close()

    def __enter__(self) -> Attachment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
