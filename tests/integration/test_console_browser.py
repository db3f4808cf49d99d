"""The Recovery Console in real headless Chromium (Debian's /usr/bin/chromium via
playwright), against an agent that has just recovered a job on the dev cluster."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import job_row, wait_for
from tests.integration.test_recovery_live import (final_rec, own_agent, running_again,
                                                  xid_under_job)

pytestmark = pytest.mark.live
CHROMIUM = "/usr/bin/chromium"
CTL = str(Path(sys.executable).parent / "recovery-ctl")


@pytest.fixture
def browser():
    from playwright.sync_api import sync_playwright
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: apt-get install chromium (make deps does)")
    with sync_playwright() as p:
        instance = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                     args=["--no-sandbox", "--disable-gpu"])
        yield instance
        instance.close()


def test_console_shows_a_recovered_job_and_refreshes_in_place(devcluster, submit, tmp_path,
                                                              cleanup, browser):
    agent = own_agent(devcluster, tmp_path)
    agent.start()
    try:
        job_id, _, bad = xid_under_job(submit, devcluster, tmp_path, cleanup, agent)
        row = job_row(agent, job_id)
        rec = final_rec(agent, row[0])
        assert rec["status"] == "done"
        wait_for(lambda: running_again(devcluster.scheduler(), job_id), 60, "running again")
        base = f"http://127.0.0.1:{agent.port}"
        page = browser.new_page(viewport={"width": 1400, "height": 1000})

        page.goto(f"{base}/console")
        link = page.locator(f"a[href='/console/job/{job_id}']").first
        assert link.is_visible()
        assert "requeue_exclude" in page.locator("#jobs").inner_text()
        page.evaluate("window.__no_reload = 42")
        subprocess.run([CTL, "exclude", "node4", "--reason", "console test", "--url", base],
                       env=agent.environ(), check=True, capture_output=True, timeout=60)
        page.wait_for_function(
            "document.querySelector('#nodes').innerText.includes('excluded')", timeout=20000)
        assert page.evaluate("window.__no_reload") == 42       # swapped in, not reloaded
        page.screenshot(path=str(tmp_path / "console.png"), full_page=True)

        link.click()
        page.wait_for_selector("svg#axis circle.ev-step")
        assert page.locator("svg#axis circle.ev-step").count() >= 4   # hold, exclude, ...
        assert page.locator("svg#axis circle.ev-detected").count() >= 1
        timeline = page.locator("#timeline").inner_text()
        for text in ("requeue_hold ok", "exclude ok", "release ok", "verdict", "XID 79",
                     f"{bad}", "hook_epilog"):
            assert text in timeline, text
        page.screenshot(path=str(tmp_path / "console-job.png"), full_page=True)
        assert (tmp_path / "console-job.png").stat().st_size > 10_000
        target = os.environ.get("RECOVERY_SCREENSHOT_DIR")
        if target:
            for name in ("console.png", "console-job.png"):
                shutil.copy(tmp_path / name, Path(target) / name)
        subprocess.run([CTL, "include", "node4", "--url", base], env=agent.environ(),
                       check=True, capture_output=True, timeout=60)
    finally:
        agent.stop()
