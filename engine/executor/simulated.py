"""SimulatedExecutor: the engine's real scheduler, KV cache and prefix cache over a cost model, in simulated time.

No weights are loaded and no forward runs. Each step, the cost model prices the scheduled batch on the configured
hardware and tensor-parallel size, the engine's SimulatedClock advances by that time, and every request that samples
gets a token: a random id from a generator seeded by the config's `seed`, never the model's EOS nor the request's
`stop_token_ids`, so each request runs to its `max_tokens` (or `max_model_len`): output lengths are the workload's.
Given a `token_script` (always, with `executor="scripted"`), the tokens come from it instead
(engine/executor/scripted.py).
Text prompts go through the model folder's tokenizer where it has one, else a byte tokenizer.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.clock import Clock, SimulatedClock
from engine.config import EngineConfig
from engine.core.sched.output import SchedulerOutput
from engine.events import EventLog
from engine.executor.abstract import Executor
from engine.executor.scripted import TokenScript
from engine.executor.sim.cost_model import CostModel, KVCapacity, ScheduledShape
from engine.executor.sim.hardware import get_hardware
from engine.executor.sim.model_spec import load_model_spec
from engine.executor.sim.tokenizer import spec_tokenizer
from engine.model.llama import ModelShape
from engine.model.runner import ModelRunnerOutput
from engine.request import Request
from engine.sampling_params import SamplingParams


class SimulatedExecutor(Executor):
    """Owns the simulated model (a ModelSpec), the hardware, the cost model that prices each step (replaceable:
    `cost_model` is anything with `step_cost(shapes) -> StepCost`), the KV capacity and the token generator."""

    def __init__(self, config: EngineConfig, events: EventLog, clock: Clock) -> None:
        if not isinstance(clock, SimulatedClock):
            raise TypeError("clock: the simulated executor advances a SimulatedClock")
        super().__init__(config, events, clock)
        self.spec = load_model_spec(config.model, config.revision)
        self.model_path = self.spec.folder
        # EngineConfig settles both for a simulated executor (the "cpu" table, the hardware's default dtype)
        assert config.hardware is not None and config.dtype is not None
        self.clock: SimulatedClock = clock
        self.hardware = get_hardware(config.hardware)
        self.cost_model = CostModel(
            self.spec,
            self.hardware,
            config.tensor_parallel_size,
            config.dtype,
            kv_cache_dtype=None if config.kv_cache_dtype == "auto" else config.kv_cache_dtype,
        )
        self.model_shape = ModelShape(**self.spec.to_shape_dict())
        self.vocab_size = self.spec.vocab_size
        self.eos_token_id = self.spec.eos_token_id
        self.bytes_per_block = self.cost_model.bytes_per_block(config.block_size)
        self.kv_capacity: KVCapacity | None = None
        self.num_blocks = config.num_kv_blocks or self.determine_num_available_blocks()
        self._rng = np.random.default_rng(config.seed)
        eos = self.eos_token_id
        self._never = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.script = (
            None
            if config.token_script is None
            else TokenScript(config.token_script, eos[0] if isinstance(eos, list) else eos, self.vocab_size)
        )

    def determine_num_available_blocks(self) -> int:
        """vLLM's rule over the hardware's memory (CostModel.kv_capacity); the split is kept as `kv_capacity`."""
        cfg = self.config
        self.kv_capacity = self.cost_model.kv_capacity(
            cfg.block_size, cfg.gpu_memory_utilization, cfg.max_num_batched_tokens, cfg.max_num_seqs
        )
        return self.kv_capacity.num_blocks

    def load_tokenizer(self):
        return spec_tokenizer(self.spec)

    def validate_request(self, params: SamplingParams) -> None:
        if params.structured_outputs is not None and self.script is None:  # a script may follow a grammar
            raise ValueError(
                "structured_outputs: the simulated executor samples random tokens, which no grammar would allow"
            )
        if params.logprobs is not None or params.prompt_logprobs is not None:
            raise ValueError("logprobs: the simulated executor computes no logits")

    def execute_model(
        self,
        scheduler_output: SchedulerOutput,
        grammar_bitmask: torch.Tensor | None = None,
        guided_rows: list[int] | None = None,
    ) -> ModelRunnerOutput:
        """Price the step, advance the clock by it, and give each sampling request one random token."""
        scheduled = scheduler_output.scheduled
        if not scheduled:
            return ModelRunnerOutput({}, {})
        shapes = [
            ScheduledShape(s.num_computed_tokens, s.num_new_tokens, len(s.spec_token_ids) + 1 if s.samples else 0)
            for s in scheduled
        ]
        cost = self.cost_model.step_cost(shapes)
        self.clock.advance(cost.total_s)
        sampled = {s.request_id: [self._token(s.request)] for s in scheduled if s.samples}
        drafts = {}
        if self.script is not None and self.config.speculative is not None:  # a scripted proposer (ScriptedModel)
            k = scheduler_output.num_spec_tokens_to_schedule
            drafts = self.script.speculate(scheduled, sampled, self.config.speculative, self.events, k)
        return ModelRunnerOutput(
            sampled, {}, dict(drafts), forward_ms=cost.forward_s * 1e3, sample_ms=cost.sampling_s * 1e3
        )

    def _token(self, request: Request) -> int:
        if self.script is not None:
            return self.script.next_token(request)
        params = request.sampling_params
        while True:  # a redraw is rare: a few excluded ids in a vocabulary of tens of thousands
            token = int(self._rng.integers(self.vocab_size))
            if token not in self._never and token not in (params.stop_token_ids or ()):
                return token
