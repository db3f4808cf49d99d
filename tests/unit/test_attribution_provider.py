"""Site attribution providers: a webhook or an entry point may overrule our
verdict; whatever goes wrong, ours is used, and the audit says which acted."""
from __future__ import annotations

import http.server
import json
import threading
import time

import pytest

from recovery_agent.config import from_mapping
from recovery_agent.inputs import provider as prov
from recovery_agent.detect.model import Detection, Evidence, Verdict
from recovery_agent.errors import ConfigError

NODES = ("n1", "n2")
OURS = Verdict(blame="application", category="cuda_error", action="requeue", confidence=0.6,
               reason="CUDA error", rests_on=(0,))
DETS = [Detection(rule="cuda.illegal_address", category="cuda_error",
                  evidence=(Evidence("RuntimeError: CUDA error", "job.out", 3, 1.0),))]


def consult(call, ours=OURS):
    return prov.Provider("test", call).consult("77", 0, NODES, "FAILED", DETS, ours)


def test_a_provider_verdict_overrules_ours_and_says_so():
    seen = {}

    def call(bundle):
        seen.update(bundle)
        return {"blame": "hardware", "nodes": ["n2"], "reason": "ticket HW-12: bad HBM"}
    got = consult(call)
    assert got.outcome == "used"
    v = got.verdict
    assert (v.blame, v.category, v.action, v.nodes) == ("node", "gpu_hardware",
                                                        "requeue_exclude", ("n2",))
    assert "HW-12" in v.reason and v.rests_on == (0,)
    assert seen["builtin_verdict"]["category"] == "cuda_error"
    assert seen["detections"][0]["evidence"][0]["text"] == "RuntimeError: CUDA error"
    json.dumps(seen)                                          # the bundle is JSON


@pytest.mark.parametrize("answer, why", [
    (None, "no verdict"), ([], "not a JSON object"), ({"blame": "gremlins"}, "blame must"),
    ({"blame": "hardware"}, "needs the nodes"), ({"blame": "hardware", "nodes": ["n9"]},
                                                 "not in the job"),
    ({"blame": "hardware", "nodes": "n1"}, "list of node names")])
def test_nonsense_answers_keep_our_verdict(answer, why):
    got = consult(lambda b: answer)
    assert got.verdict == OURS and got.outcome.startswith("kept ours") and why in got.outcome


def test_a_provider_that_raises_keeps_our_verdict():
    def boom(bundle):
        raise RuntimeError("database down")
    got = consult(boom)
    assert got.verdict == OURS and "database down" in got.outcome


def test_agreement_and_no_failure():
    got = consult(lambda b: {"blame": "application", "nodes": []})
    assert got.outcome == "used"        # same blame, but a different category: theirs acts
    same = Verdict(blame="application", category="application", action="stop",
                   confidence=0.9)
    assert consult(lambda b: {"blame": "application"}, same).outcome == "agreed"
    none = Verdict(blame="unknown", category=None, action="none", confidence=0.0)
    assert consult(lambda b: 1 / 0, none).outcome.startswith("not asked")


class Service(http.server.BaseHTTPRequestHandler):
    answer: dict = {}
    delay = 0.0
    bodies: list = []
    auth: list = []

    def do_POST(self):  # noqa: N802
        Service.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        Service.auth.append(self.headers.get("Authorization"))
        time.sleep(Service.delay)
        body = json.dumps(Service.answer).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            pass

    def log_message(self, *args):
        pass


@pytest.fixture
def service():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Service)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Service.bodies, Service.auth, Service.delay = [], [], 0.0
    yield f"http://127.0.0.1:{server.server_port}/attribute"
    server.shutdown()


def test_webhook_answers_and_gets_the_token(service, tmp_path):
    Service.answer = {"blame": "system_software", "nodes": ["n1"], "reason": "bad driver"}
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    cfg = from_mapping({"attribution": {"webhook_url": service,
                                        "webhook_token_file": str(token)}})
    got = prov.from_config(cfg).consult("77", 0, NODES, "FAILED", DETS, OURS)
    assert got.outcome == "used" and got.verdict.category == "system_software"
    assert Service.bodies[0]["job_id"] == "77" and Service.auth == ["Bearer s3cret"]


@pytest.mark.resilience("a site attribution webhook that hangs",
                        "it times out and the built-in verdict acts, with the outcome "
                        "recorded")
def test_a_hanging_webhook_times_out_and_ours_is_used(service):
    Service.answer, Service.delay = {"blame": "hardware", "nodes": ["n1"]}, 3.0
    cfg = from_mapping({"attribution": {"webhook_url": service, "webhook_timeout": "0.5s"}})
    started = time.monotonic()
    got = prov.from_config(cfg).consult("77", 0, NODES, "FAILED", DETS, OURS)
    assert time.monotonic() - started < 2.5
    assert got.verdict == OURS and "Timeout" in got.outcome


def test_config_is_checked():
    with pytest.raises(ConfigError, match="webhook_url"):
        from_mapping({"attribution": {"webhook_url": "ftp://x"}})
    assert prov.from_config(from_mapping({})) is None
    with pytest.raises(ValueError, match="no slurm_recovery.attribution entry point"):
        prov.from_config(from_mapping({"attribution": {"entry_point": "nope"}}))


def test_entry_point_provider(monkeypatch):
    class EP:
        name = "site"

        @staticmethod
        def load():
            return lambda bundle: {"blame": "hardware", "nodes": [bundle["nodes"][0]]}
    monkeypatch.setattr(prov, "entry_points", lambda group: [EP] if group == prov.GROUP
                        else [])
    p = prov.from_config(from_mapping({"attribution": {"entry_point": "site"}}))
    got = p.consult("77", 0, NODES, "FAILED", DETS, OURS)
    assert p.name == "entry point site" and got.verdict.nodes == ("n1",)


def test_the_watcher_records_whose_verdict_acted(tmp_path, monkeypatch):
    from recovery_agent import watch as watch_mod
    from recovery_agent.watch import verdicts as watch_verdicts
    from recovery_agent.detect.patterns import load_rules
    from recovery_agent.detect.scanner import Scanner
    from recovery_agent.inputs.logline import MemoryCursorStore
    from recovery_agent.inputs.tail import Tailer
    from recovery_agent.scheduler.base import Job
    from recovery_agent.store import Store
    monkeypatch.setattr(watch_verdicts, "EPILOG_GRACE", 0.0)
    out = tmp_path / "job.out"
    out.write_text("step 1\n")

    from tests.unit.scripted import Script as Listing
    listing = Listing()
    job = dict(job_id="5", numeric_id=5, submit_time=10, start_time=11, comment="recovery=prod",
               stdout=str(out), nodes=NODES, user="alice", user_id=0, group_id=0, name="t")
    cfg = from_mapping({"agent": {"cluster": "c1"}})
    store = Store(tmp_path / "r.db")
    provider = prov.Provider("test", lambda b: {"blame": "hardware", "nodes": ["n2"]})
    watcher = watch_mod.Watcher(cfg, store, listing, Scanner(load_rules(), engine="re"),
                                Tailer(MemoryCursorStore()), provider=provider)
    listing.jobs = [Job(state="RUNNING", **job)]
    assert watcher.run_once()
    with open(out, "a") as fh:
        fh.write("RuntimeError: CUDA error: an illegal memory access was encountered\n")
    listing.jobs = [Job(state="FAILED", exit_code=1, end_time=20, **job)]
    assert watcher.run_once() and watcher.run_once()
    (row,) = store.db["events"].rows_where("kind = 'verdict'")
    data = json.loads(row["data"])
    assert data["nodes"] == ["n2"] and data["category"] == "gpu_hardware"
    assert data["provider"] == {"name": "test", "outcome": "used"}
