"""The simulated executor's cost model: how many KV blocks a device holds, and how long a step takes.

KV capacity, as vLLM computes it (`gpu_memory_utilization` x device memory, minus the weights one rank holds, minus
the activation peak of a `max_num_batched_tokens` forward, minus what the runtime reserves; what is left, over the
bytes of one block in every layer, is the number of blocks). vLLM measures the activation peak by profiling a dummy
forward; here it is estimated from the shapes (below).

A step's time is a roofline per operation, per tensor-parallel rank (every rank does the same work):
- linears of each decoder layer (q/k/v/o, the MLP or the experts a MoE layer's tokens touch, the router):
  max(2 x rows x weights / (peak x e.compute), (weights + activations in and out) bytes / (bandwidth x e.memory)),
  where a GEMM's rows are its tokens plus e.gemm_fill_rows (the unfilled part of its tiles: at M rows it reaches
  M / (M + fill) of e.compute), unless it has at most e.gemv_max_rows rows (a GEMV: weights streamed once, no tiles);
- attention of each request over its context: causal FLOPs 4 x heads x head_dim x (q x c + q (q + 1) / 2) against the
  K/V it reads ((c + q) tokens), the same roofline divided by e.attention: a prefill is compute-bound, a decode
  memory-bound;
- the LM head on the rows that sample (a GEMM or GEMV as above), then sampling (reads of the logits);
- tensor parallelism: two all-reduces per layer (ring: 2 (tp - 1) / tp x bytes / interconnect bandwidth + latency)
  and an all-gather of the logits;
- fixed costs: e.step_overhead_s + e.request_overhead_s x requests + e.token_overhead_s x tokens (the scheduler,
  input preparation, launches: what the roofline does not see).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from engine.executor.sim.hardware import Efficiency, Hardware
from engine.executor.sim.model_spec import ModelSpec

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1}
LOGITS_BYTES = 4  # logits are float32 in the sampler
SAMPLING_PASSES = 3  # softmax / top-k / the draw each read the logits once


class ScheduledShape(NamedTuple):
    """One request's share of a step, as the cost model needs it: tokens with KV before the step, tokens run in
    it, and rows of logits it samples (0 mid-prefill, 1, or drafts + 1 when verifying)."""

    num_computed: int
    num_new: int
    num_logits: int


@dataclass(frozen=True)
class KVCapacity:
    """How vLLM's memory split comes out on one rank: what is requested, what the weights, the activation peak and
    the runtime take, and the KV blocks in what is left."""

    memory_bytes: int
    requested_bytes: int  # memory x gpu_memory_utilization
    weight_bytes: int  # per rank
    activation_bytes: int  # peak of a max_num_batched_tokens forward (estimated)
    reserved_bytes: int
    kv_cache_bytes: int
    bytes_per_block: int  # K and V of one block in every layer, this rank's KV heads
    num_blocks: int  # usable blocks plus the null block, as the engine counts them


@dataclass(frozen=True)
class StepCost:
    """One step's simulated seconds, by operation."""

    linears_s: float
    attention_s: float
    lm_head_s: float
    communication_s: float
    overhead_s: float
    sampling_s: float

    @property
    def forward_s(self) -> float:
        """Everything before sampling: the model, its collectives, and the fixed costs."""
        return self.linears_s + self.attention_s + self.lm_head_s + self.communication_s + self.overhead_s

    @property
    def total_s(self) -> float:
        return self.forward_s + self.sampling_s


class CostModel:
    """Owns the cost of one model on one hardware at a tensor-parallel size and dtype: weights per rank, the KV
    capacity, and each step's time from its batch (see the module docstring for the formulas)."""

    def __init__(
        self,
        spec: ModelSpec,
        hardware: Hardware,
        tensor_parallel_size: int = 1,
        dtype: str = "bfloat16",
        efficiency: Efficiency | None = None,
        kv_cache_dtype: str | None = None,
    ) -> None:
        """`kv_cache_dtype`: how K and V are stored (none: as the weights, `dtype`)."""
        for name, value in (("dtype", dtype), ("kv_cache_dtype", kv_cache_dtype or dtype)):
            if value not in DTYPE_BYTES:
                raise ValueError(f"{name}: must be one of {sorted(DTYPE_BYTES)}, got {value!r}")
        tp = tensor_parallel_size
        if spec.num_heads % tp:
            raise ValueError(f"tensor_parallel_size: {tp} must divide the model's {spec.num_heads} attention heads")
        self.spec, self.hardware, self.tp, self.dtype = spec, hardware, tp, dtype
        self.eff = hardware.efficiency if efficiency is None else efficiency
        self.weight_elt = DTYPE_BYTES[dtype]
        self.kv_elt = DTYPE_BYTES[kv_cache_dtype or dtype]
        # a CPU computes in float32 whatever the storage (as the engine does there); an accelerator in the dtype
        self.compute_dtype = "float32" if hardware.default_dtype == "float32" else dtype
        self.act_elt = DTYPE_BYTES[self.compute_dtype]
        self.peak = hardware.peak_flops(self.compute_dtype)
        s = spec
        self.q_r = s.q_size // tp
        self.kv_r = s.kv_heads_per_rank(tp) * s.head_dim
        self.heads_r = s.num_heads // tp
        self.vocab_r = -(-s.vocab_size // tp)
        self.attn_w = (2 * s.hidden_size * s.q_size) // tp + 2 * s.hidden_size * self.kv_r  # q, o split; k, v
        self.mlp_w = 3 * s.hidden_size * s.intermediate_size // tp
        self.expert_w = 3 * s.hidden_size * s.moe_intermediate_size // tp

    # ---- memory -------------------------------------------------------------------------------------------
    def weight_bytes_per_rank(self) -> int:
        """The rank's share of the split parameters plus every replicated one (the norms), at the dtype."""
        split = self.spec.num_params() - self.spec.num_replicated_params()
        return (-(-split // self.tp) + self.spec.num_replicated_params()) * self.weight_elt

    def bytes_per_block(self, block_size: int) -> int:
        return 2 * block_size * self.kv_r * self.kv_elt * self.spec.num_layers

    def activation_peak_bytes(self, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        """A forward of max_num_batched_tokens tokens: the residual and normed hidden states, q/k/v, the attention
        output and the MLP's gate/up and activation (a MoE layer's for its top-k experts), live at once in one
        layer; plus float32 logits for max_num_seqs rows of the whole vocabulary (vLLM's sampler dry run)."""
        s, t = self.spec, max_num_batched_tokens
        inter = (
            s.num_experts_per_tok * s.moe_intermediate_size if s.num_sparse_layers else s.intermediate_size
        ) // self.tp
        per_token = 2 * s.hidden_size + self.q_r + 2 * self.kv_r + self.q_r + 3 * inter
        return t * per_token * self.act_elt + max_num_seqs * s.vocab_size * LOGITS_BYTES

    def kv_capacity(
        self,
        block_size: int,
        gpu_memory_utilization: float = 0.92,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 256,
    ) -> KVCapacity:
        """vLLM's split of one rank's memory (see the module docstring); ValueError if nothing is left for KV."""
        hw = self.hardware
        requested = int(hw.memory_bytes * gpu_memory_utilization)
        weights = self.weight_bytes_per_rank()
        activations = self.activation_peak_bytes(max_num_batched_tokens, max_num_seqs)
        kv_bytes = requested - weights - activations - hw.reserved_bytes
        per_block = self.bytes_per_block(block_size)
        if kv_bytes < 2 * per_block:
            raise ValueError(
                f"gpu_memory_utilization: {gpu_memory_utilization} of {hw.name}'s {hw.memory_bytes / 2**30:.1f} GiB "
                f"leaves {kv_bytes / 2**30:.2f} GiB for the KV cache after {weights / 2**30:.1f} GiB of weights per "
                f"rank and {(activations + hw.reserved_bytes) / 2**30:.1f} GiB of activations and runtime: raise "
                "tensor_parallel_size or gpu_memory_utilization, or pick a larger device"
            )
        # the engine counts the null block among num_blocks; vLLM's count of usable blocks is num_blocks - 1
        return KVCapacity(
            hw.memory_bytes,
            requested,
            weights,
            activations,
            hw.reserved_bytes,
            kv_bytes,
            per_block,
            kv_bytes // per_block + 1,
        )

    # ---- time ---------------------------------------------------------------------------------------------
    def _roofline(self, flops: float, nbytes: float) -> float:
        return max(flops / (self.peak * self.eff.compute), nbytes / (self.hardware.memory_bandwidth * self.eff.memory))

    def _fill(self, rows: float) -> float:
        """The rows a linear of `rows` rows computes in vain: none for a GEMV, its tiles' unfilled ones for a GEMM."""
        return 0.0 if rows <= self.eff.gemv_max_rows else self.eff.gemm_fill_rows

    def _layers_s(self, tokens: int) -> float:
        s, h, a = self.spec, self.spec.hidden_size, self.act_elt
        io = 4 * h + 2 * self.q_r + 2 * self.kv_r  # norms, q/k/v out, o in/out: activations per token
        dense_w = self.attn_w + self.mlp_w
        fill = self._fill(tokens)
        dense = self._roofline(
            2 * (tokens + fill) * dense_w,
            dense_w * self.weight_elt + tokens * a * (io + 3 * s.intermediate_size // self.tp),
        )
        total = s.num_dense_layers * dense
        if s.num_sparse_layers:
            k, e = s.num_experts_per_tok, s.num_experts
            touched = e * (1 - (1 - k / e) ** tokens)  # expected distinct experts tokens' top-k choices hit
            router = h * e
            weights = self.attn_w + touched * self.expert_w + router
            # each touched expert is a GEMM of its own, with its own unfilled tile
            flops = 2 * tokens * (self.attn_w + k * self.expert_w + router) + 2 * fill * weights
            inter = k * s.moe_intermediate_size // self.tp
            sparse = self._roofline(flops, weights * self.weight_elt + tokens * a * (io + 3 * inter))
            total += s.num_sparse_layers * sparse
        embed = tokens * h * self.weight_elt / (self.hardware.memory_bandwidth * self.eff.memory)
        return total + embed

    def _attention_s(self, shapes: Sequence[ScheduledShape]) -> float:
        s = self.spec
        total = 0.0
        for c, q, _ in shapes:
            flops = 4 * self.heads_r * s.head_dim * (q * c + q * (q + 1) / 2)
            nbytes = (c + q) * 2 * self.kv_r * self.kv_elt + q * 2 * self.q_r * self.act_elt
            total += self._roofline(flops, nbytes)
        return total * s.num_layers / self.eff.attention

    def _collective_s(self, nbytes: float, factor: float) -> float:
        hw = self.hardware
        return factor * nbytes / (hw.interconnect_bandwidth * self.eff.interconnect) + hw.interconnect_latency_s

    def step_cost(self, shapes: Sequence[ScheduledShape]) -> StepCost:
        """The simulated time of one step that runs `shapes` (one per scheduled request)."""
        if not shapes:
            return StepCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        s, tp = self.spec, self.tp
        tokens = sum(x.num_new for x in shapes)
        rows = sum(x.num_logits for x in shapes)
        lm_head = sampling = comm = 0.0
        if rows:
            lm_head = self._roofline(
                2 * (rows + self._fill(rows)) * s.hidden_size * self.vocab_r,
                s.hidden_size * self.vocab_r * self.weight_elt + rows * self.vocab_r * LOGITS_BYTES,
            )
            sampling = (
                SAMPLING_PASSES
                * rows
                * s.vocab_size
                * LOGITS_BYTES
                / (self.hardware.memory_bandwidth * self.eff.memory)
            )
        if tp > 1:
            # two all-reduces of the hidden states per layer (after attention, after the MLP), ring algorithm
            comm = 2 * s.num_layers * self._collective_s(tokens * s.hidden_size * self.act_elt, 2 * (tp - 1) / tp)
            if rows:
                comm += self._collective_s(rows * s.vocab_size * LOGITS_BYTES, (tp - 1) / tp)
        e = self.eff
        overhead = e.step_overhead_s + e.request_overhead_s * len(shapes) + e.token_overhead_s * tokens
        return StepCost(self._layers_s(tokens), self._attention_s(shapes), lm_head, comm, overhead, sampling)


class ReplayCostModel:
    """Owns a run's measured clock: step k ends at `end_times[k]` (the clock's monotonic seconds), whatever its
    batch. With it, the simulator's scheduler sees a real run's time, so it must make that run's decisions."""

    def __init__(self, clock, end_times: Sequence[float]) -> None:
        self.clock = clock
        self.end_times = list(end_times)
        self.index = 0

    def step_cost(self, shapes: Sequence[ScheduledShape]) -> StepCost:
        if self.index >= len(self.end_times):
            raise RuntimeError(f"replay: only {len(self.end_times)} step times were recorded")
        seconds = max(0.0, self.end_times[self.index] - self.clock.monotonic())
        self.index += 1
        return StepCost(0.0, 0.0, 0.0, 0.0, seconds, 0.0)
