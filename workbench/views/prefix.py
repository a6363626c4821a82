"""The prefix cache: how many tokens each request found cached, the hit rate over time, and the cached chains."""

from __future__ import annotations

import panel as pn
from bokeh.models import ColumnDataSource, HoverTool, Range1d

from engine.events import StepRecord
from workbench.state import ChainNode, EngineState, Lookup, StepDelta
from workbench.views.base import View, counts_on, label_ticks, legend_above, new_figure

CACHED_NODE, EVICTED_NODE = "#31a354", "#bdbdbd"


def chains_figure(title: str, nodes: ColumnDataSource, links: ColumnDataSource, tooltips: list[tuple[str, str]]):
    """A forest of block hashes: each node (columns x, y, color) a dot, linked to its parent by a segment (columns
    x0, y0, x1, y1); hovering a dot gives `tooltips`. Also the attached server's view (workbench/views/attached.py)."""
    fig = new_figure(title, height=300, x_axis_label="block position in the chain", y_axis_label="chain")
    counts_on(fig.xaxis)
    fig.segment(x0="x0", y0="y0", x1="x1", y1="y1", source=links, color="#969696")
    dots = fig.scatter(x="x", y="y", source=nodes, size=10, fill_color="color", line_color=None)
    fig.add_tools(HoverTool(renderers=[dots], tooltips=tooltips))
    fig.yaxis.visible = False
    return fig


def _status(node: ChainNode) -> dict:
    if node.evicted:
        return {"block_id": node.block_id, "status": "evicted", "color": EVICTED_NODE}
    return {"block_id": node.block_id, "status": "cached", "color": CACHED_NODE}


class PrefixCacheView(View):
    """Owns the prefix-cache view: per request, the tokens its lookup hit against the tokens it asked for;
    the hit rate (cumulative, as the engine's PrefixCacheStats counts it: hit tokens over looked-up tokens)
    per step; and the cached chains, each block hash drawn at its depth and linked to its parent's hash. The facts
    are the state's `prefix`; the view owns only where it drew them."""

    title = "Prefix cache"

    def __init__(self, state: EngineState | None = None) -> None:
        super().__init__(state)
        self.hits = self.buffer(
            ["x", "request_id", "hit_tokens", "queried_tokens", "hit_blocks", "queried_blocks"], name="prefix_hits"
        )
        self.rate = self.buffer(["step", "hit_rate", "step_hit_rate"], name="prefix_hit_rate")
        self.nodes = self.buffer(["x", "y", "hash", "parent", "block_id", "status", "color"], name="prefix_chains")
        self.edges = self.buffer(["x0", "y0", "x1", "y1"], name="prefix_chain_links")
        self._hit_row: dict[str, int] = {}  # request id -> its bar (the layout; the facts are the state's)
        self._node: dict[str, int] = {}  # block hash -> row in nodes
        self._has_child: set[str] = set()
        self._lanes = 0
        self._panel = pn.Column(
            pn.Row(pn.pane.Bokeh(self._hits_figure()), pn.pane.Bokeh(self._rate_figure()), sizing_mode="stretch_width"),
            pn.pane.Bokeh(self._chains_figure()),
            sizing_mode="stretch_width",
        )

    def _hits_figure(self):
        fig = new_figure(
            "Prefix-cache hit per request (tokens)", x_axis_label="request (in lookup order)", y_axis_label="tokens"
        )
        label_ticks(fig.xaxis, self.hits.source, "x", "request_id")
        fig.y_range.start = 0
        counts_on(fig.yaxis)
        fig.vbar(
            x="x",
            top="queried_tokens",
            width=0.8,
            source=self.hits.source,
            fill_color="#d9d9d9",
            line_color=None,
            legend_label="looked up",
        )
        bars = fig.vbar(
            x="x",
            top="hit_tokens",
            width=0.8,
            source=self.hits.source,
            fill_color="#31a354",
            line_color=None,
            legend_label="hit",
        )
        fig.add_tools(
            HoverTool(
                renderers=[bars],
                tooltips=[
                    ("request", "@request_id"),
                    ("hit tokens", "@hit_tokens"),
                    ("looked up", "@queried_tokens"),
                    ("hit blocks", "@hit_blocks / @queried_blocks"),
                ],
            )
        )
        legend_above(fig)
        return fig

    def _rate_figure(self):
        fig = new_figure(
            "Prefix-cache hit rate",
            x_axis_label="step",
            y_axis_label="hit / looked-up tokens",
            y_range=Range1d(0, 1.05),
        )
        counts_on(fig.xaxis)
        fig.line(x="step", y="hit_rate", source=self.rate.source, line_width=2, legend_label="cumulative")
        fig.scatter(
            x="step", y="step_hit_rate", source=self.rate.source, color="#ff7f0e", size=5, legend_label="this step"
        )
        legend_above(fig)
        return fig

    def _chains_figure(self):
        return chains_figure(
            "Cached chains (block hash -> child hash; grey: evicted)",
            self.nodes.source,
            self.edges.source,
            [("hash", "@hash"), ("parent", "@parent"), ("block", "@block_id"), ("status", "@status")],
        )

    @property
    def panel(self) -> pn.Column:
        return self._panel

    def render(self, record: StepRecord, delta: StepDelta) -> None:
        for lookup in delta.lookups:
            self._lookup(lookup)
        for block_hash in delta.cached:
            if block_hash not in self._node:
                self._place(self.state.prefix.chains[block_hash])
        for block_hash in dict.fromkeys([*delta.cached, *delta.evicted]):
            self._show(block_hash)
        prefix = self.state.prefix
        if prefix.queried_tokens:
            step_hits = sum(lookup.hit_tokens for lookup in delta.lookups)
            step_queried = sum(lookup.queried_tokens for lookup in delta.lookups)
            self.rate.append(
                step=record.step,
                hit_rate=prefix.hit_rate,
                step_hit_rate=step_hits / step_queried if step_queried else None,
            )

    def _lookup(self, lookup: Lookup) -> None:
        row = dict(
            request_id=lookup.request_id,
            hit_tokens=lookup.hit_tokens,
            queried_tokens=lookup.queried_tokens,
            hit_blocks=lookup.hit_blocks,
            queried_blocks=lookup.queried_blocks,
        )
        if lookup.request_id in self._hit_row:
            self.hits.set(self._hit_row[lookup.request_id], **row)
        else:
            self._hit_row[lookup.request_id] = self.hits.append(x=len(self.hits), **row)

    def show_state(self) -> None:
        """The chains the state holds (a snapshot's cache), parents before children."""
        for node in self.state.prefix.chains.values():
            self._place(node)

    def _place(self, node: ChainNode) -> None:
        """A new node: at the end of its parent's lane, or first in a new lane (a root, or a second child)."""
        parent_hash = node.parent_hash
        parent = self._node.get(parent_hash) if parent_hash else None
        if parent_hash is None or parent is None:  # a new root: a new lane, drawn downwards
            x, y = 0, -self._lanes
            self._lanes += 1
        else:
            px, py = self.nodes.get(parent, "x"), self.nodes.get(parent, "y")
            if parent_hash not in self._has_child:
                x, y = px + 1, py  # the chain goes on in its parent's lane
            else:  # a branch off a parent that has a child already: a new lane
                x, y = px + 1, -self._lanes
                self._lanes += 1
            self._has_child.add(parent_hash)
            self.edges.append(x0=px, y0=py, x1=x, y1=y)
        self._node[node.block_hash] = self.nodes.append(
            x=x, y=y, hash=node.block_hash[:12], parent=(parent_hash or "")[:12], **_status(node)
        )

    def _show(self, block_hash: str) -> None:
        """A drawn node's block and status as the state has them now (cached again, or evicted)."""
        if block_hash in self._node:
            self.nodes.set(self._node[block_hash], **_status(self.state.prefix.chains[block_hash]))

    def reset(self) -> None:
        super().reset()
        self._hit_row, self._node, self._has_child = {}, {}, set()
        self._lanes = 0
