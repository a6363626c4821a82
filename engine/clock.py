"""The engine's clock: wall time for a real executor, simulated time for the simulated one.

Everything that stamps a time the user reads (StepRecord.start_ns / end_ns, request.added's arrival_ns, a request's
metrics, a serving benchmark's arrivals) asks the engine's clock, so a simulated run shows the dashboards, traces and
serving metrics of the machine it simulates, on that machine's clock.
"""

from __future__ import annotations

import time


class Clock:
    """Wall time: `monotonic()` (s) for intervals and request metrics, `time_ns()` for stamps a trace shows,
    `sleep_until(t)` to wait for an arrival."""

    simulated = False

    def monotonic(self) -> float:
        return time.monotonic()

    def perf_counter(self) -> float:
        return time.perf_counter()

    def time_ns(self) -> int:
        return time.time_ns()

    def sleep_until(self, deadline: float) -> None:
        """Wait until monotonic() reaches `deadline`."""
        time.sleep(max(0.0, deadline - time.monotonic()))


class SimulatedClock(Clock):
    """Simulated time: it moves only when told (`advance`, or `sleep_until`, which returns at once). Owns the
    simulated seconds elapsed: `monotonic()` and `perf_counter()` are those seconds, and `time_ns()` counts them from
    the wall time of its creation, so a simulated trace's timestamps are plausible dates."""

    simulated = True

    def __init__(self) -> None:
        self._wall0_ns = time.time_ns()
        self.elapsed = 0.0

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"seconds: a clock cannot go back ({seconds})")
        self.elapsed += seconds

    def monotonic(self) -> float:
        # the elapsed seconds themselves, so that sleep_until(t) makes monotonic() == t exactly
        return self.elapsed

    def perf_counter(self) -> float:
        return self.elapsed

    def time_ns(self) -> int:
        return self._wall0_ns + round(self.elapsed * 1e9)

    def sleep_until(self, deadline: float) -> None:
        self.elapsed = max(self.elapsed, deadline)
