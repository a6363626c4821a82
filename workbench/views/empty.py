"""A view of a feature that may not exist yet: a message until its first event, then its figures."""

from __future__ import annotations

import panel as pn


class EmptyState:
    """Owns the switch between a view's empty-state message and its content, thrown once, at the first event."""

    def __init__(self, message: str, content: pn.viewable.Viewable) -> None:
        self.message = pn.pane.Alert(message, alert_type="secondary", sizing_mode="stretch_width")
        self.content = content
        self.content.visible = False
        self.panel = pn.Column(self.message, self.content, sizing_mode="stretch_width")

    @property
    def is_empty(self) -> bool:
        return not self.content.visible

    def fill(self) -> None:
        if self.is_empty:
            self.message.visible, self.content.visible = False, True

    def clear(self) -> None:
        self.message.visible, self.content.visible = True, False
