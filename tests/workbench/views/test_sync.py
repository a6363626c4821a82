"""workbench.views.sync without a browser: a Workbench displayed as a notebook displays it, with a comm the
"browser" opens only after several steps (Run All). Nothing may be sent before it opens; when it opens, what
was drawn arrives at once and in step order; after that each draw is one message. The real thing is
tests/test_browser_lab.py."""

from __future__ import annotations

import json

import panel as pn
import pytest
import pyviz_comms

from engine import LLMEngine, SamplingParams
from workbench.app import Workbench


class _Wire:
    """What a comm puts on the wire: every send, in order."""

    def __init__(self) -> None:
        self.sent: list[tuple] = []

    def send(self, data=None, metadata=None, buffers=None) -> None:
        self.sent.append((data, metadata, buffers))


class _ServerComm(pyviz_comms.Comm):
    """A kernel-side comm that is open once `init` has run (as pyviz_comms.JupyterComm: the browser asked)."""

    def init(self, on_msg=None) -> None:
        self._comm = _Wire()

    def send(self, data=None, metadata=None, buffers=None) -> None:
        if not self._comm:
            self.init()
        self._comm.send(data, metadata=metadata, buffers=buffers)


class _Manager(pyviz_comms.CommManager):
    _comms = {}
    server_comm = _ServerComm
    client_comm = pyviz_comms.Comm


@pytest.fixture
def displayed(monkeypatch):
    """A Workbench over tiny-llama with two requests queued, displayed; its comm not open yet."""
    monkeypatch.setattr(pn.state, "_comm_manager", _Manager)
    engine = LLMEngine(
        model="tiny-llama", block_size=16, num_kv_blocks=32, max_num_batched_tokens=16, max_model_len=256
    )
    for prompt in ("The capital of France is", "A paged KV cache stores keys and values in blocks"):
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=8))
    wb = Workbench(engine)
    wb._repr_mimebundle_()
    ((ref, (comm, client_comm)),) = wb.layout._comms.items()
    yield wb, comm, client_comm
    pn.state._views.pop(ref, None)


def _streamed_steps(wire: _Wire, wb: Workbench) -> list[int]:
    """The step numbers streamed to the scheduler_steps source, in the order the messages carry them."""
    source_id = wb.dashboard.timeline.steps.source.id
    steps = []
    for data, _, _ in wire.sent:
        if not isinstance(data, str) or '"events"' not in data:
            continue
        for event in json.loads(data)["events"]:
            if event["kind"] == "ColumnsStreamed" and event["model"]["id"] == source_id:
                steps += event["data"]["entries"][0][1] if "entries" in event["data"] else event["data"]["step"]
    return steps


def test_nothing_is_sent_before_the_browser_opens_the_comm_then_everything_in_order(displayed):
    wb, comm, client_comm = displayed
    for _ in range(3):
        wb.step(1)
    wb.request_form.prompt.value = "A change Panel pushes by itself"
    assert not isinstance(comm._comm, _Wire), "the comm is not open: nothing has gone out"
    client_comm._on_open({})  # the browser rendered the output and opened its comm
    wire = comm._comm
    assert isinstance(wire, _Wire)
    assert _streamed_steps(wire, wb) == [1, 2, 3] == wb.dashboard.timeline.steps.source.data["step"]
    sent = len(wire.sent)
    wb.step(1)
    assert _streamed_steps(wire, wb) == [1, 2, 3, 4]
    assert sum('"PATCH-DOC"' in str(data) for data, _, _ in wire.sent[sent:]) == 1, "one draw, one message"


def test_a_draw_sends_nothing_until_it_ends(displayed):
    """Inside `drawing`, Panel's own pushes (a Markdown's text, a table's value) are held: the browser never
    sees half a step."""
    from workbench.views.sync import drawing

    wb, comm, client_comm = displayed
    client_comm._on_open({})
    wire = comm._comm
    sent = len(wire.sent)
    with drawing(wb.layout):
        wb.step_text.object = "step 41"
        wb.title.object = "## a title"
        assert len(wire.sent) == sent
    assert sum('"PATCH-DOC"' in str(data) for data, _, _ in wire.sent[sent:]) == 1


def _patch(*events: dict) -> dict:
    """A PATCH-DOC as the page's CommManager sends it over the client comm (pyviz_comms has decoded it)."""
    return {
        "header": {"msgid": "m1", "msgtype": "PATCH-DOC"},
        "metadata": {},
        "content": {"events": list(events)},
        "_buffers": {},
    }


def _model_of(widget) -> object:
    ((model, _),) = [widget._models[ref] for ref in widget._models]
    return model


def test_a_click_sent_with_the_typing_before_it_sees_what_was_typed(displayed):
    """A page that waits for the kernel's ack sends what happened meanwhile as one message: here the prompt
    typed, then Add request. Panel applies a message with the document held, which defers the property
    changes and runs the click at once; the form read the old prompt (the browser test, one run in three)."""
    wb, comm, client_comm = displayed
    client_comm._on_open({})
    prompt, button = _model_of(wb.request_form.prompt), _model_of(wb.request_form.button)
    typed = "Typed just now: the sky over Paris is"
    click = {
        "type": "event",
        "name": "button_click",
        "values": {"type": "map", "entries": [["model", {"id": button.id}]]},
    }
    client_comm._on_msg(
        _patch(
            {"kind": "ModelChanged", "model": {"id": prompt.id}, "attr": "value_input", "new": typed},
            {"kind": "MessageSent", "msg_type": "bokeh_event", "msg_data": click},
        )
    )
    assert wb.engine.snapshot().requests[-1].prompt == typed


class _Kernel:
    """An ipykernel as far as comms go: its shell handlers are its comm manager's, and it records parents."""

    def __init__(self) -> None:
        from comm.base_comm import CommManager

        self.comm_manager = CommManager()
        self.shell_handlers = {"comm_open": self.comm_manager.comm_open, "comm_msg": self.comm_manager.comm_msg}
        self.parents: list[str] = []

    def set_parent(self, ident, parent, channel="shell") -> None:
        self.parents.append(parent["header"]["msg_id"])


def _comm_message(kind: str, msg_id: str, comm_id: str = "c1", **content) -> dict:
    return {"header": {"msg_id": msg_id, "msg_type": kind}, "content": {"comm_id": comm_id, **content}}


def test_a_message_that_overtakes_its_comm_open_is_handled_when_the_comm_opens():
    """JupyterLab sends comm messages on a subshell and the comm_open on the busy main shell: the first
    message arrived for a comm the kernel did not know yet and was dropped, so Panel never acknowledged it and
    the page held every later click (the browser test's Step, one run in two)."""
    from workbench.views.sync import _EarlyMessages

    kernel, received = _Kernel(), []
    kernel.comm_manager.register_target(
        "dashboard", lambda comm, msg: comm.on_msg(lambda m: received.append(m["header"]["msg_id"]))
    )
    _EarlyMessages.install(kernel)
    _EarlyMessages.install(kernel)  # once per kernel
    handlers = kernel.shell_handlers
    handlers["comm_msg"](None, [], _comm_message("comm_msg", "first"))
    handlers["comm_msg"](None, [], _comm_message("comm_msg", "second"))
    handlers["comm_msg"](None, [], _comm_message("comm_msg", "other", comm_id="c2"))
    assert received == []
    handlers["comm_open"](None, [], _comm_message("comm_open", "open", target_name="dashboard", data={}))
    assert received == ["first", "second"]
    assert kernel.parents == ["first", "second", "open"], "each answered as itself, then the open again"
    handlers["comm_msg"](None, [], _comm_message("comm_msg", "third"))
    assert received == ["first", "second", "third"]
    assert list(kernel._workbench_early_messages.held) == ["c2"]


def test_messages_for_a_comm_that_never_opens_are_kept_bounded(monkeypatch):
    """A comm closed or never opened must not hold messages forever: at most MAX_PER_COMM each (the newest),
    and none older than MAX_AGE_S once another message is held."""
    from workbench.views import sync

    kernel, clock = _Kernel(), [0.0]
    monkeypatch.setattr(sync.time, "monotonic", lambda: clock[0])
    sync._EarlyMessages.install(kernel)
    early, handle = kernel._workbench_early_messages, kernel.shell_handlers["comm_msg"]
    for i in range(early.MAX_PER_COMM + 5):
        handle(None, [], _comm_message("comm_msg", f"m{i}", comm_id="gone"))
    held = early.held["gone"]
    assert len(held) == early.MAX_PER_COMM and held[0][1]["header"]["msg_id"] == "m5"
    clock[0] = early.MAX_AGE_S + 1
    handle(None, [], _comm_message("comm_msg", "late", comm_id="other"))
    assert list(early.held) == ["other"]
