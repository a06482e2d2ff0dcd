"""The app in a real browser: Playwright drives Debian's chromium through launch, live rounds and stop.

Screenshots are kept in test-artifacts/ (app-launch.png, app-live.png, app-stopped.png).
"""

import shutil
import time

import pytest
from app_helpers import app_server
from helpers import REPO

from hf_diloco import runs

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run", "--disable-quic"]
ARTIFACTS = REPO / "test-artifacts"


@pytest.fixture
def browser():
    if not shutil.which("chromium"):
        pytest.skip("Debian's chromium is not installed (apt-get install chromium; .ci/run installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        yield browser
        browser.close()


def fill(page, elem_id: str, value: str) -> None:
    page.locator(f"#{elem_id} textarea, #{elem_id} input").first.fill(value)


def test_launch_watch_and_stop_in_the_browser(browser, tmp_path):
    ARTIFACTS.mkdir(exist_ok=True)
    runs_dir = tmp_path / "runs"
    with app_server(runs_dir) as url:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(url)
        page.get_by_text("Preview command").wait_for(timeout=60_000)
        fill(page, "knob-inner_steps", "5")
        fill(page, "knob-max_steps", "400")
        page.click("#preview")
        page.get_by_text("Form is valid").wait_for(timeout=120_000)
        page.screenshot(path=str(ARTIFACTS / "app-launch.png"), full_page=True)
        assert "accelerate.commands.launch" in page.locator("#command").inner_text()

        page.click("#start")
        page.get_by_text("Started").wait_for(timeout=60_000)
        page.wait_for_function("document.querySelector('#hfd-status')?.dataset.status === 'running'",
                               timeout=60_000)
        page.get_by_role("tab", name="Live").click()
        deadline = time.time() + 240
        while "round" not in page.locator("#hfd-status").inner_text():
            assert time.time() < deadline, "no sync round reached the page"
            time.sleep(1)
        time.sleep(3)  # let the plots draw
        page.screenshot(path=str(ARTIFACTS / "app-live.png"), full_page=True)
        assert page.locator("#rounds table tbody tr").count() >= 1

        page.click("#stop")
        page.wait_for_function("document.querySelector('#hfd-status')?.dataset.status === 'stopped'",
                               timeout=240_000)
        page.screenshot(path=str(ARTIFACTS / "app-stopped.png"), full_page=True)
    (run,) = runs.list_runs(runs_dir)
    assert run.status == "stopped" and list((runs_dir / run.id / "output").glob("checkpoint-*"))
    assert runs.training_pids(run) == []
