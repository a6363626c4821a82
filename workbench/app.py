"""The Workbench: the dashboards over a live engine with the controls that drive it; the Replay of a recorded
trace; and the Panel servers behind `workbench serve` and `workbench replay`.

Threads: engine steps run on a worker (Stepper) under `Workbench.lock`; every engine call takes that lock.
The views change on the UI's thread: under a Panel server the records are handed to the session's document
with `add_next_tick_callback` (the only thread-safe Document call), so the page never waits on a step; in a
notebook, to the kernel's event loop, where cells run (a button's callback, which JupyterLab may deliver on
a comm subshell thread, posts its work there too); elsewhere (a script, a test) they are drawn where they
arrive. Draws are atomic, and in a notebook every draw reaches the browser once and in order, whatever the
timing of display, steps and clicks (workbench.views.sync)."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import panel as pn

from engine.async_llm import QueueFullError
from engine.config import EngineConfig
from engine.events import StepRecord
from workbench.controls import EngineForm, RequestForm, Stepper
from workbench.views import Dashboard, ensure_extension
from workbench.views.sync import connect, drawing

if TYPE_CHECKING:
    from bokeh.document import Document

    from engine.async_llm import AsyncLLM
    from engine.llm_engine import LLMEngine
    from workbench.trace import Trace


def _step_label(step: int) -> str:
    return f"step {step}"


def _step_text() -> pn.pane.Markdown:
    """The `step N` text (its CSS class lets a browser test find it)."""
    return pn.pane.Markdown(
        _step_label(0), name="step_text", css_classes=["workbench-step"], styles={"font-size": "1.3em"}, margin=(0, 15)
    )


def _running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop of this thread, if one runs here (a notebook kernel's); None in a script or a test."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


DATA_PARALLEL = (
    "Data parallelism: {n} replicas, each a whole engine stepping on its own behind the front end "
    "followed here. Requests come from HTTP or the form; Step, Play and Pause are off (no single loop "
    "to hold); the Parallelism tab shows each replica's load and every routing decision, and the "
    "views of one engine's steps or blocks say they are per replica."
)


class Workbench:
    """Owns a live engine (rebuilt by Reset and by the config knobs), the Dashboard drawn from its steps,
    the controls (Step, Run N, Play, Pause, Reset, the add-request form, the engine knobs), the `step N`
    text, the message line for errors, and the layout (`layout`, `__panel__`, `servable()`)."""

    def __init__(self, engine: LLMEngine, play_delay_s: float = 0.1, serving: AsyncLLM | None = None) -> None:
        ensure_extension()
        self.engine = engine
        # a served engine is stepped by its AsyncLLM's loop: the buttons hold and release that loop, and every
        # engine call here takes the lock the loop steps under
        self.serving = serving
        self.lock = serving.lock if serving is not None else threading.RLock()  # held around every engine call
        self.dashboard = Dashboard()
        self.stepper = Stepper(self._step_once, play_delay_s)
        self._doc = pn.state.curdoc
        self._ui_thread = threading.get_ident()
        self._loop = _running_loop()
        self._inbox: list[StepRecord] = []
        self._inbox_lock = threading.Lock()
        self._drain_scheduled = False
        self._build_widgets()
        self.layout = self._build_layout()
        self._attach(engine)
        if self.data_parallel_size > 1:
            self._say(DATA_PARALLEL.format(n=self.data_parallel_size), "info")

    # ---- layout -----------------------------------------------------------------------------------------
    def _build_widgets(self) -> None:
        self.step_button = pn.widgets.Button(label="Step", color="primary", width=80)
        self.run_button = pn.widgets.Button(label="Run", width=70)
        self.run_steps = pn.widgets.IntInput(label="", value=10, width=80)
        self.play_button = pn.widgets.Button(label="Play", color="success", width=70)
        self.pause_button = pn.widgets.Button(label="Pause", width=70)
        self.reset_button = pn.widgets.Button(label="Reset", color="danger", width=70)
        self.step_text = _step_text()
        self.message = pn.pane.Alert("", alert_type="danger", visible=False, sizing_mode="stretch_width")
        self.request_form = RequestForm()
        self.engine_form = EngineForm(self.engine.config)
        for button, action in (
            (self.step_button, lambda: self.step(1)),
            (self.run_button, lambda: self.step(self.run_steps.value or 0)),
            (self.play_button, self.play),
            (self.pause_button, self.pause),
            (self.reset_button, self.reset),
            (self.request_form.button, self.add_request_from_form),
            (self.engine_form.button, self.rebuild_from_form),
        ):
            # a notebook may call widget callbacks on a comm subshell thread: the work runs on the UI's
            def clicked(_event: Any, action: Callable[[], object] = action) -> None:
                if not self._post(action):
                    action()

            button.on_click(clicked)

    def _build_layout(self) -> pn.Row:
        controls = pn.Row(
            self.step_button,
            self.run_button,
            self.run_steps,
            self.play_button,
            self.pause_button,
            self.reset_button,
            self.step_text,
            align="center",
        )
        self.title = pn.pane.Markdown(self._title(), margin=(0, 10))
        sidebar = pn.Column(
            "### Add a request", self.request_form.panel, "### Engine", self.engine_form.panel, width=290
        )
        main = pn.Column(self.title, controls, self.message, self.dashboard.tabs(), sizing_mode="stretch_width")
        return pn.Row(sidebar, main, sizing_mode="stretch_width")

    @property
    def data_parallel_size(self) -> int:
        """More than 1: the engine is a data-parallel front end (a DPLBClient), whose replicas step on their own."""
        return getattr(self.engine.config, "data_parallel_size", 1)

    def _title(self) -> str:
        c = self.engine.config
        dp = (
            f" · data parallel: {c.data_parallel_size} replicas, routing by {c.data_parallel_routing}"
            if self.data_parallel_size > 1
            else ""
        )
        return (
            f"## Inference Workbench · `{c.model}` · block size {c.block_size} · budget "
            f"{c.max_num_batched_tokens} tokens · prefix caching {'on' if c.enable_prefix_caching else 'off'}{dp}"
        )

    def _enable_controls(self) -> None:
        """A data-parallel front end has no loop to hold and no steps of its own: Step, Run, Play, Pause, Reset
        and the engine knobs are off (requests still come from the form)."""
        off = self.data_parallel_size > 1
        for widget in (
            self.step_button,
            self.run_button,
            self.run_steps,
            self.play_button,
            self.pause_button,
            self.reset_button,
            self.engine_form.button,
        ):
            widget.disabled = off

    def __panel__(self) -> pn.Row:
        return self.layout

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> Any:
        bundle = self.layout._repr_mimebundle_(include, exclude)  # a notebook cell that ends with it shows it
        connect(self.layout)
        return bundle

    def servable(self, title: str = "Inference Workbench") -> pn.Row:
        return self.layout.servable(title=title)

    # ---- messages -----------------------------------------------------------------------------------------
    def _say(self, text: str, kind: str = "danger") -> None:
        def show() -> None:
            self.message.param.update(object=text, alert_type=kind, visible=bool(text))

        self._in_ui(show)

    @property
    def _served_doc(self) -> Document | None:
        """The document of the server session showing the Workbench; None outside a server (a notebook, a script)."""
        doc = self._doc
        return doc if doc is not None and doc.session_context is not None else None

    @property
    def _served(self) -> bool:
        return self._served_doc is not None

    def _post(self, work: Callable[[], Any]) -> bool:
        """Hand `work` to the UI's event loop if this is another thread (a worker, a notebook's comm subshell);
        False if it is to run here."""
        if self._loop is None or threading.get_ident() == self._ui_thread:
            return False
        self._loop.call_soon_threadsafe(work)
        return True

    def _in_ui(self, callback: Callable[[], None]) -> None:
        """Run `callback`, which changes the views, on the UI's thread (see the module's docstring)."""
        doc = self._served_doc
        if doc is not None:
            doc.add_next_tick_callback(callback)
        elif not self._post(lambda: self._in_ui(callback)):
            with drawing(self.layout):
                callback()

    # ---- stepping -----------------------------------------------------------------------------------------
    def _step_once(self) -> bool:
        with self.lock:
            if not self.engine.has_unfinished_requests():
                self._say("Nothing to run: add a request.", "info")
                return False
            try:
                self.engine.step()
            except Exception as exc:  # shown, not raised: a worker thread has no one to raise to
                text = f"engine error: {type(exc).__name__}: {exc}"
                self._say(text)
                return False
        return True

    def step(self, num_steps: int = 1) -> None:
        """Run `num_steps` engine steps: on the worker under a server, here otherwise."""
        self._doc = pn.state.curdoc or self._doc
        self._say("")
        if self.serving is not None:
            if not self.serving.step(num_steps):
                self._say("Nothing to run: send a request over HTTP or add one here.", "info")
            return
        if self._served:
            self.stepper.run(num_steps)
            return
        for _ in range(num_steps):
            if not self._step_once():
                break

    def play(self) -> None:
        """Step on the worker until Pause (or until nothing is left to run)."""
        self._doc = pn.state.curdoc or self._doc
        self._say("")
        if self.serving is not None:
            self.serving.resume()
            return
        self.stepper.play()

    def pause(self) -> None:
        """Stop stepping after the step running (a served engine: its loop holds; requests still queue)."""
        if self.serving is not None:
            self.serving.pause()
            return
        self.stepper.pause()

    def close(self) -> None:
        """Stop following the engine (a browser session that ended: the engine serves on without it)."""
        with self.lock:
            try:
                self.engine.unsubscribe(self._on_record)
            except ValueError:  # closed before
                pass

    def _on_record(self, record: StepRecord) -> None:
        # an engine subscriber: runs on whichever thread stepped (the worker, or a notebook cell)
        with self._inbox_lock:
            self._inbox.append(record)
            if self._drain_scheduled:
                return
            self._drain_scheduled = True
        self._in_ui(self._drain)

    def _drain(self) -> None:
        """Draw every record that arrived since the last draw, in one batch (Play outpacing the page coalesces)."""
        with self._inbox_lock:
            records, self._inbox, self._drain_scheduled = self._inbox, [], False
        if records:
            self.dashboard.extend(records)
            self.step_text.object = _step_label(records[-1].step)

    # ---- requests and engines ------------------------------------------------------------------------------
    def add_request_from_form(self) -> str | None:
        """Queue the form's request; its errors (the engine's ValueError/TypeError) are shown, not raised."""
        try:
            kwargs = self.request_form.add_request_args()
            if self.serving is not None:  # through the loop, which wakes for it
                rid = self.serving.add_request(**kwargs)
            else:
                with self.lock:
                    rid = self.engine.add_request(**kwargs)
        except (ValueError, TypeError, QueueFullError) as exc:  # a served loop's queue may be full (503 over HTTP)
            self._say(str(exc))
            return None
        self._say(f"request {rid} queued: it shows from the next step on.", "success")
        return rid

    def rebuild_from_form(self) -> None:
        """A new engine from the knobs; a config the engine refuses is shown and the running engine kept."""
        try:
            config = self.engine_form.config(self.engine.config)
        except (ValueError, TypeError) as exc:
            self._say(str(exc))
            return
        self._replace_engine(config, "engine rebuilt")

    def reset(self) -> None:
        """A fresh engine with the same config: no requests, step 0, empty views."""
        self._replace_engine(EngineConfig(**self.engine.config.to_dict()), "engine reset")

    def _replace_engine(self, config: EngineConfig, done: str) -> None:
        from engine.llm_engine import LLMEngine

        if self.serving is not None:
            self._say(
                "This engine is shared with the HTTP server: restart `workbench serve` with other flags to change it."
            )
            return
        self.stepper.pause()
        self.stepper.join(timeout=60)
        try:
            engine = LLMEngine(config)
        except (ValueError, TypeError) as exc:
            self._say(str(exc))
            return
        with self.lock:
            self.engine.unsubscribe(self._on_record)
            self.engine = engine
        self._attach(engine)
        self._say(
            f"{done}: {config.model}, {engine.kv_cache_manager.num_usable_blocks} KV blocks of "
            f"{config.block_size} tokens.",
            "success",
        )

    def _attach(self, engine: LLMEngine) -> None:
        """Follow `engine` from its state now: a snapshot, then every record after it (none missed or drawn twice)."""
        with self.lock:
            snapshot = engine.snapshot()
            with self._inbox_lock:
                self._inbox = []
            engine.subscribe(self._on_record)
        # journeys and block lives from the engine itself; a data-parallel front end has no scheduler steps of its
        # own to explain (each replica's are its own), and keeps no records for it
        explanations = self.dashboard.explanations
        explanations.block_size = engine.config.block_size
        if self.data_parallel_size > 1:
            explanations.attach(None, None, keep_records=False)
        elif not hasattr(engine, "explain"):
            explanations.attach(None, None)
        else:
            explanations.attach(engine.explain, engine.block_life, self.lock)

        def start() -> None:
            self.dashboard.reset(
                engine.config.max_num_batched_tokens,
                snapshot=snapshot,
                data_parallel_size=getattr(engine.config, "data_parallel_size", 1),
            )
            self.step_text.object = _step_label(snapshot.step)
            self.engine_form.show(engine.config)
            self.title.object = self._title()
            self._enable_controls()

        self._in_ui(start)

    # ---- replay ------------------------------------------------------------------------------------------
    @classmethod
    def from_trace(cls, path: str | os.PathLike) -> Replay:
        """The same dashboards over a recorded trace, with a step slider; no model needed."""
        from workbench.trace import read_trace

        return Replay(read_trace(path))


class Replay:
    """Owns the dashboards over a recorded trace (or StepRecords held in memory: `from_records`), its heading
    (`title`, else the trace's model and date) and the controls that move through it: a step slider and a
    `Step` button (one step on). Going back redraws from the first record; going on draws only the new ones."""

    def __init__(self, trace: Trace, title: str | None = None) -> None:
        ensure_extension()
        self.trace = trace
        self.records: list[StepRecord] = trace.records
        self.budget = (trace.header.get("config") or {}).get("max_num_batched_tokens")
        self.num_blocks = trace.records[0].kv.total if trace.records else None
        self.snapshot = trace.snapshot
        # a data-parallel front end's trace: the per-replica views say so
        self.data_parallel_size = (trace.header.get("config") or {}).get("data_parallel_size", 1)
        self.dashboard = Dashboard(self.budget, self.num_blocks)
        self.dashboard.show_data_parallel(self.data_parallel_size)
        # journeys and block lives are folded from the records shown, when a request or a block is opened
        self.dashboard.explanations.block_size = (trace.header.get("config") or {}).get("block_size", 16)
        self._shown = 0
        n = len(self.records)
        self.slider = pn.widgets.IntSlider(
            label="records shown", start=0, end=max(n, 1), value=0, disabled=not n, sizing_mode="stretch_width"
        )
        self.step_button = pn.widgets.Button(label="Step", color="primary", width=80)
        self.step_text = _step_text()
        self.slider.param.watch(lambda e: self.show(e.new), "value")
        self.step_button.on_click(lambda e: self._step_on())
        model, created = trace.header.get("model") or {}, trace.header.get("created", "?")
        title = title or f"Replay · `{model.get('name', '?')}` · {n} steps · recorded {created}"
        self.layout = pn.Column(
            f"## {title}",
            pn.Row(self.step_button, self.step_text, self.slider, align="center"),
            self.dashboard.tabs(),
            sizing_mode="stretch_width",
        )
        self.slider.value = n

    @classmethod
    def from_records(cls, records: Sequence[StepRecord], title: str) -> Replay:
        """The same dashboards over StepRecords held in memory (one instance's list from a PDCluster's
        `records()`, say), headed `title`; no trace file."""
        from workbench.trace import Trace

        return cls(Trace({}, list(records)), title)

    def __panel__(self) -> pn.Column:
        return self.layout

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> Any:
        bundle = self.layout._repr_mimebundle_(include, exclude)
        connect(self.layout)
        return bundle

    def servable(self, title: str = "Inference Workbench replay") -> pn.Column:
        return self.layout.servable(title=title)

    def _step_on(self) -> None:
        shown = self.slider.value
        if shown is not None and shown < len(self.records):
            self.slider.value = shown + 1

    def show(self, num_records: int) -> None:
        """Show the state after the first `num_records` records (on the trace's snapshot, if it begun mid-run)."""
        num_records = max(0, min(num_records, len(self.records)))
        with drawing(self.layout):
            if num_records < self._shown or self._shown == 0:
                self.dashboard.reset(self.budget, self.num_blocks, self.snapshot, self.data_parallel_size)
                self._shown = 0
            self.dashboard.extend(self.records[self._shown : num_records])
            self._shown = num_records
            first = self.snapshot.step if self.snapshot else 0
            self.step_text.object = _step_label(self.records[num_records - 1].step if num_records else first)


# ---- servers -----------------------------------------------------------------------------------------------
def _port_taken(port: int, exc: OSError, host: str = "127.0.0.1") -> OSError:
    return OSError(
        f"cannot serve on {host}:{port} ({exc.strerror or exc}): another server may hold it; "
        "pass --port to use another port"
    )


def check_port(port: int, host: str = "127.0.0.1") -> None:
    """Refuse a port another server holds before loading anything or announcing a URL (the server's own bind
    would fail only after that, with a bare "Address already in use")."""
    import socket

    with socket.socket() as s:
        # as the server's bind does: a port left in TIME_WAIT by a server that has stopped is free
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise _port_taken(port, exc, host) from None


def _server(
    app: Callable[[], Any], port: int, title: str, start: bool, announce: Callable[[str], Any] | None = None
) -> Any:
    """A Panel server on 127.0.0.1 only, its JavaScript inline (offline), no browser opened. `announce(url)` is
    called once the port is bound, before serving: a port another server holds fails first, with nothing said."""
    ensure_extension()
    origins = [f"127.0.0.1:{port}", f"localhost:{port}"]
    try:  # start=False: Bokeh binds the port here and serves nothing yet
        server = pn.serve(
            {"/": app},
            port=port,
            address="127.0.0.1",
            websocket_origin=origins,
            show=False,
            start=False,
            title=title,
            verbose=False,
            liveness=True,
        )  # /liveness: up, no session
    except OSError as exc:  # EADDRINUSE above all: taken since check_port
        raise _port_taken(port, exc) from None
    if announce is not None:
        announce(f"http://127.0.0.1:{port}/")
    if start:  # as pn.serve(start=True) does: runs until the loop stops (Ctrl-C)
        server.start()
        try:
            server.io_loop.start()
        except RuntimeError:  # a loop already running (inside Jupyter): it serves from there
            pass
    return server


def serve_replay(
    path: str | os.PathLike, port: int, start: bool = True, announce: Callable[[str], Any] | None = None
) -> Any:
    """Serve the Replay of a trace; the trace is read here, so a bad file fails before the server starts (an
    OSError or ValueError that names the file); `announce(url)` once it listens."""
    from workbench.trace import read_trace

    try:
        trace = read_trace(path)
    except UnicodeDecodeError:
        raise ValueError(f"{os.fspath(path)}: not a trace (not UTF-8 text)") from None
    except OSError as exc:
        raise OSError(f"cannot read the trace {os.fspath(path)!r}: {exc.strerror or exc}") from None
    return _server(lambda: Replay(trace).layout, port, "Inference Workbench replay", start, announce)
