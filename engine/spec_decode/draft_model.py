"""The draft-model proposer: a small model with the target's tokenizer proposes k tokens autoregressively.

Its KV cache has its own tensors but the target's block ids: every step it runs over the same flattened
batch as the target (so its cache holds the same tokens, chunks and prefix hits included), then proposes
from each request's newest token into the lookahead slots the scheduler allocated. Positions past a
rejection are simply overwritten later, which keeps the cache consistent after accepts and rejects.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.model.attention import allocate_kv_caches
from engine.model.loader import resolve_model
from engine.model.registry import load_model
from engine.spec_decode.proposer import (
    DraftRequest,
    Drafts,
    Proposer,
    TargetBatch,
    TargetModel,
    chain_drafts,
    decode_metadata,
    sample_drafts,
)


class DraftModelProposer(Proposer):
    """Owns the draft model's weights and KV cache tensors; proposes drafts with their probabilities."""

    method = "draft_model"
    drafts_have_probs = True

    def __init__(
        self,
        path: Path,
        num_speculative_tokens: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        target_vocab_size: int,
        default_generator: torch.Generator,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        """`kv_cache_dtype`: how the draft's K and V are stored (none: as its weights, `dtype`)."""
        self.model, config = load_model(path, dtype, device)
        if config.vocab_size != target_vocab_size:
            raise ValueError(
                f"speculative_config.model: the draft's vocabulary ({config.vocab_size}) differs from "
                f"the target's ({target_vocab_size})"
            )
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.device = device
        self.default_generator = default_generator
        self.kv_caches = allocate_kv_caches(self.model, num_blocks, block_size, kv_cache_dtype or dtype, device)

    @classmethod
    def from_config(cls, target: TargetModel) -> DraftModelProposer:
        config, spec = target.config, target.speculative
        if spec.model is None:  # SpeculativeConfig.from_dict refuses draft_model without one
            raise ValueError("speculative_config.model: a draft model name or path is required for draft_model")
        return cls(
            resolve_model(spec.model),
            spec.num_speculative_tokens,
            target.num_blocks,
            config.block_size,
            config.torch_dtype,
            target.device,
            target.vocab_size,
            target.default_generator,
            config.kv_cache_torch_dtype,
        )

    def mirror(self, batch: TargetBatch) -> None:
        """Run the target's batch through the draft so its cache holds the same tokens."""
        self.model(batch.input_ids, batch.positions, batch.attn, self.kv_caches)

    def propose(self, inputs: list[DraftRequest]) -> Drafts:
        """For each request, `num_drafts` tokens sampled from the draft (argmax at temperature 0), from its newest
        token on, and their draft distributions [num_drafts, V]."""

        def draft(live: list[int], tokens: list[int], step: int) -> tuple[list[int], torch.Tensor]:
            live_inputs = [inputs[i] for i in live]
            return sample_drafts(self._decode(tokens, live_inputs, step), live_inputs, self.default_generator)

        return chain_drafts(inputs, draft)

    def _decode(self, token_ids: list[int], inputs: list[DraftRequest], step: int) -> torch.Tensor:
        positions = [len(inp.token_ids) - 1 + step for inp in inputs]  # the newest token's, then each draft's
        attn = decode_metadata(inputs, positions, self.block_size, self.device)
        hidden = self.model(
            torch.tensor(token_ids, device=self.device),
            torch.tensor(positions, device=self.device),
            attn,
            self.kv_caches,
        )
        return self.model.compute_logits(hidden)
