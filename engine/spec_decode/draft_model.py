"""The draft-model proposer: a small model with the target's tokenizer proposes k tokens autoregressively.

Its KV cache has its own tensors but the target's block ids: every step it runs over the same flattened
batch as the target (so its cache holds the same tokens, chunks and prefix hits included), then proposes
from each request's newest token into the lookahead slots the scheduler allocated. Positions past a
rejection are simply overwritten later, which keeps the cache consistent after accepts and rejects.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from engine.model.attention import AttentionMetadata, allocate_kv_caches
from engine.model.loader import resolve_model
from engine.model.registry import load_model
from engine.sample.sampler import exponential_noise
from engine.spec_decode.proposer import DraftRequest, Drafts, Proposer, TargetModel


class DraftModelProposer(Proposer):
    """Owns the draft model's weights and KV cache tensors; proposes drafts with their probabilities."""

    method = "draft_model"

    def __init__(self, path: Path, num_speculative_tokens: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, target_vocab_size: int,
                 default_generator: torch.Generator) -> None:
        self.model, config = load_model(path, dtype, device)
        if config.vocab_size != target_vocab_size:
            raise ValueError(f"speculative_config.model: the draft's vocabulary ({config.vocab_size}) differs from "
                             f"the target's ({target_vocab_size})")
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.device = device
        self.default_generator = default_generator
        self.kv_caches = allocate_kv_caches(self.model, num_blocks, block_size, dtype, device)

    @classmethod
    def from_config(cls, target: TargetModel) -> DraftModelProposer:
        config = target.config
        spec = config.speculative
        return cls(resolve_model(spec.model), spec.num_speculative_tokens, target.num_blocks, config.block_size,
                   config.torch_dtype, target.device, target.vocab_size, target.default_generator)

    def mirror(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> None:
        """Run the target's batch through the draft so its cache holds the same tokens."""
        self.model(input_ids, positions, attn, self.kv_caches)

    def propose(self, inputs: list[DraftRequest]) -> Drafts:
        """For each request, `num_drafts` tokens sampled from the draft (argmax at temperature 0), from its newest
        token on, and their draft distributions [num_drafts, V]."""
        live = list(range(len(inputs)))
        tokens = [[] for _ in inputs]
        probs: list[list[torch.Tensor]] = [[] for _ in inputs]
        current = [inp.token_ids[-1] for inp in inputs]
        for step in range(max((inp.num_drafts for inp in inputs), default=0)):
            live = [i for i in live if inputs[i].num_drafts > step]
            logits = self._decode([current[i] for i in live], [inputs[i] for i in live], step)
            drafted, dist = self._sample(logits, [inputs[i] for i in live])
            for row, i in enumerate(live):
                tokens[i].append(drafted[row])
                probs[i].append(dist[row])
                current[i] = drafted[row]
        return {inp.request_id: (t, torch.stack(p) if p else torch.empty(0))
                for inp, t, p in zip(inputs, tokens, probs)}

    def _decode(self, token_ids: list[int], inputs: list[DraftRequest], step: int) -> torch.Tensor:
        bs = self.block_size
        positions = [len(inp.token_ids) - 1 + step for inp in inputs]  # the newest token's, then each draft's
        max_blocks = max(len(inp.block_ids) for inp in inputs)
        tables = np.zeros((len(inputs), max_blocks), dtype=np.int32)
        for i, inp in enumerate(inputs):
            tables[i, :len(inp.block_ids)] = inp.block_ids
        slots = [int(tables[i, p // bs]) * bs + p % bs for i, p in enumerate(positions)]
        dev = self.device
        attn = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=torch.from_numpy(tables).to(dev),
            seq_lens=torch.tensor([p + 1 for p in positions], dtype=torch.int32, device=dev),
            query_start_loc=torch.arange(len(inputs) + 1, dtype=torch.int32, device=dev),
        )
        hidden = self.model(torch.tensor(token_ids, device=dev), torch.tensor(positions, device=dev), attn,
                            self.kv_caches)
        return self.model.compute_logits(hidden)

    def _sample(self, logits: torch.Tensor, inputs: list[DraftRequest]) -> tuple[list[int], torch.Tensor]:
        temps = torch.tensor([max(inp.temperature, 1e-5) for inp in inputs], device=logits.device)
        dist = torch.softmax(logits / temps[:, None], dim=-1)
        greedy = torch.tensor([inp.temperature < 1e-5 for inp in inputs], device=logits.device)
        generators = {i: inp.generator for i, inp in enumerate(inputs) if inp.generator is not None}
        sampled = (dist / exponential_noise(dist, generators, self.default_generator)).argmax(dim=-1)
        return torch.where(greedy, logits.argmax(dim=-1), sampled).tolist(), dist
