"""The tour in JupyterLab, in a real Chromium: JupyterLab on 127.0.0.1 over a copy of notebooks/00_tour.ipynb,
Kernel > Restart Kernel and Run All Cells, the dashboard renders, a click on its `Step` button moves its `step N`
text on. A screenshot goes to docs/img/tour.png. The repository's notebook is never opened, so JupyterLab
cannot save outputs into it."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.net import free_port, wait_for_http

CHROMIUM = Path("/usr/bin/chromium")
ROOT = Path(__file__).resolve().parents[1]
TOUR = ROOT / "notebooks" / "00_tour.ipynb"
SCREENSHOT = ROOT / "docs" / "img" / "tour.png"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
RUN_ALL_TIMEOUT_MS = 240_000  # the tour's cells on 2 busy CPU cores
STEP_TEXT = re.compile(r"^step (\d+)$")
KERNEL_IDLE = re.compile(r"^Python 3 \(ipykernel\) \| Idle$")  # the status bar, once the kernel is connected
RUNNING_PROMPT = re.compile(r"^\[(\*|\d+)\]:$")  # a code cell's prompt once it is queued or has run

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is missing: `apt-get install -y chromium` "
                       "(CI installs it) to run the real-browser test"),
]


@pytest.fixture
def lab_url(tmp_path):
    """JupyterLab over a temp folder holding a copy of the tour; its settings and workspaces live there too."""
    shutil.copy(TOUR, tmp_path / TOUR.name)
    home = tmp_path / ".jupyter"
    # JupyterLab 4 renders only the cells in view by default: the test reads cells anywhere in the notebook.
    # And no news toast over the screenshot (nor a request for news, offline).
    settings = {("notebook-extension", "tracker"): {"windowingMode": "none"},
                ("apputils-extension", "notification"): {"fetchNews": "false"}}
    for (extension, plugin), values in settings.items():
        path = home / "settings" / "@jupyterlab" / extension / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    port = free_port()
    env = {**os.environ, "PANEL_INLINE": "true", "JUPYTER_CONFIG_DIR": str(home / "config"),
           "JUPYTERLAB_SETTINGS_DIR": str(home / "settings"), "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces"),
           # the "python3" kernel is this interpreter's (jupyter_client maps a `python` argv to sys.executable)
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip", "127.0.0.1", "--port", str(port),
           "--IdentityProvider.token=", "--allow-root", "--ServerApp.root_dir", str(tmp_path)]
    log = open(tmp_path / "lab.log", "w")
    server = subprocess.Popen(cmd, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_http(f"{url}/api/status", server, timeout=60, name="jupyter lab")
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


def _step_number(text: str) -> int:
    return int(STEP_TEXT.match(text).group(1))


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


def test_tour_runs_and_steps_in_jupyterlab(lab_url):
    playwright = pytest.importorskip("playwright.sync_api")
    sync_playwright, expect = playwright.sync_playwright, playwright.expect
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 860})
            page.goto(f"{lab_url}/lab/tree/{TOUR.name}?reset")
            page.locator(".jp-Notebook").wait_for(timeout=60_000)
            _restart_and_run_all(page)
            # the last cell prints this line once every assertion of the tour has passed
            page.get_by_text(re.compile(r"^greedy == transformers: True")).wait_for(timeout=RUN_ALL_TIMEOUT_MS)
            step_text = page.get_by_text(STEP_TEXT)
            step_text.wait_for(timeout=30_000)
            before = step_text.inner_text().strip()
            step_button = page.get_by_role("button", name="Step", exact=True)
            step_button.scroll_into_view_if_needed()
            step_button.click()
            expect(step_text).not_to_have_text(before, timeout=60_000)
            after = step_text.inner_text().strip()
            assert _step_number(after) > _step_number(before), (before, after)
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SCREENSHOT))
        finally:
            browser.close()
    assert SCREENSHOT.stat().st_size < 400_000
