"""How changes to the views reach a notebook's browser, and the browser's clicks reach the kernel: all of
them, once each, in the order they were made.

In a notebook, a displayed Panel object talks to its browser view over Jupyter comms that the browser opens
when it renders the cell's output. Five things went wrong there, each fixed here:
- Under Run All the kernel goes on stepping the engine before the browser has rendered the output. Panel then
  retries each message on its own 0.1 s timer, the retries land in any order, and the browser ended up with
  steps [18, 13, 14, ...] and a `step N` text one behind. Now changes are made with the comm blocked, so they
  stay held in the view's document in order (Bokeh merges repeated changes of one property) and go out as one
  message when the comm is open, or when the browser opens it; anything Panel sends before that is queued in
  order by an `_Outbox` and sent first.
- JupyterLab 4 and ipykernel 7 handle comm messages (a button's click) on a subshell thread, beside the main
  thread where cells run and the Workbench draws. Panel's handler holds and releases the document around each
  message; released in the middle of a draw, it dropped that draw's changes (a Step whose bars never came).
  Now one lock, `_doc_lock`, admits one thread at a time to a displayed document: the draws and Panel's
  handling of browser messages.
- The browser sent back every change it had applied from the kernel (`drop_echoes_script`).
- Under Run All the page's first message on the dashboard's comm was lost, and with it every later click
  (`_EarlyMessages`); and a click sent together with the typing before it read the old text (`_in_order`).
"""

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import panel as pn
from panel.io.notebook import block_comm
from panel.io.notebook import push as push_doc

# Panel's notebook CommManager (panel 1.9) sends every change of the browser's document back to the kernel,
# the changes it has just applied from the kernel included: each row streamed to a source came back and was
# streamed into the kernel's copy a second time. Bokeh marks applied changes `sync = false` and its own
# server client drops them; this does the same for the notebook's CommManager, once per page.
_DROP_ECHOES_JS = """
(function drop_echoes(tries) {
  const models = window.Bokeh && window.Bokeh.Models;
  const CommManager = models && models.get("panel.models.comm_manager.CommManager");
  if (CommManager == null) {
    if (tries > 0) setTimeout(() => drop_echoes(tries - 1), 50);
    return;
  }
  const proto = CommManager.prototype;
  if (proto._workbench_drops_echoes) return;
  const changed = proto._document_changed;
  proto._document_changed = function (event) {
    const events = event.events !== undefined ? (event.sync ? event.events : []) : [event];
    for (const e of events) if (e.sync) changed.call(this, e);
  };
  proto._workbench_drops_echoes = true;
})(200);
"""


class _Outbox:
    """Stands in for a comm the browser has not opened yet: keeps what is sent, in order."""

    def __init__(self) -> None:
        self.messages: list[tuple[Any, Any, Any]] = []

    def send(self, data: Any = None, metadata: Any = None, buffers: Any = None) -> None:
        self.messages.append((data, metadata, buffers))


def _displays(viewable: Any) -> Iterator[tuple[str, Any, Any, Any]]:
    """(ref, displayed object, document, comm) of each notebook display that shows `viewable` (alone or
    inside a layout); none under a server or headless."""
    for ref in list(getattr(viewable, "_models", {})):
        entry = pn.state._views.get(ref)
        if entry is None:
            continue
        shown, root, doc, comm = entry
        if comm is not None and "embedded" not in root.tags:
            yield ref, shown, doc, comm


_doc_lock = threading.RLock()
_depth = 0  # nested drawing() on the lock's owner: only the outermost pushes


def _in_order(msg: Any) -> Iterator[Any]:
    """The browser's message cut before each event it carries (a click) that follows changes (typing).

    Panel applies a message with the document held: property changes reach the widgets' parameters only at
    the end, while an event's callbacks run at once. A page waiting for the kernel's ack sends what happened
    meanwhile as one message, and the Add-request click read the prompt from before the typing. Each part is
    applied on its own, so the click runs after the changes sent ahead of it have landed."""
    events = msg.get("content", {}).get("events") if isinstance(msg, dict) else None
    if not events:
        yield msg
        return
    part: list[Any] = []
    for event in events:
        if event.get("kind") == "MessageSent" and part:
            yield _with_events(msg, part)
            part = []
        part.append(event)
    yield _with_events(msg, part)


def _with_events(msg: dict, events: list[Any]) -> dict:
    # Panel's handler writes into the header and pops the buffers: each part gets its own
    return {
        **msg,
        "header": dict(msg.get("header", {})),
        "content": {**msg["content"], "events": events},
        "_buffers": dict(msg.get("_buffers") or {}),
    }


class _Locked:
    """A comm handler run under the document lock, part by part; marked so that a second display of the same
    view does not wrap it again."""

    workbench_locked = True

    def __init__(self, handler: Callable[[Any], None]) -> None:
        self.handler = handler

    def __call__(self, msg: Any) -> None:
        with _doc_lock:
            for part in _in_order(msg):
                self.handler(part)


def _guard(shown: Any, ref: str, doc: Any, comm: Any) -> None:
    """Once per display: Panel's handling of the browser's messages takes the document lock, and an unopened
    comm gets an _Outbox until the browser opens it (then the queue goes out, then what was held since)."""
    if ref not in shown._comms:
        return
    client_comm = shown._comms[ref][1]
    if getattr(client_comm._on_msg, "workbench_locked", False):
        return
    client_comm._on_msg = _Locked(client_comm._on_msg)
    if comm._comm is not None:
        return
    outbox, opened = _Outbox(), client_comm._on_open

    def on_open(msg: Any) -> None:
        comm._comm = None
        opened(msg)  # Panel's handler: opens the real comm
        for data, metadata, buffers in outbox.messages:
            comm._comm.send(data, metadata=metadata, buffers=buffers)
        outbox.messages.clear()
        push_doc(doc, comm)  # what was held since

    comm._comm, client_comm._on_open = outbox, _Locked(on_open)


class _EarlyMessages:
    """Owns the comm messages that reach the kernel before their comm is open, until it opens.

    JupyterLab (4.4 on) sends a comm's messages on a kernel subshell, which runs beside the cells, but the
    comm's comm_open on the main shell, which waits for the running cell. Under Run All the page's first
    message on the dashboard's comm reached its subshell while the comm_open still waited behind the cells,
    and ipykernel drops a message for a comm it does not know. Panel never acknowledged it, so the page's
    CommManager kept every later change and click (the browser test's Step) until some change came after its
    5 s timeout, which may never happen. Held here, they are handled as the comm opens, in order, before any
    later message on that comm."""

    MAX_AGE_S = 600.0  # for a comm that never opens (or closed): dropped after this, as ipykernel would
    MAX_PER_COMM = 256

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.lock = threading.Lock()
        self.held: dict[str, deque] = {}
        self.handle_open = kernel.shell_handlers["comm_open"]
        self.handle_msg = kernel.shell_handlers["comm_msg"]

    @classmethod
    def install(cls, kernel: Any) -> None:
        """Once per kernel. Without subshells a message precedes its comm_open only when its comm is gone; such
        messages are dropped after MAX_AGE_S, as ipykernel drops them at once."""
        if getattr(kernel, "shell_handlers", None) is None or hasattr(kernel, "_workbench_early_messages"):
            return
        early = kernel._workbench_early_messages = cls(kernel)
        kernel.shell_handlers.update(comm_open=early.comm_open, comm_msg=early.comm_msg)

    def comm_msg(self, stream: Any, ident: Any, msg: dict) -> None:
        comm_id = msg["content"].get("comm_id")
        with self.lock:
            if self.kernel.comm_manager.get_comm(comm_id) is None:
                now = time.monotonic()
                for stale in [c for c, queue in self.held.items() if now - queue[-1][2] > self.MAX_AGE_S]:
                    del self.held[stale]
                self.held.setdefault(comm_id, deque(maxlen=self.MAX_PER_COMM)).append((ident, msg, now))
                return
        self.handle_msg(stream, ident, msg)

    def comm_open(self, stream: Any, ident: Any, msg: dict) -> None:
        with self.lock:  # a message on the opened comm waits here until the held ones are handled
            self.handle_open(stream, ident, msg)
            for held_ident, held, _ in self.held.pop(msg["content"].get("comm_id"), ()):
                self.kernel.set_parent(held_ident, held, channel="shell")  # its ack answers it, on its subshell
                self.handle_msg(stream, held_ident, held)
            self.kernel.set_parent(ident, msg, channel="shell")


def _kernel() -> Any:
    """The IPython kernel this runs in, if any."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return getattr(get_ipython(), "kernel", None)


def connect(viewable: Any) -> None:
    """Guard every notebook display of `viewable` (call right after displaying it; `push` does it too)."""
    with _doc_lock:
        _EarlyMessages.install(_kernel())
        for ref, shown, doc, comm in _displays(viewable):
            _guard(shown, ref, doc, comm)


def push(viewable: Any) -> None:
    """Send what changed to each open notebook display of `viewable`; an unopened one gets it when it opens.
    Panel does this itself under a server."""
    with _doc_lock:
        connect(viewable)
        for _, _, doc, comm in _displays(viewable):
            if not isinstance(comm._comm, _Outbox):
                push_doc(doc, comm)


@contextmanager
def drawing(viewable: Any) -> Iterator[None]:
    """Change the models of `viewable` (and anything inside it) alone, with nothing sent until the end, then
    push. Nested uses send once, at the end of the outermost."""
    global _depth
    with _doc_lock:
        _depth += 1
        try:
            if _depth > 1:
                yield
                return
            with block_comm():
                yield
            push(viewable)
        finally:
            _depth -= 1


def drop_echoes_script() -> str:
    """HTML that makes the page's Panel CommManager stop echoing applied changes (see _DROP_ECHOES_JS)."""
    return f"<script>{_DROP_ECHOES_JS}</script>"
