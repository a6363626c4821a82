"""The model runner: owns the weights, the paged KV cache tensors and the sampler; runs one step's batch.

All scheduled tokens of all requests are flattened into one forward. Logits are computed only at the
positions that sample (the last token of a request whose prefill completes, or its decode token).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from engine.config import EngineConfig
from engine.core.scheduler import SchedulerOutput
from engine.events import EventLog
from engine.model.attention import AttentionMetadata
from engine.model.llama import load_model
from engine.model.sampler import Sampler, SamplingMetadata
from engine.spec.decoder import SpecDecoder


@dataclass
class ModelRunnerOutput:
    """Sampled tokens by request id (absent for requests mid-prefill), their logprobs, and stage timings."""

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[dict[int, float]]]
    spec_token_ids: dict[str, tuple[list[int], torch.Tensor | None]] = field(default_factory=dict)  # drafts, probs
    forward_ms: float = 0.0
    sample_ms: float = 0.0


@dataclass
class _BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    logits_indices: torch.Tensor
    sampling_rows: list  # the ScheduledRequests that sample, in batch order
    first_rows: list[int]  # each one's first logits row (a verify request has one per draft, plus one)


def kv_cache_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                             dtype: torch.dtype) -> int:
    """K and V of one block in every layer: 2 x block_size x kv heads x head size x bytes, per layer."""
    return 2 * block_size * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size() * num_layers


def allocate_kv_caches(model, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (K, V) pair per layer, each [num_blocks, block_size, kv heads, head dim]."""
    shape = (num_blocks, block_size, model.shape.num_kv_heads, model.shape.head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(model.shape.num_layers)]


class ModelRunner:
    """Owns the model, the KV cache tensors ([num_blocks, block_size, kv heads, head dim] per layer, K and V)
    and the sampler. Holds no request state of its own: each request carries its tokens and its generator."""

    def __init__(self, config: EngineConfig, model_path: Path, events: EventLog) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        self.model, self.hf_config = load_model(model_path, config.torch_dtype, self.device)
        shape = self.model.shape
        self.num_layers, self.num_kv_heads, self.head_dim = shape.num_layers, shape.num_kv_heads, shape.head_dim
        self.bytes_per_block = kv_cache_bytes_per_block(self.num_layers, self.block_size, self.num_kv_heads,
                                                        self.head_dim, config.torch_dtype)
        self.num_blocks = config.num_kv_blocks or max(2, config.kv_cache_memory // self.bytes_per_block)
        self.kv_caches = allocate_kv_caches(self.model, self.num_blocks, self.block_size, config.torch_dtype,
                                            self.device)
        self.sampler = Sampler()
        self.default_generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.spec = None if config.speculative is None else SpecDecoder(config, self, events)

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @torch.inference_mode()
    def execute_model(self, output: SchedulerOutput, grammar_bitmask: torch.Tensor | None = None,
                      guided_rows: list[int] | None = None) -> ModelRunnerOutput:
        """Run the step's batch; `grammar_bitmask` (one row per logits row) masks the `guided_rows`."""
        if output.is_empty:
            return ModelRunnerOutput({}, {})
        t0 = time.perf_counter()
        batch = self._prepare_inputs(output)
        hidden = self.model(batch.input_ids, batch.positions, batch.attn, self.kv_caches)
        if self.spec is not None:
            self.spec.mirror(batch.input_ids, batch.positions, batch.attn)
        if not batch.sampling_rows:
            return ModelRunnerOutput({}, {}, forward_ms=(time.perf_counter() - t0) * 1e3)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        if grammar_bitmask is not None:
            from engine.structured.xgrammar_backend import apply_bitmask

            apply_bitmask(logits, grammar_bitmask, guided_rows)
        t1 = time.perf_counter()
        sampled, logprobs = self._sample(logits, batch)
        drafts = self.spec.propose(batch.sampling_rows, sampled) if self.spec is not None else {}
        t2 = time.perf_counter()
        return ModelRunnerOutput(sampled, logprobs, drafts, forward_ms=(t1 - t0) * 1e3, sample_ms=(t2 - t1) * 1e3)

    def _sample(self, logits: torch.Tensor, batch: _BatchInputs) -> tuple[dict, dict]:
        """Plain rows through the sampler; rows with drafts through the rejection sampler."""
        plain = [(s, r) for s, r in zip(batch.sampling_rows, batch.first_rows) if not s.spec_token_ids]
        verify = [(s, r) for s, r in zip(batch.sampling_rows, batch.first_rows) if s.spec_token_ids]
        sampled, logprobs = {}, {}
        if plain:
            rows = [s for s, _ in plain]
            plain_logits = logits if not verify else logits[[r for _, r in plain]]
            out = self.sampler(plain_logits, self._sampling_metadata(rows))
            sampled = {s.request_id: [t] for s, t in zip(rows, out.sampled_token_ids.tolist())}
            logprobs = self._logprobs(rows, out.logprobs)
        if verify:
            sampled.update(self.spec.rejection_sampler(logits, [s for s, _ in verify], [r for _, r in verify],
                                                       self._sampling_metadata))
        return sampled, logprobs

    def _prepare_inputs(self, output: SchedulerOutput) -> _BatchInputs:
        bs = self.block_size
        ids, positions, slots, seq_lens, query_lens, logits_indices, rows = [], [], [], [], [], [], []
        first_rows = []
        max_blocks = max(len(s.block_ids) for s in output.scheduled)
        block_tables = np.zeros((len(output.scheduled), max_blocks), dtype=np.int32)
        offset = 0
        for i, s in enumerate(output.scheduled):
            start, n = s.num_computed_tokens, s.num_new_tokens
            tokens = s.request.all_token_ids[start:start + n]
            ids.extend(tokens)
            ids.extend(s.spec_token_ids[:n - len(tokens)])
            pos = np.arange(start, start + n)
            table = np.asarray(s.block_ids, dtype=np.int64)
            block_tables[i, :len(table)] = table
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            seq_lens.append(start + n)
            query_lens.append(n)
            offset += n
            if s.samples:  # a verify request samples at its last token and at each draft
                first_rows.append(len(logits_indices))
                logits_indices.extend(range(offset - 1 - len(s.spec_token_ids), offset))
                rows.append(s)
        dev = self.device
        positions_np = np.concatenate(positions)
        attn = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
            block_tables=torch.from_numpy(block_tables).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor([0, *np.cumsum(query_lens).tolist()], dtype=torch.int32, device=dev),
        )
        return _BatchInputs(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.from_numpy(positions_np).to(dev),
            attn=attn,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=dev),
            sampling_rows=rows,
            first_rows=first_rows,
        )

    def _sampling_metadata(self, rows: list) -> SamplingMetadata:
        params = [s.request.sampling_params for s in rows]
        generators = {}
        for i, s in enumerate(rows):
            request = s.request
            if request.sampling_params.seed is not None and not request.sampling_params.greedy:
                if request.generator is None:
                    request.generator = torch.Generator(device=self.device).manual_seed(request.sampling_params.seed)
                generators[i] = request.generator
        dev = self.device
        greedy = [p.greedy for p in params]
        any_top_k = any(p.top_k > 0 for p in params)
        any_top_p = any(p.top_p < 1.0 for p in params)
        any_min_p = any(p.min_p > 0.0 for p in params)
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        return SamplingMetadata(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long, device=dev) if any_top_k else None,
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev) if any_top_p else None,
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev) if any_min_p else None,
            generators=generators,
            default_generator=self.default_generator,
            all_greedy=all(greedy),
            all_random=not any(greedy),
            max_num_logprobs=max(logprobs) if logprobs else None,
        )

    @staticmethod
    def _logprobs(rows: list, tensors) -> dict[str, list[dict[int, float]]]:
        if tensors is None:
            return {}
        ids, values = tensors.logprob_token_ids.tolist(), tensors.logprobs.tolist()
        out = {}
        for i, s in enumerate(rows):
            n = s.request.sampling_params.logprobs
            if n is not None:
                # column 0 is the sampled token; then the top-n
                out[s.request_id] = [dict(zip(ids[i][:n + 1], values[i][:n + 1]))]
        return out
