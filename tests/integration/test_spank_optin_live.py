"""Issue 22 live: the opt-in means what the job itself asked for, with the real
SPANK plugin, the real node hooks and an agent on the dev cluster.

* A job submitted from inside an opted-in job inherits the enclosing job's raw
  option through the environment (Slurm reads SLURM_SPANK_<option> as if it
  were given): it must be opted in only by its own ``--recovery``.
* Every ``--export`` mode registers a ``--recovery`` job, and its batch step
  sees SLURM_RECOVERY, although Slurm skips the option callback for a batch
  step whose environment was not exported.
* A ``RECOVERY_HOOKS_*`` variable a user exports never reaches the hooks: Slurm
  builds their environment itself.
"""
from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from slurm_hooks import spec
from tests.integration.conftest import job_row, wait_for

pytestmark = pytest.mark.live

UNSET = "<unset>"
# builtins only: under --export=NONE the batch script may run without a PATH
SHOW_SPEC = f'printf "%s\\n" "${{{spec.JOB_ENV}-{UNSET}}}"'


def slurm_state(devcluster, job_id: str) -> str:
    out = devcluster.runner(timeout=30).run(["squeue", "-h", "-t", "all", "-j", job_id,
                                             "-o", "%T"], check=False)
    return out.stdout.strip()


def finished(devcluster, job_id: str, timeout: float = 60) -> str:
    return wait_for(lambda: (s := slurm_state(devcluster, job_id)) in
                    ("COMPLETED", "FAILED", "CANCELLED") and s, timeout, f"job {job_id} to end")


def output(path: Path, timeout: float = 60) -> str:
    return wait_for(lambda: path.exists() and path.read_text().endswith("\n")
                    and path.read_text(), timeout, f"output {path.name}")


def test_a_job_submitted_inside_an_opted_in_job_is_opted_in_only_by_its_own_directive(
        devcluster, agent, submit):
    jobs = devcluster.lay.jobs
    for stale in jobs.glob("nested-*"):   # an earlier run's files
        stale.unlink()
    inner = f"--mem=50 --parsable --chdir={jobs} --wrap {shlex.quote(SHOW_SPEC)}"
    script = "\n".join([
        f"sbatch {inner} -o {jobs}/nested-plain-%j.out > {jobs}/nested-plain.id "
        f"2> {jobs}/nested-plain.err",
        f"sbatch {inner} --recovery=act:monitor -o {jobs}/nested-own-%j.out "
        f"> {jobs}/nested-own.id 2> {jobs}/nested-own.err",
        # a step of the job itself still sees the job's own spec
        f"srun --mem=50 sh -c {shlex.quote(SHOW_SPEC)} > {jobs}/nested-step.out",
    ])
    outer = submit("-N1", "--mem=200", "--recovery=act", "-o", str(jobs / "nested-outer.out"),
                   script=script)
    assert wait_for(lambda: job_row(agent, outer), 30, "the outer job registered")[2] == ""
    own_id = output(jobs / "nested-own.id").strip()
    plain_id = output(jobs / "nested-plain.id").strip()
    submit.submitted += [own_id, plain_id]
    # the inner job that asked: registered, in the mode it asked for
    own = wait_for(lambda: job_row(agent, own_id), 30, "the inner job that asked registered")
    assert own[1:] == ("act", "monitor", "act:monitor")
    assert output(jobs / f"nested-own-{own_id}.out").strip() == "act:monitor"
    # the inner job that did not ask: no SLURM_RECOVERY, never registered
    assert output(jobs / f"nested-plain-{plain_id}.out").strip() == UNSET
    assert finished(devcluster, plain_id) == "COMPLETED"
    assert job_row(agent, plain_id) is None
    # and its sbatch said so; the one that asked was told nothing
    said = (jobs / "nested-plain.err").read_text()
    assert f"job {outer}'s --recovery is not passed on to this job" in said, said
    assert "slurm-recovery" not in (jobs / "nested-own.err").read_text()
    assert output(jobs / "nested-step.out").strip() == "act"


@pytest.mark.parametrize("export", ["ALL", "NONE", "SLURM_JOB_NAME", "ALL,RECOVERY_X=1", "NIL"])
def test_every_export_mode_registers_a_recovery_job(devcluster, agent, submit, export):
    out = devcluster.lay.jobs / f"export-{export.replace(',', '_')}.out"
    out.unlink(missing_ok=True)
    job = submit("-N1", f"--export={export}", "--recovery=act:monitor,hang=20m", "-o",
                 str(out), script=SHOW_SPEC)
    row = wait_for(lambda: job_row(agent, job), 30, f"the --export={export} job registered")
    assert row[1:] == ("act", "monitor", "act:monitor,hang=1200s")
    assert output(out).strip() == "act:monitor,hang=1200s"


@pytest.mark.security
def test_a_users_recovery_hooks_variables_never_reach_the_hooks(devcluster, agent, submit,
                                                                 unix_users):
    # the user points the hooks' agent URL at a dead port and their log at
    # their own file: the job is registered through the configured agent anyway
    user = unix_users("hookenv")
    trap = Path("/tmp") / f"hookenv-{user.uid}.log"
    runner = devcluster.runner(timeout=30)
    runner.extra_env = {"RECOVERY_HOOKS_AGENT_URL": "http://127.0.0.1:9",
                        "RECOVERY_HOOKS_LOG_FILE": str(trap)}
    done = runner.run(user.argv(["sbatch", "--parsable", "--chdir=/tmp", "-o", "/dev/null",
                                 "--mem=50", "--recovery=act:monitor", "--wrap", "true"]))
    job = done.stdout.strip().split(";")[0]
    submit.submitted.append(job)
    row = wait_for(lambda: job_row(agent, job), 30, "the user's job registered")
    assert row[2] == "monitor"
    assert not trap.exists()
