"""The tour in JupyterLab, in a real Chromium: JupyterLab on 127.0.0.1 over a copy of notebooks/00_tour.ipynb,
Kernel > Restart Kernel and Run All Cells, then a click on the dashboard's `Step`. After each, what the browser
holds (Bokeh data sources, the requests table, `step N`) must equal what the kernel's dashboard holds, and that
must equal the StepRecords it was drawn from. The repository's notebook is never opened, so JupyterLab cannot
save outputs into it. With WORKBENCH_SCREENSHOTS=DIR (`make screenshots`), a screenshot goes to DIR/tour.png."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.net import free_port, stop, wait_for_http

CHROMIUM = Path("/usr/bin/chromium")
ROOT = Path(__file__).resolve().parents[1]
TOUR = ROOT / "notebooks" / "00_tour.ipynb"
SCREENSHOT_DIR = os.environ.get("WORKBENCH_SCREENSHOTS")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
RUN_ALL_TIMEOUT_MS = 240_000  # the tour's cells on 2 busy CPU cores
KERNEL_IDLE = re.compile(r"^Python 3 \(ipykernel\) \| Idle$")  # the status bar, once the kernel is connected
RUNNING_PROMPT = re.compile(r"^\[(\*|\d+)\]:$")  # a code cell's prompt once it is queued or has run

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason=f"{CHROMIUM} is missing: `apt-get install -y chromium` (CI installs it) to run the real-browser test",
    ),
]


@pytest.fixture
def lab_url(tmp_path):
    """JupyterLab over a temp folder holding a copy of the tour; its settings and workspaces live there too."""
    notebook = json.loads(TOUR.read_text(encoding="utf-8"))
    source = DUMP_CELL.format(path=str(tmp_path / "dashboard.json"), columns=SOURCE_COLUMNS)
    notebook["cells"].append(
        {
            "cell_type": "code",
            "metadata": {},
            "outputs": [],
            "execution_count": None,
            "source": source.strip().splitlines(keepends=True),
        }
    )
    (tmp_path / TOUR.name).write_text(json.dumps(notebook), encoding="utf-8")
    home = tmp_path / ".jupyter"
    # JupyterLab 4 renders only the cells in view by default: the test reads cells anywhere in the notebook.
    # And no news toast over the screenshot (nor a request for news, offline).
    settings = {
        ("notebook-extension", "tracker"): {"windowingMode": "none"},
        ("apputils-extension", "notification"): {"fetchNews": "false"},
    }
    for (extension, plugin), values in settings.items():
        path = home / "settings" / "@jupyterlab" / extension / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    port = free_port()
    env = {
        **os.environ,
        "PANEL_INLINE": "true",
        "JUPYTER_CONFIG_DIR": str(home / "config"),
        "JUPYTERLAB_SETTINGS_DIR": str(home / "settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces"),
        # the "python3" kernel is this interpreter's (jupyter_client maps a `python` argv to sys.executable)
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    cmd = [
        sys.executable,
        "-m",
        "jupyter",
        "lab",
        "--no-browser",
        "--ip",
        "127.0.0.1",
        "--port",
        str(port),
        "--IdentityProvider.token=",
        "--allow-root",
        "--ServerApp.root_dir",
        str(tmp_path),
    ]
    log = open(tmp_path / "lab.log", "w")
    server = subprocess.Popen(cmd, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_http(f"{url}/api/status", server, timeout=60, name="jupyter lab")
        yield url
    finally:
        stop(server)
        log.close()


# Appended to the copy of the tour: after Run All (and after every later step, e.g. a Step click), the kernel
# writes what its dashboard holds next to the records it was drawn from. The dump is queued where the
# Workbench draws (the kernel's event loop; a click may be handled on another thread), after that step's draw.
DUMP_CELL = """
import json as _json

def _dump_dashboard(_record=None, _path={path!r}):
    d = wb.dashboard
    state = {{"records": [{{"step": r.step, "num_waiting": r.num_waiting, "num_running": r.num_running,
                            "used": r.kv.used, "cached_free": r.kv.cached_free}} for r in records],
             "step_text": wb.step_text.object, "sources": {{}}}}
    for buf in (buf for view in d.views for buf in view._buffers):
        columns = SOURCE_COLUMNS.get(buf.source.name, ())
        state["sources"][buf.source.name] = {{c: list(buf.source.data[c]) for c in columns}}
    table = d.requests.table.value
    columns = ("request_id", "status", "num_output_tokens", "text")
    state["table"] = {{c: [str(v) for v in table[c]] for c in columns}}
    state["prompts"] = [r.prompt for r in d.state.requests.values()]
    with open(_path + ".tmp", "w") as f:
        _json.dump(state, f)
    import os as _os
    _os.replace(_path + ".tmp", _path)

SOURCE_COLUMNS = {columns!r}
_dump_dashboard()
engine.subscribe(lambda _record: wb._in_ui(_dump_dashboard))
print("dashboard dumped at", wb.step_text.object)
"""

# What the browser must hold, column by column, for the sources the tour's dashboard shows.
SOURCE_COLUMNS = {
    "scheduler_steps": ["step", "total", "num_waiting", "num_running"],
    "scheduler_timeline": ["step", "request_id", "phase", "num_tokens", "bottom", "top"],
    "kv_block_map": ["block_id", "kind", "holders", "ref_cnt"],
    "metrics_kv": ["step", "used", "cached_free", "total"],
    "prefix_hits": ["request_id", "hit_tokens", "queried_tokens"],
}

BROWSER_STATE = r"""(columns) => {
  const found = [];
  for (const doc of Bokeh.documents) {
    const state = {sources: {}, table: null, step_text: null};
    for (const m of doc._all_models.values()) {
      if (m.name in columns) {
        state.sources[m.name] = Object.fromEntries(columns[m.name].map((c) => [c, Array.from(m.data[c])]));
      }
      // the requests table, by its columns: other views have tables too (the speculative view's verifications)
      const wanted = ["request_id", "status", "num_output_tokens", "text"];
      if (m.type === "panel.models.tabulator.DataTabulator" && wanted.every((c) => c in m.source.data)) {
        state.table = Object.fromEntries(wanted.map(
          (c) => [c, Array.from(m.source.data[c]).map((v) => String(v))]));
      }
      if ((m.css_classes || []).includes("workbench-step")) state.step_text = m.text.match(/step \d+/)[0];
    }
    if (Object.keys(state.sources).length) found.push(state);
  }
  return found;
}"""


def _kernel_state(path: Path) -> dict:
    return json.loads(path.read_text())


def _browser_state(page) -> dict:
    found = page.evaluate(BROWSER_STATE, SOURCE_COLUMNS)
    assert len(found) == 1, f"expected one dashboard in the page, found {len(found)}"
    return found[0]


def _differences(kernel: dict, browser: dict) -> list[str]:
    """What the browser shows that the kernel's dashboard does not hold, and where the kernel's dashboard
    disagrees with the records it was drawn from."""
    out = []
    records = kernel["records"]
    steps = kernel["sources"]["scheduler_steps"]
    # the tour subscribes `records` just before it attaches the Workbench: both saw the same steps
    if steps["step"] != [r["step"] for r in records]:
        out.append(f"kernel dashboard steps {steps['step']} vs records {[r['step'] for r in records]}")
    if steps["num_running"] != [r["num_running"] for r in records]:
        out.append(f"kernel dashboard running {steps['num_running']} vs records")
    kinds = kernel["sources"]["kv_block_map"]["kind"]
    if (kinds.count("used"), kinds.count("cached")) != (records[-1]["used"], records[-1]["cached_free"]):
        out.append(
            f"kernel block map used/cached {kinds.count('used')}/{kinds.count('cached')} vs the last "
            f"record's {records[-1]['used']}/{records[-1]['cached_free']}"
        )
    if kernel["step_text"] != f"step {records[-1]['step']}":
        out.append(f"kernel step text {kernel['step_text']!r}, last record {records[-1]['step']}")
    if browser["step_text"] != kernel["step_text"]:
        out.append(f"browser step text {browser['step_text']!r}, kernel {kernel['step_text']!r}")
    for name, columns in kernel["sources"].items():
        for column, values in columns.items():
            shown = browser["sources"].get(name, {}).get(column)
            if shown != values:
                out.append(f"{name}.{column}: browser {shown!r:.200} vs kernel {values!r:.200}")
    if browser["table"] != kernel["table"]:
        out.append(f"requests table: browser {browser['table']!r:.300} vs kernel {kernel['table']!r:.300}")
    return out


def _wait_until_same(page, dump: Path, timeout_s: float, min_step: int = 0, console: list[str] = ()) -> dict:
    """Poll until the kernel's dashboard has drawn step `min_step` and the browser's equals it (changes
    arrive over the comm a moment after the kernel makes them)."""
    deadline = time.monotonic() + timeout_s
    while True:
        kernel = _kernel_state(dump)
        diff = _differences(kernel, _browser_state(page))
        if kernel["records"][-1]["step"] < min_step:
            diff.append(f"the kernel has not drawn step {min_step} yet")
        if not diff:
            return kernel
        if time.monotonic() > deadline:
            errors = [line for line in console if "rror" in line and "NAME_NOT_RESOLVED" not in line]
            pytest.fail("the browser's dashboard is not the kernel's:\n" + "\n".join(diff + errors[-20:]))
        time.sleep(0.5)


def _restart_and_run_all(page) -> None:
    """Kernel > Restart Kernel and Run All Cells…, confirmed; once more if no cell starts (a restart asked for
    while the kernel is still connecting is dropped)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    for _ in range(2):
        page.get_by_text(KERNEL_IDLE).wait_for(timeout=120_000)
        page.get_by_role("menuitem", name="Kernel", exact=True).click()
        page.get_by_text("Restart Kernel and Run All Cells…", exact=True).click()
        page.locator(".jp-Dialog .jp-mod-accept").click()  # "Confirm Kernel Restart"
        try:
            page.get_by_text(RUNNING_PROMPT).first.wait_for(timeout=60_000)
            return
        except PlaywrightTimeout:
            continue
    pytest.fail("Restart Kernel and Run All Cells did not start the notebook")


def test_run_all_then_step_shows_exactly_what_the_kernel_drew(lab_url, tmp_path):
    """Run All on the tour, then Step, then a request typed into the form and Step: each time the browser's data
    sources, requests table and `step N` equal the kernel's dashboard, which equals the records. It failed when
    Panel's retried messages arrived out of order, when the browser echoed streamed rows back into the kernel,
    when a click handled on a comm subshell dropped the changes of a draw in progress, when the form read
    the prompt before the field lost focus, when the page's first message reached its comm's subshell before
    the busy main shell had opened the comm (the kernel dropped it, and the page held the Step click for want
    of an ack), and when a click sent in one message with the typing before it ran before the typing landed."""
    playwright = pytest.importorskip("playwright.sync_api")
    dump = tmp_path / "dashboard.json"
    with playwright.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 860})
            console: list[str] = []
            page.on("console", lambda message: console.append(f"console {message.type}: {message.text}"))
            page.on("pageerror", lambda error: console.append(f"page error: {error}"))
            page.goto(f"{lab_url}/lab/tree/{TOUR.name}?reset")
            page.locator(".jp-Notebook").wait_for(timeout=60_000)
            _restart_and_run_all(page)
            page.get_by_text(re.compile(r"^dashboard dumped at step \d+")).wait_for(timeout=RUN_ALL_TIMEOUT_MS)
            page.get_by_text(KERNEL_IDLE).wait_for(timeout=60_000)

            def same(timeout_s: float, min_step: int = 0) -> dict:
                return _wait_until_same(page, dump, timeout_s, min_step, console)

            before = same(timeout_s=30)
            step_button = page.get_by_role("button", name="Step", exact=True)
            step_button.scroll_into_view_if_needed()
            playwright.expect(step_button).to_be_enabled()
            step_button.click()
            after = same(timeout_s=60, min_step=before["records"][-1]["step"] + 1)
            assert after["step_text"] == f"step {before['records'][-1]['step'] + 1}", "one click, one step"
            # the form takes the prompt as typed, the button clicked straight after (no blur first)
            typed = "Typed just now: the sky over Paris is"
            page.get_by_label("Prompt").fill(typed)
            page.get_by_role("button", name="Add request", exact=True).click()
            page.get_by_text(re.compile(r"request \d+ queued")).wait_for(timeout=30_000)
            step_button.click()
            added = same(timeout_s=60, min_step=after["records"][-1]["step"] + 1)
            assert added["prompts"][-1] == typed, added["prompts"]
            # at 1280 px, the requests table shows its text column in the notebook cell
            text_column = page.locator(".tabulator-col[tabulator-field='text']")
            text_column.scroll_into_view_if_needed()
            box = text_column.bounding_box()
            assert box is not None and box["x"] + box["width"] <= 1280, box
            if SCREENSHOT_DIR:  # the dashboard at the top, the file browser folded away
                page.locator(".jp-SideBar.jp-mod-left .lm-TabBar-tab.lm-mod-current").click()
                title = page.get_by_text(re.compile(r"^Inference Workbench · "))
                title.evaluate("element => element.scrollIntoView({block: 'start'})")
                page.wait_for_timeout(1000)
                page.screenshot(path=str(Path(SCREENSHOT_DIR) / "tour.png"))
        finally:
            browser.close()
