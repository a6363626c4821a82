"""Build and load the C++ CPU ops (kernels/cpu/ops.cpp) with torch.utils.cpp_extension.

The build is cached per machine, keyed by the source, torch's version and the CPU's instruction sets (it is
compiled with -march=native: a build from another CPU could use instructions this one lacks). `make lab` and
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

SOURCE = Path(__file__).with_name("ops.cpp")


def build_name() -> str:
    """The build's name: a hash of the source, torch's version and the CPU's flags line (the build uses them all)."""
    key = SOURCE.read_bytes() + torch.__version__.encode() + cpu_info().flags_line.encode()
    return "workbench_cpu_" + hashlib.sha256(key).hexdigest()[:12]


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
                    sources=[str(SOURCE)],
                    extra_cflags=["-O3", "-march=native", "-fopenmp"],
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
    return True


if __name__ == "__main__":
    print(f"kernels.cpu: {'built' if available() else 'NOT built'} ({build_name()})")
