"""Executors: what runs the model for the engine (vLLM's `vllm/v1/executor/`). `UniProcExecutor` runs the
ModelRunner in this process (the default); `MultiProcExecutor` runs one worker process per tensor-parallel rank;
`SimulatedExecutor` runs no model, only a cost model in simulated time.
Each is an `Executor` (abstract.py); `get_executor_class` picks the one the config names (vLLM's
`Executor.get_class`, here beside the classes so that the interface imports none of them)."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.executor.abstract import Executor


def get_executor_class(config: EngineConfig) -> type[Executor]:
    """The executor class `config.executor` names; imported on use (the simulated one needs no model code)."""
    if config.simulated:
        from engine.executor.simulated import SimulatedExecutor

        return SimulatedExecutor
    if config.executor == "uniproc":
        from engine.executor.uniproc import UniProcExecutor

        return UniProcExecutor
    if config.executor == "multiproc":
        from engine.executor.multiproc import MultiProcExecutor

        return MultiProcExecutor
    raise ValueError(f"executor: {config.executor!r} is not available")
