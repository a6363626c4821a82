"""The served dashboard in a real Chromium: `workbench serve` on the default model with two requests queued (the
loop starts paused); `/` leads to `/dashboard`; clicking `Step` three times reads `step 3` and changes the KV block
map; `Play` runs them to the end on the serving loop; a request sent over HTTP with the `openai` client then shows
its row with its text, and `step N` advances; clicking its row opens its journey, and clicking block 1 on the block
map that block's life. With WORKBENCH_SCREENSHOTS=DIR (`make screenshots`), a screenshot goes to DIR/dashboard.png."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.net import serve_cli

CHROMIUM = Path("/usr/bin/chromium")
ROOT = Path(__file__).resolve().parents[2]
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

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason=f"{CHROMIUM} is missing: `apt-get install -y chromium` (CI installs it) to run the real-browser test",
    ),
]

BLOCK_KINDS = "() => Array.from(Bokeh.documents[0].get_model_by_name('kv_block_map').data.kind)"
# The y range the browser computed for the figure whose title starts with the argument, and the whole title.
Y_RANGE = """(title) => {
  for (const m of Bokeh.documents[0]._all_models.values())
    if (m.title != null && m.title.text !== undefined && m.title.text.startsWith(title))
      return [m.y_range.start, m.y_range.end, m.title.text];
  return null;
}"""


# Where the browser drew the cell at data (x, y) of the figure whose title starts with the first argument: page pixels.
CELL_XY = """([title, x, y]) => {
  const found = [];
  const visit = (view) => {
    if (view.model.title != null && String(view.model.title.text).startsWith(title)) found.push(view);
    for (const child of view.child_views ?? []) visit(child);
  };
  for (const root of Bokeh.index.roots) visit(root);
  const view = found[0], box = view.canvas_view.el.getBoundingClientRect();
  return [box.left + view.frame.x_scale.compute(x), box.top + view.frame.y_scale.compute(y)];
}"""


def _shown_step(page) -> int:
    return int(page.get_by_text(re.compile(r"^step \d+$")).inner_text().split()[1])


@pytest.fixture
def server_url():
    yield from serve_cli(
        [
            "--model",
            "smollm2-135m",
            "--num-kv-blocks",
            "64",
            "--max-tokens",
            "8",
            "--served-model-name",
            "smollm2",
            "--prompt",
            "The capital of France is",
            "--prompt",
            "A paged KV cache stores keys and values in fixed-size blocks",
        ],
        ROOT,
    )


def test_step_three_times_then_serve_http_in_chromium(server_url):
    sync_playwright = pytest.importorskip("playwright.sync_api").sync_playwright
    openai = pytest.importorskip("openai")
    requested: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.on("request", lambda request: requested.append(request.url))
            page.goto(server_url)
            assert page.url == f"{server_url}dashboard"
            page.get_by_text("step 0", exact=True).wait_for(timeout=30_000)
            before = page.evaluate(BLOCK_KINDS)
            assert before and set(before) == {"free"}, "no step yet: every block is free"
            step = page.get_by_role("button", name="Step", exact=True)
            for n in (1, 2, 3):
                step.click()
                page.get_by_text(f"step {n}", exact=True).wait_for(timeout=15_000)
            assert page.get_by_text("step 3", exact=True).is_visible()
            page.wait_for_function(f"() => ({BLOCK_KINDS})().includes('used')", timeout=10_000)
            after = page.evaluate(BLOCK_KINDS)
            assert after != before and "used" in after, "the two requests hold KV blocks after 3 steps"
            # at the default budget (2048), bars of ~20 tokens fill the chart: the axis fits the data
            low, high, title = page.evaluate(Y_RANGE, "Tokens per step")
            assert low == 0 and 20 <= high < 40 and "budget 2048" in title, (low, high, title)
            # Play releases the serving loop: it steps until both requests finish, and their blocks are freed
            page.get_by_role("button", name="Play", exact=True).click()
            page.wait_for_function(f"() => !({BLOCK_KINDS})().includes('used')", timeout=30_000)
            assert page.get_by_text(re.compile(r"^step ([4-9]|\d\d)$")).is_visible()
            steps_before = _shown_step(page)
            # a request over HTTP: its row and its text appear, and the step count moves on
            client = openai.OpenAI(base_url=f"{server_url}v1", api_key="none")
            reply = client.completions.create(
                model="smollm2",
                prompt="The capital of France is",
                max_tokens=4,
                temperature=0,
                extra_body={"request_id": "from-http"},
            )
            # the requests table's cells (the id is also an <option> of the block-table picker, hidden)
            page.locator(".tabulator-cell", has_text="cmpl-from-http").first.wait_for(timeout=15_000)
            page.locator(".tabulator-cell", has_text=reply.choices[0].text.strip()).first.wait_for(timeout=15_000)
            for _ in range(75):  # the page's `step N` follows the steps that request ran
                if _shown_step(page) > steps_before:
                    break
                page.wait_for_timeout(200)
            assert _shown_step(page) > steps_before
            # its row clicked: its journey, as the engine explains it (a prefill, then three decodes: 4 tokens)
            page.locator(".tabulator-cell[tabulator-field=request_id]", has_text="cmpl-from-http").first.click()
            page.get_by_text("Journey of request cmpl-from-http · finished (length)").wait_for(timeout=15_000)
            assert page.get_by_text("decode 1 token each").first.is_visible()
            # block 1 clicked on the map: its life, from the first prompt's first block on
            page.mouse.click(*page.evaluate(CELL_XY, ["KV blocks", 0, 0]))
            page.get_by_text(re.compile(r"^Life of block 1 · \d+ (life|lives) seen$")).wait_for(timeout=15_000)
            assert page.get_by_text("allocated at step 1 to req-0").is_visible()
            if SCREENSHOT_DIR:
                page.screenshot(path=str(Path(SCREENSHOT_DIR) / "dashboard.png"))
        finally:
            browser.close()
    offsite = [
        url
        for url in requested
        if not url.startswith(server_url.rstrip("/")) and not url.startswith(("data:", "blob:", "ws://127.0.0.1"))
    ]
    assert not offsite, f"the page must work offline (resources inline), but it asked for {offsite[:5]}"
