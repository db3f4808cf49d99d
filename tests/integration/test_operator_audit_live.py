"""Issue 22 on the dev cluster: a session of operator commands, each signed
with the real munged as the Unix user who ran it, and then ``recovery-ctl
audit`` lists every one of them with that user (items 1 and 2); a human drain
lifted before ``recovery-ctl report`` ran still counts (item 8).

alice and bob are real unprivileged users. alice owns a job whose
recommendation waits for a site controller; she may cancel it, and nothing
else: her mode change and exclusion are refused and leave no record. bob is in
``api.admin_uids``, so the same mode change by him is taken, and recorded as
bob's, not root's."""
from __future__ import annotations

import csv
import io
import json
import os
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from tests.integration.conftest import AgentProcess, Submitter, wait_for

pytestmark = [pytest.mark.live, pytest.mark.security]
CTL = str(Path(sys.executable).parent / "recovery-ctl")
VERBS = ["mode", "mode", "mode_clear", "exclude", "include", "ack", "complete", "cancel"]


@pytest.fixture(scope="module")
def people(unix_users):
    return unix_users("alice"), unix_users("bob")


@pytest.fixture(scope="module")
def agent(devcluster, people):
    """An agent of its own (its own store), with an environment whose
    recommendations wait for a site controller, bob as an admin, and the
    nodes listed every 2 s for their state history."""
    _, bob = people
    folder = devcluster.lay.root / "op-audit"
    folder.mkdir(exist_ok=True)
    os.chmod(folder, 0o755)
    db = folder / "recovery.db"
    for leftover in (db, Path(f"{db}-wal"), Path(f"{db}-shm")):
        leftover.unlink(missing_ok=True)
    agent = AgentProcess(devcluster, db=db,
                         env={"RECOVERY_AGENT_NODE_POLL_INTERVAL": "2s"})
    agent.config = folder / "recovery.toml"
    text = devcluster.lay.agent_config.read_text()
    assert "\n[api]\n" in text
    agent.config.write_text(text.replace("\n[api]\n", f'\n[api]\nadmin_uids = "0,{bob.uid}"\n')
                            + '[environments.ext]\nmode = "external"\n')
    os.chmod(agent.config, 0o644)
    agent.start()
    yield agent
    agent.stop()


def iso(ts: float) -> str:
    """A time as --since takes it (a bare number there is a duration back)."""
    return datetime.fromtimestamp(ts).isoformat(timespec="seconds")


def ctl(agent, *args, user=None):
    argv = [CTL, *args]
    if "--db" not in args and args[0] not in ("report",):
        argv += ["--url", f"http://127.0.0.1:{agent.port}"]
    if user is None:
        import subprocess
        return subprocess.run(argv, env=agent.environ(), capture_output=True, text=True,
                              timeout=120)
    return user.run(argv, check=False, env=agent.environ(), timeout=120)


def job_recs(agent, job_id: str) -> list[tuple]:
    return agent.query("select r.id, r.status, r.mode from recommendations r join jobs j "
                       "on r.job = j.id where j.job_id = ? and r.scope = 'job' order by r.id",
                       job_id)


@pytest.fixture(scope="module")
def waiting(agent, devcluster, people):
    """Two failed jobs with a recommendation each waiting for a site
    controller: alice's, and one of root's."""
    alice, _ = people
    submit = Submitter(devcluster)
    try:
        script = "echo 'step 1 loss 2.0'; sleep 3; exit 1"
        hers = submit("-N1", "--recovery=ext", "-o", "opa-%j.out", script=script,
                      as_user=alice)
        ours = submit("-N1", "--recovery=ext", "-o", "opa-%j.out", script=script)
        found = {}
        for job_id in (hers, ours):
            (rec,) = wait_for(lambda: job_recs(agent, job_id), 120,
                              f"job {job_id}'s recommendation")
            assert rec[1:] == ("proposed", "external"), rec
            found[job_id] = rec[0]
        yield {"hers": (hers, found[hers]), "ours": (ours, found[ours])}
    finally:
        submit.cleanup()


def test_a_session_of_operator_commands_is_listed_by_audit_with_who_ran_each(
        agent, people, waiting):
    alice, bob = people
    her_job, her_rec = waiting["hers"]
    our_job, our_rec = waiting["ours"]
    time.sleep(2)       # --since is to the second: the recommendations come before it
    start = iso(time.time())
    me = "root"
    # refused, and recorded nowhere: alice is no admin
    for args in (["mode", "act", "monitor", "--reason", "mine now"],
                 ["mode", "act", "--clear"],
                 ["exclude", "node3", "--reason", "x"],
                 ["ack", str(her_rec)]):
        refused = ctl(agent, *args, user=alice)
        assert refused.returncode == 1 and "HTTP 403" in refused.stderr, (args, refused)
    assert agent.query("select count(*) from operator_actions") == [(0,)]
    log = agent.log.read_text()
    assert f"refused change modes by {alice.name} (uid {alice.uid}, via api)" in log
    # the session: root, bob (an admin by api.admin_uids) and alice (her own job)
    for user, args in ((None, ["mode", "act", "monitor", "--reason", "incident 7"]),
                       (bob, ["mode", "act", "external", "--reason", "controller test"]),
                       (None, ["mode", "act", "--clear", "--reason", "over"]),
                       (None, ["exclude", "node3", "--reason", "IB flaps"]),
                       (None, ["include", "node3", "--reason", "cable swapped"]),
                       (None, ["ack", str(our_rec), "--reason", "the controller"]),
                       (None, ["complete", str(our_rec), "--outcome", "done",
                               "--detail", "requeued by hand"]),
                       (alice, ["cancel", str(her_rec), "--reason", "I will resubmit"])):
        done = ctl(agent, *args, user=user)
        assert done.returncode == 0, (user, args, done.stdout, done.stderr)
    # every one of them, as root reads the trail through the agent ...
    records = [json.loads(line) for line in
               ctl(agent, "audit", "--json", "--since", start).stdout.splitlines()]
    ops = [r for r in records if r["kind"] == "operator"]
    assert [r["action"] for r in ops] == VERBS
    assert len(ops) == len(records)    # the recommendations came before --since
    assert [(r["actor"], r["actor_uid"], r["role"], r["via"]) for r in ops] == [
        (me, 0, "admin", "api"), (bob.name, bob.uid, "admin", "api"),
        *[(me, 0, "admin", "api")] * 5, (alice.name, alice.uid, "user", "api")]
    assert [(r["target"], r["before"], r["after"]) for r in ops] == [
        ("act", "action", "monitor"), ("act", "monitor", "external"),
        ("act", "external", "action"), ("node3", "included", "excluded"),
        ("node3", "excluded", "included"), (f"#{our_rec}", "proposed", "executing"),
        (f"#{our_rec}", "executing", "done"), (f"#{her_rec}", "proposed", "cancelled")]
    assert [r["reason"] for r in ops] == ["incident 7", "controller test", "over", "IB flaps",
                                          "cable swapped", "the controller",
                                          "requeued by hand", "I will resubmit"]
    assert (ops[-1]["job_id"], ops[-1]["user"]) == (her_job, alice.name)
    # ... the same from the store, in text and in CSV
    text = ctl(agent, "audit", "--db", str(agent.db), "--since", start).stdout
    assert text.count("operator #") == len(VERBS)
    assert f"by {bob.name} (uid {bob.uid}, admin, through the agent's API)" in text
    rows = list(csv.DictReader(io.StringIO(ctl(agent, "audit", "--format", "csv", "--since",
                                               start).stdout)))
    assert [r["action"] for r in rows if r["kind"] == "operator"] == VERBS
    # --since after the session: none of them
    later = ctl(agent, "audit", "--json", "--since", iso(time.time() + 5)).stdout
    assert [json.loads(line)["kind"] for line in later.splitlines()] == []
    # alice reads only her job's record and her own change to it
    hers = [json.loads(line) for line in ctl(agent, "audit", "--json", user=alice)
            .stdout.splitlines()]
    assert {(r["kind"], r.get("job_id")) for r in hers} == {("recommendation", her_job),
                                                          ("operator", her_job)}
    # the mode follows the file again, and show config says so
    shown = json.loads(ctl(agent, "show", "config", "--json").stdout)["environments"]["act"]
    assert (shown["mode"], shown["mode_source"]["source"]) == ("action", "file")


def test_show_config_names_the_operator_who_set_a_mode(agent, people):
    _, bob = people
    assert ctl(agent, "mode", "demo", "monitor", "--reason", "quiet", user=bob).returncode == 0
    try:
        text = ctl(agent, "show", "config").stdout
        demo = text[text.index("[environments.demo]"):]
        assert f'mode = "monitor"  # set by {bob.name} (uid {bob.uid}) at ' in demo
        assert 'quiet; the config file says "action"' in demo
        console = ctl(agent, "show", "config", "--json", user=bob).stdout
        assert json.loads(console)["environments"]["demo"]["mode_source"]["set_by"] == bob.name
    finally:
        assert ctl(agent, "mode", "demo", "--clear").returncode == 0


def test_report_counts_a_human_drain_lifted_before_it_ran(agent, devcluster, submit):
    node = "node4"
    runner = submit.runner
    sched = devcluster.scheduler()
    runner.run(["scontrol", "update", f"nodename={node}", "state=DRAIN",
                "reason=PSU swap, ticket 88"])
    try:
        wait_for(lambda: agent.query("select id from node_states where node = ? and "
                                     "drained = 1 and reason like 'PSU swap%'", node),
                 30, "the drain in the node state history")
    finally:
        runner.run(["scontrol", "update", f"nodename={node}", "state=RESUME"])
    wait_for(lambda: not sched.get_node(node).drained, 30, "the drain lifted")
    wait_for(lambda: agent.query("select drained from node_states where node = ? "
                                 "order by id desc limit 1", node) == [(0,)], 30,
             "the resume in the node state history")
    result = ctl(agent, "report", "--since", "1h", "--json")
    assert result.returncode == 0, result.stderr
    drains = json.loads(result.stdout)["human_drains"]
    assert drains[node].startswith("PSU swap, ticket 88 (") and drains[node].endswith(
        ", lifted since"), drains
