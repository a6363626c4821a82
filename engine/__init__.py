"""The headless engine: a stepwise, vLLM-V1-style inference engine whose every decision is a typed event."""

from __future__ import annotations

import importlib
from typing import Any

from engine.clock import SimulatedClock
from engine.config import EngineConfig
from engine.events import EngineSnapshot, Event, KVUsage, StepRecord
from engine.executor.sim.cost_model import CostModel, ScheduledShape
from engine.executor.sim.hardware import get_hardware, hardware_table
from engine.executor.sim.model_spec import builtin_models
from engine.outputs import CompletionOutput, RequestOutput
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams, StructuredOutputsParams

# The engine classes pull in the model code (and transformers): import them on first use, so that the
# scheduler, the block pool and the CLI start fast.
_LAZY = {
    "LLM": "engine.entrypoints.llm",
    "LLMEngine": "engine.llm_engine",
    "AsyncLLM": "engine.async_llm",
    "PDCluster": "engine.entrypoints.pd_cluster",
    "DPLBClient": "engine.entrypoints.dp_client",
    "resolve_model": "engine.model.loader",
    "smollm2_gguf_path": "engine.model.loader",
    "SUPPORTED_MODEL_TYPES": "engine.model.registry",
    "default_head_path": "engine.spec_decode.draft_heads",
    "build_app": "engine.entrypoints.openai.api_server",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")


__all__ = [
    "LLM",
    "LLMEngine",
    "AsyncLLM",
    "EngineConfig",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "RequestStatus",
    "StepRecord",
    "KVUsage",
    "Event",
    "EngineSnapshot",
    "PDCluster",
    "DPLBClient",
    "resolve_model",
    "smollm2_gguf_path",
    "SUPPORTED_MODEL_TYPES",
    "default_head_path",
    "build_app",
    "get_hardware",
    "hardware_table",
    "builtin_models",
    "CostModel",
    "ScheduledShape",
    "SimulatedClock",
]
