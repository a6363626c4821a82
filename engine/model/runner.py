"""The model runner: owns the weights, the paged KV cache tensors and the sampler; runs one step's batch.

All scheduled tokens of all requests are flattened into one forward. Logits are computed only at the
positions that sample (the last token of a request whose prefill completes, or its decode token).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

import kernels
from engine.config import EngineConfig
from engine.core.sched.output import ScheduledRequest, SchedulerOutput
from engine.events import EventLog, MoERouted
from engine.model.attention import AttentionMetadata, allocate_kv_caches
from engine.model.block_table import BlockTable
from engine.model.registry import load_model
from engine.sample.logits_processors import LogitsInputs
from engine.sample.sampler import Sampler, SamplingMetadata, argmax_only, greedy_sample
from engine.spec_decode.decoder import SpecDecoder
from engine.spec_decode.proposer import TargetModel


@dataclass
class ModelRunnerOutput:
    """Sampled tokens by request id (absent for requests mid-prefill), their logprobs, and stage timings."""

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[dict[int, float]]]
    spec_token_ids: dict[str, tuple[list[int], torch.Tensor | None]] = field(default_factory=dict)  # drafts, probs
    prompt_logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)  # this step's prompt positions
    forward_ms: float = 0.0
    sample_ms: float = 0.0


@dataclass
class _BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    logits_indices: torch.Tensor
    sampling_rows: list[ScheduledRequest]  # those that sample, in batch order
    first_rows: list[int]  # each one's first logits row (a verify request has one per draft, plus one)


class DecodeInputs:
    """Owns the CPU buffers of a decode step's inputs, reused every step as vLLM's runner reuses its input buffers,
    and their tensor views by batch shape: int64 [ids | positions | slots | logits rows] and int32 [seq lens | query
    start locs | block tables]. A step's views hold the last step's values once the next one is prepared."""

    MAX_VIEWS = 64  # shapes (requests, blocks) whose views are kept

    def __init__(self, max_num_reqs: int, max_blocks: int) -> None:
        self.i64 = torch.zeros(4 * max_num_reqs, dtype=torch.int64)
        self.i32 = torch.zeros(2 * max_num_reqs + 1 + max_num_reqs * max_blocks, dtype=torch.int32)
        self.i64_np, self.i32_np = self.i64.numpy(), self.i32.numpy()
        self.views: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}

    def fill(
        self,
        ids: list[int],
        positions: list[int],
        slots: list[int],
        table: np.ndarray,
        rows: list[int],
        blocks: int,
    ) -> tuple[torch.Tensor, ...]:
        """input_ids, positions, slot_mapping, logits_indices, seq_lens, query_start_loc and block_tables of S
        requests with one token each (rows: their block table rows; blocks: the most any holds)."""
        n = len(ids)
        self.i64_np[: 4 * n] = ids + positions + slots + list(range(n))
        self.i32_np[: 2 * n + 1] = [p + 1 for p in positions] + list(range(n + 1))
        self.i32_np[2 * n + 1 : 2 * n + 1 + n * blocks].reshape(n, blocks)[:] = table[rows, :blocks]
        views = self.views.get((n, blocks))
        if views is None:
            if len(self.views) >= self.MAX_VIEWS:
                self.views.clear()
            seq_lens, query_start_loc, tables = self.i32[: 2 * n + 1 + n * blocks].split([n, n + 1, n * blocks])
            views = (*self.i64[: 4 * n].split(n), seq_lens, query_start_loc, tables.view(n, blocks))
            self.views[(n, blocks)] = views
        return views


PROMPT_LOGPROBS_ROWS = 256  # prompt positions whose logits exist at once


def kv_cache_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """K and V of one block in every layer: 2 x block_size x kv heads x head size x bytes, per layer."""
    return 2 * block_size * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size() * num_layers


class ModelRunner:
    """Owns the model, the KV cache tensors ([num_blocks, block_size, kv heads, head dim] per layer, K and V),
    the persistent block table (a row per running request) and the sampler. Each request carries its tokens and
    its generator."""

    def __init__(self, config: EngineConfig, model_path: Path, events: EventLog) -> None:
        self.config = config
        assert config.device is not None, "EngineConfig resolves it (CUDA where present)"
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        self.model, self.hf_config = load_model(model_path, config.torch_dtype, self.device, config.quantization)
        shape = self.model.shape
        self.num_layers, self.num_kv_heads, self.head_dim = shape.num_layers, shape.num_kv_heads, shape.head_dim
        self.bytes_per_block = kv_cache_bytes_per_block(
            self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, config.kv_cache_torch_dtype
        )
        self.num_blocks = config.num_kv_blocks or max(2, config.kv_cache_memory // self.bytes_per_block)
        self.kv_caches = allocate_kv_caches(
            self.model, self.num_blocks, self.block_size, config.kv_cache_torch_dtype, self.device
        )
        # compiled now rather than at the step where a growing context first changes the split choice
        self.attention_variants_warmed = kernels.warm_up_paged_attention(
            shape.num_heads, *self.kv_caches[0], config.compute_dtype
        )
        max_blocks_per_req = -(-(shape.max_position_embeddings or self.num_blocks * self.block_size) // self.block_size)
        self.block_table = BlockTable(self.block_size, config.max_num_seqs, min(self.num_blocks, max_blocks_per_req))
        # on an accelerator every step's inputs take the general path (two copies to the device)
        max_blocks = self.block_table.block_table_np.shape[1]
        self.decode_inputs = DecodeInputs(config.max_num_seqs, max_blocks) if self.device.type == "cpu" else None
        self.sampler = Sampler()
        self.default_generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.spec = None if config.speculative is None else SpecDecoder(config, self._as_target(), self.sampler, events)
        self.events = events
        # (layer, SparseMoeBlock) of a mixture-of-experts model, whose routing each step reports
        moe_blocks = getattr(self.model, "moe_blocks", None)
        self.moe_blocks = moe_blocks() if moe_blocks is not None else []
        # Each is called with every SchedulerOutput as execute_model starts, before any of the step runs, and must
        # leave it as it is: how a profiler or a tracer sees the steps without replacing execute_model (bench
        # profile captures a step's output with one, then times prepare_inputs on it).
        self.step_hooks: list[Callable[[SchedulerOutput], None]] = []

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    def _as_target(self) -> TargetModel:
        """What a proposer may know of this runner's model."""
        return TargetModel(
            self.config, self.num_blocks, self.vocab_size, self.device, self.default_generator, self.model
        )

    @torch.inference_mode()
    def execute_model(
        self, output: SchedulerOutput, grammar_bitmask: torch.Tensor | None = None, guided_rows: list[int] | None = None
    ) -> ModelRunnerOutput:
        """Run the step's batch; `grammar_bitmask` (one row per logits row) masks the `guided_rows`."""
        for hook in self.step_hooks:
            hook(output)
        # rows of requests that finished or were preempted since the last step are reused
        self.block_table.remove(output.finished_req_ids)
        self.block_table.remove(output.preempted_req_ids)
        if output.is_empty:
            return ModelRunnerOutput({}, {})
        t0 = time.perf_counter()
        batch = self.prepare_inputs(output)
        hidden = self.model(batch.input_ids, batch.positions, batch.attn, self.kv_caches)
        if self.moe_blocks:
            self._emit_routing(output, batch)
        if self.spec is not None:
            self.spec.mirror(
                output.scheduled,
                batch.input_ids,
                batch.positions,
                batch.attn,
                hidden,
                self.model.model.aux_hidden_states,
            )
        prompt_logprobs = self._prompt_logprobs(output, batch, hidden)
        if not batch.sampling_rows:
            return ModelRunnerOutput(
                {}, {}, forward_ms=(time.perf_counter() - t0) * 1e3, prompt_logprobs=prompt_logprobs
            )
        # logits rows rise through [0, T): as many as the tokens is every row, in order (a decode step)
        sampled_hidden = hidden if len(batch.logits_indices) == len(hidden) else hidden[batch.logits_indices]
        logits = self.model.compute_logits(sampled_hidden)
        if grammar_bitmask is not None:
            from engine.structured_output.backend_xgrammar import apply_bitmask

            apply_bitmask(logits, grammar_bitmask, guided_rows or [])
        t1 = time.perf_counter()
        sampled, logprobs = self._sample(logits, batch)
        drafts = (
            self.spec.propose(batch.sampling_rows, sampled, self.kv_caches, output.num_spec_tokens_to_schedule)
            if self.spec is not None
            else {}
        )
        t2 = time.perf_counter()
        return ModelRunnerOutput(
            sampled,
            logprobs,
            drafts,
            forward_ms=(t1 - t0) * 1e3,
            sample_ms=(t2 - t1) * 1e3,
            prompt_logprobs=prompt_logprobs,
        )

    def _prompt_logprobs(
        self, output: SchedulerOutput, batch: _BatchInputs, hidden: torch.Tensor
    ) -> dict[str, list[dict[int, float]]]:
        """For requests with ``prompt_logprobs``: each prompt token this step's positions predict, its raw logprob
        and the top-n. Positions already reported (before a preemption) are not reported again."""
        out: dict[str, list[dict[int, float]]] = {}
        starts = None
        for i, s in enumerate(output.scheduled):
            request = s.request
            n = request.sampling_params.prompt_logprobs
            if n is None:
                continue
            if starts is None:
                starts = batch.attn.query_start_loc.tolist()
            reported = request.prompt_logprobs
            assert reported is not None, "a request that asks for prompt logprobs keeps a list of them"
            first = len(reported) - 1  # the first position not reported yet
            lo = max(s.num_computed_tokens, first)
            hi = min(s.num_computed_tokens + s.num_new_tokens, request.num_prompt_tokens - 1)
            entries = []
            # Slices bound the [rows, vocab] logits a long prompt would otherwise make at once.
            for a in range(lo, hi, PROMPT_LOGPROBS_ROWS):
                b = min(a + PROMPT_LOGPROBS_ROWS, hi)
                rows = hidden[starts[i] + a - s.num_computed_tokens : starts[i] + b - s.num_computed_tokens]
                logprobs = self.model.compute_logits(rows).log_softmax(dim=-1)
                targets = torch.tensor(request.prompt_token_ids[a + 1 : b + 1], device=logprobs.device)
                chosen = logprobs.gather(1, targets[:, None])
                top = logprobs.topk(n, dim=-1)
                ids = torch.cat((targets[:, None], top.indices), dim=1).tolist()
                values = torch.cat((chosen, top.values), dim=1).tolist()
                entries += [dict(zip(i_row, v_row)) for i_row, v_row in zip(ids, values)]
            if entries:
                out[s.request_id] = entries
        return out

    def _emit_routing(self, output: SchedulerOutput, batch: _BatchInputs) -> None:
        """One ``moe.routed`` event: expert load per sparse layer, and each request's tokens' expert choices."""
        choices = torch.stack([block.last_expert_ids for _, block in self.moe_blocks])  # [L, T, k]
        num_experts = self.moe_blocks[0][1].num_experts
        counts = torch.stack([torch.bincount(layer.flatten(), minlength=num_experts) for layer in choices])
        starts = batch.attn.query_start_loc.tolist()
        per_request = {s.request_id: choices[:, a:b].tolist() for s, a, b in zip(output.scheduled, starts, starts[1:])}
        self.events.emit(
            MoERouted,
            layers=tuple(i for i, _ in self.moe_blocks),
            num_experts=num_experts,
            counts=tuple(tuple(row) for row in counts.tolist()),
            token_experts=per_request,
        )

    def _sample(self, logits: torch.Tensor, batch: _BatchInputs) -> tuple[dict, dict]:
        """Plain rows through the sampler; rows with drafts through the rejection sampler."""
        plain = [(s, r) for s, r in zip(batch.sampling_rows, batch.first_rows) if not s.spec_token_ids]
        verify = [(s, r) for s, r in zip(batch.sampling_rows, batch.first_rows) if s.spec_token_ids]
        sampled, logprobs = {}, {}
        if plain:
            rows = [s for s, _ in plain]
            plain_logits = logits if not verify else logits[[r for _, r in plain]]
            if all(argmax_only(s.request.sampling_params) for s in rows):
                sampled = {s.request_id: [t] for s, t in zip(rows, greedy_sample(plain_logits).tolist())}
            else:
                out = self.sampler(plain_logits, self._sampling_metadata(rows))
                sampled = {s.request_id: [t] for s, t in zip(rows, out.sampled_token_ids.tolist())}
                logprobs = self._logprobs(rows, out.logprobs)
        if verify:
            assert self.spec is not None, "drafts come only from a proposer"
            sampled.update(
                self.spec.rejection_sampler(
                    logits, [s for s, _ in verify], [r for _, r in verify], self._sampling_metadata
                )
            )
        return sampled, logprobs

    def prepare_inputs(self, output: SchedulerOutput) -> _BatchInputs:
        """The step's flat inputs: where every request decodes one token and samples it (the steady state, no
        proposer, on the CPU), by `DecodeInputs`; else `prepare_any_inputs`. Public so that it can be timed alone
        (bench profile): run again on an output this runner was given, it writes the same block table rows and
        returns the same inputs."""
        decodes = self.decode_inputs if self.spec is None else None
        batch = None if decodes is None else self._prepare_decodes(decodes, output)
        return batch if batch is not None else self.prepare_any_inputs(output)

    def _prepare_decodes(self, inputs: DecodeInputs, output: SchedulerOutput) -> _BatchInputs | None:
        """A step of one sampled token per request in plain Python, into `DecodeInputs`'s buffers; None where a
        request runs more than one token, drafts or does not sample. Every numpy or torch call a step makes costs
        tens of microseconds right after the weights streamed through the caches; Python's own arithmetic, less."""
        bs = self.block_size
        rows, ids, positions, slots, blocks = [], [], [], [], 0
        for s in output.scheduled:
            pos = s.num_computed_tokens
            tokens = s.request.all_token_ids
            if s.num_new_tokens != 1 or not s.samples or s.spec_token_ids or pos >= len(tokens):
                return None
            rows.append(self.block_table.append(s.request_id, s.block_ids))
            ids.append(tokens[pos])
            positions.append(pos)
            slots.append(s.block_ids[pos // bs] * bs + pos % bs)
            blocks = max(blocks, len(s.block_ids))
        views = inputs.fill(ids, positions, slots, self.block_table.block_table_np, rows, blocks)
        input_ids, positions_t, slot_mapping, logits_idx, seq_lens, query_start_loc, tables = views
        attn = AttentionMetadata(slot_mapping, tables, seq_lens, query_start_loc)
        return _BatchInputs(input_ids, positions_t, attn, logits_idx, list(output.scheduled), list(range(len(rows))))

    def prepare_any_inputs(self, output: SchedulerOutput) -> _BatchInputs:
        """Any step's flat inputs: one Python pass over the requests, then positions, slots, query start locs and
        logits rows by numpy arithmetic over per-request counts, and one int64 plus one int32 array to the device
        (two host-to-device copies on an accelerator)."""
        rows, ids, counts, sampling_rows = self._scan_requests(output)
        starts, query_lens, num_logits, num_blocks = counts
        cu_query, cu_logits = np.cumsum(query_lens), np.cumsum(num_logits)
        positions = np.arange(cu_query[-1]) + np.repeat(starts - cu_query + query_lens, query_lens)
        slots = self.block_table.compute_slot_mapping(np.repeat(rows, query_lens), positions)
        # a draft tree's nodes (in the slots after their root's) sit at its position plus their depth, and see only
        # their ancestors
        tree_mask = None if self.spec is None else self.spec.tree_inputs(output.scheduled, positions, cu_query)
        logits_indices = np.arange(cu_logits[-1]) + np.repeat(cu_query - cu_logits, num_logits)
        block_tables = self.block_table.block_table_np[rows, : num_blocks.max()]
        i64 = torch.from_numpy(np.concatenate((ids, positions, slots, logits_indices))).to(self.device)
        i32 = torch.from_numpy(
            np.concatenate((starts + query_lens, [0], cu_query, block_tables.ravel()), dtype=np.int32)
        ).to(self.device)
        num_tokens, num_reqs = len(positions), len(rows)
        input_ids, positions_t, slot_mapping, logits_idx = i64.split([num_tokens] * 3 + [len(logits_indices)])
        seq_lens, query_start_loc, tables = i32.split([num_reqs, num_reqs + 1, block_tables.size])
        attn = AttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=tables.view(block_tables.shape),
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            tree_mask=None if tree_mask is None else torch.from_numpy(tree_mask).to(self.device),
        )
        return _BatchInputs(
            input_ids=input_ids,
            positions=positions_t,
            attn=attn,
            logits_indices=logits_idx,
            sampling_rows=sampling_rows,
            first_rows=(cu_logits - num_logits)[num_logits > 0].tolist(),
        )

    def _scan_requests(self, output: SchedulerOutput) -> tuple[list[int], np.ndarray, np.ndarray, list]:
        """Per request, in batch order: its block table row (new block ids appended), its tokens this step,
        and [num_computed_tokens, num_new_tokens, logits rows, blocks] (as a [4, S] array); and the sampling
        requests."""
        rows: list[int] = []
        ids: list[int] = []
        counts: list[int] = []
        sampling_rows: list[ScheduledRequest] = []
        for s in output.scheduled:
            rows.append(self.block_table.append(s.request_id, s.block_ids))
            start, n = s.num_computed_tokens, s.num_new_tokens
            tokens = s.request.all_token_ids[start : start + n]
            ids += tokens
            ids += s.spec_token_ids[: n - len(tokens)]
            # a verify request samples at its last token and at each draft
            counts += (start, n, len(s.spec_token_ids) + 1 if s.samples else 0, len(s.block_ids))
            if s.samples:
                sampling_rows.append(s)
        # fromiter: numpy reads a list of ints faster this way than np.array or concatenate do
        ids_np = np.fromiter(ids, np.int64, len(ids))
        return rows, ids_np, np.fromiter(counts, np.int64, len(counts)).reshape(-1, 4).T, sampling_rows

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
            logits_inputs=LogitsInputs.from_requests([s.request for s in rows], dev),
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
                out[s.request_id] = [dict(zip(ids[i][: n + 1], values[i][: n + 1]))]
        return out
