"""The Dashboard: one EngineState, updated once per record, and every view drawn from it and the record's delta."""

from __future__ import annotations

from collections.abc import Iterable

import panel as pn

from engine.events import EngineSnapshot, StepRecord
from workbench.state import EngineState
from workbench.views.base import View
from workbench.views.grammar import GrammarView
from workbench.views.journey import BlockLifeView, Explanations, JourneyView
from workbench.views.kv_blocks import KVBlockMap
from workbench.views.kv_transfer import KVTransferView
from workbench.views.metrics import MetricsView
from workbench.views.moe import MoEView
from workbench.views.parallel import ParallelView
from workbench.views.prefix import PrefixCacheView
from workbench.views.requests import RequestsView
from workbench.views.spec import SpecDecodeView
from workbench.views.timeline import SchedulerTimeline

PER_REPLICA = (
    "**{title}: per replica, not available with data parallelism.** This dashboard follows the "
    "data-parallel front end of {n} replicas; each replica is a whole engine with its own scheduler and KV "
    "cache, and the front end sees the routing, each replica's load and the requests' tokens, not a "
    "replica's steps or blocks. The Parallelism tab shows each replica's waiting and running requests and "
    "every routing decision; the Requests table and the Metrics tab cover all replicas."
)


class Dashboard:
    """Owns one EngineState and every view drawn from it; feeds them records and lays them out as tabs (the
    Experts tab joins them at the first routed step of a mixture-of-experts model, and leaves at a reset). Drawing
    a data-parallel front end's records (`data_parallel_size` > 1 at `reset`), the views that need one engine's
    steps or blocks (`per_replica`) say so in place of their content. A request clicked (in the requests table or
    on the timeline) opens its journey, a block clicked on the block map its life, both from `explanations`
    (a live engine's, once attached; else the records fed here, folded only for what is opened)."""

    def __init__(self, budget: int | None = None, num_blocks: int | None = None) -> None:
        self.state = EngineState()
        self.timeline = SchedulerTimeline(self.state, budget)
        self.kv_blocks = KVBlockMap(self.state, num_blocks)
        self.prefix = PrefixCacheView(self.state)
        self.requests = RequestsView(self.state)
        self.metrics = MetricsView(self.state)
        self.grammar = GrammarView(self.state)
        self.spec = SpecDecodeView(self.state)
        self.kv_transfer = KVTransferView(self.state)
        self.moe = MoEView(self.state)
        self.parallel = ParallelView(self.state)
        self.explanations = Explanations()
        self.journey = JourneyView(self.state, self.explanations)
        self.block_life = BlockLifeView(self.state, self.explanations)
        self.timeline.on_request = self.journey.open
        self.kv_blocks.on_block = self.block_life.open
        self.views: list[View] = [
            self.timeline,
            self.kv_blocks,
            self.prefix,
            self.requests,
            self.metrics,
            self.grammar,
            self.spec,
            self.kv_transfer,
            self.moe,
            self.parallel,
            self.journey,
            self.block_life,
        ]
        self._tab_sets: list[pn.Tabs] = []  # every layout tabs() built: each gains the Experts tab
        # what a data-parallel front end's records cannot fill: each replica's scheduler steps, blocks, prefix
        # lookups, grammar masks, drafts, transfers
        self.per_replica: list[View] = [
            self.timeline,
            self.kv_blocks,
            self.prefix,
            self.grammar,
            self.spec,
            self.kv_transfer,
            self.journey,
            self.block_life,
        ]
        self.notices = {
            view: pn.pane.Alert("", alert_type="warning", visible=False, sizing_mode="stretch_width")
            for view in self.per_replica
        }
        self.data_parallel_size = 1
        self.requests.table.param.watch(self._select_request, "selection")

    def _select_request(self, event) -> None:
        """A row picked in the requests table opens that request's journey and draws its block table on the block
        map."""
        if event.new:
            rid = self.requests.table.value.iloc[event.new[0]]["request_id"]
            self.journey.open(rid)
            if rid in self.kv_blocks.select.options:
                self.kv_blocks.select.value = rid

    def extend(self, records: Iterable[StepRecord]) -> None:
        """Fold records into the state and queue each view's changes; then send them, one message per source."""
        records = list(records)
        self.explanations.observe(records)
        for record in records:
            delta = self.state.apply(record)
            for view in self.views:
                view.render(record, delta)
        for view in self.views:
            view.flush()
        self._show_moe(not self.moe.empty.is_empty)

    def _show_moe(self, show: bool) -> None:
        # a dense model never routes: its dashboard keeps the tabs it always had
        for tabs in self._tab_sets:
            if show and self.moe.panel not in tabs.objects:
                tabs.append((self.moe.title, self.moe.panel))
            elif not show and self.moe.panel in tabs.objects:
                tabs.remove(self.moe.panel)

    def update(self, record: StepRecord) -> None:
        self.extend([record])

    def reset(
        self,
        budget: int | None = None,
        num_blocks: int | None = None,
        snapshot: EngineSnapshot | None = None,
        data_parallel_size: int = 1,
    ) -> None:
        """Back to no step, or to an engine's `snapshot` (a view attached mid-run); `budget` and `num_blocks`
        describe the engine drawn from now on (a snapshot knows its number of blocks); `data_parallel_size` > 1:
        it is a data-parallel front end (the per-replica views say they are not available)."""
        self.show_data_parallel(data_parallel_size)
        if not self.explanations.live:
            self.explanations.clear()
        if snapshot is None:
            self.state.clear()
        else:
            self.state.load(snapshot)
            num_blocks = snapshot.kv.total
        self.timeline.budget = budget
        for view in self.views:
            view.reset()
            view.show_state()
            view.flush()
        self.kv_blocks.show_blocks(num_blocks)
        self._show_moe(False)

    def show_data_parallel(self, data_parallel_size: int) -> None:
        """Draw a data-parallel front end (`data_parallel_size` > 1: each per-replica view gives way to its notice)
        or one engine (1: the views themselves)."""
        self.data_parallel_size = data_parallel_size
        dp = data_parallel_size > 1
        for view, notice in self.notices.items():
            notice.object = PER_REPLICA.format(title=view.title or type(view).__name__, n=data_parallel_size)
            notice.visible, view.panel.visible = dp, not dp

    def _held(self, view: View) -> pn.Column:
        """A per-replica view with its notice above it (one of the two is visible)."""
        return pn.Column(self.notices[view], view.panel, sizing_mode="stretch_width")

    def tabs(self) -> pn.Tabs:
        overview = pn.Column(
            pn.Row(self._held(self.timeline), self._held(self.kv_blocks), sizing_mode="stretch_width"),
            self.requests,
            pn.Row(self._held(self.journey), self._held(self.block_life), sizing_mode="stretch_width"),
            sizing_mode="stretch_width",
        )
        tabs = pn.Tabs(
            ("Overview", overview),
            (self.prefix.title, self._held(self.prefix)),
            (self.metrics.title, self.metrics),
            (self.grammar.title, self._held(self.grammar)),
            (self.spec.title, self._held(self.spec)),
            (self.kv_transfer.title, self._held(self.kv_transfer)),
            (self.parallel.title, self.parallel),
            sizing_mode="stretch_width",
        )
        self._tab_sets.append(tabs)
        if not self.moe.empty.is_empty:
            tabs.append((self.moe.title, self.moe.panel))
        return tabs
