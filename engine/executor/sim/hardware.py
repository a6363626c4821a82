"""The hardware the simulated executor runs on: a built-in table (hardware.json: `h100-sxm`, `h200`, `a100-80gb`,
`l4`, `cpu`), measured efficiency factors over it (calibration.json, written by `workbench bench calibrate`), or a
user's dict."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

HARDWARE_PATH = Path(__file__).with_name("hardware.json")
CALIBRATION_PATH = Path(__file__).with_name("calibration.json")


@dataclass(frozen=True)
class Efficiency:
    """The fractions of the peaks that kernels reach, and the step's fixed costs (what a roofline leaves out:
    the scheduler, input preparation, kernel launches). Calibrated by measurement where the source says so."""

    compute: float = 1.0  # of peak FLOP/s, for the linear layers (and the LM head)
    memory: float = 1.0  # of memory bandwidth, for streaming weights and activations
    attention: float = 1.0  # attention kernels' share of the roofline (both bounds)
    interconnect: float = 1.0  # of interconnect bandwidth, for tensor-parallel collectives
    # A GEMM computes whole tiles of rows: at M rows it does the work of M + gemm_fill_rows, so its share of the
    # compute peak is M / (M + fill). Up to gemv_max_rows rows a linear is a GEMV instead, which streams the
    # weights once and fills no tiles (the CPU kernels' PACKED_SMALL_M). 0 and 0: every GEMM at the full factor.
    gemm_fill_rows: float = 0.0
    gemv_max_rows: int = 0
    step_overhead_s: float = 0.0  # per step
    request_overhead_s: float = 0.0  # per scheduled request
    token_overhead_s: float = 0.0  # per scheduled token


@dataclass(frozen=True)
class Hardware:
    """Owns one accelerator's numbers: memory size and bandwidth, peak FLOP/s per dtype, interconnect bandwidth
    (one direction, per device) and latency, memory the runtime keeps for itself, and the efficiency factors."""

    name: str
    memory_bytes: int
    memory_bandwidth: float  # bytes/s
    flops: dict[str, float]  # dtype name -> FLOP/s
    interconnect_bandwidth: float  # bytes/s
    interconnect_latency_s: float = 1e-5
    reserved_bytes: int = 0  # CUDA context, NCCL buffers: what vLLM's profiling finds outside torch
    efficiency: Efficiency = field(default_factory=Efficiency)
    source: str = ""

    @property
    def default_dtype(self) -> str:
        """bfloat16 on an accelerator that computes it fastest, else float32 (a CPU)."""
        return "bfloat16" if self.flops.get("bfloat16", 0) > self.flops.get("float32", 0) else "float32"

    def peak_flops(self, dtype: str) -> float:
        if dtype not in self.flops:
            raise ValueError(f"hardware: {self.name} has no peak FLOP/s for {dtype} (it has {sorted(self.flops)})")
        return self.flops[dtype]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, name: str, d: dict[str, Any]) -> Hardware:
        """From a table entry or a user's dict; ValueError/TypeError name the key."""
        if not isinstance(d, dict):
            raise TypeError(f"hardware: expected a name or a dict, got {type(d).__name__}")
        known = {f.name for f in fields(cls)} - {"name"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"hardware.{unknown[0]}: unknown key (known: {', '.join(sorted(known))})")
        for key in ("memory_bytes", "memory_bandwidth", "flops", "interconnect_bandwidth"):
            if key not in d:
                raise ValueError(f"hardware.{key}: required")
        if not isinstance(d["flops"], dict) or not d["flops"]:
            raise TypeError("hardware.flops: expected a dict of dtype -> FLOP/s")
        for key in ("memory_bytes", "memory_bandwidth", "interconnect_bandwidth"):
            if not d[key] > 0:
                raise ValueError(f"hardware.{key}: must be > 0, got {d[key]}")
        eff = d.get("efficiency", {})
        if isinstance(eff, dict):
            bad = sorted(set(eff) - {f.name for f in fields(Efficiency)})
            if bad:
                raise ValueError(f"hardware.efficiency.{bad[0]}: unknown key")
            eff = Efficiency(**eff)
        for f in ("compute", "memory", "attention", "interconnect"):
            if not 0 < getattr(eff, f) <= 1:
                raise ValueError(f"hardware.efficiency.{f}: must be in (0, 1], got {getattr(eff, f)}")
        for f in ("gemm_fill_rows", "gemv_max_rows"):
            if not getattr(eff, f) >= 0:
                raise ValueError(f"hardware.efficiency.{f}: must be >= 0, got {getattr(eff, f)}")
        return cls(name=name, **{**d, "efficiency": eff})


def _read(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    return {k: v for k, v in json.loads(path.read_text(encoding="utf-8")).items() if not k.startswith("_")}


def hardware_table() -> dict[str, dict[str, Any]]:
    """The built-in entries, each with what calibration.json measured for it laid over (its keys win)."""
    table = _read(HARDWARE_PATH)
    for name, measured in _read(CALIBRATION_PATH).items():
        if name in table:
            table[name] = {**table[name], **{k: v for k, v in measured.items() if k in table[name]}}
    return table


def get_hardware(hardware: str | dict[str, Any] | Hardware) -> Hardware:
    """A Hardware from a table name, a user's dict (the table's keys), or a Hardware."""
    if isinstance(hardware, Hardware):
        return hardware
    if isinstance(hardware, dict):
        return Hardware.from_dict(
            str(hardware.get("name", "custom")), {k: v for k, v in hardware.items() if k != "name"}
        )
    if not isinstance(hardware, str):
        raise TypeError(f"hardware: expected a name or a dict, got {type(hardware).__name__}")
    table = hardware_table()
    if hardware not in table:
        raise ValueError(f"hardware: must be one of {', '.join(table)} or a dict, got {hardware!r}")
    return Hardware.from_dict(hardware, table[hardware])
