"""EngineConfig: one validated aggregate of every knob the engine has (cache, scheduler, model, kv transfer)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Literal, cast, get_args
from urllib.parse import urlsplit

import torch

if TYPE_CHECKING:
    from engine.spec_decode.tree import SpecTree

# The fixed sets a setting is checked against, vLLM's names: the config refuses anything else and the command line
# offers them as choices (engine/arg_utils.py reads them off the annotations)
DType = Literal["float32", "bfloat16", "float16"]
# vLLM's CacheDType, of which a CPU has "auto" and "bfloat16" (its others are fp8 formats of CUDA, ROCm and Gaudi)
KVCacheDType = Literal["auto", "bfloat16"]
# engine/core/block_hash.py's HASH_FUNCTIONS, by name (named here so that the config imports no engine module)
PrefixCachingHashAlgo = Literal["sha256", "sha256_cbor", "builtin"]
SchedulingPolicy = Literal["fcfs", "priority"]
Quantization = Literal["int8"]
Executor = Literal["uniproc", "multiproc", "simulated", "scripted"]
DataParallelRouting = Literal["load", "prefix"]
# speculative_config.method: engine/spec_decode/'s PROPOSERS maps each to its proposer class (a test checks they agree)
SpeculativeMethod = Literal["ngram", "draft_model", "eagle", "medusa", "eagle3"]
# the methods that draft trees: each level of the tree is one step of their network (engine/spec_decode/tree.py)
TREE_METHODS = ("eagle", "eagle3", "medusa")
KVEventsPublisher = Literal["null", "zmq"]
# vLLM's ObservabilityConfig.collect_detailed_traces and ProfilerConfig.profiler (only its torch profiler here)
DetailedTraceModules = Literal["model", "worker", "all"]
ProfilerKind = Literal["torch"]

_DTYPES = {name: getattr(torch, name) for name in get_args(DType)}


def _check_choice(name: str, value: object, choices: Any) -> None:
    """`value` must be one of the Literal `choices`' values: refused naming the field and every choice."""
    allowed = get_args(choices)
    if value not in allowed:
        raise ValueError(f"{name}: must be one of {', '.join(map(repr, allowed))}, got {value!r}")


def _check_keys(cls: type, d: Any, name: str) -> None:
    """A dict config: every key must be one of the dataclass's fields."""
    if not isinstance(d, dict):
        raise TypeError(f"{name}: expected dict, got {type(d).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"{name}.{unknown[0]}: unknown key (known: {', '.join(sorted(known))})")


@dataclass(frozen=True)
class ScriptedModel:
    """A scripted model and proposer, given as `token_script` (engine/executor/scripted.py reads it): `tokens` is a
    plain script (request id -> the token ids it samples); `drafts[request_id][n]` the drafts proposed once the
    request has n output tokens (none where absent; at most num_speculative_tokens of them are verified)."""

    tokens: Mapping[str, Sequence[int]]
    drafts: Mapping[str, Sequence[Sequence[int]]] = field(default_factory=dict)


def check_token_script(script: object) -> None:
    """A script must be a mapping of request ids to lists of token ids, or a callable: anything else is refused
    with the field named."""
    if isinstance(script, ScriptedModel):
        script = script.tokens
    if callable(script):
        return
    if not isinstance(script, Mapping):
        raise TypeError(
            f"token_script: expected a dict {{request_id: [token ids]}} or a callable, got {type(script).__name__}"
        )
    for rid, tokens in script.items():
        if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
            raise TypeError(f"token_script[{rid!r}]: expected a list of token ids, got {type(tokens).__name__}")
        bad = next((t for t in tokens if isinstance(t, bool) or not isinstance(t, int)), None)
        if bad is not None:
            raise TypeError(f"token_script[{rid!r}]: token ids must be int, got {type(bad).__name__} ({bad!r})")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, vLLM's keys: method "ngram" (prompt_lookup_max/min), "draft_model" (model: a model),
    "eagle" or "medusa" (model: a draft head folder; none: the target's default head)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 2
    model: str | None = None
    # vLLM's draft tree: a string of a list of node paths, breadth first (engine/spec_decode/tree.py); None: a chain
    speculative_token_tree: str | None = None
    # vLLM's dynamic speculative decoding: [(range_start, range_end, K), ...], the drafts a step takes by its batch
    # size (engine/spec_decode/dynamic.py); None: num_speculative_tokens at every batch size
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] | None = None

    @classmethod
    def from_dict(cls, d: dict) -> SpeculativeConfig:
        _check_keys(cls, d, "speculative_config")
        method = d.get("method")
        _check_choice("speculative_config.method", method, SpeculativeMethod)
        k = d.get("num_speculative_tokens")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"speculative_config.num_speculative_tokens: must be an int >= 1, got {k!r}")
        schedule = d.get("num_speculative_tokens_per_batch_size")
        if schedule is not None:
            from engine.spec_decode.dynamic import parse_schedule

            d = {**d, "num_speculative_tokens_per_batch_size": tuple(parse_schedule(schedule))}
        cfg = cls(**d)
        if method == "ngram" and not 1 <= cfg.prompt_lookup_min <= cfg.prompt_lookup_max:
            raise ValueError(
                "speculative_config.prompt_lookup_min: must be in [1, prompt_lookup_max="
                f"{cfg.prompt_lookup_max}], got {cfg.prompt_lookup_min}"
            )
        if method == "draft_model" and not cfg.model:
            raise ValueError("speculative_config.model: a draft model name or path is required for draft_model")
        if cfg.speculative_token_tree is not None:
            if method not in TREE_METHODS:
                raise ValueError(
                    f"speculative_config.speculative_token_tree: only for {', '.join(TREE_METHODS)}, not {method!r}"
                )
            n = len(cfg.tree or ())
            if k != n:
                raise ValueError(
                    f"speculative_config.num_speculative_tokens: must be the tree's number of nodes, {n}, got {k}"
                )
        return cfg

    @property
    def tree(self) -> SpecTree | None:
        """The draft tree (validated), or None for a chain."""
        from engine.spec_decode.tree import SpecTree

        return None if self.speculative_token_tree is None else SpecTree.parse(self.speculative_token_tree)


# vLLM 0.33's connector names, the name the 2025 article used (SharedStorageConnector, vLLM's before it became
# ExampleConnector), and the short names the CLI uses
KV_CONNECTORS = {
    "ExampleConnector": "ExampleConnector",
    "SharedStorageConnector": "ExampleConnector",
    "shared_storage": "ExampleConnector",
    "RedisConnector": "RedisConnector",
    "redis": "RedisConnector",
}


@dataclass(frozen=True)
class KVTransferConfig:
    """KV transfer between instances, vLLM's keys: which connector, this instance's role, its settings,
    and what a failed load does ("recompute" locally, or "fail" the request)."""

    kv_connector: str
    kv_role: str
    kv_connector_extra_config: dict = field(default_factory=dict)
    kv_load_failure_policy: str = "recompute"
    engine_id: str | None = None

    @classmethod
    def from_dict(cls, d: dict) -> KVTransferConfig:
        _check_keys(cls, d, "kv_transfer_config")
        name = d.get("kv_connector")
        if name not in KV_CONNECTORS:
            raise ValueError(f"kv_transfer_config.kv_connector: must be one of {sorted(KV_CONNECTORS)}, got {name!r}")
        if d.get("kv_role") not in ("kv_producer", "kv_consumer", "kv_both"):
            raise ValueError(
                "kv_transfer_config.kv_role: must be 'kv_producer', 'kv_consumer' or 'kv_both', "
                f"got {d.get('kv_role')!r}"
            )
        if not isinstance(d.get("kv_connector_extra_config", {}), dict):
            raise TypeError("kv_transfer_config.kv_connector_extra_config: expected dict")
        if d.get("kv_load_failure_policy", "recompute") not in ("recompute", "fail"):
            raise ValueError(
                "kv_transfer_config.kv_load_failure_policy: must be 'recompute' or 'fail', "
                f"got {d.get('kv_load_failure_policy')!r}"
            )
        return cls(**{**d, "kv_connector": KV_CONNECTORS[name]})

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


# ZeroMQ endpoints, vLLM's transports: tcp://HOST:PORT (an IPv6 host in brackets), ipc://PATH, inproc://NAME
_ENDPOINT = re.compile(r"tcp://(?:\[[0-9A-Fa-f:.]+\]|[^:/\[\]]+):(?P<port>\d{1,5})|ipc://.+|inproc://.+")


def _check_endpoint(name: str, value: object, num_ranks: int) -> None:
    """A ZeroMQ endpoint that `num_ranks` data-parallel ranks can each offset (vLLM's rule: tcp port + rank,
    inproc name + _dp{rank}; ipc cannot be offset)."""
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected str, got {type(value).__name__}")
    match = _ENDPOINT.fullmatch(value)
    if match is None:
        raise ValueError(f"{name}: expected tcp://HOST:PORT, ipc://PATH or inproc://NAME, got {value!r}")
    port = match["port"]
    if port is not None and int(port) and int(port) + num_ranks - 1 > 65535:
        raise ValueError(
            f"{name}: port {port} + {num_ranks - 1} (one port per data-parallel rank) is past 65535, in {value!r}"
        )
    if value.startswith("ipc://") and num_ranks > 1:
        raise ValueError(f"{name}: an ipc:// endpoint has no port to offset per data-parallel rank, got {value!r}")


@dataclass(frozen=True)
class KVEventsConfig:
    """KV cache events, vLLM's keys (vllm/config/kv_events.py): whether the block pool records them, the publisher,
    where it publishes and answers replays, the batches it keeps for replay, its high-water mark and queue, the
    topic. Endpoints default to loopback (vLLM's is tcp://*:5557, every interface): a wildcard or loopback host
    binds, another host is connected to."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # none: "zmq" when enabled, else "null" (vLLM's __post_init__)
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def from_dict(cls, d: dict, num_ranks: int = 1) -> KVEventsConfig:
        """Check vLLM's keys; `num_ranks` ranks each take endpoint and replay_endpoint offset by their rank."""
        _check_keys(cls, d, "kv_events_config")
        cfg = cls(**d)
        enabled = cfg.enable_kv_cache_events
        if not isinstance(enabled, bool):
            raise TypeError(f"kv_events_config.enable_kv_cache_events: expected bool, got {type(enabled).__name__}")
        publisher = cfg.publisher or ("zmq" if enabled else "null")
        _check_choice("kv_events_config.publisher", publisher, KVEventsPublisher)
        _check_endpoint("kv_events_config.endpoint", cfg.endpoint, num_ranks)
        if cfg.replay_endpoint is not None:
            _check_endpoint("kv_events_config.replay_endpoint", cfg.replay_endpoint, num_ranks)
            if cfg.replay_endpoint == cfg.endpoint and not cfg.endpoint.endswith(":0"):
                raise ValueError(f"kv_events_config.replay_endpoint: must differ from endpoint ({cfg.endpoint!r})")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(cfg, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"kv_events_config.{name}: expected int, got {type(value).__name__}")
            if value < 0:
                raise ValueError(f"kv_events_config.{name}: must be >= 0, got {value}")
        if not isinstance(cfg.topic, str):
            raise TypeError(f"kv_events_config.topic: expected str, got {type(cfg.topic).__name__}")
        return replace(cfg, publisher=publisher)


@dataclass(frozen=True)
class ProfilerConfig:
    """The torch profiler behind /start_profile and /stop_profile, vLLM 0.33's ProfilerConfig keys (those of its
    torch profiler): where traces go and what they record (engine/profiler.py runs it)."""

    profiler: ProfilerKind
    torch_profiler_dir: str
    torch_profiler_with_stack: bool = True
    torch_profiler_with_flops: bool = False
    torch_profiler_use_gzip: bool = True
    torch_profiler_record_shapes: bool = False
    torch_profiler_with_memory: bool = False

    @classmethod
    def from_dict(cls, d: dict) -> ProfilerConfig | None:
        """The settings of `d`; None when `d` names no profiler (profiling off, as vLLM's default)."""
        _check_keys(cls, d, "profiler_config")
        if d.get("profiler") is None:
            if d.get("torch_profiler_dir"):  # vLLM's refusal
                raise ValueError("profiler_config.torch_profiler_dir: only applicable when profiler is set to 'torch'")
            return None
        _check_choice("profiler_config.profiler", d["profiler"], ProfilerKind)
        folder = d.get("torch_profiler_dir")
        if not isinstance(folder, str) or not folder:
            raise ValueError("profiler_config.torch_profiler_dir: must be set when profiler is 'torch'")
        if "://" in folder:  # vLLM also writes to gs:// or s3://; here traces go to a local folder only
            raise ValueError(f"profiler_config.torch_profiler_dir: must be a local folder, got {folder!r}")
        for name in [f.name for f in fields(cls)][2:]:
            if not isinstance(d.get(name, False), bool):
                raise TypeError(f"profiler_config.{name}: expected bool, got {type(d[name]).__name__}")
        return cls(**{**d, "torch_profiler_dir": os.path.abspath(os.path.expanduser(folder))})


@dataclass
class EngineConfig:
    """All engine settings, vLLM's names. Invalid values raise ValueError/TypeError naming the field.

    The docstring under each field is its help: the `workbench` commands make their engine flags from these fields
    (engine/arg_utils.py), as vLLM's EngineArgs does from its own."""

    model: str = "smollm2-135m"
    """A name of the model registry (smollm2-135m, tiny-llama ...), a local Hugging Face folder, a hub id or a
    .gguf file."""

    # ---- cache
    block_size: int = 16
    """Tokens per KV cache block, a power of two."""
    num_kv_blocks: int | None = None
    """KV cache size in blocks; none: sized from kv_cache_memory."""
    kv_cache_memory: int = 1 << 30
    """Bytes for K and V of all layers, where num_kv_blocks is not given."""
    kv_cache_dtype: KVCacheDType = "auto"
    """vLLM's: how K and V are stored; "auto": as the weights (dtype). "bfloat16" under float32 or int8 weights on a
    CPU halves the cache: twice the blocks in kv_cache_memory, and half the bytes a decode's attention reads (the
    arithmetic stays float32, as it is for bfloat16 weights). Elsewhere only "auto" or the weights' own dtype."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of a prefix already computed (automatic prefix caching)."""
    prefix_caching_hash_algo: PrefixCachingHashAlgo = "sha256"
    """How blocks are hashed: vLLM's algorithms, bit-equal to its hashes, "sha256" (pickle, vLLM's default) and
    "sha256_cbor"; "builtin" is this engine's own: Python's hash of a tuple, fastest, the same only within one
    process."""

    # ---- scheduler
    max_num_batched_tokens: int = 2048
    """The token budget of one step."""
    max_num_seqs: int = 256
    """Requests running at once, at most; also the most `n` a request may ask for."""
    max_model_len: int | None = None
    """Prompt plus output tokens of one request, at most; none: the model's max_position_embeddings."""
    enable_chunked_prefill: bool = True
    """Split a long prompt over several steps; without it, a whole sequence must fit one step's budget."""
    long_prefill_token_threshold: int = 0
    """The most prompt tokens one request may prefill in a step; 0: no cap but the budget."""
    scheduling_policy: SchedulingPolicy = "fcfs"
    """Which waiting request goes first: "fcfs" by arrival, "priority" by each request's priority, then arrival."""
    scheduler_reserve_full_isl: bool = True
    """vLLM 0.33's: admit a waiting request only if its whole sequence fits in the free blocks, not only its first
    chunk."""
    async_scheduling: bool = False
    """vLLM's AsyncScheduler (on by default in vLLM 0.33, off here: a step's record then holds its own outputs): each
    step schedules the next batch before the previous batch's tokens are back, with a placeholder for each."""
    max_logprobs: int = 20  # engine/limits.py holds requests to it
    """vLLM's: the most logprobs / prompt_logprobs a request may ask for."""

    # ---- model
    dtype: DType | None = None
    """How weights and the KV cache are stored; none: float32 on a CPU, bfloat16 on CUDA. On a CPU the arithmetic
    runs in float32 but for the linears' products, which meet bfloat16 weights with the input rounded to bfloat16."""
    device: str | None = None
    """Where the model runs, as torch names it (cpu, cuda, cuda:1 ...); none: CUDA where present."""
    revision: str | None = None
    """A hub id's branch, tag or commit (vLLM's name); none: the default branch."""
    quantization: Quantization | None = None
    """"int8": int8 weights with a scale per output row, W8A8 (each linear's input quantized to int8 in blocks of 32
    columns; CPU only); none: the weights as stored."""
    seed: int = 0
    """The seed of sampling for the requests that bring none of their own (and of the simulated executor's
    tokens)."""
    speculative_config: dict | None = None
    """Speculative decoding, vLLM's keys: method (ngram, draft_model, eagle, medusa), num_speculative_tokens,
    prompt_lookup_max / prompt_lookup_min (ngram), model (the draft model or head); a JSON object on the command
    line."""
    kv_transfer_config: dict | None = None
    """KV transfer between instances, vLLM's keys: kv_connector, kv_role (kv_producer, kv_consumer, kv_both),
    kv_connector_extra_config, kv_load_failure_policy (recompute, fail), engine_id; a JSON object on the command
    line."""
    kv_events_config: dict | None = None
    """KV cache events in vLLM's wire format (engine/distributed/kv_events.py), vLLM's keys: enable_kv_cache_events,
    publisher (zmq, null), endpoint (default tcp://127.0.0.1:5557), replay_endpoint, buffer_steps, hwm,
    max_queue_size, topic; a JSON object on the command line."""

    # ---- execution (vLLM's names)
    executor: Executor = "uniproc"  # engine/executor/: uniproc.py, multiproc.py, simulated.py, scripted.py
    """"uniproc" runs the model in this process; "multiproc" in tensor_parallel_size worker processes on
    torch.distributed (chosen by itself when tensor_parallel_size > 1, as vLLM does); "simulated" runs the scheduler
    and KV cache over a cost model of `hardware` in simulated time, no weights; "scripted" is the simulated executor
    whose sampled tokens come from token_script, priced on the "cpu" hardware unless told otherwise."""
    hardware: str | dict | None = None
    """The simulated executor's device: a name of its hardware table (h100-sxm, h200, a100-80gb, l4, cpu ...) or
    the table's fields (a JSON object on the command line)."""
    token_script: dict | Callable | None = None
    """The scripted executor's sampled tokens: {request_id: [token ids]}, a callable, or a ScriptedModel
    (engine/executor/scripted.py: tokens, and the drafts a scripted proposer makes)."""
    tensor_parallel_size: int = 1
    """Ranks the model is split over (the multiproc executor's worker processes)."""
    # see engine/distributed/nodes.py
    nnodes: int = 1
    """Tensor parallelism over several machines, as torch.distributed: the ranks split evenly over nnodes nodes;
    this engine is node 0, the others run `python -m engine.distributed.launch`."""
    master_addr: str | None = None
    """Where the nodes meet; none: MASTER_ADDR, else 127.0.0.1."""
    master_port: int | None = None
    """The port where the nodes meet; none: MASTER_PORT, else 29500."""
    # see engine/entrypoints/dp_client.py
    data_parallel_size: int = 1
    """Engine processes, each its own scheduler and KV cache, behind a front end that routes each request (the LLM
    entry point only)."""
    data_parallel_routing: DataParallelRouting = "load"
    """How the data-parallel front end routes a request: "load" (vLLM's waiting * 4 + running) or "prefix" (where
    its prefix is cached, else load); replicas hash blocks with sha256 whatever prefix_caching_hash_algo says (the
    front end follows their caches by hash)."""
    data_parallel_replica_timeout_s: float = 60.0
    """How long the front end waits for a replica that owes it an answer (the acknowledgement of an add, a step's
    report while it holds requests, a records() reply) before it declares the replica dead: killed and reaped, its
    requests failed naming it, the others serving on (vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S)."""
    data_parallel_rank: int = 0
    """This engine's rank among the data-parallel replicas (the front end sets each replica's): its KV events go to
    the endpoints' port + rank and carry it as data_parallel_rank, as vLLM's."""
    gpu_memory_utilization: float = 0.92
    """The simulated executor's share of device memory for weights, activations and KV (vLLM 0.33's default)."""

    # ---- observability (vLLM's ObservabilityConfig and ProfilerConfig; engine/tracing.py, engine/profiler.py)
    otlp_traces_endpoint: str | None = None
    """vLLM's: the URL OpenTelemetry traces are sent to, over OTLP/HTTP (a collector's http://HOST:4318/v1/traces):
    one llm_request span per request with vLLM's gen_ai.* attributes, its parent the caller's W3C traceparent. Needs
    opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http."""
    collect_detailed_traces: list[DetailedTraceModules] | None = None
    """vLLM's, with otlp_traces_endpoint: "model" adds a request's time in the model's forward
    (gen_ai.latency.time_in_model_forward), "worker" its time in the runner's forward and sampling
    (gen_ai.latency.time_in_model_execute), "all" both; any of them also gives the span an event for every step the
    request ran in, not only where its phase changed."""
    profiler_config: dict | None = None
    """vLLM 0.33's: the torch profiler behind POST /start_profile and /stop_profile (the routes are absent without
    it), its keys: profiler ("torch"), torch_profiler_dir (where traces go), torch_profiler_with_stack and
    torch_profiler_use_gzip (on by default), torch_profiler_record_shapes, torch_profiler_with_memory,
    torch_profiler_with_flops; a JSON object on the command line."""

    def __post_init__(self) -> None:
        ints = (
            "block_size",
            "kv_cache_memory",
            "max_num_batched_tokens",
            "max_num_seqs",
            "long_prefill_token_threshold",
            "seed",
            "max_logprobs",
        )
        for name in ints:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name}: expected int, got {type(value).__name__}")
        for name in ("num_kv_blocks", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"{name}: expected int or None, got {type(value).__name__}")
        for name in (
            "enable_prefix_caching",
            "enable_chunked_prefill",
            "scheduler_reserve_full_isl",
            "async_scheduling",
        ):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: expected bool, got {type(getattr(self, name)).__name__}")
        if not isinstance(self.model, str):
            self.model = str(self.model)  # a pathlib.Path is welcome
        self._check_executor()
        if self.revision is not None and not isinstance(self.revision, str):
            raise TypeError(f"revision: expected str or None, got {type(self.revision).__name__}")
        self._check_ranges()
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.dtype is None:
            self.dtype = "bfloat16" if self.device.startswith("cuda") else "float32"
        _check_choice("dtype", self.dtype, DType)
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KVCacheDType)
        if self.kv_cache_dtype not in ("auto", self.dtype) and self.device != "cpu" and not self.simulated:
            raise ValueError(
                f"kv_cache_dtype: {self.kv_cache_dtype!r} under {self.dtype} weights runs on a CPU only (device is "
                f"{self.device!r}); use 'auto'"
            )
        if self.quantization is not None:
            _check_choice("quantization", self.quantization, Quantization)
        if self.quantization is not None and self.device != "cpu":
            raise ValueError(f"quantization: {self.quantization!r} runs on a CPU only (device is {self.device!r})")
        self.speculative = (
            None if self.speculative_config is None else SpeculativeConfig.from_dict(self.speculative_config)
        )
        self.kv_transfer = (
            None if self.kv_transfer_config is None else KVTransferConfig.from_dict(self.kv_transfer_config)
        )
        num_ranks = max(self.data_parallel_size, self.data_parallel_rank + 1)  # the ports the ranks' events take
        self.kv_events = (
            None if self.kv_events_config is None else KVEventsConfig.from_dict(self.kv_events_config, num_ranks)
        )
        self._check_observability()
        if self.async_scheduling:
            for name, used in (
                ("speculative_config", self.speculative is not None),
                ("kv_transfer_config", self.kv_transfer is not None),
                ("executor", self.executor == "multiproc"),
                ("data_parallel_size", self.data_parallel_size > 1),
            ):
                if used:
                    raise ValueError(f"async_scheduling: not supported with {name}={getattr(self, name)!r} yet")

    def _check_executor(self) -> None:
        """The executor and what only it reads; a simulated engine's dtype defaults to its hardware's."""
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(self.tensor_parallel_size, int):
            raise TypeError(f"tensor_parallel_size: expected int, got {type(self.tensor_parallel_size).__name__}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size: must be >= 1, got {self.tensor_parallel_size}")
        if isinstance(self.gpu_memory_utilization, bool) or not isinstance(self.gpu_memory_utilization, (int, float)):
            raise TypeError(f"gpu_memory_utilization: expected float, got {type(self.gpu_memory_utilization).__name__}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        self._check_data_parallel()
        _check_choice("executor", self.executor, Executor)
        if self.executor == "scripted":
            if self.token_script is None:
                raise ValueError(
                    "token_script: executor 'scripted' samples from a script: give token_script "
                    "({request_id: [token ids]} or a callable)"
                )
            self.hardware = "cpu" if self.hardware is None else self.hardware
        if self.token_script is not None:
            check_token_script(self.token_script)
        if not self.simulated:
            if self.hardware is not None:
                raise ValueError("hardware: only the simulated executor reads it (executor='simulated')")
            if self.token_script is not None:
                raise ValueError(
                    "token_script: only a model-free executor reads it (executor='scripted' or 'simulated')"
                )
            if self.tensor_parallel_size != 1:
                self.executor = "multiproc"  # one process cannot hold several ranks
            self._check_nodes()
            if self.executor == "multiproc":
                for name in ("speculative_config", "kv_transfer_config"):
                    if getattr(self, name) is not None:
                        raise ValueError(f"{name}: not supported by the multiproc executor yet")
            return
        from engine.executor.sim.hardware import get_hardware, hardware_table

        if self.hardware is None:
            raise ValueError(f"hardware: the simulated executor needs one of {', '.join(hardware_table())} or a dict")
        hardware = get_hardware(self.hardware)  # refuses an unknown name or a bad dict here
        if self.kv_transfer_config is not None:
            raise ValueError("kv_transfer_config: not supported by the simulated executor yet")
        if self.speculative_config is not None and self.token_script is None:
            raise ValueError(
                "speculative_config: not supported by the simulated executor without a token_script (its drafts "
                "come from a ScriptedModel)"
            )
        self.device = self.device or "cpu"  # no tensor is made: the hardware is simulated
        self.dtype = self.dtype or cast(DType, hardware.default_dtype)  # checked with the others in __post_init__

    def _check_observability(self) -> None:
        """vLLM's tracing settings, and its profiler's (read into `profiler`: None when profiling is off).
        OpenTelemetry is imported here only when tracing is asked for; without it the setting is refused naming what
        to install, as vLLM refuses it."""
        endpoint, modules = self.otlp_traces_endpoint, self.collect_detailed_traces
        if endpoint is not None:
            if not isinstance(endpoint, str):
                raise TypeError(f"otlp_traces_endpoint: expected str, got {type(endpoint).__name__}")
            url = urlsplit(endpoint)
            if url.scheme not in ("http", "https") or not url.hostname:
                raise ValueError(
                    "otlp_traces_endpoint: expected the http:// or https:// URL of an OTLP/HTTP receiver (a "
                    f"collector's http://HOST:4318/v1/traces), got {endpoint!r}"
                )
            from engine.tracing import check_tracing_available

            check_tracing_available()
        if modules is not None:
            if not isinstance(modules, list):
                raise TypeError(f"collect_detailed_traces: expected a list, got {type(modules).__name__}")
            for module in modules:
                _check_choice("collect_detailed_traces", module, DetailedTraceModules)
            if modules and endpoint is None:  # vLLM's refusal
                raise ValueError("collect_detailed_traces: requires otlp_traces_endpoint to be set")
        self.profiler = None if self.profiler_config is None else ProfilerConfig.from_dict(self.profiler_config)
        if self.data_parallel_size > 1:
            for name, used in (("otlp_traces_endpoint", endpoint is not None), ("profiler_config", self.profiler)):
                if used:
                    raise ValueError(
                        f"{name}: not supported with data_parallel_size {self.data_parallel_size} yet (each replica "
                        "steps in its own process)"
                    )

    def _check_data_parallel(self) -> None:
        """data_parallel_size and routing, and the combinations the data-parallel front end cannot run yet."""
        dp = self.data_parallel_size
        if isinstance(dp, bool) or not isinstance(dp, int):
            raise TypeError(f"data_parallel_size: expected int, got {type(dp).__name__}")
        if dp < 1:
            raise ValueError(f"data_parallel_size: must be >= 1, got {dp}")
        timeout = self.data_parallel_replica_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise TypeError(f"data_parallel_replica_timeout_s: expected float, got {type(timeout).__name__}")
        if not timeout > 0:
            raise ValueError(f"data_parallel_replica_timeout_s: must be > 0 seconds, got {timeout}")
        _check_choice("data_parallel_routing", self.data_parallel_routing, DataParallelRouting)
        rank = self.data_parallel_rank
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"data_parallel_rank: expected int, got {type(rank).__name__}")
        if rank < 0 or (dp > 1 and rank != 0):
            raise ValueError(
                f"data_parallel_rank: must be >= 0, and 0 for the front end of data_parallel_size > 1 (each replica "
                f"it starts gets its own), got {rank}"
            )
        if dp == 1:
            return
        if self.tensor_parallel_size != 1:  # a replica's process is a daemon: it cannot start TP workers
            raise ValueError(
                f"data_parallel_size: {dp} with tensor_parallel_size {self.tensor_parallel_size} is not "
                "supported yet (use one of them)"
            )
        for name, bad in (("executor", self.simulated), ("kv_transfer_config", self.kv_transfer_config is not None)):
            if bad:
                raise ValueError(f"data_parallel_size: {dp} with {name} {getattr(self, name)!r} is not supported")
        if self.data_parallel_routing == "prefix" and not self.enable_prefix_caching:
            raise ValueError("data_parallel_routing: 'prefix' needs enable_prefix_caching=True")

    def _check_nodes(self) -> None:
        if isinstance(self.nnodes, bool) or not isinstance(self.nnodes, int) or self.nnodes < 1:
            raise ValueError(f"nnodes: must be an int >= 1, got {self.nnodes!r}")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"nnodes: {self.nnodes} must divide tensor_parallel_size ({self.tensor_parallel_size})")

    def _check_ranges(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size: must be a power of two >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks: must be >= 2 (one is the null block), got {self.num_kv_blocks}")
        if self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory: must be > 0 bytes, got {self.kv_cache_memory}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens: must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len: must be >= 2, got {self.max_model_len}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs: must be >= 0, got {self.max_logprobs}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold: must be >= 0, got {self.long_prefill_token_threshold}")
        _check_choice("scheduling_policy", self.scheduling_policy, SchedulingPolicy)
        _check_choice("prefix_caching_hash_algo", self.prefix_caching_hash_algo, PrefixCachingHashAlgo)

    def set_max_model_len(self, model_max: int) -> None:
        """Fill `max_model_len` from the model's limit, then check what depends on it."""
        if self.max_model_len is None:
            self.max_model_len = model_max
        elif self.max_model_len > model_max:
            raise ValueError(
                f"max_model_len: {self.max_model_len} exceeds the model's max_position_embeddings ({model_max})"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # without chunking, a request (prompt + outputs, recomputed after preemption) must fit one step
            raise ValueError(
                f"max_num_batched_tokens: {self.max_num_batched_tokens} must be >= max_model_len "
                f"({self.max_model_len}) when enable_chunked_prefill is off"
            )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"{unknown[0]}: not an EngineConfig field (known: {', '.join(sorted(known))})")
        return cls(**kwargs)

    @property
    def simulated(self) -> bool:
        """No model runs: the simulated executor (random or scripted tokens) on the simulated clock."""
        return self.executor in ("simulated", "scripted")

    @property
    def torch_dtype(self) -> torch.dtype:
        """How weights and the KV cache are stored."""
        return _DTYPES[self.dtype]

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        """How the KV cache is stored: kv_cache_dtype, or the weights' dtype where it is "auto"."""
        return self.torch_dtype if self.kv_cache_dtype == "auto" else _DTYPES[self.kv_cache_dtype]

    @property
    def compute_dtype(self) -> torch.dtype:
        """What activations are computed in: float32 on a CPU, the storage dtype elsewhere."""
        return torch.float32 if self.device == "cpu" else self.torch_dtype

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
