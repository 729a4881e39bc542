"""The browser the viewer's page tests open it in: Debian's headless Chromium driven by playwright.

Without either the tests that ask for ``open_page`` are skipped, saying which is missing.
"""

import shutil
import tempfile
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
# offline and quiet: this machine's network is closed, and Chromium's background connections would be refused
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="browser tests need `pip install playwright`")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"browser tests need Chromium at {CHROMIUM}: `apt-get install -y chromium`")
    profile = tempfile.mkdtemp(prefix="partita-chromium-")
    with sync_api.sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, args=CHROMIUM_ARGS,
                                                        headless=True, viewport={"width": 1400, "height": 1000})
        yield context
        context.close()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture
def open_page(browser, tmp_path):
    """Write the page to a file, open it offline, wait for it to draw; fail on any console error or request."""
    opened = []

    def open_(html: str):
        path = tmp_path / f"page{len(opened)}.html"
        path.write_text(html)
        page = browser.new_page()
        problems: list[str] = []
        page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}")
                if m.type in ("error", "warning") else None)
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
        page.on("requestfailed", lambda r: problems.append(f"failed request: {r.url}"))
        page.on("request", lambda r: None if r.url.startswith(("file://", "data:", "blob:")) else
                problems.append(f"network request: {r.url}"))
        page.goto(path.as_uri())
        page.wait_for_selector("body[data-ready]", timeout=15_000)
        assert page.get_attribute("body", "data-ready") == "1", page.text_content("#app")
        opened.append((page, problems))
        return page

    yield open_
    for page, problems in opened:
        assert problems == []
        page.close()
