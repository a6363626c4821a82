"""Speculative decoding: which draft tokens the target model accepted, step by step, acceptance by position, and
why: each request's last verification with the draft's probability of each draft next to the target's. Empty
until the first spec.* event (an engine with a speculative_config)."""

from __future__ import annotations

import pandas as pd
import panel as pn
from bokeh.models import HoverTool, Range1d
from bokeh.models.widgets import NumberFormatter

from engine.events import StepRecord
from workbench.state import ACCEPTED, NOT_REACHED, REJECTED, DraftPosition, EngineState, StepDelta, Verification
from workbench.views.base import View, counts_on, label_ticks, legend_above, new_figure
from workbench.views.empty import EmptyState

ACCEPTED_COLOR, BONUS_COLOR, RECOVERED_COLOR = "#2ca02c", "#f2b701", "#9467bd"
# a draft position's outcome: after the first rejection nothing is judged
OUTCOME_COLORS = {ACCEPTED: ACCEPTED_COLOR, REJECTED: "#d62728", NOT_REACHED: "#bbbbbb"}
LAST_COLUMNS = {
    "request_id": "request",
    "step": "step",
    "position": "position",
    "token": "token",
    "q": "q (draft)",
    "p": "p (target)",
    "outcome": "outcome",
    "why": "why",
}
_LAST_DTYPES = {
    "request_id": "object",
    "step": "int64",
    "position": "int64",
    "token": "object",
    "q": "float64",
    "p": "float64",
    "outcome": "object",
    "why": "object",
}
RULES = (
    "Each request's last verification, one row per draft position: the draft's own probability **q** of its "
    "token beside the target's **p**. Greedy requests keep a draft iff it is the target's top token; sampled "
    "ones iff a uniform draw u < min(1, p/q). The first rejection ends the verification: the target's token "
    "replaces it (recovered); when every draft stands, the target adds one more (bonus)."
)
NO_Q = " · n-gram drafts carry no distribution: q is blank, and a draft counts as certain (q = 1)"


def _token(text: str, token_id: int) -> str:
    return repr(text) if text else f"id {token_id}"  # a trace from before texts were recorded: the id


def _why(v: Verification, d: DraftPosition) -> str:
    """The rule's verdict on one position, with the numbers it read."""
    if d.outcome == NOT_REACHED:
        return "its branch was not taken: never judged" if v.tree_parents else "after the first rejection: never judged"
    if v.rule == "greedy":
        if d.outcome == ACCEPTED:
            return "the target's top token too"
        return f"the target's top token is {v.emitted_text!r}"  # greedy: the recovered token is the target's argmax
    if v.rule == "sampled":
        ratio = min(1.0, d.p / (1.0 if d.q is None else d.q))
        return f"u = {d.uniform:.3f} {'<' if d.outcome == ACCEPTED else '>='} min(1, p/q) = {ratio:.3f}"
    return ""  # a trace from before the rule was recorded


def _emitted_why(v: Verification) -> str:
    if v.bonus and v.tree_parents:
        return "the path reached a leaf: one more token from the target, after it"
    if v.bonus:
        return "every draft stood: one more token from the target, after them"
    if v.rule == "sampled" and v.tree_parents:
        return "drawn from what the rejected children left of p (max(p - q, 0), normalised, after each)"
    if v.rule == "sampled":
        return "drawn from max(p - q, 0), normalised, in place of the rejected draft"
    return "the target's own token in place of the rejected draft" if v.rule else ""


def _last_rows(v: Verification) -> list[dict]:
    """The rows of one verification in the view's table: its draft positions, then the token it emitted."""
    rows = [
        {
            "request_id": v.request_id,
            "step": v.step,
            "position": d.position,
            "token": _token(d.text, d.token_id),
            "q": float("nan") if d.q is None else d.q,
            "p": d.p,
            "outcome": d.outcome,
            "why": _why(v, d),
        }
        for d in v.positions()
    ]
    rows.append(
        {
            "request_id": v.request_id,
            "step": v.step,
            "position": len(v.draft_token_ids),
            "token": _token(v.emitted_text, v.emitted_token),
            "q": float("nan"),
            "p": float("nan"),
            "outcome": "bonus" if v.bonus else "recovered",
            "why": _emitted_why(v),
        }
    )
    return rows


def _frame(rows: list[dict]) -> pd.DataFrame:
    # explicit dtypes: an empty frame of object columns breaks Tabulator's updates
    return pd.DataFrame(rows, columns=list(LAST_COLUMNS)).astype(_LAST_DTYPES)


class SpecDecodeView(View):
    """Owns the speculative-decoding view: one row per (step, request) verification, a cell per draft position
    (green accepted, red rejected, grey not reached; hover gives p_target and p_draft), then the token emitted after
    the accepted prefix (gold: the bonus token, all drafts accepted; purple: the recovered token after a
    rejection); the acceptance rate by draft position, from the state's `spec`; and a table (`last`, a Panel
    Tabulator) of each request's last verification: per position the draft's text, q beside p, the outcome and
    the rule's verdict with its numbers. Shows an empty state until the first spec.* event. Above them, the
    method and, for guided requests, how many drafts the grammar cut before verification."""

    title = "Speculative decoding"

    def __init__(self, state: EngineState | None = None) -> None:
        super().__init__(state)
        self.cells = self.buffer(
            ["x", "y", "step", "request_id", "row", "token_id", "outcome", "p_target", "p_draft", "color"],
            name="spec_tokens",
        )
        self.by_position = self.buffer(["position", "proposed", "accepted", "rate"], name="spec_acceptance")
        # the last verified draft tree: a node per draft at (depth, rank within its depth), edges to parents
        self.tree_nodes = self.buffer(
            ["x", "y", "node", "token", "outcome", "p_target", "p_draft", "color"], name="spec_tree_nodes"
        )
        self.tree_edges = self.buffer(["x0", "y0", "x1", "y1", "color"], name="spec_tree_edges")
        self._rows = 0
        self._last: dict[str, list[dict]] = {}  # request id -> its last verification's rows (first-verified order)
        self._last_changed = False
        self._no_q = False  # a verification came without draft probabilities (n-gram)
        self.methods = pn.pane.Markdown("", margin=(0, 10))
        probability = NumberFormatter(format="0.000", nan_format="")
        self.last = pn.widgets.Tabulator(
            _frame([]),
            show_index=False,
            disabled=True,
            height=260,
            sizing_mode="stretch_width",
            titles=LAST_COLUMNS,
            widths={"why": 420},
            formatters={"q": probability, "p": probability},
        )
        content = pn.Column(
            self.methods,
            pn.Row(
                pn.pane.Bokeh(self._tokens_figure()),
                pn.pane.Bokeh(self._acceptance_figure()),
                sizing_mode="stretch_width",
            ),
            pn.pane.Bokeh(self._tree_figure()),
            pn.pane.Markdown(RULES, margin=(0, 10)),
            self.last,
            sizing_mode="stretch_width",
        )
        self.empty = EmptyState(
            "No speculative decoding yet: this view fills in when spec events arrive "
            "(an engine with a speculative_config).",
            content,
        )

    def _tokens_figure(self):
        fig = new_figure(
            "Draft tokens per step and request",
            height=300,
            x_axis_label="draft position",
            y_axis_label="verification (newest at the bottom)",
        )
        cells = fig.rect(
            x="x",
            y="y",
            width=0.9,
            height=0.85,
            source=self.cells.source,
            fill_color="color",
            line_color=None,
            legend_field="outcome",
        )
        fig.add_tools(
            HoverTool(
                renderers=[cells],
                tooltips=[
                    ("step", "@step"),
                    ("request", "@request_id"),
                    ("position", "@x"),
                    ("token", "@token_id"),
                    ("outcome", "@outcome"),
                    ("p target / draft", "@p_target{0.000} / @p_draft{0.000}"),
                ],
            )
        )
        label_ticks(fig.yaxis, self.cells.source, "y", "row")
        counts_on(fig.xaxis)
        legend_above(fig)
        return fig

    def _acceptance_figure(self):
        fig = new_figure(
            "Acceptance rate by draft position (a tree's: by depth)",
            height=300,
            x_axis_label="draft position",
            y_axis_label="accepted / proposed",
            y_range=Range1d(0, 1.05),
        )
        counts_on(fig.xaxis)
        bars = fig.vbar(x="position", top="rate", width=0.8, source=self.by_position.source, color=ACCEPTED_COLOR)
        fig.add_tools(
            HoverTool(
                renderers=[bars],
                tooltips=[("position", "@position"), ("accepted", "@accepted / @proposed"), ("rate", "@rate{0.00}")],
            )
        )
        return fig

    def _tree_figure(self):
        fig = new_figure(
            "Last verified draft tree (speculative_token_tree): the accepted path in green",
            height=280,
            x_axis_label="depth",
            y_axis_label="node at that depth",
        )
        fig.segment(x0="x0", y0="y0", x1="x1", y1="y1", color="color", line_width=2, source=self.tree_edges.source)
        nodes = fig.scatter(x="x", y="y", size=16, fill_color="color", line_color=None, source=self.tree_nodes.source)
        fig.add_tools(
            HoverTool(
                renderers=[nodes],
                tooltips=[
                    ("node", "@node"),
                    ("token", "@token"),
                    ("outcome", "@outcome"),
                    ("p target / draft", "@p_target{0.000} / @p_draft{0.000}"),
                ],
            )
        )
        counts_on(fig.xaxis, fig.yaxis)
        return fig

    def _draw_tree(self, v: Verification) -> None:
        """Root at depth 0, each node at its depth and its rank there, then the emitted token after the path."""
        place = {0: (0, 0)}
        ranks: dict[int, int] = {}
        nodes = [dict(x=0, y=0, node="root", token="(newest token)", outcome="root", p_target=None, p_draft=None)]
        nodes[0]["color"] = "#444444"
        edges = []
        for d in v.positions():
            depth = v.depth(d.position)
            ranks[depth] = ranks.get(depth, -1) + 1
            place[d.position + 1] = (depth, ranks[depth])
            x0, y0 = place[v.tree_parents[d.position]]
            color = OUTCOME_COLORS[d.outcome]
            nodes.append(
                dict(
                    x=depth,
                    y=ranks[depth],
                    node=str(d.position + 1),
                    token=_token(d.text, d.token_id),
                    outcome=d.outcome,
                    p_target=d.p,
                    p_draft=d.q,
                    color=color,
                )
            )
            edges.append(dict(x0=x0, y0=y0, x1=depth, y1=ranks[depth], color=color))
        x0, y0 = place[v.accepted_path[-1] if v.accepted_path else 0]
        color = BONUS_COLOR if v.bonus else RECOVERED_COLOR
        nodes.append(
            dict(
                x=x0 + 1,
                y=y0,
                node="emitted",
                token=_token(v.emitted_text, v.emitted_token),
                outcome="bonus" if v.bonus else "recovered",
                p_target=None,
                p_draft=None,
                color=color,
            )
        )
        edges.append(dict(x0=x0, y0=y0, x1=x0 + 1, y1=y0, color=color))
        self.tree_nodes.replace({k: [n[k] for n in nodes] for k in nodes[0]})
        self.tree_edges.replace({k: [e[k] for e in edges] for k in edges[0]})

    @property
    def panel(self) -> pn.Column:
        return self.empty.panel

    def render(self, record: StepRecord, delta: StepDelta) -> None:
        if not (delta.spec_proposed or delta.verifications):
            return
        self.empty.fill()
        self._no_q = self._no_q or any(v.p_draft is None for v in delta.verifications)
        text = f"method: {self.state.spec.method}" + (NO_Q if self._no_q else "")
        if self.state.spec.num_cut_by_grammar:  # guided requests: drafts that never reached verification
            text += f" · drafts cut by the grammar: {self.state.spec.num_cut_by_grammar}"
        if self.state.spec.method and self.methods.object != text:
            self.methods.object = text
        for verification in delta.verifications:
            self._verified(verification)
        for position in sorted(delta.spec_positions):
            self._count(position)

    def _verified(self, v: Verification) -> None:
        y = -self._rows
        self._rows += 1
        row = dict(y=y, step=v.step, request_id=v.request_id, row=f"step {v.step} · {v.request_id}")
        for d in v.positions():
            self.cells.append(
                x=d.position,
                token_id=d.token_id,
                outcome=d.outcome,
                p_target=d.p,
                p_draft=d.q,
                color=OUTCOME_COLORS[d.outcome],
                **row,
            )
        self.cells.append(
            x=len(v.draft_token_ids),
            token_id=v.emitted_token,
            outcome="bonus" if v.bonus else "recovered",
            p_target=None,
            p_draft=None,
            color=BONUS_COLOR if v.bonus else RECOVERED_COLOR,
            **row,
        )
        self._last[v.request_id] = _last_rows(v)
        self._last_changed = True
        if v.tree_parents:
            self._draw_tree(v)

    def _count(self, position: int) -> None:
        spec = self.state.spec
        while len(self.by_position) <= position:
            self.by_position.append(position=len(self.by_position), proposed=0, accepted=0, rate=0.0)
        self.by_position.set(
            position, proposed=spec.proposed[position], accepted=spec.accepted[position], rate=spec.rate(position)
        )

    def flush(self) -> None:
        super().flush()
        if self._last_changed:  # a new frame, as the requests table: Tabulator's patches and streams misdraw
            self.last.value = _frame([row for rows in self._last.values() for row in rows])
            self._last_changed = False

    def reset(self) -> None:
        super().reset()
        self._rows, self._last, self._last_changed, self._no_q = 0, {}, False, False
        self.methods.object = ""
        self.last.value = _frame([])
        self.empty.clear()
