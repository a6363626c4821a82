"""Triton kernels with the signatures of ``kernels.reference``: the CUDA path of ``kernels``.

They run on CPU tensors only under the Triton interpreter (``TRITON_INTERPRET=1`` set before
this package is first imported), which is how the tests check them against the references.
bf16 and fp16 inputs are accepted; softmax statistics and accumulators are fp32.
"""

from kernels.triton.attention import paged_attention
from kernels.triton.cache import store_kvcache
from kernels.triton.rejection import rejection_sample
from kernels.triton.tree_attention import tree_attention

__all__ = ["paged_attention", "rejection_sample", "store_kvcache", "tree_attention"]
