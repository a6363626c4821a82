"""The embedding split by vocabulary over the tensor-parallel ranks (vLLM's VocabParallelEmbedding).

Each rank holds rows ``[rank * V_p, (rank + 1) * V_p)`` of the table, where ``V_p = ceil(V / tp)`` (the last
rank's rows past the vocabulary are zero padding, as vLLM pads). A token's vector is looked up by the rank holding
it; the others contribute zeros, and an all-reduce sums them. The LM head, tied or not, is split the same way: each
rank computes its share of the logits and they are gathered (`LlamaForCausalLM.compute_logits`).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.distributed.parallel_state import get_tp_group


def padded_vocab_per_rank(vocab_size: int, tp_size: int) -> int:
    """Rows of the vocabulary one rank holds: the vocabulary split evenly, rounded up."""
    return -(-vocab_size // tp_size)


class VocabParallelEmbedding(nn.Module):
    """Owns this rank's rows of the embedding table ``[V_p, hidden]`` and the range of token ids they cover."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        tp = get_tp_group()
        self.num_embeddings = num_embeddings
        self.rows = padded_vocab_per_rank(num_embeddings, tp.size)
        self.start = tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, embedding_dim), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.float() if out.dtype != torch.float32 and out.device.type == "cpu" else out
        out.masked_fill_(outside[:, None], 0.0)
        return get_tp_group().all_reduce(out)

    def extra_repr(self) -> str:
        return f"rows {self.start}..{self.start + self.rows} of {self.num_embeddings}, {self.weight.dtype}"
