"""schemathesis against the agent's OpenAPI document: generated requests to every
operation (reads, the Advisor calls, operator changes, hook ingest) never get a
5xx, and every answer conforms to the document: its status code is listed, its
content type and body match the schema of that status, its headers too; a call
without the credential its security asks for is refused, as is a request the
schema says is invalid. The app runs in-process over a store holding a job and
its recommendations, with munge authentication on: ``munge.verify_body`` is a
stand-in that knows one credential, an admin's (munge itself is tested live)."""
from __future__ import annotations

import tempfile
import time
from unittest import mock

import schemathesis
from hypothesis import HealthCheck, settings

from recovery_agent.interfaces.api import create_app
from recovery_agent.config import from_mapping
from recovery_agent.inputs.ingest import Ingest
from recovery_agent.scheduler.base import Job, Node
from recovery_agent.store import Store
from slurm_hooks import munge

_DIR = tempfile.mkdtemp(prefix="recovery-fuzz-")
ADMIN_CRED = "cred-admin"


def _verify(cred: str, body: bytes, socket: str = "") -> int:
    if cred != ADMIN_CRED:
        raise munge.MungeError("invalid credential")
    return 0


def _app():
    cfg = from_mapping({"agent": {"cluster": "c1", "state_dir": _DIR},
                        "api": {"auth": "munge", "admin_uids": "0", "hook_uids": "0"},
                        "environments": {"ext": {"mode": "external"}}})
    store = Store(f"{_DIR}/r.db")
    job = Job(job_id="42", numeric_id=42, submit_time=1000, user="nobody", state="FAILED")
    with store.lock:
        pk = store.record_job(job, "c1", env="ext", mode="", spec="ext")
        store.record_attempt(pk, job)
        for status in ("proposed", "done"):
            store.add_recommendation({
                "job": pk, "attempt": 0, "job_id": "42", "scope": "job" if status == "done"
                else "node", "action": "requeue_exclude", "rule": "hardware",
                "reason": "x", "target_nodes": ["node2"], "exclude": ["node2"],
                "mode": "external", "status": status, "restart_at": 0, "user": "nobody"})
        store.add_strike("node2", "gpu_hardware", 1.0, pk, "nobody")
        store.set_node("node2", cluster="c1", drained_by_us=1, drain_reason="recovery: 1 x",
                       drain_rec=1, last_health='{"hook": "health", "ok": false}')
    # a live watch loop: /healthz answers 200 (its 503 is on purpose, tested elsewhere)
    store.set_state("heartbeat", {"time": time.time() + 86400, "cycles": 1})
    return create_app(cfg, Ingest(store, "c1"))


class _Slurm:
    """exclude asks Slurm which nodes exist; here, a Slurm of node1..node3."""

    def list_nodes(self, names=None):
        return [Node(name=f"node{i}", state="IDLE") for i in (1, 2, 3)]


schema = schemathesis.openapi.from_asgi("/openapi.json", _app())


@schema.parametrize()
@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_every_answer_conforms_to_the_document(case):
    with mock.patch.object(munge, "verify_body", _verify), \
            mock.patch("recovery_agent.interfaces.service.scheduler_for", lambda cfg: _Slurm()):
        response = case.call_and_validate(headers={"Authorization": f"Munge {ADMIN_CRED}"})
    assert response.status_code < 500, (case.method, case.formatted_path, response.text[:300])
