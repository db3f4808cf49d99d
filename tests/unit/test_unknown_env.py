"""A job whose directive names an environment the config lacks (``dmeo`` for
``demo``) runs as ``default``: its timeline says so once, and ``show job`` flags
it in text (``EnvKnown=no``) and JSON (``env_known: false``)."""
from __future__ import annotations

import json
import os

from click.testing import CliRunner

from recovery_agent.config import from_mapping
from recovery_agent.detect.patterns import load_rules
from recovery_agent.detect.scanner import Scanner
from recovery_agent.inputs.logline import MemoryCursorStore
from recovery_agent.inputs.tail import Tailer
from recovery_agent.interfaces.ctl import main as ctl
from recovery_agent.scheduler.base import Job
from recovery_agent.store import Store
from recovery_agent.watch import Watcher
from tests.unit.scripted import Script

CONFIG = {"agent": {"cluster": "c1"}, "environments": {"prod": {"mode": "action"}}}


def job(comment: str, out, job_id: str = "77") -> Job:
    return Job(job_id=job_id, numeric_id=int(job_id), state="RUNNING", submit_time=1000,
               start_time=1001, nodes=("node1",), comment=comment, stdout=str(out),
               stderr=str(out), user_id=0, group_id=0)


def watch(tmp_path, *jobs: Job, cycles: int = 2):
    cfg = from_mapping(CONFIG)
    store = Store(tmp_path / "r.db")
    sched = Script()
    sched.jobs = list(jobs)
    clock = [2000.0]
    watcher = Watcher(cfg, store, sched, Scanner(load_rules(), engine="re"),
                      Tailer(MemoryCursorStore()), clock=lambda: clock[0])
    for _ in range(cycles):
        watcher.cycle()
        clock[0] += 2
    return store


def flags(store, pk: int) -> list[dict]:
    return [e for e in store.timeline(pk) if e["kind"] == "env_unknown"]


def test_an_unknown_environment_is_on_the_timeline_once_with_what_applies(tmp_path):
    out = tmp_path / "o.out"
    out.write_text("")
    store = watch(tmp_path, job("recovery=dmeo:action", out), job("recovery=prod", out, "78"),
                  cycles=3)
    (flag,) = flags(store, store.find_job("c1", "77")["id"])
    assert flag["message"] == ("environment 'dmeo' is not configured (known: default, prod); "
                               "decisions use [environments.default], mode monitor")
    assert flags(store, store.find_job("c1", "78")["id"]) == []


def test_a_restarted_agent_does_not_flag_the_job_again(tmp_path):
    out = tmp_path / "o.out"
    out.write_text("")
    watch(tmp_path, job("recovery=dmeo", out))
    store = watch(tmp_path, job("recovery=dmeo", out))   # a new loop on the same store
    assert len(flags(store, store.find_job("c1", "77")["id"])) == 1


def test_store_notes_an_unknown_environment_once(tmp_path):
    store = Store(tmp_path / "r.db")
    with store.lock:
        pk = store.record_job(job("", tmp_path / "o"), "c1", env="dmeo")
    assert store.note_unknown_env(pk, "dmeo", ["prod", "default"], "monitor") is True
    assert store.note_unknown_env(pk, "dmeo", ["prod", "default"], "monitor") is False
    (event,) = flags(store, pk)
    assert "known: default, prod" in event["message"] and event["source"] == "agent"


def test_show_job_flags_an_unknown_environment_in_text_and_json(tmp_path, monkeypatch):
    config = tmp_path / "recovery.toml"
    config.write_text(f'[agent]\ncluster = "c1"\nstate_dir = "{tmp_path}"\n'
                      f'[api]\nauth = "none"\nadmin_uids = "{os.getuid()}"\n'
                      '[environments.prod]\nmode = "monitor"\n')
    monkeypatch.setenv("RECOVERY_CONFIG", str(config))
    store = Store(tmp_path / "recovery.db")
    with store.lock:
        store.record_job(job("", tmp_path / "o", "10"), "c1", env="dmeo", spec="dmeo")
        store.record_job(job("", tmp_path / "o", "11"), "c1", env="prod", spec="prod")
    db = str(tmp_path / "recovery.db")

    def show(job_id, *extra):
        result = CliRunner().invoke(ctl, ["show", "job", job_id, "--db", db, *extra],
                                    catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return result.output

    assert "Env=dmeo EnvKnown=no Mode=monitor" in show("10").splitlines()[0]
    assert "EnvKnown" not in show("11")
    assert json.loads(show("10", "--json"))["job"]["env_known"] is False
    assert json.loads(show("11", "--json"))["job"]["env_known"] is True
