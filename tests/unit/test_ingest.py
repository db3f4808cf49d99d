"""Hook ingest: validation, atomic storage, idempotent replays, via the HTTP app."""
from __future__ import annotations

from dataclasses import replace

import copy
import json

import pytest
from fastapi.testclient import TestClient

from recovery_agent.interfaces.api import create_app
from recovery_agent.config import from_mapping
from recovery_agent.inputs.ingest import Ingest, ReportError, validate
from recovery_agent.inputs.jobcache import JobCache
from recovery_agent.scheduler.base import Job
from recovery_agent.store import Store

GPU0 = {"index": 0, "uuid": "GPU-aaaa", "name": "NVIDIA H100", "pci_bus_id": "00000000:3B:00.0",
        "pci_short": "0000:3b:00", "lost": False, "errors": {}}
GPU1 = dict(GPU0, index=1, uuid="GPU-bbbb", pci_bus_id="00000000:5E:00.0", pci_short="0000:5e:00")
XID79 = {"xid": 79, "kind": "xid", "pci": "0000:5e:00", "time": 1_800_000_100.0,
         "message": "GPU has fallen off the bus.",
         "raw": "2027-01-15T08:01:40+0000 node2 kernel: NVRM: Xid (PCI:0000:5e:00): 79, "
                "pid=1, name=python, GPU has fallen off the bus."}


def report(hook="prolog", **over) -> dict:
    body = {"version": 1, "hook": hook, "report_id": "0" * 31 + "1", "created": 1_800_000_000.0,
            "cluster": "c1", "node": "node2",
            "job": {"job_id": "1234", "attempt": 0, "spec": "prod:action", "user": "alice"},
            "gpus": {"ok": True, "error": None, "count": 2, "gpus": [GPU0, GPU1]},
            "xids": [], "preflight": {"mode": "report", "verdict": "ok", "faults": []}}
    if hook == "epilog":
        body["exit"] = {"code": 1, "signal": None}
    body.update(over)
    return body


class ListingScheduler:
    """Just enough of a scheduler for the job cache: a fixed listing."""

    def __init__(self, jobs: list[Job]) -> None:
        self.jobs = jobs
        self.calls = 0

    def list_jobs(self, job_ids=None) -> list[Job]:
        self.calls += 1
        return list(self.jobs)


@pytest.fixture
def app(tmp_path):
    store = Store(tmp_path / "r.db")
    cfg = from_mapping({"api": {"auth": "none"}, "agent": {"cluster": "c1"}})
    listed = [Job(job_id="1234", numeric_id=1234, state="RUNNING",
                  submit_time=1_799_999_000, nodes=("node1", "node2"))]
    cache = JobCache(ListingScheduler(listed), min_interval=0)
    cache.refresh()
    ingest = Ingest(store, "c1", cache)
    client = TestClient(create_app(cfg, ingest))
    client.store = store
    return client


def post(client, hook, body):
    return client.post(f"/v1/hooks/{hook}", content=json.dumps(body).encode())


def test_prolog_registers_job_attempt_and_snapshot(app):
    resp = post(app, "prolog", report())
    assert resp.status_code == 201, resp.text
    job = app.store.find_job("c1", "1234")
    assert job["submit_time"] == 1_799_999_000  # identity completed from the scheduler
    assert (job["env"], job["mode"], job["spec"]) == ("prod", "action", "prod:action")
    assert [a["attempt"] for a in app.store.attempts(job["id"])] == [0]
    row = next(app.store.db["node_reports"].rows)
    assert row["node"] == "node2" and row["gpu_count"] == 2 and row["job"] == job["id"]
    assert json.loads(row["gpus"])[1]["uuid"] == "GPU-bbbb"
    health = json.loads(app.store.db["nodes"].get("node2")["last_health"])
    assert health["ok"] and health["count"] == 2
    assert [e["kind"] for e in app.store.timeline(job["id"])] == ["hook_prolog"]


def test_xid_is_tied_to_node_gpu_and_job(app):
    assert post(app, "epilog", report("epilog", xids=[XID79])).status_code == 201
    (xid,) = list(app.store.db["xids"].rows)
    assert (xid["node"], xid["xid"], xid["gpu_index"], xid["gpu_uuid"]) == \
        ("node2", 79, 1, "GPU-bbbb")
    assert xid["job"] == app.store.find_job("c1", "1234")["id"]
    assert next(app.store.db["node_reports"].rows)["exit_code"] == 1


def test_duplicate_delivery_is_idempotent(app):
    body = report("epilog", xids=[XID79])
    assert post(app, "epilog", body).status_code == 201
    again = post(app, "epilog", body)
    assert again.status_code == 200 and again.json()["status"] == "duplicate"
    assert app.store.db["node_reports"].count == 1 and app.store.db["xids"].count == 1


def test_same_kernel_line_in_two_reports_is_one_xid_per_job(app):
    post(app, "prolog", report(xids=[XID79]))
    post(app, "epilog", report("epilog", report_id="0" * 31 + "2", xids=[XID79]))
    assert app.store.db["node_reports"].count == 2 and app.store.db["xids"].count == 1


def test_array_task_and_later_attempt(app):
    body = report(job={"job_id": "1200_7", "attempt": 2, "spec": "lab", "user": "bob"})
    assert post(app, "prolog", body).status_code == 201
    job = app.store.find_job("c1", "1200_7")
    assert job["restart_count"] == 2 and job["env"] == "lab" and job["mode"] == ""
    assert [a["attempt"] for a in app.store.attempts(job["id"])] == [2]


def test_invalid_comment_spec_is_flagged_and_only_monitored(app):
    body = report(job={"job_id": "1234", "attempt": 0, "spec": "prod:yolo", "user": "a"})
    assert post(app, "prolog", body).status_code == 201
    job = app.store.find_job("c1", "1234")
    assert (job["env"], job["mode"]) == ("default", "monitor")
    (flag,) = [e for e in app.store.timeline(job["id"]) if e["kind"] == "spec_invalid"]
    assert "invalid mode 'yolo'" in flag["message"]


def test_invalid_spec_is_flagged_once_per_job(app):
    """Every node's prolog and epilog carries the same bad spec: one flag."""
    spec = {"job_id": "1234", "attempt": 0, "spec": "prod:yolo", "user": "a"}
    for n, (hook, node) in enumerate([("prolog", "node2"), ("prolog", "node3"),
                                      ("epilog", "node2"), ("epilog", "node3")]):
        body = report(hook, node=node, job=spec, report_id=f"{n:032x}")
        assert post(app, hook, body).status_code == 201
    job = app.store.find_job("c1", "1234")
    flags = [e for e in app.store.timeline(job["id"]) if e["kind"] == "spec_invalid"]
    assert len(flags) == 1


def test_unknown_job_is_completed_by_the_background_refresh(tmp_path):
    """Ingest never waits for slurmctld: a job the cache has not listed yet is
    stored at once, and gets its submit time when the refresh lands."""
    sched = ListingScheduler([])
    cache = JobCache(sched, min_interval=0)
    ingest = Ingest(Store(tmp_path / "r.db"), "c1", cache)
    client = TestClient(create_app(from_mapping({"api": {"auth": "none"}}), ingest))
    assert post(client, "prolog", report()).status_code == 201
    cache.wait()
    assert ingest.store.find_job("c1", "1234")["submit_time"] == 0  # slurmctld had nothing
    sched.jobs = [Job(job_id="1234", numeric_id=1234, state="RUNNING", submit_time=1_799_999_000)]
    cache.refresh()
    (job,) = ingest.store.jobs()
    assert job["submit_time"] == 1_799_999_000
    # later reports land on the same row, now under its full key
    post(client, "epilog", report("epilog", report_id="0" * 31 + "9"))
    assert ingest.store.db["jobs"].count == 1


def test_reused_job_id_after_the_old_job_finished(tmp_path):
    store = Store(tmp_path / "r.db")
    old = store.record_job(Job(job_id="1234", numeric_id=1234, state="COMPLETED",
                               submit_time=1_700_000_000), cluster="c1")
    client = TestClient(create_app(from_mapping({"api": {"auth": "none"}}),
                                   Ingest(store, "c1")))
    assert post(client, "prolog", report()).status_code == 201
    new = store.find_job("c1", "1234")
    assert new["id"] != old and new["submit_time"] == 0


def test_a_stale_listing_of_a_reused_id_is_not_the_new_job(tmp_path):
    """slurmctld's state was reset and job id 1234 handed out again; the job
    cache still lists the old 1234, ended before the new job's first prolog
    was made. The prolog is a new job's: a row of its own, its own spec, and
    the old row keeps its directive (the live identity test found the old row
    taking the new job's reports under load)."""
    ended = Job(job_id="1234", numeric_id=1234, state="CANCELLED", submit_time=1_700_000_000,
                end_time=1_799_999_000, user="alice")
    sched = ListingScheduler([ended])
    cache = JobCache(sched, min_interval=0)
    cache.refresh()
    store = Store(tmp_path / "r.db")
    old = store.record_job(ended, cluster="c1", env="prod", mode="action", spec="prod:action")
    ingest = Ingest(store, "c1", cache)
    client = TestClient(create_app(from_mapping({"api": {"auth": "none"}}), ingest))
    job = {"job_id": "1234", "attempt": 0, "spec": "prod:monitor", "user": "alice"}
    assert post(client, "prolog", report(job=job)).status_code == 201
    rows = {r["id"]: r for r in store.db["jobs"].rows}
    assert len(rows) == 2 and rows[old]["mode"] == "action" and rows[old]["state"] == "CANCELLED"
    (new,) = [r for pk, r in rows.items() if pk != old]
    assert (new["mode"], new["submit_time"]) == ("monitor", 0)
    # a listing that ended after the report was made is this job: its own row
    late = report(job={**job, "job_id": "1235"}, report_id="0" * 31 + "2")
    sched.jobs = [replace(ended, job_id="1235", numeric_id=1235, end_time=1_800_000_100)]
    cache.refresh()
    assert post(client, "prolog", late).status_code == 201
    assert store.find_job("c1", "1235")["submit_time"] == 1_700_000_000


def test_a_first_prolog_never_revives_an_ended_row(tmp_path):
    """The RUNS=20 campaign: the job cache still listed the old job 1234 as
    RUNNING (a listing from before it was cancelled and slurmctld reset); the
    poller had marked its row gone and registered the new 1234 from its
    comment. The new job's first prolog belongs to the new row; the old row
    stays gone, with its own directive."""
    old_job = Job(job_id="1234", numeric_id=1234, state="RUNNING", submit_time=1_700_000_000,
                  user="alice")
    sched = ListingScheduler([old_job])
    cache = JobCache(sched, min_interval=0)
    cache.refresh()
    store = Store(tmp_path / "r.db")
    old = store.record_job(old_job, cluster="c1", env="prod", mode="action", spec="prod:action")
    store.db["jobs"].update(old, {"state": "GONE"})
    new_job = replace(old_job, state="PENDING", submit_time=1_799_999_990)
    new = store.record_job(new_job, cluster="c1", env="prod", mode="monitor", spec="prod:monitor")
    client = TestClient(create_app(from_mapping({"api": {"auth": "none"}}),
                                   Ingest(store, "c1", cache)))
    job = {"job_id": "1234", "attempt": 0, "spec": "prod:monitor", "user": "alice"}
    assert post(client, "prolog", report(job=job)).status_code == 201
    rows = {r["id"]: r for r in store.db["jobs"].rows}
    assert (rows[old]["state"], rows[old]["mode"]) == ("GONE", "action")
    assert [r["job"] for r in store.db["node_reports"].rows] == [new]


def test_health_report_needs_no_job(app):
    body = report("health", job=None)
    body.pop("preflight")
    assert post(app, "health", body).status_code == 201
    assert app.store.db["jobs"].count == 0


BAD = [
    ({"version": 2}, "version"),
    ({"hook": "epilog"}, "hook"),
    ({"report_id": "not-hex"}, "report_id"),
    ({"node": "node;rm -rf /"}, "node"),
    ({"node": None}, "node: missing"),
    ({"job": {"job_id": "12x", "attempt": 0, "spec": ""}}, "job.job_id"),
    ({"job": {"job_id": "12", "attempt": -1, "spec": ""}}, "job.attempt"),
    ({"job": {"job_id": "12", "attempt": True, "spec": ""}}, "job.attempt"),
    ({"job": {"job_id": "12", "attempt": 0, "spec": "x" * 3000}}, "job.spec"),
    ({"gpus": {"ok": True, "gpus": [{"index": "0"}]}}, "gpus.gpus[0].index"),
    ({"gpus": []}, "gpus"),
    ({"xids": [{"xid": "79", "raw": "x"}]}, "xids[0].xid"),
    ({"xids": [{"xid": 79}]}, "xids[0].raw"),
    ({"log_lines": [{"text": 5}]}, "log_lines[0].text"),
    ({"log_lines": "oops"}, "log_lines"),
    ({"delivery": ["spooled"]}, "delivery"),
    ({"delivery": {"spooled_at": "yesterday"}}, "delivery.spooled_at"),
    ({"delivery": {"spooled_at": float("nan")}}, "delivery.spooled_at: not a finite"),
    ({"delivery": {"tries": -1}}, "delivery.tries"),
    ({"delivery": {"by": "mallory"}}, "delivery.by"),
]


@pytest.mark.resilience("hostile input: hook bodies with wrong types",
                        "refused whole with 400 naming the field; nothing half-stored")
@pytest.mark.parametrize("change, field", BAD, ids=[f for _, f in BAD])
def test_bad_reports_are_refused_whole(app, change, field):
    body = report(xids=[XID79])
    body.update(change)
    resp = post(app, "prolog", body)
    assert resp.status_code == 400 and field in resp.json()["error"]
    for table in ("jobs", "attempts", "node_reports", "xids", "events"):
        assert app.store.db[table].count == 0, f"{table} was half-stored"


def test_not_json_and_unknown_hook(app):
    assert app.post("/v1/hooks/prolog", content=b"\xff\xfe{").status_code == 400
    assert post(app, "teardown", report()).status_code == 404


def test_munge_auth_is_required_by_default(tmp_path):
    client = TestClient(create_app(from_mapping({}), Ingest(Store(tmp_path / "r.db"), "c1")))
    resp = post(client, "prolog", report())
    assert resp.status_code == 401 and "Munge" in resp.json()["error"]
    resp = client.post("/v1/hooks/prolog", content=b"{}",
                       headers={"Authorization": "Munge not-a-credential"})
    assert resp.status_code == 401 and resp.json()["error"].startswith("munge:")


def test_validate_rejects_non_objects():
    with pytest.raises(ReportError):
        validate("prolog", [report()])
    with pytest.raises(ReportError):
        validate("prolog", copy.deepcopy(report(gpus={"gpus": [GPU0] * 65})))


@pytest.mark.resilience("hostile input: huge node names and lists in hook bodies",
                        "refused or capped with 400, nothing stored, the agent answers on")
@pytest.mark.parametrize("change", [{"node": "n" * 100_000},
                                    {"xids": [XID79] * 20_000},
                                    {"log_lines": [{"text": "x"}] * 50_000}],
                         ids=["100k-char node", "20k xids", "50k log lines"])
def test_huge_reports_are_refused_not_swallowed(app, change):
    body = report()
    body.update(change)
    resp = post(app, "prolog", body)
    assert resp.status_code in (400, 413), resp.text[:200]
    assert app.store.db["node_reports"].count == 0
    assert post(app, "prolog", report()).status_code in (200, 201)   # still answering


# -- finding 11: a report replayed from a node's spool is late, and says so ----------

def test_replayed_report_is_stored_late_with_its_delivery(app):
    assert post(app, "prolog", report()).status_code == 201
    late = {"spooled_at": 1_800_000_005.0, "tries": 3, "by": "health"}
    body = report("epilog", report_id="0" * 31 + "2", delivery=late)
    assert post(app, "epilog", body).status_code == 201
    rows = {r["hook"]: r for r in app.store.db["node_reports"].rows}
    assert rows["prolog"]["late"] == 0 and rows["prolog"]["spooled_at"] is None
    epilog = rows["epilog"]
    assert epilog["late"] == 1 and epilog["spooled_at"] == 1_800_000_005.0
    assert json.loads(epilog["delivery"]) == late and epilog["after_verdict"] == 0
    job = app.store.find_job("c1", "1234")
    line = [e for e in app.store.timeline(job["id"]) if e["kind"] == "hook_epilog"][0]
    assert line["message"].startswith("late epilog report from node2 (spooled ")
    assert line["message"].endswith("s ago, 3 tries, replayed by the health check)")
    assert line["data"]["delivery"] == late


def test_a_report_for_a_judged_attempt_is_marked_after_the_verdict(app):
    assert post(app, "prolog", report()).status_code == 201
    job = app.store.find_job("c1", "1234")
    app.store.add_event(job["id"], "verdict", "unknown: no failure -> none", attempt=0)
    body = report("epilog", report_id="0" * 31 + "2",
                  delivery={"spooled_at": 1_800_000_001.0, "tries": 1, "by": "replayer"})
    assert post(app, "epilog", body).status_code == 201
    row = app.store.db["node_reports"].get(2)
    assert row["after_verdict"] == 1 and row["counted_at"] is None
    line = [e for e in app.store.timeline(job["id"]) if e["kind"] == "hook_epilog"][0]
    assert "replayed by the epilog's replayer" in line["message"]
    assert line["message"].endswith(", after this attempt's verdict")


def test_a_report_sent_on_time_is_not_late(app):
    assert post(app, "epilog", report("epilog")).status_code == 201
    row = next(app.store.db["node_reports"].rows)
    assert (row["late"], row["delivery"], row["after_verdict"]) == (0, None, 0)


# ---- the degradation score on ingest (issue 20, first slice) ----------------

def health(n: int, every: float = 1200.0, **gpu1) -> dict:
    body = report("health", job=None, report_id=f"{n:032x}", created=1_800_000_000.0 + n * every)
    body.pop("preflight")
    body["gpus"] = {"ok": True, "error": None, "count": 2,
                    "gpus": [dict(GPU0, ecc_volatile_corrected=0), dict(GPU1, **gpu1)]}
    return body


@pytest.fixture
def scored(tmp_path):
    from recovery_agent.config.schema import ProactiveConfig
    store = Store(tmp_path / "r.db")
    cfg = from_mapping({"api": {"auth": "none"}, "agent": {"cluster": "c1"}})
    client = TestClient(create_app(cfg, Ingest(store, "c1", proactive=ProactiveConfig())))
    client.store = store
    return client


def test_rising_sbe_over_health_reports_is_recorded_once_per_change(scored):
    for n in range(4):      # 300 corrected errors per 20 minutes on GPU-bbbb
        assert post(scored, "health", health(n, ecc_volatile_corrected=300 * n)).status_code == 201
    rows = scored.store.node_degradation("node2")
    assert len(rows) == 1                    # one change (ok -> watch), not one per report
    rec = rows[0]
    assert (rec["gpu"], rec["level"], rec["previous_level"]) == ("GPU-bbbb", "watch", "ok")
    assert [r["rule"] for r in rec["rules"]] == ["sbe_rate"]
    assert rec["report"] == scored.store.report_by_id(f"{1:032x}")["id"]
    # a pending remap raises the level: a second record with both rules
    post(scored, "health", health(4, ecc_volatile_corrected=1200, remapped_rows_pending=True))
    newest = scored.store.node_degradation("node2")[0]
    assert newest["level"] == "degraded" and newest["previous_level"] == "watch"
    assert {r["rule"] for r in newest["rules"]} == {"sbe_rate", "row_remap_pending"}
    assert scored.store.last_degradation("node2", "GPU-aaaa") is None   # the quiet GPU


def test_gpu_reset_clears_without_a_false_rate(scored):
    for n in range(3):
        post(scored, "health", health(n, ecc_volatile_corrected=5000 + 300 * n))
    assert scored.store.last_degradation("node2", "GPU-bbbb")["level"] == "watch"
    # the GPU is reset: the volatile count falls to 0 and stays low for 7 hours
    for n in range(3, 25):
        post(scored, "health", health(n, ecc_volatile_corrected=n - 3))
    last = scored.store.last_degradation("node2", "GPU-bbbb")
    assert last["level"] == "ok" and last["cleared"] == ["sbe_rate"]
    assert len(scored.store.node_degradation("node2")) == 2


def test_odd_counter_values_are_no_data_not_a_crash(scored):
    for n in range(3):
        assert post(scored, "health", health(n, ecc_volatile_corrected="lots",
                                             remapped_rows_pending="yes",
                                             nvlink=[{"link": "x", "replay": 5}])
                    ).status_code == 201
    assert scored.store.node_degradation("node2") == []


def test_without_thresholds_nothing_is_scored(app):
    for n in range(3):
        post(app, "health", health(n, ecc_volatile_corrected=900 * n))
    assert app.store.node_degradation("node2") == []


def test_a_reset_gpu_xid_in_a_health_report_degrades_its_gpu(scored):
    """The kernel log's Xid 119 on GPU-bbbb's PCI address (the catalog's RESET_GPU
    bucket) while its job runs: degraded, recorded once; the other GPU is not."""
    xid = dict(XID79, xid=119, message="Timeout after 45s of waiting for RPC response",
               raw=XID79["raw"].replace("79, pid=1, name=python, GPU has fallen off the bus.",
                                        "119, pid=1, name=python, Timeout after 45s of "
                                        "waiting for RPC response from GPU1 GSP!"))
    post(scored, "health", health(0))
    with_xid = health(1)
    with_xid["xids"] = [xid]
    assert post(scored, "health", with_xid).status_code == 201
    post(scored, "health", health(2))
    (rec,) = scored.store.node_degradation("node2")
    assert (rec["gpu"], rec["level"]) == ("GPU-bbbb", "degraded")
    assert [r["rule"] for r in rec["rules"]] == ["xid_reset_soon"]
    # read back from the store by a fresh ingest (a restarted agent): the same score
    from recovery_agent.config.schema import ProactiveConfig
    from recovery_agent.detect import degradation
    again = Ingest(scored.store, "c1", proactive=ProactiveConfig())
    again._degradation(health(3), 0, "c1")
    assert scored.store.node_degradation("node2")[0]["id"] == rec["id"]   # nothing changed
    xids = scored.store.node_xids_since("node2", 0)
    assert [x["xid"] for rows in xids.values() for x in rows] == [119]
    assert degradation.RULES["xid_reset_soon"] == 1.0


def test_the_node_series_is_read_from_the_store_once_and_kept_up(scored, monkeypatch):
    """Each report used to read every report of its node in the window again,
    so ingest slowed as a node's reports piled up (the hooks benchmark fell
    from ~180 to ~12 reports/s over 900 reports of one node)."""
    reads = []
    real = scored.store.reports_since
    monkeypatch.setattr(scored.store, "reports_since",
                        lambda *a, **k: reads.append(a) or real(*a, **k))
    for n in range(4):
        post(scored, "health", health(n, ecc_volatile_corrected=300 * n))
    assert len(reads) == 1
    # the same records as reading the store each time gave (see the test above)
    (rec,) = scored.store.node_degradation("node2")
    assert (rec["gpu"], rec["level"]) == ("GPU-bbbb", "watch")
    # a report that reads no counter changes nothing the score reads: not scored
    bare = health(5)
    bare["gpus"] = {"ok": False, "error": "NVML: driver not loaded", "count": 0, "gpus": []}
    post(scored, "health", bare)
    post(scored, "health", health(6, ecc_volatile_corrected=1800, remapped_rows_pending=True))
    assert len(reads) == 1
    assert scored.store.node_degradation("node2")[0]["level"] == "degraded"
