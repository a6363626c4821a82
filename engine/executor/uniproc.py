"""UniProcExecutor: the ModelRunner in the engine's own process (vLLM's `UniProcExecutor`), the default."""

from __future__ import annotations

import torch

from engine.clock import Clock
from engine.config import EngineConfig
from engine.core.sched.output import SchedulerOutput
from engine.events import EventLog
from engine.executor.abstract import Executor
from engine.model.loader import resolve_model
from engine.model.runner import ModelRunner, ModelRunnerOutput


class UniProcExecutor(Executor):
    """Owns one ModelRunner in this process: the weights, the KV cache tensors and the sampler."""

    def __init__(self, config: EngineConfig, events: EventLog, clock: Clock) -> None:
        super().__init__(config, events, clock)
        self.model_path = resolve_model(config.model, config.revision)
        self.runner: ModelRunner = ModelRunner(config, self.model_path, events)
        self.model_shape = self.runner.model.shape
        self.vocab_size = self.runner.vocab_size
        self.eos_token_id = getattr(self.runner.hf_config, "eos_token_id", None)
        self.bytes_per_block = self.runner.bytes_per_block
        self.num_blocks = self.runner.num_blocks

    def determine_num_available_blocks(self) -> int:
        """The runner sized its cache from `kv_cache_memory` (this engine's rule on a CPU, not vLLM's profiling)."""
        return max(2, self.config.kv_cache_memory // self.bytes_per_block)

    def execute_model(
        self,
        scheduler_output: SchedulerOutput,
        grammar_bitmask: torch.Tensor | None = None,
        guided_rows: list[int] | None = None,
    ) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output, grammar_bitmask, guided_rows)

    @property
    def spec_stats(self):
        return None if self.runner.spec is None else self.runner.spec.stats
