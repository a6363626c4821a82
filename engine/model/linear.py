"""Linear layers whose weights are stored as the engine is told: float32, bfloat16, or int8 with a scale per
output row. What each computes is kernels.reference.linear's: float32 exact; bfloat16 weights meet the input rounded
to bfloat16 (AVX512-BF16's dot product); int8 is W8A8, the input quantized to int8 in blocks of 32 columns as
llama.cpp's Q8_0 does (VNNI or AVX2 integer dot products). The C++ kernels stream the weights once per step."""

from __future__ import annotations

import torch
from torch import nn

import kernels


class Linear(nn.Module):
    """Owns one layer's weight ``[out, in]`` as stored (and its per-row scale when int8), its bias, and, once
    `pack` has run, the weight's second copy as the CPU GEMM's panels."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.weight_scale: torch.Tensor | None = None
        self.weight_packed: torch.Tensor | None
        self.register_buffer("weight_packed", None, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, self.weight, self.weight_scale, self.bias, self.weight_packed)

    def parts(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """The weight as stored, its per-row scale (int8), its bias and its packed panels: what a kernel given the
        whole layer takes."""
        return self.weight, self.weight_scale, self.bias, self.weight_packed

    def pack(self) -> None:
        """Keep the weight also in the panels that the CPU GEMM would otherwise pack from it at every call
        (kernels.pack_gemm_weight), or none where no GEMM takes it. Over them the GEMM takes a linear from a few
        rows (kernels/cpu/linear.cpp's PACKED_*_MIN_ROWS); the weight stays as stored for the rest: a call of one
        row streams it as it is, and others (a tied embedding, the draft heads) read it."""
        self.weight_packed = kernels.pack_gemm_weight(self.weight.data)

    def store(self, dtype: torch.dtype, quantization: str | None = None) -> None:
        """Keep the (loaded, full-precision) weight as `dtype`, or as int8 with a scale per output row (W8A8)."""
        weight = self.weight.data
        if quantization == "int8":
            scale = weight.float().abs().amax(dim=1).clamp_min(1e-12) / 127.0
            self.weight = nn.Parameter(torch.round(weight.float() / scale[:, None]).to(torch.int8), requires_grad=False)
            self.weight_scale = scale
        else:
            self.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
        if self.weight_packed is not None:
            self.pack()  # panels of the weight as it was before

    def extra_repr(self) -> str:
        quant = ", int8 weights" if self.weight_scale is not None else ""
        return f"in={self.in_features}, out={self.out_features}, {self.weight.dtype}{quant}"


class RowParallelLinear(Linear):
    """vLLM's RowParallelLinear: this rank's columns of the weight ``[out, in / tp]`` (the input arrives already
    split: heads from attention, columns of the MLP's intermediate), so each rank computes a partial sum of the
    full output and one all-reduce adds them. The bias is added by rank 0 only, so it counts once in the sum.
    Column-parallel layers need no class of their own here: a rank's q/k/v or gate/up rows are an ordinary
    `Linear` whose loader reads only that rank's slice (LlamaForCausalLM.load_weights)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from engine.distributed.parallel_state import get_tp_group

        tp = get_tp_group()
        out = kernels.linear(x, self.weight, self.weight_scale, self.bias if tp.rank == 0 else None, self.weight_packed)
        return tp.all_reduce(out)
