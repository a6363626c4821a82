"""The tensor-parallel group of this process (vLLM's `vllm/distributed/parallel_state.py`, at our size).

A worker of the multiproc executor joins a torch.distributed group and installs it here with `init_tp_group`
before it builds its model shard; the model's layers read `get_tp_group()` to size themselves (heads, columns,
rows, vocabulary) and to run their collectives. Every other process, the engine's own included, sees the trivial
group of size 1: its collectives are no-ops, so the single-process path runs unchanged.

It is process-level state, as in vLLM: one worker process holds exactly one rank of one group.
Each collective is counted (calls, bytes, wall time) so that the executor can report what every rank did in a
step (the `parallel.step` event).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class CollectiveStats:
    """One kind of collective within a step: how many calls, the bytes each rank contributed, the wall time."""

    count: int = 0
    bytes: int = 0
    ms: float = 0.0

    def to_dict(self) -> dict[str, float]:
        return {"count": self.count, "bytes": self.bytes, "ms": round(self.ms, 4)}


@dataclass
class TPGroup:
    """Owns this process's rank and size in the tensor-parallel group, the torch.distributed group handle (None
    for size 1) and the counters of the collectives run since the last `take_stats`."""

    rank: int = 0
    size: int = 1
    group: object | None = None  # a torch.distributed ProcessGroup; None when size is 1
    stats: dict[str, CollectiveStats] = field(default_factory=dict)

    def _count(self, kind: str, tensor: torch.Tensor, t0: float) -> None:
        s = self.stats.setdefault(kind, CollectiveStats())
        s.count += 1
        s.bytes += tensor.numel() * tensor.element_size()
        s.ms += (time.perf_counter() - t0) * 1e3

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks in place (a row-parallel linear's partial products); returns `x`."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        t0 = time.perf_counter()
        dist.all_reduce(x, group=self.group)
        self._count("all_reduce", x, t0)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` concatenated along `dim` in rank order (a vocabulary-parallel LM head's logits)."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        t0 = time.perf_counter()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        self._count("all_gather", x, t0)
        return torch.cat(parts, dim=dim)

    def take_stats(self) -> dict[str, dict[str, float]]:
        """The counters since the last call, as JSON-safe dicts, then zeroed (one step's collectives)."""
        out = {kind: s.to_dict() for kind, s in self.stats.items()}
        self.stats = {}
        return out


_TP_GROUP = TPGroup()


def get_tp_group() -> TPGroup:
    """This process's tensor-parallel group: size 1 unless a multiproc worker installed its own."""
    return _TP_GROUP


def init_tp_group(rank: int, size: int, group: object | None) -> TPGroup:
    """Install this process's rank and group (a worker does it once, before building its model shard)."""
    global _TP_GROUP
    if not 0 <= rank < size:
        raise ValueError(f"rank: {rank} is outside the group of size {size}")
    _TP_GROUP = TPGroup(rank, size, group)
    return _TP_GROUP


def tp_head_split(num_heads: int, num_kv_heads: int, size: int, rank: int) -> tuple[int, int, int]:
    """(query heads, KV heads, first KV head) of `rank`: query heads split evenly; KV heads split evenly when
    there are at least as many as ranks, otherwise each KV head replicated over size // num_kv_heads ranks (vLLM's
    QKVParallelLinear). Divisibility is checked by the executor before any worker starts."""
    if num_kv_heads >= size:
        kv = num_kv_heads // size
        return num_heads // size, kv, rank * kv
    replicas = size // num_kv_heads
    return num_heads // size, 1, rank // replicas


def check_tp_divides(num_heads: int, num_kv_heads: int, size: int) -> None:
    """Refuse a tensor-parallel size that does not split the model's heads (ValueError naming the field and both
    head counts)."""
    ok = num_heads % size == 0 and (num_kv_heads % size == 0 or size % num_kv_heads == 0)
    if not ok:
        raise ValueError(
            f"tensor_parallel_size: {size} must divide the model's num_attention_heads ({num_heads}), and either "
            f"divide or be a multiple of its num_key_value_heads ({num_kv_heads})"
        )
