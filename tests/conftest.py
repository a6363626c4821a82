"""Shared fixtures: the registry models, resolved (and built on first use) once per session."""

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The converted SmolLM2-135M-Instruct folder (about 20 s the first time on a machine)."""
    from engine.model.loader import resolve_model

    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    """The deterministic tiny random Llama folder (SmolLM2's tokenizer)."""
    from engine.model.loader import resolve_model

    return resolve_model("tiny-llama")


@pytest.fixture(scope="session", autouse=True)
def tests_leave_tracked_files_alone():
    """No test may write into the repository's docs or notebooks (screenshots, benchmark tables, executed
    notebooks go to temporary folders; `make screenshots` and `--write-docs` write there on purpose)."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    listed = subprocess.run(["git", "ls-files", "docs", "notebooks"], cwd=root, capture_output=True, text=True)
    paths = [root / p for p in listed.stdout.split()] if listed.returncode == 0 else []

    def stamps() -> dict[str, int]:
        return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in paths if p.exists()}

    before = stamps()
    yield
    shots = os.environ.get("WORKBENCH_SCREENSHOTS")  # `make screenshots` writes the README's images there
    changed = sorted(
        p
        for p, stamp in stamps().items()
        if before.get(p) != stamp and not (shots and (root / p).parent == Path(shots))
    )
    assert not changed, f"tests wrote into tracked files: {changed}"


# A test that hangs would hold CI until its limit and say nothing of where. Past this, every thread's stack is
# printed and the run ends (the slowest test takes under a minute on 2 quiet cores; the bound grows with the load).
TEST_WATCHDOG_S = float(os.environ.get("WORKBENCH_TEST_WATCHDOG_S", "600"))
_STDERR: list[int] = []  # a copy of the real stderr, taken before pytest captures fd 2 during tests


def pytest_collection_modifyitems(items) -> None:
    """A test that reads the real model (through the smollm2_path fixture) is slow, wherever it is: `-m "not slow"`
    leaves every one of them out, with no list to keep."""
    for item in items:
        if "smollm2_path" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


def pytest_configure(config) -> None:
    import sys

    _STDERR.append(os.dup(sys.__stderr__.fileno()))
    _share_the_cores()


def _share_the_cores() -> None:
    """Under pytest-xdist (`make test`: one worker per core), each worker's torch, and every kernel, server and
    subprocess it starts, uses its share of the cores: two workers each running two OpenMP threads on two cores
    would spin against each other at every parallel region."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # the processes it starts read it as torch loads
        import torch

        torch.set_num_threads(threads)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    import faulthandler

    if TEST_WATCHDOG_S > 0:
        # a machine busy with other work runs the test slower, it does not hang it: the bound stretches with how
        # oversubscribed the cores are as the test starts (a hang is caught all the same, only later)
        busy = max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
        # the main thread's stack names the test; the machine line at the session's start says where it ran
        faulthandler.dump_traceback_later(TEST_WATCHDOG_S * busy, exit=True, file=_STDERR[0])
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def machine_line() -> str:
    """The machine, for reading a CI log: the CPU, its vector units, its cores, how busy it is."""
    from kernels.cpu.cpuinfo import cpu_info

    cpu = cpu_info()
    return (
        f"machine: {cpu.model}, {os.cpu_count()} cores, {' '.join(cpu.vector_units) or 'no AVX2'}, "
        f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )


def pytest_sessionstart(session) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(machine_line())


def pytest_terminal_summary(terminalreporter) -> None:
    terminalreporter.write_line(machine_line())
