"""How changes to the views reach a notebook's browser: all of them, once each, in the order they were made.

In a notebook, a displayed Panel object talks to its browser view over Jupyter comms that the browser opens
when it renders the cell's output. Three things went wrong there, each fixed here:
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
"""

import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import panel as pn
from panel.io.notebook import block_comm, push as push_doc

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


def _locked(handler: Callable[[Any], None]) -> Callable[[Any], None]:
    def run(msg: Any) -> None:
        with _doc_lock:
            handler(msg)

    run.workbench_locked = True
    return run


def _guard(shown: Any, ref: str, doc: Any, comm: Any) -> None:
    """Once per display: Panel's handling of the browser's messages takes the document lock, and an unopened
    comm gets an _Outbox until the browser opens it (then the queue goes out, then what was held since)."""
    if ref not in shown._comms:
        return
    client_comm = shown._comms[ref][1]
    if getattr(client_comm._on_msg, "workbench_locked", False):
        return
    client_comm._on_msg = _locked(client_comm._on_msg)
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

    comm._comm, client_comm._on_open = outbox, _locked(on_open)


def connect(viewable: Any) -> None:
    """Guard every notebook display of `viewable` (call right after displaying it; `push` does it too)."""
    with _doc_lock:
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
