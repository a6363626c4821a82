"""Build and load the C++ CPU ops (kernels/cpu/*.cpp, sharing vec.h) with torch.utils.cpp_extension.

The build is cached per machine, keyed by the sources, torch's version, the CPU's instruction sets (it is
compiled with -march=native: a build from another CPU could use instructions this one lacks) and the ISA asked for:
WORKBENCH_CPU_ISA=avx2 builds the AVX2 kernels on an AVX-512 CPU (-mno-avx512f), so one machine tests and times
both paths. `make lab` and
`make test` build it at set-up (`python -m kernels.cpu.build`, about a minute); a first use builds it too. With no
compiler, or WORKBENCH_CPU_OPS=0, `available()` is False and the torch references run.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
import warnings
from pathlib import Path

import torch

from kernels.cpu.cpuinfo import cpu_info

FOLDER = Path(__file__).parent
# What each WORKBENCH_CPU_ISA builds with on top of -march=native: "native" all the CPU has; "avx2" no AVX-512 (what
# an AVX2-only CPU runs: the kernels' #if __AVX512F__ / __AVX512BF16__ / __AVX512VNNI__ branches compiled out).
ISA_FLAGS = {"native": [], "avx2": ["-mno-avx512f"]}


def sources() -> list[Path]:
    """The op sources, in a fixed order (ops.cpp declares the library; the others add to it with
    TORCH_LIBRARY_FRAGMENT)."""
    return sorted(FOLDER.glob("*.cpp"))


def isa() -> str:
    """The instruction sets asked for: WORKBENCH_CPU_ISA, "native" unless set."""
    name = os.environ.get("WORKBENCH_CPU_ISA", "native")
    if name not in ISA_FLAGS:
        raise ValueError(f"WORKBENCH_CPU_ISA={name!r}: must be one of {sorted(ISA_FLAGS)}")
    return name


def has_isa(flag: str) -> bool:
    """Whether the build uses `flag` (a /proc/cpuinfo name such as avx512_bf16): the CPU has it and WORKBENCH_CPU_ISA
    does not compile it out."""
    return flag in cpu_info().flags and not (isa() == "avx2" and flag.startswith("avx512"))


def build_name() -> str:
    """The build's name: a hash of the sources and headers, torch's version, the CPU's flags line and the ISA asked
    for (the build uses them all)."""
    files = sources() + sorted(FOLDER.glob("*.h"))
    key = b"".join(f.read_bytes() for f in files) + torch.__version__.encode() + cpu_info().flags_line.encode()
    suffix = "" if isa() == "native" else "_" + isa()
    return "workbench_cpu_" + hashlib.sha256(key).hexdigest()[:12] + suffix


def build_directory(name: str) -> Path:
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


def load_ops(name: str) -> None:
    """Load the built library, building it first if no finished build is there.

    torch's `load()` takes a lock file in the build folder on every call, even with nothing to build, and a process
    killed while it holds it leaves the file behind: every later `load()` then waits on it forever (a killed
    worker did that to every process started after it). So a finished build, marked by a stamp written after it,
    is loaded directly, and builds are serialised by a lock the kernel releases when its holder dies.
    """
    from filelock import FileLock
    from torch.utils.cpp_extension import load

    folder = build_directory(name)
    library, stamp = folder / f"{name}.so", folder / "built"
    if not (stamp.is_file() and library.is_file()):
        with FileLock(str(folder) + ".lock"):
            if not stamp.is_file():  # no other process finished it while we waited
                # every build holds the lock taken above: a torch lock file seen now was left by a dead one
                (folder / "lock").unlink(missing_ok=True)
                load(
                    name=name,
                    sources=[str(f) for f in sources()],
                    extra_cflags=["-O3", "-march=native", *ISA_FLAGS[isa()], "-fopenmp"],
                    extra_ldflags=["-fopenmp"],
                    is_python_module=False,
                    verbose=False,
                )
                stamp.write_text(name)
                return
    torch.ops.load_library(str(library))


@functools.cache
def available() -> bool:
    """Whether torch.ops.workbench_cpu is loaded (built now if needed)."""
    if os.environ.get("WORKBENCH_CPU_OPS", "1") == "0" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    if not {"avx2", "fma"} <= cpu_info().flags:
        return False
    # ninja, which the build runs, is installed beside this interpreter (a venv's bin may not be on PATH)
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    try:
        load_ops(build_name())
    except Exception as exc:  # no compiler, no ninja, a failed build: the references still run, slower
        warnings.warn(
            f"kernels.cpu: the C++ CPU ops could not be built ({type(exc).__name__}: {exc}); the torch "
            "reference kernels run instead. Install a C++ compiler (Debian: build-essential).",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    from kernels.cpu.fake import register

    register()  # the ops' output shapes, for torch.compile
    return True


if __name__ == "__main__":
    print(f"kernels.cpu: {'built' if available() else 'NOT built'} ({build_name()}, ISA {isa()})")
