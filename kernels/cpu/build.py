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
import time
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("ops.cpp")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def build_name() -> str:
    key = SOURCE.read_bytes() + torch.__version__.encode() + _cpu_flags().encode()
    return "workbench_cpu_" + hashlib.sha256(key).hexdigest()[:12]


# A build takes about a minute, several on a loaded machine. torch's build lock (a file beside the build) is never
# cleared by a build that died, and torch waits on it forever: one older than this was left behind.
STALE_LOCK_S = 15 * 60


def wait_for_other_build(name: str, stale_s: float = STALE_LOCK_S, poll_s: float = 1.0) -> None:
    """Wait while another process builds `name`; remove its lock once older than `stale_s` (a dead build)."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(name, verbose=False)) / "lock"
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > stale_s:
            warnings.warn(f"kernels.cpu: removing a build lock left {age / 60:.0f} min ago by a build that did not "
                          f"finish ({lock})", RuntimeWarning, stacklevel=3)
            lock.unlink(missing_ok=True)
            return
        time.sleep(poll_s)


@functools.cache
def available() -> bool:
    """Whether torch.ops.workbench_cpu is loaded (built now if needed)."""
    if os.environ.get("WORKBENCH_CPU_OPS", "1") == "0" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    if "avx2" not in _cpu_flags() or "fma" not in _cpu_flags():
        return False
    from torch.utils.cpp_extension import load

    # ninja, which the build runs, is installed beside this interpreter (a venv's bin may not be on PATH)
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    try:
        wait_for_other_build(build_name())
        load(name=build_name(), sources=[str(SOURCE)], extra_cflags=["-O3", "-march=native", "-fopenmp"],
             extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except Exception as exc:  # no compiler, no ninja, a failed build: the references still run, slower
        warnings.warn(f"kernels.cpu: the C++ CPU ops could not be built ({type(exc).__name__}: {exc}); the torch "
                      "reference kernels run instead. Install a C++ compiler (Debian: build-essential).",
                      RuntimeWarning, stacklevel=2)
        return False
    return True


if __name__ == "__main__":
    print(f"kernels.cpu: {'built' if available() else 'NOT built'} ({build_name()})")
