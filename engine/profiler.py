"""The torch profiler behind vLLM's `/start_profile` and `/stop_profile` (vllm/profiler/wrapper.py's
TorchProfilerWrapper, at this engine's size: one process steps the engine, so one profiler records it).

With `profiler_config` {"profiler": "torch", "torch_profiler_dir": DIR}, a session records every torch op the
engine's thread runs, each step inside a `record_function` marker named for its number (`step_12`), from start to
stop; stop writes the trace into DIR as torch's tensorboard_trace_handler names it
(`{host}_{pid}.engine.{ns}.pt.trace.json`, `.gz` with torch_profiler_use_gzip as vLLM's default): a Chrome trace
that Perfetto (ui.perfetto.dev) and chrome://tracing open. The profiler must be started and stopped on the thread
that steps the engine (Kineto refuses another): AsyncLLM runs both on its loop."""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from contextlib import AbstractContextManager, nullcontext

import torch

from engine.config import ProfilerConfig


class ProfilerAlreadyActiveError(RuntimeError):
    """A start while a session runs (vLLM's error, which its server answers with 409 Conflict)."""

    def __init__(self) -> None:
        super().__init__("A profiling session is already active. Call /stop_profile before starting another session.")


def validate_profile_prefix(prefix: str | None) -> None:
    """vLLM's rule for a session's file name prefix (it becomes part of a path: no separator may pass)."""
    if prefix is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", prefix):
        raise ValueError(
            "profile_prefix: must be 1-128 ASCII characters, start with a letter or number, and contain only "
            f"letters, numbers, '.', '_', or '-', got {prefix!r}"
        )


def step_marker_name(step: int) -> str:
    """The name of the marker around engine step `step` in a trace."""
    return f"step_{step}"


class EngineProfiler:
    """Owns one engine's torch profiler sessions: the settings, the session running (if any) and the thread that
    started it, and where each trace goes (`profile_prefix` names a session's file, as vLLM's)."""

    def __init__(self, config: ProfilerConfig, device: str) -> None:
        self.config = config
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.startswith("cuda"):  # vLLM's default activities on a CUDA platform
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._activities = activities
        self._profile: torch.profiler.profile | None = None
        self._thread: int | None = None
        self._name = ""

    @property
    def is_running(self) -> bool:
        return self._profile is not None

    def start(self, profile_prefix: str | None = None) -> None:
        """Start recording on this thread. Refused while a session runs (ProfilerAlreadyActiveError)."""
        if self._profile is not None:
            raise ProfilerAlreadyActiveError()
        validate_profile_prefix(profile_prefix)
        cfg = self.config
        profile = torch.profiler.profile(
            activities=self._activities,
            record_shapes=cfg.torch_profiler_record_shapes,
            profile_memory=cfg.torch_profiler_with_memory,
            with_stack=cfg.torch_profiler_with_stack,
            with_flops=cfg.torch_profiler_with_flops,
        )
        profile.start()
        worker = f"{socket.gethostname()}_{os.getpid()}.engine"
        self._profile, self._thread = profile, threading.get_ident()
        self._name = worker if profile_prefix is None else f"{profile_prefix}_{worker}"

    def stop(self) -> str | None:
        """Stop recording and write the trace; returns its path (None when no session ran: ignored, as vLLM)."""
        profile = self._profile
        if profile is None:
            return None
        if threading.get_ident() != self._thread:
            raise RuntimeError("stop_profile: the profiler must be stopped on the thread that started it")
        self._profile = None
        profile.stop()
        os.makedirs(self.config.torch_profiler_dir, exist_ok=True)
        name = f"{self._name}.{time.time_ns()}.pt.trace.json" + (".gz" if self.config.torch_profiler_use_gzip else "")
        path = os.path.join(self.config.torch_profiler_dir, name)
        profile.export_chrome_trace(path)
        return path

    def step_marker(self, step: int) -> AbstractContextManager[object]:
        """The marker around engine step `step` while a session records; nothing otherwise."""
        if self._profile is None:
            return nullcontext()
        return torch.profiler.record_function(step_marker_name(step))
