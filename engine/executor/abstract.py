"""The executor interface between LLMEngine and whatever runs the model (vLLM's `vllm/v1/executor/abstract.py`).

The engine schedules, then hands each step's SchedulerOutput to `execute_model` and gets a ModelRunnerOutput back;
how the step runs (one process, tensor-parallel workers, or a cost model in simulated time) is the executor's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.clock import Clock
from engine.config import EngineConfig
from engine.events import EventLog

if TYPE_CHECKING:
    import torch

    from engine.core.sched.output import SchedulerOutput
    from engine.model.llama import ModelShape
    from engine.model.runner import ModelRunner, ModelRunnerOutput
    from engine.sampling_params import SamplingParams


class Executor(ABC):
    """Owns the model's execution for one engine: the workers (or none), the KV cache's size, and each step's
    run. Subclasses set `model_path` (None where no folder backs the model), `model_shape`, `vocab_size`,
    `eos_token_id`, `bytes_per_block` and `num_blocks` in their constructor."""

    model_path: Path | None
    model_shape: ModelShape
    vocab_size: int
    eos_token_id: int | list[int] | None
    bytes_per_block: int
    num_blocks: int
    # the in-process ModelRunner where there is one (uniproc); None where the model runs elsewhere or nowhere
    runner: ModelRunner | None = None
    # torch threads of each worker process (multiproc); None where there are no worker processes
    threads_per_rank: int | None = None

    def __init__(self, config: EngineConfig, events: EventLog, clock: Clock) -> None:
        self.config = config
        self.events = events
        self.clock = clock

    @abstractmethod
    def determine_num_available_blocks(self) -> int:
        """How many KV blocks (the null block included) the device memory holds, when the config does not say."""

    @abstractmethod
    def execute_model(
        self,
        scheduler_output: SchedulerOutput,
        grammar_bitmask: torch.Tensor | None = None,
        guided_rows: list[int] | None = None,
    ) -> ModelRunnerOutput:
        """Run one step's batch; `grammar_bitmask` (one row per logits row) masks the `guided_rows`."""

    def load_tokenizer(self) -> Any:
        """The tokenizer beside the model's weights."""
        from transformers import AutoTokenizer  # heavy: import only when an engine is built

        return AutoTokenizer.from_pretrained(self.model_path)

    def validate_request(self, params: SamplingParams) -> None:
        """Refuse (ValueError naming the field) what this executor cannot run; every option by default."""

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids, rank order; none where the model runs in the engine's process (or nowhere)."""
        return []

    @property
    def spec_stats(self) -> Any:
        """Speculative decoding statistics, or None without speculation."""
        return None

    def shutdown(self) -> None:
        """Release workers and device memory; nothing to do in-process."""
