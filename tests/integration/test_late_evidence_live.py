"""Issue 14, finding 11 live: a node's epilog cannot reach the agent while its
job fails, so its XID report goes to the node's spool; the verdict waits for the
replay, and the job is requeued without that node, which is drained.

The node is cut off the way a node-local fault cuts it off: its hooks' wrapper
points them at an agent address where nothing answers (a copy of the cluster's
recovery.toml with another ``agent_url``), while every other node reaches the
agent. Each test runs an agent on a store of its own.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from recovery_devtools.devcluster.inject import clear_node, inject_xid
from tests.integration.conftest import AgentProcess, job_row, wait_for
from tests.integration.test_recovery_live import final_rec, job_now, recs, running_again

pytestmark = pytest.mark.live


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Relay:
    """A TCP relay from ``port`` to the agent: the network between the node and
    the agent healing. Nothing listens on ``port`` until :meth:`start`."""

    def __init__(self, port: int, target: int) -> None:
        self.port, self.target = port, target
        self.server: socket.socket | None = None

    def start(self) -> None:
        self.server = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while self.server is not None:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target), timeout=10)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(65536):
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.close()


@contextlib.contextmanager
def cut_off(devcluster, node: str, hooks: tuple[str, ...], port: int):
    """``node``'s ``hooks`` send to 127.0.0.1:``port`` instead of the agent."""
    lay = devcluster.lay
    blocked = lay.etc / f"recovery-{node}-cut-off-{port}.toml"
    text = lay.agent_config.read_text()
    blocked.write_text("\n".join(f'agent_url = "http://127.0.0.1:{port}"'
                                 if line.startswith("agent_url =") else line
                                 for line in text.splitlines()) + "\n")
    originals = {}
    for hook in hooks:
        wrapper = lay.hook_wrapper(hook)
        originals[wrapper] = wrapper.read_text()
        line = f"RECOVERY_CONFIG={lay.agent_config}\n"
        assert line in originals[wrapper], wrapper
        _write(wrapper, originals[wrapper].replace(
            line, line + f'[ "$SLURMD_NODENAME" = {node} ] && RECOVERY_CONFIG={blocked}\n'))
    try:
        yield blocked
    finally:
        for wrapper, text in originals.items():
            _write(wrapper, text)
        blocked.unlink(missing_ok=True)


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.chmod(0o755)
    os.replace(tmp, path)


def timeline(agent, job_pk: int, kind: str) -> list[str]:
    return [r[0] for r in agent.query("select message from events where job = ? and kind = ? "
                                      "order by id", job_pk, kind)]


@pytest.fixture
def late_agent(devcluster, tmp_path):
    a = AgentProcess(devcluster, db=tmp_path / "recovery.db")
    a.start()
    yield a
    a.stop()


def start_job(devcluster, submit, cleanup, agent, tmp_path) -> tuple[str, str, tuple, Path]:
    """A 2-node job, running, with both prolog reports in; it exits 1 (its
    output says nothing) once the returned file exists. Returns (job id, its
    second node, the job's row, the file)."""
    sched = devcluster.scheduler()
    for node in devcluster.node_names():
        clear_node(devcluster.lay, node)   # no XID an earlier test left may blame a node
    go = devcluster.lay.jobs / f"go-{tmp_path.name}-{time.time_ns()}"
    script = (f'if [ "${{SLURM_RESTART_COUNT:-0}}" -gt 0 ]; then sleep 300; exit 0; fi; '
              f"for i in $(seq 600); do [ -e {go} ] && exit 1; sleep 0.2; done")
    job_id = submit("-N2", "--requeue", "--open-mode=append", "--recovery=act",
                    "-o", "late-%j.out", script=script)
    job = wait_for(lambda: (j := job_now(sched, job_id)) and j.state == "RUNNING" and j,
                   60, f"job {job_id} RUNNING")
    bad = job.nodes[1]
    cleanup.append((bad, agent))
    row = wait_for(lambda: job_row(agent, job_id), 30, "job registered")
    wait_for(lambda: len(agent.query("select distinct node from node_reports where job = ? "
                                     "and hook = 'prolog'", row[0])) == 2, 30,
             "both nodes' prolog reports")
    return job_id, bad, row, go


def spooled_epilog(devcluster, node: str, job_id: str) -> list[Path]:
    found = []
    for path in devcluster.lay.spool_dir(node).glob("*-epilog-*.json"):
        try:
            if json.loads(path.read_text())["job"]["job_id"] == job_id:
                found.append(path)
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return found


def check_recovered_without(devcluster, agent, job_id: str, row, bad: str,
                            waited: bool = True) -> dict:
    """The job requeued without ``bad`` and ``bad`` drained, on the evidence of
    its late epilog report; ``waited``: the report came after the 15 s grace,
    so the timeline says the verdict waited for it."""
    sched = devcluster.scheduler()
    rec = final_rec(agent, row[0], timeout=150, attempt=0)
    assert (rec["action"], rec["status"], rec["rule"]) == ("requeue_exclude", "done",
                                                           "hardware"), rec
    assert rec["exclude"] == [bad]
    again = wait_for(lambda: running_again(sched, job_id), 60, "the job running again")
    assert bad not in again.nodes and bad in again.excluded_nodes
    (drain,) = recs(agent, row[0], "node")
    assert drain["status"] == "done" and drain["targets"] == [bad]
    assert sched.get_node(bad).drained
    waits = timeline(agent, row[0], "node_report_wait")
    if waited or waits:
        (wait,) = waits
        assert f"epilog report of {bad}" in wait
    assert timeline(agent, row[0], "node_report_missing") == []
    late = [m for m in timeline(agent, row[0], "hook_epilog")
            if m.startswith(f"late epilog report from {bad} (spooled ")]
    assert len(late) == 1, timeline(agent, row[0], "hook_epilog")
    (verdict,) = agent.query("select data from events where job = ? and kind = 'verdict' "
                             "and attempt = 0", row[0])
    data = json.loads(verdict[0])
    assert (data["blame"], data["nodes"]) == ("node", [bad])
    return {"late": late[0]}


@pytest.mark.resilience("late node evidence: a node's epilog cannot reach the agent",
                        "the verdict waits for the spooled epilog report; the job is "
                        "requeued without the node, which is drained; the timeline says "
                        "what was waited for and that the report came late")
def test_the_epilogs_replayer_brings_the_xid_and_the_job_avoids_the_node(
        devcluster, submit, cleanup, late_agent, tmp_path):
    """The node's hooks cannot reach the agent for 25 s after the job fails
    (longer than the old 15 s grace); then its epilog can, and its health check
    still cannot (its own way in stays cut, so a health check that happens to
    run first cannot replay the spool): the epilog's own replayer delivers the
    report."""
    job_id, bad, row, go = start_job(devcluster, submit, cleanup, late_agent, tmp_path)
    port = free_port()
    relay = Relay(port, late_agent.port)
    try:
        with cut_off(devcluster, bad, ("epilog",), port), \
                cut_off(devcluster, bad, ("health",), free_port()):
            inject_xid(devcluster.lay, bad, 0, 79)
            go.touch()
            wait_for(lambda: spooled_epilog(devcluster, bad, job_id), 60,
                     f"{bad}'s epilog report in its spool")
            spooled = time.monotonic()
            time.sleep(25)
            assert late_agent.query("select count(*) from events where job = ? and "
                                    "kind = 'verdict'", row[0]) == [(0,)]
            relay.start()
            found = check_recovered_without(devcluster, late_agent, job_id, row, bad)
            assert "replayed by the epilog's replayer" in found["late"], found
            assert time.monotonic() - spooled < 90
    finally:
        relay.stop()


@pytest.mark.slow
@pytest.mark.resilience("late node evidence: a node's epilog cannot reach the agent",
                        "the node's next health check replays the report")
def test_the_health_check_replays_the_xid_and_the_job_avoids_the_node(
        devcluster, submit, cleanup, late_agent, tmp_path):
    """The node's epilog stays cut off; its health check (HealthCheckInterval=60
    on the dev cluster) reaches the agent and replays the spool, within
    agent.node_report_wait (90 s)."""
    job_id, bad, row, go = start_job(devcluster, submit, cleanup, late_agent, tmp_path)
    with cut_off(devcluster, bad, ("epilog",), free_port()):
        inject_xid(devcluster.lay, bad, 0, 79)
        go.touch()
        wait_for(lambda: spooled_epilog(devcluster, bad, job_id), 60,
                 f"{bad}'s epilog report in its spool")
        # the health check may come within the grace, or up to a minute later
        found = check_recovered_without(devcluster, late_agent, job_id, row, bad,
                                        waited=False)
        assert "replayed by the health check" in found["late"], found
