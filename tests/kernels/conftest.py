"""The kernel tests run the Triton kernels on CPU tensors under the Triton interpreter.

Triton decides interpreted or compiled when ``@triton.jit`` decorates a function: its own
``triton.language`` helpers when ``triton`` is first imported, our kernels when
``kernels.triton`` is. So TRITON_INTERPRET is set here, at collection, before either is
imported, and stays set: nothing else in the suite launches Triton on CPU.
"""

import importlib
import os
import sys
from types import ModuleType

import pytest

os.environ["TRITON_INTERPRET"] = "1"

_TRITON_MODULES = (
    "kernels.triton.attention",
    "kernels.triton.cache",
    "kernels.triton.rejection",
    "kernels.triton.tree_attention",
    "kernels.triton",
)


@pytest.fixture(scope="session")
def triton_kernels() -> ModuleType:
    """``kernels.triton`` with interpreted kernels; re-imported if it was imported for the GPU first."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.standard.cdiv, InterpretedFunction):
        pytest.fail(
            "triton was imported before TRITON_INTERPRET=1 was set (its tl helpers are compiled, not "
            "interpreted): run `TRITON_INTERPRET=1 pytest ...` or these tests in their own process"
        )
    import kernels.triton

    if not isinstance(kernels.triton.attention._unified_attention_kernel, InterpretedFunction):
        for name in _TRITON_MODULES:
            importlib.reload(sys.modules[name])
    return kernels.triton
