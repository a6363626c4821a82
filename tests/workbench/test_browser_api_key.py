"""One key for every door, in a real Chromium (issue #39): `workbench serve tiny-llama --api-key KEY` with a request
queued (the loop paused). Without the key the dashboard's page is the login form and nothing else, its websocket is
refused, the hold routes answer 401, and the engine's step count stays 0. With the key typed once into the form, the
dashboard works (Step moves the engine to step 1), and the browser stays signed in on reload; a fresh browser is
refused again."""

from __future__ import annotations

import httpx
import pytest

from tests.net import serve_cli
from tests.workbench.test_browser import CHROMIUM, CHROMIUM_ARGS, ROOT

KEY = "door-key-39"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason=f"{CHROMIUM} is missing: `apt-get install -y chromium` (CI installs it) to run the real-browser test",
    ),
]

# from the page, without the key: does the dashboard's websocket open, and what do the hold routes answer?
TRY_THE_DOORS = """async () => {
  const opened = await new Promise((resolve) => {
    const ws = new WebSocket(`ws://${location.host}/dashboard/ws`);
    ws.onopen = () => { ws.close(); resolve(true); };
    ws.onerror = () => resolve(false);
    ws.onclose = () => resolve(false);
  });
  const statuses = [];
  for (const path of ['/step', '/pause', '/resume'])
    statuses.push((await fetch(path, {method: 'POST'})).status);
  return {opened, statuses};
}"""


@pytest.fixture
def keyed_server():
    for url in serve_cli(
        [
            "tiny-llama",
            "--api-key",
            KEY,
            "--num-kv-blocks",
            "64",
            "--max-tokens",
            "8",
            "--prompt",
            "The capital of France is",
        ],
        ROOT,
    ):
        yield url.rstrip("/")


def _engine_step(url: str) -> int:
    reply = httpx.get(f"{url}/is_paused", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()["step"]


def test_without_the_key_the_page_refuses_and_no_control_reaches_the_engine(keyed_server):
    sync_playwright = pytest.importorskip("playwright.sync_api").sync_playwright
    url = keyed_server
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            response = page.goto(f"{url}/dashboard")
            assert response.status == 401
            assert page.locator("input[name=key]").is_visible()
            assert page.get_by_text("step 0", exact=True).count() == 0 and "Bokeh" not in page.content()
            doors = page.evaluate(TRY_THE_DOORS)
            assert doors == {"opened": False, "statuses": [401, 401, 401]}, doors
            assert _engine_step(url) == 0  # nothing reached the engine

            page.fill("input[name=key]", "a wrong key")
            page.click("button[type=submit]")
            page.get_by_text("That key is not this server's.").wait_for(timeout=15_000)
            assert _engine_step(url) == 0

            page.fill("input[name=key]", KEY)  # once: the session cookie keeps it
            page.click("button[type=submit]")
            page.get_by_text("step 0", exact=True).wait_for(timeout=60_000)
            assert page.url == f"{url}/dashboard"
            page.get_by_role("button", name="Step", exact=True).click()
            page.get_by_text("step 1", exact=True).wait_for(timeout=30_000)
            assert _engine_step(url) == 1  # the signed-in page's Step reached the engine
            page.reload()
            page.get_by_text("step 1", exact=True).wait_for(timeout=60_000)  # still signed in

            stranger = browser.new_context().new_page()  # another browser session: no cookie
            assert stranger.goto(f"{url}/dashboard").status == 401
            assert stranger.evaluate(TRY_THE_DOORS) == {"opened": False, "statuses": [401, 401, 401]}
            assert _engine_step(url) == 1
        finally:
            browser.close()
