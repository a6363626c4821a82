"""Shared fixtures: the registry models, resolved (and built on first use) once per session."""

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
