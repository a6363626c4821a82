"""Compile the Triton kernels for a GPU that is not here: every launch the wrappers make, specialised as the JIT
would specialise it on that GPU, compiled through ptxas for it, and not run.

The Triton interpreter forgives what a GPU compiler refuses (a variable that is int32 on one branch and int64 on
another, ...), and it cannot say how many variants a workload compiles. ``LaunchRecorder`` answers both on a
CPU: while it is active, ``kernel[grid](...)`` computes the launch's signature, constexprs and alignment
attributes with the target's backend (pointer alignment from ``data_ptr()``, integers equal to 1 or divisible by
16, exactly as ``JITFunction.run`` does), compiles each distinct variant once per process with
``triton.compile(ASTSource(...), target=...)`` and records it. Only meaningful with ``TRITON_INTERPRET`` unset
when ``kernels.triton`` was imported (interpreted kernels are not ``JITFunction`` s and are not intercepted).

It reaches into ``JITFunction``'s private helpers (``params``, ``_pack_args``, ``create_function_from_signature``):
pinned triton (3.7) only. The GPU check (``workbench/gpu_check.py``) counts variants from the JIT's own cache there.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime import jit

# Hopper (H100/H200): what the kernels target first. 132 SMs is the H100 SXM's count (an H200 has the same).
SM90 = GPUTarget("cuda", 90, 32)
SM90_NUM_SMS = 132


@dataclass(frozen=True)
class Variant:
    """One compiled specialisation of a kernel: what the JIT keys its cache on, in readable form."""

    kernel: str
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, Any], ...]
    attrs: tuple[tuple[str, str], ...]  # argument -> the alignment/equality facts the compiler was given

    def describe(self) -> str:
        """One line: the kernel, its constexprs and the attributes that made this variant."""
        consts = ", ".join(f"{k}={v}" for k, v in self.constexprs)
        attrs = ", ".join(f"{k}:{v}" for k, v in self.attrs)
        return f"{self.kernel}({consts}) [{attrs}]"


# Per process: a variant compiled once is not compiled again (each takes ~0.5 s through ptxas on a CPU).
_COMPILED: dict[tuple[Variant, GPUTarget], float] = {}


@dataclass
class LaunchRecorder:
    """Owns the launches seen while it is active (``with LaunchRecorder() as rec:``): each one specialised for
    ``target``, compiled there once per process (``compile=False``: only specialised) and recorded in order.
    Nothing runs: outputs the wrappers allocate stay as allocated."""

    target: GPUTarget = SM90
    compile: bool = True
    launches: list[Variant] = field(default_factory=list)
    failures: list[tuple[Variant, str]] = field(default_factory=list)  # a variant and why it did not compile
    compile_seconds: float = 0.0
    _saved_run: Any = None

    def __enter__(self) -> LaunchRecorder:
        self._saved_run = jit.JITFunction.run
        recorder = self

        def run(fn: jit.JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
            recorder._record(fn, args, kwargs)

        jit.JITFunction.run = run
        return self

    def __exit__(self, *exc: object) -> None:
        jit.JITFunction.run = self._saved_run

    @property
    def variants(self) -> set[Variant]:
        """The distinct variants launched while recording."""
        return set(self.launches)

    def variants_of(self, kernel: str) -> set[Variant]:
        """The distinct variants of one kernel (by its function name)."""
        return {v for v in self.launches if v.kernel == kernel}

    def _record(self, fn: jit.JITFunction, args: tuple, kwargs: dict) -> None:
        backend = make_backend(self.target)
        # The same binder JITFunction.run builds for the current device, built for the target instead.
        binder = jit.create_function_from_signature(fn.signature, fn.params, backend)
        kwargs = {"debug": False, **kwargs}
        bound_args, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, options)
        names = [p.name for p in fn.params]
        variant = Variant(
            kernel=fn.__name__,
            signature=tuple((k, v) for k, v in signature.items() if v != "constexpr"),
            constexprs=tuple((names[path[0]], value) for path, value in sorted(constexprs.items())),
            attrs=tuple((names[path[0]], str(value)) for path, value in sorted(attrs.items()) if value),
        )
        self.launches.append(variant)
        if not self.compile or (variant, self.target) in _COMPILED or variant in dict(self.failures):
            return
        start = time.perf_counter()
        try:
            triton.compile(ASTSource(fn, signature, constexprs, attrs), target=self.target, options=options.__dict__)
        except Exception as exc:  # noqa: BLE001 - every failure is reported, with its cause, after the workload
            self.failures.append((variant, _explain(exc)))
        else:
            _COMPILED[variant, self.target] = time.perf_counter() - start
        self.compile_seconds += time.perf_counter() - start


def _explain(exc: BaseException | None) -> str:
    """The exception and its causes, last line of each: Triton's CompilationError shows the source line, its
    cause says what is wrong there."""
    lines = []
    while exc is not None:
        lines.append("".join(traceback.format_exception_only(type(exc), exc)).strip())
        exc = exc.__cause__
    return "\n".join(lines)
