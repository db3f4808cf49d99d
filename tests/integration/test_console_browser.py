"""The Recovery Console in real headless Chromium (Debian's /usr/bin/chromium via
playwright), against an agent that has just recovered a job on the dev cluster.

It checks what an on-call admin works from: the banner (modes, agent health),
the job list's filters, search and paging, a job's timeline (labelled lanes,
the text of each event, attempts marked off, every detection beside its own
evidence line, checked against the store), output files and next commands,
a node's page, and the goodput page (its charts drawn on the server, checked
against GET /v1/goodput). It writes the screenshots in docs/ (console-jobs.png,
console-job.png, console-node.png, console-goodput.png): a rerun regenerates
them."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from recovery_agent.interfaces.console.timeline import LANES
from tests.integration.conftest import REPO, job_row, wait_for
from tests.integration.test_recovery_live import (final_rec, own_agent, running_again,
                                                  xid_under_job)

pytestmark = pytest.mark.live
CHROMIUM = "/usr/bin/chromium"
CTL = str(Path(sys.executable).parent / "recovery-ctl")
DOCS = Path(os.environ.get("RECOVERY_SCREENSHOT_DIR") or REPO / "docs")
# two detections of one rule with different lines: each must show its own
TASK_EXITS = ("srun: error: node1: task 0: Exited with exit code 3",
              "srun: error: node2: task 5: Exited with exit code 7")


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


def get(base: str, path: str) -> dict:
    with urllib.request.urlopen(f"{base}{path}", timeout=10) as answer:
        return json.loads(answer.read())


def shot(page, name: str) -> None:
    DOCS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(DOCS / name), full_page=True)
    assert (DOCS / name).stat().st_size > 10_000, name


# the timeline as the browser shows it, read in one go (the script swaps the
# section every few seconds, so no element is held across calls)
READ_TIMELINE = """() => {
  const t = document.querySelector('#timeline');
  return {
    axisLanes: [...t.querySelectorAll('svg#axis text.lane-label')].map(e => e.textContent),
    headLanes: [...t.querySelectorAll('table.lanes thead th[data-lane]')].map(e => e.textContent),
    bands: [...t.querySelectorAll('svg#axis rect.attempt-band')].map(e => e.dataset.attempt),
    bandLabels: [...t.querySelectorAll('svg#axis text.attempt-label')].map(e => e.textContent),
    groups: [...t.querySelectorAll('tbody.attempt')].map(g => ({
      attempt: g.dataset.attempt,
      head: g.querySelector('tr.attempt-head').innerText.trim(),
      rows: [...g.querySelectorAll('tr[id^=ev-]')].map(r => {
        const cells = [...r.querySelectorAll('td.cell')];
        const filled = cells.findIndex(c => c.innerText.trim() !== '');
        const ev = r.querySelector('.evidence');
        const box = cells[filled] ? cells[filled].getBoundingClientRect() : {height: 0};
        return {lane: r.className.replace('row-', ''), column: filled,
                text: cells[filled] ? cells[filled].innerText : '', shown: box.height > 0,
                detection: ev ? ev.dataset.detection : null,
                evidence: ev ? ev.firstChild.textContent.trim() : null};
      })}))
  };
}"""


def check_timeline(page, base: str, job_id: str, bad: str) -> None:
    seen = page.evaluate(READ_TIMELINE)
    labels = [label for _, label in LANES]
    assert seen["axisLanes"] == labels and seen["headLanes"] == labels
    # attempts marked off: a band on the axis and a section of rows each
    assert seen["bands"][:2] == ["0", "1"] and seen["bandLabels"][:2] == ["attempt 0",
                                                                         "attempt 1"]
    heads = {g["attempt"]: g["head"] for g in seen["groups"]}
    assert heads["0"].startswith("attempt 0 on ") and bad in heads["0"]
    assert heads["1"].startswith("attempt 1 on ") and bad not in heads["1"]
    rows = [r for g in seen["groups"] for r in g["rows"]]
    names = [name for name, _ in LANES]
    for row in rows:   # each event's text is shown, in its own lane's column
        assert row["shown"] and row["text"].strip(), row
        assert names[row["column"]] == row["lane"], row
    verdicts = [r["text"] for r in rows if r["lane"] == "decision" and "verdict" in r["text"]]
    assert verdicts and any(bad in text for text in verdicts)
    assert any("requeue_hold ok" in r["text"] for r in rows if r["lane"] == "step")
    check_pairing(rows, base, job_id)
    events = get(base, f"/v1/jobs/{job_id}/timeline")["events"]
    xids = [r for r in rows if r["text"].startswith("xid")]
    raw = {e["data"]["raw"] for e in events if e["kind"] == "xid"}
    assert xids and all(r["evidence"] in raw for r in xids)


def check_pairing(rows: list[dict], base: str, job_id: str) -> list[str]:
    """Every detection row shows the line of the detection its event names,
    as the store has it (no row shows another detection's line); the lines."""
    stored = {d["id"]: d for d in get(base, f"/v1/jobs/{job_id}")["detections"]}
    events = get(base, f"/v1/jobs/{job_id}/timeline")["events"]
    detected = [e for e in events if e["kind"] == "detected"]
    shown = [r for r in rows if r["lane"] == "detected" and r["text"].startswith("detected")]
    assert len(shown) == len(detected)
    for row, event in zip(shown, detected):
        assert row["detection"] == str(event["detection"]), (row, event)
        lines = stored[event["detection"]]["evidence"].get("lines") or []
        assert row["evidence"] == (lines[0]["text"] if lines else None), (row, lines)
    return [r["evidence"] for r in shown]


def test_console_after_a_recovery(devcluster, submit, tmp_path, cleanup, browser):
    agent = own_agent(devcluster, tmp_path)
    agent.start()
    try:
        job_id, out, bad = xid_under_job(submit, devcluster, tmp_path, cleanup, agent)
        # a second tracked job whose output holds two task exits (monitor: it only watches)
        script = "; ".join(f"echo '{line}'" for line in TASK_EXITS) + "; sleep 20"
        small = submit("-N1", "--recovery=act:monitor", "-o", "small-%j.out", script=script)
        row = job_row(agent, job_id)
        rec = final_rec(agent, row[0])
        assert rec["status"] == "done"
        wait_for(lambda: running_again(devcluster.scheduler(), job_id), 60, "running again")
        base = f"http://127.0.0.1:{agent.port}"
        wait_for(lambda: len(get(base, f"/v1/jobs/{small}")["detections"]) >= 2, 60,
                 "the small job's two detections")
        page = browser.new_page(viewport={"width": 1400, "height": 1000})

        # -- the overview: banner, live refresh, filters, search, paging --------------
        page.goto(f"{base}/console")
        banner = page.locator("#banner").inner_text()
        assert "act" in banner and "action" in banner and "watching: last cycle" in banner
        link = page.locator(f"#job-list a[href='/console/job/{job_id}']").first
        assert link.is_visible()
        assert "requeue_exclude" in page.locator("#job-list").inner_text()
        page.evaluate("window.__no_reload = 42")
        subprocess.run([CTL, "exclude", "node4", "--reason", "console test", "--url", base],
                       env=agent.environ(), check=True, capture_output=True, timeout=60)
        page.wait_for_function(
            "document.querySelector('#nodes').innerText.includes('excluded')", timeout=20000)
        assert page.evaluate("window.__no_reload") == 42       # swapped in, not reloaded
        shot(page, "console-jobs.png")

        def listed() -> list[str]:
            return page.eval_on_selector_all(
                "#job-list a[href^='/console/job/']", "els => els.map(e => e.textContent)")

        # other tests' jobs may be listed too: each check is about this test's two
        everything = listed()
        assert everything.index(small) < everything.index(job_id)      # newest first
        page.fill("input[name=q]", small)
        page.click("form.filters button[type=submit]")
        page.wait_for_url("**/console?*q=*")
        assert small in listed() and all(small in j for j in listed())
        page.goto(f"{base}/console?node={bad}")
        assert job_id in listed()
        page.goto(f"{base}/console?state=RUNNING&env=act")
        assert job_id in listed()
        page.goto(f"{base}/console?category=gpu_hardware")
        assert job_id in listed() and small not in listed()
        page.goto(f"{base}/console?node=nodeZZ")
        assert listed() == [] and "no job matches" in page.locator("#job-list").inner_text()
        page.goto(f"{base}/console?limit=1")                  # paging: one a page
        walked = listed()
        while page.locator("#job-list a.older").count():
            page.click("#job-list a.older")
            assert len(listed()) == 1
            walked += listed()
        assert walked == everything
        page.click("#job-list a.newest")
        assert listed() == everything[:1]

        # -- the job: timeline, output files, commands -----------------------------------
        page.goto(f"{base}/console/job/{job_id}")
        page.wait_for_selector("svg#axis circle.ev-step")
        assert page.locator("svg#axis circle.ev-step").count() >= 4   # hold, exclude, ...
        check_timeline(page, base, job_id, bad)
        attempts = page.locator("#attempts").inner_text()
        assert str(out) in attempts
        commands = page.locator("#commands").inner_text()
        assert f"recovery-ctl show job {job_id}" in commands
        assert f"recovery-ctl show node {bad}" in commands
        shot(page, "console-job.png")
        page.goto(f"{base}/console/job/{small}")
        seen = page.evaluate(READ_TIMELINE)
        rows = [r for g in seen["groups"] for r in g["rows"]]
        lines = check_pairing(rows, base, small)
        assert sorted(line for line in lines if "task" in (line or "")) == sorted(TASK_EXITS)

        # -- the node the XID hit ----------------------------------------------------------
        page.goto(f"{base}/console/job/{job_id}")
        page.click(f"#attempts a[href='/console/node/{bad}']")
        page.wait_for_url(f"**/console/node/{bad}")
        assert "79" in page.locator("#xids").inner_text()
        drains = page.locator("#drains").inner_text()
        assert "drain_node" in drains and "the recovery agent" in drains
        assert f"{job_id}" in page.locator("#ran").inner_text()
        assert "drained by us" in page.locator("#node").inner_text()
        shot(page, "console-node.png")
        subprocess.run([CTL, "include", "node4", "--url", base], env=agent.environ(),
                       check=True, capture_output=True, timeout=60)
        check_goodput(page, base, job_id, bad)
    finally:
        agent.stop()


def check_goodput(page, base: str, job_id: str, bad: str) -> None:
    """The goodput page after the recovery: the incident's lost GPU time in the
    chart under its category, ETTR for its environment, the faulted node among
    the worst, as GET /v1/goodput reports them."""
    def known():
        report = get(base, "/v1/goodput?since=1d")
        mine = [i for i in report["incidents"] if i["job_id"] == job_id]
        return report if mine and mine[0]["gpu_s_lost"] is not None else None
    report = wait_for(known, 60, "the incident's lost GPU time known")
    (inc,) = [i for i in report["incidents"] if i["job_id"] == job_id]
    page.goto(f"{base}/console/goodput?since=7d")
    drawn = page.eval_on_selector_all(
        "svg#lost rect.lost-bar", "els => els.map(e => [e.dataset.category, "
        "e.getBoundingClientRect().height])")
    assert any(cat == inc["category"] and height > 0 for cat, height in drawn), drawn
    ettr = page.eval_on_selector_all("#ettr g.bar-row", "els => els.map(e => e.dataset.label)")
    assert "act" in ettr, ettr
    assert bad in page.locator("#worst-nodes").inner_text()
    assert job_id in page.locator("#incidents").inner_text()
    assert page.locator("script[src]").count() == 0      # nothing fetched from elsewhere
    shot(page, "console-goodput.png")
