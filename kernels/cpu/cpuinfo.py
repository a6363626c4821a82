"""What this machine's CPU is, read from /proc/cpuinfo once for everyone: the C++ ops' build (its cache key and
whether AVX2 is there), the benchmarks' machine description and the test session's machine line."""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path

# The vector units a timing of the kernels depends on, in the order a machine line names them.
VECTOR_UNITS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile")


@dataclass(frozen=True)
class CPUInfo:
    """The CPU's marketing name and its /proc/cpuinfo flags line verbatim (the build cache hashes exactly that
    text, so a build made before this reader existed is still found)."""

    model: str
    flags_line: str

    @property
    def flags(self) -> frozenset[str]:
        """The instruction sets the flags line names."""
        return frozenset(self.flags_line.partition(":")[2].split())

    @property
    def vector_units(self) -> list[str]:
        """The VECTOR_UNITS this CPU has."""
        return [unit for unit in VECTOR_UNITS if unit in self.flags]


def read_cpuinfo(text: str) -> CPUInfo:
    """A CPUInfo from the text of /proc/cpuinfo (the first processor's lines; every core of a machine is alike);
    the processor's name from `platform` stands in for a line the text lacks."""
    lines = text.splitlines()
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)
    flags = next((line for line in lines if line.startswith("flags")), None)
    fallback = platform.processor()
    return CPUInfo(model or fallback or "unknown", flags or fallback)


@functools.cache
def cpu_info() -> CPUInfo:
    """This machine's CPUInfo (read once; from `platform` alone where there is no /proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    return read_cpuinfo(text)
