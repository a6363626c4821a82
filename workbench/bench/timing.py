"""The benchmarks' harness: timed runs (warm-up, N runs, their median), sides that take turns run by run, per-metric
medians over runs' results, and the load average sampled and stated one way. The machine a timing depends on is
`report.machine_info`, its CPU from `kernels.cpu.cpuinfo` (the one reader of /proc/cpuinfo).

The machines these benchmarks run on are shared, and one run can differ from the next by tens of percent: so a
number is a median of runs, sides compared in one process take turns (a slow spell then falls on every side, not on
whichever ran all its runs then), and each report says the load average before and after."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")
K = TypeVar("K")


@dataclass(frozen=True)
class Timed(Generic[T]):
    """The timed calls of one function: each one's wall seconds, in call order, and what the last one returned."""

    seconds: list[float]
    last: T

    @property
    def median_s(self) -> float:
        """The median of the calls' seconds."""
        return statistics.median(self.seconds)


def timed(fn: Callable[[], T], runs: int, warmup: int = 1) -> Timed[T]:
    """`warmup` untimed calls of `fn` (first touch: page faults, the allocator's first requests and lazy set-up stay
    out of the timing), then `runs` (at least one) calls timed with time.perf_counter."""
    for _ in range(warmup):
        fn()
    seconds: list[float] = []
    values: list[T] = []
    for _ in range(runs):
        # the previous call's value is let go before this call runs: memory it held is free to reuse, as it is for
        # a caller that drops each value (a timing of fresh allocations would add page faults to the run)
        values.clear()
        t0 = time.perf_counter()
        values.append(fn())
        seconds.append(time.perf_counter() - t0)
    return Timed(seconds, values[-1])


@dataclass(frozen=True)
class Turn(Generic[K, T]):
    """One side's call in `alternate`: the run it belongs to (from 0), the side, its wall seconds, its value."""

    run: int
    side: K
    seconds: float
    value: T


def alternate(sides: Mapping[K, Callable[[], T]], runs: int) -> Iterator[Turn[K, T]]:
    """`runs` rounds in which every side is called once, in the mapping's order, each call timed with
    time.perf_counter; each Turn as it ends (so that a caller can say its progress). Warming up is the caller's:
    some warm their sides up on a smaller workload than the timed one."""
    for run in range(runs):
        for side, fn in sides.items():
            t0 = time.perf_counter()
            value = fn()
            yield Turn(run, side, time.perf_counter() - t0, value)


def medians(samples: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Per key, the median of its values over `samples` (one run's metrics each, all with the first one's keys)."""
    return {key: statistics.median(sample[key] for sample in samples) for key in samples[0]}


class LoadAverage:
    """The load average (1, 5, 15 min) when a benchmark starts, and with `done()` when it ends: work of others on
    the machine's cores slows what runs meanwhile, and the report says how much there was."""

    def __init__(self) -> None:
        self.before = list(os.getloadavg())

    def done(self) -> dict[str, list[float]]:
        """{"before": [...], "after": [...]}: what a result keeps as its `load_average`."""
        return {"before": self.before, "after": list(os.getloadavg())}


def load_line(result: dict[str, Any]) -> str:
    """A report's line for the load average its result kept (LoadAverage.done()), or "" where it kept none."""
    load = result.get("load_average")
    if not load:
        return ""
    before, after = (" / ".join(f"{x:.2f}" for x in load[k]) for k in ("before", "after"))
    cores = os.cpu_count() or 1
    busy = max(load["before"][0], load["after"][0]) > cores
    return f"Load average (1 / 5 / 15 min) before: {before}, after: {after}, on {cores} cores" + (
        ": above the core count, other work shared the machine during these runs" if busy else ""
    )
