"""transformers' own continuous batching as a baseline: the machinery behind `model.generate_batch(...)`
(transformers/generation/continuous_batching/: a paged KV cache and a scheduler on a background thread), driven the
way `generate_batch` drives it, but kept running across the timed runs so that, as for the engine, building it is
not timed. Used by `bench throughput` (every request at once) and `bench serve` (requests at their arrival times).

Two settings are given rather than left to transformers: the cache size (`num_blocks`) and the token budget per
step (`max_batch_tokens`). Left alone, transformers sizes them from the free memory of the device, which on a CPU
host is most of its RAM: tens of seconds to allocate and a dense attention mask over every cached token at each
step. Here the cache holds the whole workload at once (as the engine's does) and the budget is the engine's
`max_num_batched_tokens`. Everything else is transformers' default (page size, scheduler "fifo", sdpa attention)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from workbench.bench.datasets import BenchRequest

if TYPE_CHECKING:
    from transformers.generation.continuous_batching.requests import GenerationOutput


@dataclass(frozen=True)
class TokenTimeline:
    """One request served by transformers' continuous batching: its prompt length, the tokens it counted and the
    time (s after its arrival) at which each came out."""

    prompt_len: int
    times: list[float]

    @property
    def output_len(self) -> int:
        return len(self.times)


class HFContinuousBaseline:
    """Owns a transformers model of the same weights and its continuous batching manager (started once, sized for
    `workload`), and serves workloads through it: all at once (`run`) or at arrival times (`serve`)."""

    def __init__(self, model_path: str | Path, workload: Sequence[BenchRequest], max_batch_tokens: int = 2048) -> None:
        from transformers import AutoModelForCausalLM, GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
        from transformers.generation.continuous_batching.initialization import WorkloadHints
        from transformers.utils import logging

        if any(r.json_schema is not None for r in workload):
            raise ValueError(
                "cb baseline: JSON-schema requests need per-request logits processors, which "
                "transformers' continuous batching does not take; run it on another dataset"
            )
        logging.set_verbosity_error()
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        gen = self.model.generation_config
        self.eos_token_id = gen.eos_token_id[0] if isinstance(gen.eos_token_id, list) else gen.eos_token_id
        config = GenerationConfig(
            do_sample=False,
            max_new_tokens=max(r.output_len for r in workload),
            eos_token_id=self.eos_token_id,
            pad_token_id=gen.pad_token_id,
        )
        page = ContinuousBatchingConfig().page_size
        # room for every request of the workload at once, prompt and output, in whole pages (plus one spare each)
        num_blocks = sum(math.ceil((len(r.prompt_token_ids) + r.output_len) / page) + 1 for r in workload)
        cb_config = ContinuousBatchingConfig(num_blocks=num_blocks, max_batch_tokens=max_batch_tokens)
        hints = WorkloadHints(
            max_prompt_length=max(len(r.prompt_token_ids) for r in workload),
            max_generated_length=config.max_new_tokens,
            num_requests=len(workload),
        )
        self.max_batch_tokens = max_batch_tokens
        self.num_blocks = num_blocks
        self.manager = self.model.init_continuous_batching(
            generation_config=config, continuous_batching_config=cb_config, workload_hints=hints
        )
        self.manager.start()
        self._count = 0

    def close(self) -> None:
        """Stop the manager's thread and free its cache."""
        self.manager.stop(block=True, timeout=30)
        self.manager.destroy()

    def __enter__(self) -> HFContinuousBaseline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add(self, request: BenchRequest) -> str:
        self._count += 1
        # eos_token_id=-1: no token ends the request, as ignore_eos on the engine side
        rid = self.manager.add_request(
            request.prompt_token_ids,
            request_id=f"wb-{self._count}",
            max_new_tokens=request.output_len,
            record_timestamps=True,
            eos_token_id=-1 if request.ignore_eos else self.eos_token_id,
        )
        if rid is None:
            raise RuntimeError("cb baseline: transformers' continuous batching manager refused a request")
        return rid

    def run(self, requests: Sequence[BenchRequest]) -> float:
        """Every request added at once, as `generate_batch` adds them; seconds until the last one finished."""
        t0 = time.perf_counter()
        ids = [self._add(r) for r in requests]
        outputs = self._collect(len(ids), lambda: None)
        elapsed = time.perf_counter() - t0
        short = [
            i
            for i, (rid, r) in enumerate(zip(ids, requests))
            if r.ignore_eos and len(outputs[rid].generated_tokens) != r.output_len
        ]
        if short:
            raise RuntimeError(f"cb baseline: requests {short} did not generate their requested lengths")
        return elapsed

    def serve(self, requests: Sequence[BenchRequest], arrivals: Sequence[float]) -> tuple[list[TokenTimeline], float]:
        """Each request added at its arrival (s after the start), while earlier ones run; returns per request the
        times of its tokens from its arrival (the manager stamps each token as it is sampled), and the duration
        (start to last token, s)."""
        order = sorted(range(len(requests)), key=lambda i: arrivals[i])
        start = time.perf_counter()
        ids: dict[str, int] = {}
        pending = list(order)

        def admit_due() -> float | None:
            """Add every request whose time has come; the seconds until the next one (None: none left)."""
            while pending and start + arrivals[pending[0]] <= time.perf_counter():
                i = pending.pop(0)
                ids[self._add(requests[i])] = i
            return None if not pending else max(0.0, start + arrivals[pending[0]] - time.perf_counter())

        outputs = self._collect(len(requests), admit_due)
        timelines: dict[int, TokenTimeline] = {}  # by the request's index: every one of them is among `outputs`
        last = start
        for rid, out in outputs.items():
            i = ids[rid]
            stamps = out.timestamps or []
            last = max([last, *stamps])
            timelines[i] = TokenTimeline(len(requests[i].prompt_token_ids), [t - (start + arrivals[i]) for t in stamps])
        return [timelines[i] for i in range(len(requests))], last - start

    def _collect(self, want: int, admit: Callable[[], float | None]) -> dict[str, GenerationOutput]:
        """Wait for the finished outputs of `want` requests (by request id), calling `admit()` between waits: it
        adds requests that are due and says how long until the next (None: no more to add)."""
        done: dict[str, GenerationOutput] = {}
        while len(done) < want:
            wait = admit()
            result = self.manager.get_result(timeout=0.05 if wait is None else min(wait, 0.05))
            if result is not None and result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"cb baseline: request {result.request_id} failed: {result.error}")
                done[result.request_id] = result
            elif result is None and not self.manager.is_running():
                raise RuntimeError("cb baseline: transformers' generation thread stopped")
        return done
