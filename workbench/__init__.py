"""The workbench: what sits on top of the headless engine: the Panel dashboards (`Workbench`, `Replay`), step
traces, benchmarks and the `workbench` CLI. Panel is imported on first use of the dashboards, so the CLI
starts fast."""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "Workbench": "workbench.app",
    "Replay": "workbench.app",
    "ensure_extension": "workbench.views.base",
    "transfer_timeline": "workbench.views.kv_transfer",
    "transfer_timeline_figure": "workbench.views.kv_transfer",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'workbench' has no attribute {name!r}")


__all__ = ["Workbench", "Replay", "ensure_extension", "transfer_timeline", "transfer_timeline_figure"]
