"""The benchmark harness (workbench/bench/timing.py), the settings a result keeps (report.run_settings) and the one
reader of /proc/cpuinfo (kernels/cpu/cpuinfo.py). No timed assertions: only what is called, when, and what comes
back."""

from __future__ import annotations

import os

from kernels.cpu.cpuinfo import VECTOR_UNITS, cpu_info, read_cpuinfo
from workbench.bench.report import machine_info, run_settings
from workbench.bench.timing import LoadAverage, alternate, load_line, medians, timed


def test_timed_leaves_the_warm_up_out_and_keeps_the_last_value() -> None:
    calls = []
    result = timed(lambda: calls.append(len(calls)) or len(calls), runs=3, warmup=2)
    assert calls == [0, 1, 2, 3, 4] and len(result.seconds) == 3  # two untimed, three timed
    assert result.last == 5 and result.median_s == sorted(result.seconds)[1]
    assert len(timed(lambda: None, runs=1, warmup=0).seconds) == 1


def test_the_sides_take_turns_run_by_run() -> None:
    calls = []
    sides = {"a": lambda: calls.append("a") or "A", "b": lambda: calls.append("b") or "B"}
    turns = [(t.run, t.side, t.value) for t in alternate(sides, runs=2)]
    assert calls == ["a", "b", "a", "b"]
    assert turns == [(0, "a", "A"), (0, "b", "B"), (1, "a", "A"), (1, "b", "B")]


def test_medians_are_per_key() -> None:
    assert medians([{"x": 1.0, "y": 30.0}, {"x": 3.0, "y": 10.0}, {"x": 2.0, "y": 20.0}]) == {"x": 2.0, "y": 20.0}


def test_the_load_average_is_kept_and_said_one_way() -> None:
    load = LoadAverage().done()
    assert set(load) == {"before", "after"} and all(len(v) == 3 for v in load.values())
    assert load_line({}) == ""
    cores = os.cpu_count()
    quiet = load_line({"load_average": {"before": [0.5, 0.4, 0.3], "after": [0.6, 0.5, 0.4]}})
    said = "Load average (1 / 5 / 15 min) before: 0.50 / 0.40 / 0.30, after: 0.60 / 0.50 / 0.40"
    assert quiet == f"{said}, on {cores} cores"
    busy = load_line({"load_average": {"before": [cores + 1.0] * 3, "after": [0.0] * 3}})
    assert busy.endswith("other work shared the machine during these runs")


def test_a_result_keeps_its_run_functions_parameters_as_settings() -> None:
    def run(model="m", sizes=(1, 2), seed=0, path=None, engine_kwargs=None, log=print, progress=True) -> dict:
        engine_kwargs = dict(engine_kwargs or {})
        scratch = 1  # a local that is no parameter
        return run_settings(run, locals(), omit=("path",), seed=seed + scratch, extra="x")

    assert run() == {"sizes": [1, 2], "seed": 1, "engine_kwargs": {}, "extra": "x"}


def test_one_reader_of_cpuinfo() -> None:
    text = "processor\t: 0\nmodel name\t: Some CPU 9000\nflags\t\t: fpu sse2 avx2 fma avx512f\n\nprocessor\t: 1\n"
    cpu = read_cpuinfo(text)
    assert cpu.model == "Some CPU 9000" and cpu.flags_line == "flags\t\t: fpu sse2 avx2 fma avx512f"
    assert {"avx2", "fma", "avx512f"} <= cpu.flags and "flags" not in cpu.flags
    assert cpu.vector_units == ["avx2", "fma", "avx512f"]  # in VECTOR_UNITS' order
    bare = read_cpuinfo("")  # no /proc/cpuinfo: the platform's processor name stands in
    assert bare.model and bare.vector_units == []
    assert cpu_info() is cpu_info() and set(cpu_info().vector_units) <= set(VECTOR_UNITS)


def test_the_machine_lines_say_which_cpu_kernels_ran(monkeypatch) -> None:
    # an AVX2 run on an AVX-512 CPU lists the same vector units as a native one: only this line tells them apart
    monkeypatch.delenv("WORKBENCH_CPU_OPS", raising=False)
    monkeypatch.setenv("WORKBENCH_CPU_ISA", "avx2")
    assert "WORKBENCH_CPU_ISA=avx2" in machine_info()["CPU kernels"]
    monkeypatch.setenv("WORKBENCH_CPU_ISA", "native")
    assert "native" in machine_info()["CPU kernels"]
    monkeypatch.setenv("WORKBENCH_CPU_OPS", "0")
    assert "WORKBENCH_CPU_OPS=0" in machine_info()["CPU kernels"]
