"""The first step where two traces of one workload part: which fields differ there, and both values."""

from __future__ import annotations

import json
import subprocess
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.fidelity.engine_side import run_workload

VLLM_DRIVER = Path(__file__).resolve().parents[2] / "tests" / "fidelity" / "vllm_driver.py"


@dataclass
class Divergence:
    """Where this engine's trace of a workload first differs from vLLM's."""

    workload: str
    step: int | None  # None: one trace ran more steps than the other
    fields: list[str]
    vllm: dict[str, Any]
    engine: dict[str, Any]

    def __str__(self) -> str:
        if self.step is None:
            return f"{self.workload}: vLLM ran {self.vllm['steps']} steps, this engine {self.engine['steps']}"
        first = self.fields[0]
        return (
            f"{self.workload}: step {self.step} differs in {', '.join(self.fields)}; {first}: "
            f"vLLM {json.dumps(self.vllm[first])[:300]} vs engine {json.dumps(self.engine[first])[:300]}"
        )


def first_divergence(vllm: dict[str, Any], engine: dict[str, Any]) -> Divergence | None:
    for a, b in zip(vllm["steps"], engine["steps"]):
        if a != b:
            fields = [k for k in a if a.get(k) != b.get(k)] + [k for k in b if k not in a]
            return Divergence(
                vllm["name"], a["step"], fields, {k: a.get(k) for k in fields}, {k: b.get(k) for k in fields}
            )
    if len(vllm["steps"]) != len(engine["steps"]) or vllm["outputs"] != engine["outputs"]:
        return Divergence(vllm["name"], None, ["steps"], {"steps": len(vllm["steps"])}, {"steps": len(engine["steps"])})
    return None


def run_vllm(workloads: Iterable[dict[str, Any]], vllm_python: str) -> list[dict[str, Any]]:
    """vLLM's traces of `workloads`: the driver in the reference venv, as a child process (it imports vLLM, which
    this process never does). Its log goes to this process's stderr only when it fails."""
    if not VLLM_DRIVER.exists():
        raise OSError(f"the vLLM driver is not at {VLLM_DRIVER}: run `workbench fidelity` from a checkout")
    with tempfile.TemporaryDirectory(prefix="fidelity-") as tmp:
        src, dst = Path(tmp) / "workloads.jsonl", Path(tmp) / "traces.jsonl"
        src.write_text("".join(json.dumps(w) + "\n" for w in workloads))
        done = subprocess.run([vllm_python, str(VLLM_DRIVER), str(src), str(dst)], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"the vLLM driver failed ({vllm_python}):\n{done.stderr[-4000:]}")
        return [json.loads(line) for line in dst.read_text().splitlines() if line.strip()]


def vllm_version(vllm_python: str) -> str:
    done = subprocess.run(
        [vllm_python, "-c", "import importlib.metadata as m; print(m.version('vllm'))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


def compare(workloads: list[dict[str, Any]], vllm_traces: list[dict[str, Any]]) -> list[Divergence]:
    """Run each workload through this engine and compare with vLLM's trace of it; the divergences found."""
    found = []
    for workload, vllm in zip(workloads, vllm_traces, strict=True):
        divergence = first_divergence(vllm, run_workload(workload))
        if divergence is not None:
            found.append(divergence)
    return found
