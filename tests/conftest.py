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
    changed = sorted(p for p, stamp in stamps().items()
                     if before.get(p) != stamp and not (shots and (root / p).parent == Path(shots)))
    assert not changed, f"tests wrote into tracked files: {changed}"
