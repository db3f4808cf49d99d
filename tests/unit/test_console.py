"""The Console's pages render the store (the browser test is in integration/):
the overview with its banner, filters and paging; a job's page with its
timeline lanes, attempts, output files, evidence lines and next commands; a
node's page; and who sees what on each."""
from __future__ import annotations

import pwd
import re
import time
from types import SimpleNamespace
from unittest.mock import patch

import pytest
from fastapi.testclient import TestClient

from recovery_agent.config import from_mapping
from recovery_agent.detect.model import Detection, Evidence
from recovery_agent.inputs.ingest import Ingest
from recovery_agent.interfaces.api import create_app
from recovery_agent.interfaces.console import Console
from recovery_agent.interfaces.console.timeline import LANES
from recovery_agent.interfaces.service import Caller, Service
from recovery_agent.scheduler.base import Job, Node
from recovery_agent.store import Store
from recovery_agent.watch.attempt import AttemptLines

ANA = Caller(1001, "ana", False)
BOB = Caller(1002, "bob", False)
ADMIN = Caller(0, "root", True)
TASK_EXITS = ("srun: error: node1: task 0: Exited with exit code 1",
              "srun: error: node2: task 3: Exited with exit code 9")


class _Slurm:
    """exclude asks Slurm which nodes exist; here, a Slurm of node1..node4."""

    def list_nodes(self, names=None):
        return [Node(name=f"node{i}", state="IDLE") for i in range(1, 5)]


@pytest.fixture(autouse=True)
def slurm_lists_its_nodes(monkeypatch):
    monkeypatch.setattr("recovery_agent.interfaces.service.scheduler_for", lambda cfg: _Slurm())


def config(**api):
    return from_mapping({"agent": {"cluster": "c1"}, "api": {"auth": "none", **api},
                         "environments": {"prod": {"mode": "action"},
                                          "ext": {"mode": "external"}}})


def detect(store, pk: int, attempt: int, found: list[Detection], now: float) -> None:
    """Store detections the way the watch loop does (a detection and its
    timeline event together)."""
    watch = SimpleNamespace(job_id="4410", attempt=attempt, job_pk=pk, found=[],
                            found_at=[], unstored=[])
    with patch("recovery_agent.store.timeline.time.time", return_value=now):
        AttemptLines._store(SimpleNamespace(store=store, _defer=None), watch, found, now)


def task_exit(text: str, line: int) -> Detection:
    return Detection(rule="slurm.task_exit", category="application",
                     evidence=(Evidence(text=text, source="/home/ana/slurm-4410.out",
                                        line=line),))


def make(tmp_path, **api):
    cfg = config(**api)
    store = Store(tmp_path / "r.db")
    job = Job(job_id="4410", numeric_id=4410, submit_time=1000, user="ana", name="llm<x>",
              state="FAILED", nodes=("node1", "node2"), start_time=1000,
              stdout="/home/ana/slurm-4410.out", stderr="/home/ana/slurm-4410.err")
    with store.lock:
        pk = store.record_job(job, "c1", env="prod", mode="", spec="prod")
        store.record_attempt(pk, job)
        store.add_event(pk, "hook_prolog", "prolog report from node1", attempt=0, ts=1000.0)
    detect(store, pk, 0, [task_exit(TASK_EXITS[0], 12)], 1001.0)
    detect(store, pk, 0, [task_exit(TASK_EXITS[1], 40)], 1002.0)
    with store.lock:
        store.add_event(pk, "verdict", "node: gpu_hardware -> requeue_exclude (node2)",
                        attempt=0, ts=1003.0)
        rec = store.add_recommendation({
            "job": pk, "attempt": 0, "job_id": "4410", "scope": "job",
            "action": "requeue_exclude", "rule": "hardware", "reason": "xid 79 on node2",
            "reason_category": "gpu_hardware",
            "target_nodes": ["node2"], "exclude": ["node2"], "mode": "action",
            "status": "proposed", "restart_at": 0, "env": "prod", "user": "ana"})
        store.add_recommendation({
            "job": pk, "attempt": 0, "job_id": "4410", "scope": "node", "parent": rec,
            "action": "drain_node", "rule": "hardware", "reason": "over budget",
            "target_nodes": ["node2"], "mode": "action", "status": "blocked_by_budget",
            "error": "drain budget spent", "user": "ana"})
    store.add_step(rec, "requeue_hold", "ok", "restart 0 -> 1", ts=1004.0)
    again = Job(job_id="4410", numeric_id=4410, submit_time=1010, user="ana", name="llm<x>",
                state="RUNNING", nodes=("node3", "node4"), restart_count=1, start_time=1010,
                end_time=99_999_999, stdout="/home/ana/slurm-4410.out")  # Slurm's estimate
    with store.lock:
        store.record_job(again, "c1", env="prod", mode="", spec="prod")
        store.record_attempt(pk, again)
        store.add_event(pk, "hook_prolog", "prolog report from node3", attempt=1, ts=1011.0)
    return store, TestClient(create_app(cfg, Ingest(store, "c1")))


def console(store) -> Console:
    return Console(Service(config(), store))


def add_job(store, job_id: str, user: str, state: str = "RUNNING", env: str = "prod",
            nodes=("node1",), name: str = "train") -> int:
    job = Job(job_id=job_id, numeric_id=int(job_id), submit_time=2000 + int(job_id),
              user=user, name=name, state=state, nodes=nodes)
    with store.lock:
        pk = store.record_job(job, "c1", env=env, mode="", spec=env)
        store.record_attempt(pk, job)
    return pk


def job_links(html: str) -> list[str]:
    return re.findall(r"href='/console/job/([^']+)'", html)


# -- the overview ---------------------------------------------------------------------
def test_overview_lists_jobs_open_and_blocked_recommendations_and_nodes(tmp_path):
    _, client = make(tmp_path)
    page = client.get("/console")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    text = page.text
    assert "href='/console/job/4410'" in text and "llm&lt;x&gt;" in text   # escaped
    assert "blocked_by_budget" in text and "drain budget spent" in text
    assert "data-part='/console/part/jobs'" in text and "setInterval(refresh" in text
    assert "href='/console/node/node2'" in text


def test_the_banner_shows_each_environments_mode_and_the_agents_health(tmp_path):
    store, client = make(tmp_path)
    client.post("/v1/environments/prod/mode", json={"mode": "monitor", "reason": "calm"})
    text = client.get("/console").text
    banner = text[text.index("<div id=\"banner\">"):text.index("<main>")]
    # who set it, when and why (the title), and the file's mode
    me = pwd.getpwuid(0).pw_name
    assert re.search(r'data-env="prod"><b>prod</b>\s*<span class="tag ">monitor</span>\s*'
                     r'<span class="muted" title="calm">\(set by ' + me + r' \d{4}-\d\d-\d\dT'
                     r'[\d:]+; configured action\)', banner), banner
    assert re.search(r'data-env="ext"><b>ext</b>\s*<span class="tag warn">external', banner)
    assert "NOT watching: no cycle yet" in banner and 'class="bad tag"' in banner
    store.set_state("heartbeat", {"time": time.time() - 3, "cycles": 41})
    banner = client.get("/console/job/4410").text
    assert re.search(r'id="health" class="ok tag">agent\s*watching: last cycle 3 s ago '
                     r'\(cycle 41\)\s*· store ok', banner), banner
    store.set_state("heartbeat", {"time": time.time() - 600, "cycles": 42})
    assert "NOT watching: last cycle 600 s ago" in client.get("/console").text


def test_the_job_list_filters_by_state_env_user_node_category_and_text(tmp_path):
    store, client = make(tmp_path)
    add_job(store, "5001", "bob", state="PENDING", env="ext", nodes=("node7",), name="vision")
    cat = add_job(store, "5002", "cat", nodes=("node2",), name="llm-small")
    with store.lock:
        store.record_detection(cat, 0, Detection(rule="nccl.timeout", category="nccl"))

    def listed(query: str) -> list[str]:
        return job_links(client.get(f"/console/part/jobs?{query}").text)

    assert listed("") == ["5002", "5001", "4410"]
    assert listed("state=PENDING") == ["5001"] and listed("env=ext") == ["5001"]
    assert listed("user=cat") == ["5002"] and listed("node=node2") == ["5002", "4410"]
    assert listed("node=node4") == ["4410"]                 # its second attempt's node
    assert listed("category=nccl") == ["5002"]
    assert listed("category=application") == []    # 4410's recommendation decided it
    assert listed("category=gpu_hardware") == ["4410"]
    assert listed("q=LLM") == ["5002", "4410"] and listed("q=501") == []
    assert listed("q=vis&env=ext&state=PENDING") == ["5001"]
    assert "no job matches these filters" in client.get("/console/part/jobs?user=zed").text
    page = client.get("/console?env=ext&q=vis").text
    assert job_links(page[page.index("id='jobs'"):page.index("id='nodes'")]) == ["5001"]
    assert "data-part='/console/part/jobs?env=ext&amp;q=vis'" in page   # refreshes the same
    form = page[page.index("<form"):page.index("</form>")]
    assert "<option selected>ext</option>" in form and 'value="vis"' in form
    for name in ("state", "env", "user", "category", "node", "q"):
        assert f'name="{name}"' in form, name


def test_the_job_list_pages_past_200_with_before(tmp_path):
    store, client = make(tmp_path)
    for n in range(250):
        add_job(store, str(6000 + n), "bob")
    seen, url, pages = [], "/console", 0
    while url:
        text = client.get(url).text
        part = text[text.index("id='job-list'"):text.index("id='nodes'")]
        seen += job_links(part)
        older = re.search(r"class=\"older\" href='([^']+)'", part)
        url = older and older.group(1).replace("&amp;", "&")
        pages += 1
    assert pages == 3 and len(seen) == 251 and len(set(seen)) == 251
    assert seen[0] == "6249" and seen[-1] == "4410"
    second = client.get("/console?before=99999&limit=50&user=bob").text
    assert len(job_links(second[second.index("id='job-list'"):])) == 50
    assert "&larr; newest" in second and "limit=50" in second


def test_a_user_lists_only_their_own_jobs_whatever_the_filters_say(tmp_path):
    store, _ = make(tmp_path)
    add_job(store, "5001", "bob", nodes=("node2",))
    view = console(store)
    assert job_links(view.jobs_part(ANA)) == ["4410"]
    assert job_links(view.jobs_part(ANA, {"user": "bob"})) == ["4410"]
    assert job_links(view.jobs_part(BOB, {"node": "node2"})) == ["5001"]
    assert job_links(view.jobs_part(ADMIN, {"user": "bob"})) == ["5001"]
    with store.lock:
        store.record_job(Job(job_id="5003", numeric_id=5003, submit_time=3, user="ana",
                             state="BOOT_FAIL"), "c1", env="secret-env")
    mine = view.overview(BOB)
    assert "name=\"user\"" not in mine and ">ana<" not in mine   # no other users offered
    assert "secret-env" not in mine and "BOOT_FAIL" not in mine   # nor their values
    assert "secret-env" in view.overview(ADMIN)
    assert "4410" not in mine[mine.index("id='jobs'"):mine.index("id='nodes'")]


# -- one job ----------------------------------------------------------------------------
def test_each_detection_shows_its_own_evidence_line(tmp_path):
    """Two detections of one rule: each row carries the line of its own
    detection (on main both showed the first: evidence was keyed by rule)."""
    store, client = make(tmp_path)
    text = client.get("/console/part/job/4410/timeline").text
    rows = re.findall(r"<tr id='ev-\d+' class='row-detected'>(.*?)</tr>", text, re.S)
    assert len(rows) == 2
    for row, line, number in zip(rows, TASK_EXITS, (12, 40)):
        assert "slurm.task_exit" in row
        (shown,) = re.findall(r"<div class='evidence'[^>]*>(.*?) <span", row, re.S)
        assert shown == line and f"slurm-4410.out:{number}" in row
    # and each names the detection it belongs to, whose line that is
    by_id = {d["id"]: d["evidence"]["lines"][0]["text"]
             for d in store.detections(store.find_job("c1", "4410")["id"])}
    for found, line in re.findall(r"data-detection='(\d+)'>(.*?) <span", text):
        assert by_id[int(found)] == line


def test_the_timeline_has_labelled_lanes_with_the_event_text_visible(tmp_path):
    _, client = make(tmp_path)
    text = client.get("/console/job/4410").text
    for name, label in LANES:
        assert f"<text class='lane-label' data-lane='{name}'" in text and f">{label}<" in text
        assert f"<th class='lane-{name}' data-lane='{name}'>{label}</th>" in text
    # the text of each event is in its lane's column, not only in a tooltip
    row = re.search(r"<tr id='ev-\d+' class='row-decision'>(.*?)</tr>", text, re.S).group(1)
    cells = re.findall(r"<td class='cell[^']*'>(.*?)</td>", row, re.S)
    assert [bool(c) for c in cells] == [False, False, False, True, False]
    assert "node: gpu_hardware -&gt; requeue_exclude (node2)" in cells[3]
    assert "requeue_hold ok restart 0 -&gt; 1" in text
    assert text.count("<circle class='ev") == 6   # prologs, detections, verdict, step


def test_the_timeline_marks_off_each_attempt(tmp_path):
    _, client = make(tmp_path)
    text = client.get("/console/part/job/4410/timeline").text
    assert text.startswith("<h2>Timeline</h2>") and "<html" not in text
    bands = re.findall(r"<rect class='attempt-band' data-attempt='(\d+)' x='([\d.]+)'", text)
    assert [b[0] for b in bands] == ["0", "1"] and float(bands[0][1]) < float(bands[1][1])
    assert ">attempt 0</text>" in text and ">attempt 1</text>" in text
    groups = re.findall(r"<tbody class='attempt' data-attempt='(\d+)'>\s*<tr class='attempt-head'>"
                        r"<td[^>]*>(.*?)</td>(.*?)</tbody>", text, re.S)
    assert [(g[0], g[1]) for g in groups] == [("0", "attempt 0 on node1, node2"),
                                              ("1", "attempt 1 on node3, node4")]
    assert "prolog report from node1" in groups[0][2] and "requeue_hold" in groups[0][2]
    assert "prolog report from node3" in groups[1][2] and "node1" not in groups[1][2]


def test_the_job_page_shows_each_attempts_output_files_and_next_commands(tmp_path):
    store, client = make(tmp_path)
    text = client.get("/console/job/4410").text
    rows = dict(re.findall(r"<tr data-attempt='(\d)'>(.*?)</tr>", text, re.S))
    assert "href='file:///home/ana/slurm-4410.out'" in rows["0"]
    assert ">/home/ana/slurm-4410.err</a>" in rows["0"]
    assert ">/home/ana/slurm-4410.out</a>" in rows["1"] and ".err" not in rows["1"]
    ended = [re.findall(r"<td>([^<]*)</td>", rows[n])[2] for n in "01"]
    assert ended == ["-", "-"]      # attempt 0 has no end recorded, attempt 1 runs still
    commands = re.findall(r"<code class='copyable'>(.*?)</code>", text)
    assert commands == ["recovery-ctl show job 4410", "recovery-ctl audit --job 4410",
                        "recovery-ctl cancel 1 --reason &#34;...&#34;",
                        "recovery-ctl show node node2"]
    # an external recommendation waiting for a site controller: ack it
    with store.lock:
        store.update_rec(1, mode="external")
    commands = re.findall(r"<code class='copyable'>(.*?)</code>",
                          client.get("/console/job/4410").text)
    assert "recovery-ctl ack 1" in commands


def test_a_user_gets_only_the_commands_they_may_run(tmp_path):
    store, _ = make(tmp_path)
    with store.lock:
        store.update_rec(1, mode="external")
    text = console(store).job_page("4410", ANA)
    commands = re.findall(r"<code class='copyable'>(.*?)</code>", text)
    assert "recovery-ctl ack 1" not in commands and "recovery-ctl show node node2" not in commands
    assert "recovery-ctl cancel 1 --reason &#34;...&#34;" in commands


def test_unknown_job_node_and_part_are_404(tmp_path):
    _, client = make(tmp_path)
    assert client.get("/console/job/999").status_code == 404
    assert client.get("/console/node/nodeZZ").status_code == 404
    assert client.get("/console/part/bogus").status_code == 404


def test_console_needs_the_token_when_one_is_set(tmp_path):
    token = tmp_path / "t"
    token.write_text("abc")
    _, client = make(tmp_path, read_token_file=str(token))
    assert client.get("/console").status_code == 401
    assert client.get("/console/node/node2").status_code == 401
    assert client.get("/console", headers={"Authorization": "Bearer abc"}).status_code == 200


# -- one node ---------------------------------------------------------------------------
def node_rig(tmp_path):
    store, client = make(tmp_path)
    ana = store.find_job("c1", "4410")["id"]
    bob = add_job(store, "5001", "bob", nodes=("node2", "node5"))
    report = store.add_report({"report_id": "r1", "hook": "epilog", "node": "node2",
                               "received": 1005.0, "job": ana, "attempt": 0})
    store.add_xid({"report": report, "job": ana, "attempt": 0, "node": "node2", "kind": "xid",
                   "xid": 79, "gpu_index": 1, "message": "GPU has fallen off the bus",
                   "raw": "NVRM: Xid (PCI:0000:3b:00): 79", "fingerprint": "a"})
    other = store.add_report({"report_id": "r2", "hook": "epilog", "node": "node2",
                              "received": 1006.0, "job": bob, "attempt": 0})
    store.add_xid({"report": other, "job": bob, "attempt": 0, "node": "node2", "kind": "xid",
                   "xid": 48, "message": "DBE", "raw": "NVRM: Xid 48", "fingerprint": "b"})
    store.add_strike("node2", "gpu_hardware", 1.0, ana, "ana", rec=1, ts=1007.0)
    store.add_strike("node2", "gpu_hardware", 0.5, bob, "bob", ts=1008.0)
    with store.transaction():
        store.set_node("node2", drained_by_us=1, drain_reason="recovery: 2 xid 79",
                       drained_at=1009.0, drain_slurm_reason="recovery: 2 xid 79",
                       drain_slurm_user="root", drain_slurm_time=1009)
        store.add_recommendation({"job": bob, "attempt": 0, "job_id": "5001", "scope": "node",
                                  "action": "drain_node", "reason": "dbe on node2",
                                  "target_nodes": ["node2"], "mode": "external",
                                  "status": "executing", "claimed_by": "uid:0",
                                  "user": "bob"})
    health = store.add_report({"report_id": "r3", "hook": "healthcheck", "node": "node2",
                               "received": 1010.0})
    store.add_xid({"report": health, "node": "node2", "kind": "xid", "xid": 94,
                   "raw": "NVRM: Xid 94 between jobs", "fingerprint": "c"})
    client.post("/v1/nodes/node2/exclude", json={"reason": "IB flaps, ticket 88"})
    return store, client


def test_the_node_page_shows_xids_strikes_drains_and_the_jobs_that_ran_there(tmp_path):
    store, client = node_rig(tmp_path)
    page = client.get("/console/node/node2")
    assert page.status_code == 200
    text = page.text
    section = {name: text[text.index(f"id='{name}'"):] for name in
               ("node", "xids", "strikes", "drains", "ran")}
    assert "drained by us" in section["node"] and "excluded by operator" in section["node"]
    assert "Slurm shows the drain as <span class='mono'>recovery: 2 xid 79</span>, set by root" \
        in section["node"]
    xids = section["xids"][:section["xids"].index("id='strikes'")]
    assert re.findall(r"<td>(\d+)</td>\s*<td>(\d+|-)</td>", xids) == \
        [("94", "-"), ("48", "-"), ("79", "1")]
    assert "GPU has fallen off the bus" in xids and job_links(xids) == ["5001", "4410"]
    strikes = section["strikes"][:section["strikes"].index("id='drains'")]
    assert job_links(strikes) == ["4410", "5001"] and "<td>#1</td>" in strikes
    drains = section["drains"][:section["drains"].index("id='ran'")]
    assert "#2 drain_node" in drains and "drain budget spent" in drains
    assert "the recovery agent (action mode)" in drains
    assert "uid:0 (external)" in drains and "dbe on node2" in drains
    assert re.search(r"exclude \(operator\)</td><td></td>\s*<td>root \(uid 0\)</td>\s*"
                     r"<td>IB flaps, ticket 88</td>", drains), drains
    assert job_links(section["ran"]) == ["5001", "4410"]
    commands = re.findall(r"<code class='copyable'>(.*?)</code>", text)
    assert commands == ["recovery-ctl show node node2", "recovery-ctl include node2"]
    # a node known only from the jobs that ran there has a page too
    assert job_links(client.get("/console/node/node5").text) == ["5001"]


def test_the_node_page_hides_other_users_jobs_and_users(tmp_path):
    store, _ = node_rig(tmp_path)
    view = console(store)
    text = view.node_page("node2", ANA)
    assert "5001" not in text and "bob" not in text
    assert set(job_links(text)) == {"4410"}
    assert text.count("another user's job") == 2        # bob's XID and bob's drain
    assert "NVRM: Xid 48" not in text and ">DBE<" in text   # his XID's kernel line hidden
    assert "NVRM: Xid 94 between jobs" in text               # nobody's: shown to all
    assert "and 1 attempt of other users' jobs" in text
    assert "recovery-ctl include" not in text and "recovery-ctl exclude" not in text
    theirs = view.node_page("node2", BOB)
    assert "4410" not in theirs and "ana" not in theirs and "5001" in theirs
    assert "5001" in view.node_page("node2", ADMIN) and "4410" in view.node_page("node2", None)


# -- the goodput page ------------------------------------------------------------------
def _goodput(tmp_path, monkeypatch, who=None, since="7d"):
    """The goodput page over tests/unit/test_ledger.py's XID recovery (an hour
    ago), and one more failed attempt whose loss is unknown (no checkpoint)."""
    from tests.unit import test_ledger as led
    monkeypatch.setattr(led, "T", float(int(time.time())) - 3600)
    store = Store(tmp_path / "r.db")
    led._xid_recovery(store)
    other = led._attempt(store, "4490", 0, led.T, led.T + 600, "FAILED", user="bob",
                         nodes=("node5",))
    led._rec(store, other, 0, "requeue", "interconnect", led.T + 600, led.T + 601,
             nodes=("node5",), running_again=led.T + 700)
    page = Console(Service(config(), store)).goodput_page(who, {"since": since})
    return page, store


def test_the_goodput_page_draws_its_charts_on_the_server(tmp_path, monkeypatch):
    page, _ = _goodput(tmp_path, monkeypatch)
    lost = re.findall(r"<rect class='lost-bar' data-category='([a-z_]+)'", page)
    assert lost == ["gpu_hardware"]            # the other incident's loss is unknown ...
    assert "0.20 GPU-h lost to gpu_hardware" in page
    assert re.search(r"class='unknown-mark'[^>]*>\?1<", page)   # ... and counted, not drawn
    assert "data-label='gpu_hardware'" in page and "median 40 s, p95 40 s" in page
    assert "data-label='prod'" in page                        # ETTR per environment
    worst = page[page.index("id='worst-nodes'"):page.index("id='blame'")]
    assert worst.index("node2") < worst.index("node5")       # most GPU-hours lost first
    assert "precision unknown" in page and "0 stop(s)" in page
    # no script from elsewhere, no chart library: the page is whole as served
    assert "<script src" not in page and "cdn" not in page.lower()


def test_a_user_sees_the_goodput_of_their_own_jobs(tmp_path, monkeypatch):
    page, _ = _goodput(tmp_path, monkeypatch, who=BOB)
    assert "of your jobs" in page and "4490" in page and "4410" not in page
    assert "<rect class='lost-bar'" not in page


def test_the_goodput_page_over_http_and_a_window_it_cannot_read(tmp_path, monkeypatch):
    _, store = _goodput(tmp_path, monkeypatch)
    client = TestClient(create_app(config(), Ingest(store, "c1")))
    answer = client.get("/console/goodput", params={"since": "90d"})
    assert answer.status_code == 200 and "<option selected>90d</option>" in answer.text
    fallback = client.get("/console/goodput", params={"since": "yesterday-ish"})
    assert fallback.status_code == 200 and "<option selected>30d</option>" in fallback.text
    assert "href='/console/goodput'" in client.get("/console").text
