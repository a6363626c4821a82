"""The dashboard views, each a Panel component that reads one EngineState and each record's StepDelta, and the
Dashboard (workbench.views.dashboard) that feeds them all from one state."""

from __future__ import annotations

from workbench.state import EngineState
from workbench.views.base import View, ensure_extension
from workbench.views.dashboard import Dashboard
from workbench.views.grammar import GrammarView
from workbench.views.kv_blocks import KVBlockMap
from workbench.views.kv_transfer import KVTransferView
from workbench.views.metrics import MetricsView
from workbench.views.moe import MoEView
from workbench.views.parallel import ParallelView
from workbench.views.prefix import PrefixCacheView
from workbench.views.requests import RequestsView
from workbench.views.spec import SpecDecodeView
from workbench.views.timeline import SchedulerTimeline

__all__ = [
    "Dashboard",
    "View",
    "SchedulerTimeline",
    "KVBlockMap",
    "PrefixCacheView",
    "RequestsView",
    "MetricsView",
    "GrammarView",
    "SpecDecodeView",
    "KVTransferView",
    "MoEView",
    "ParallelView",
    "EngineState",
    "ensure_extension",
]
