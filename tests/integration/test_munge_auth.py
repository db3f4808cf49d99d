"""Ingest authentication against the dev cluster's real munged: a report is
taken only with a fresh credential made for exactly its body."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import pytest
from fastapi.testclient import TestClient

from recovery_agent.interfaces.api import create_app
from recovery_agent.config import from_mapping
from recovery_agent.inputs.ingest import Ingest
from recovery_agent.store import Store
from slurm_hooks import munge
from tests.integration.conftest import wait_for

pytestmark = pytest.mark.live


def body(n: int = 1) -> bytes:
    return json.dumps({
        "version": 1, "hook": "health", "report_id": f"{n:032x}", "created": time.time(),
        "cluster": "devcluster", "node": "node1", "job": None,
        "gpus": {"ok": True, "count": 0, "gpus": []}, "xids": []}).encode()


@pytest.fixture
def client(devcluster, tmp_path):
    sock = str(devcluster.lay.munge_socket)
    cfg = from_mapping({"api": {"munge_socket": sock, "hook_uids": str(os.getuid())}})
    app = TestClient(create_app(cfg, Ingest(Store(tmp_path / "r.db"), "devcluster")))
    app.sock = sock
    return app


def post(client, data: bytes, cred: str):
    return client.post("/v1/hooks/health", content=data,
                       headers={"Authorization": f"Munge {cred}"})


def test_good_credential_is_taken(client):
    data = body()
    assert post(client, data, munge.sign_body(data, client.sock)).status_code == 201


def test_credential_for_another_body_is_refused(client):
    cred = munge.sign_body(body(1), client.sock)
    resp = post(client, body(2), cred)
    assert resp.status_code == 401 and "does not match" in resp.json()["error"]


def test_replayed_credential_is_refused(client):
    data = body(3)
    cred = munge.sign_body(data, client.sock)
    assert post(client, data, cred).status_code == 201
    resp = post(client, data, cred)
    assert resp.status_code == 401 and "Replayed" in resp.json()["error"]


def test_expired_credential_is_refused(client):
    data = body(4)
    cred = munge.sign_body(data, client.sock, ttl=1)
    time.sleep(2.2)
    resp = post(client, data, cred)
    assert resp.status_code == 401 and "Expired" in resp.json()["error"]


def test_garbled_credential_is_refused(client):
    data = body(5)
    cred = munge.sign_body(data, client.sock)
    forged = cred[:20] + ("A" if cred[20] != "A" else "B") + cred[21:]
    assert post(client, data, forged).status_code == 401


def test_credential_from_another_munge_key_is_refused(client, tmp_path):
    """A host with a different key (not in this cluster) cannot sign reports."""
    keydir = tmp_path / "otherkey"
    keydir.mkdir(mode=0o700)
    key = keydir / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    sock = tmp_path / "other.sock"
    proc = subprocess.Popen([shutil.which("munged"), "--foreground", "--force",
                             f"--key-file={key}", f"--socket={sock}",
                             f"--pid-file={tmp_path}/m.pid", f"--log-file={tmp_path}/m.log",
                             f"--seed-file={tmp_path}/m.seed"])
    try:
        wait_for(sock.exists, 10, "second munged")
        data = body(6)
        resp = post(client, data, munge.sign_body(data, str(sock)))
        assert resp.status_code == 401 and resp.json()["error"].startswith("munge:")
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_uid_not_allowed_is_forbidden(devcluster, tmp_path):
    sock = str(devcluster.lay.munge_socket)
    cfg = from_mapping({"api": {"munge_socket": sock, "hook_uids": "4242"}})
    app = TestClient(create_app(cfg, Ingest(Store(tmp_path / "r.db"), "devcluster")))
    data = body(7)
    resp = post(app, data, munge.sign_body(data, sock))
    assert resp.status_code == 403 and "may not send" in resp.json()["error"]
