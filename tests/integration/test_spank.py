"""The SPANK plugin (spank/) on a real Slurm: ``--recovery`` is checked on the
submit host against the shared cases, and an accepted spec reaches the job as
SLURM_RECOVERY in its canonical form.

These tests run a two-node cluster of their own (port RECOVERY_TEST_PORT+2000, or
RECOVERY_SPANK_TEST_PORT) whose plugstack line carries plugin arguments, and a
prolog that records the option variable Slurm hands to prolog scripts.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from recovery_devtools.devcluster.cluster import DevCluster
from recovery_devtools.devcluster.config import HOOKS, ClusterSpec
from slurm_hooks import spec
from tests.conftest import FIXTURES
from tests.integration.conftest import wait_for

pytestmark = pytest.mark.live

ROOT = Path(__file__).resolve().parents[2]
# RECOVERY_SPANK_PLUGIN: a build against another release's headers (tests/slurm_matrix.sh)
PLUGIN = Path(os.environ.get("RECOVERY_SPANK_PLUGIN") or ROOT / "spank" / "slurm_recovery.so")
# RECOVERY_SPANK_TEST_PORT: this cluster's own port, where +2000 is someone else's
PORT = int(os.environ.get("RECOVERY_SPANK_TEST_PORT")
           or int(os.environ.get("RECOVERY_TEST_PORT", "26817")) + 2000)
ALLOWED = ("lab", "prod", "default", "team-a_1", "a" * 64)
SPANK_ARGS = f"default_env=lab allowed_envs={','.join(ALLOWED)}"
CASES = json.loads((FIXTURES / "spec_cases.json").read_text())
VALID = [c for c in CASES if c["ok"]]
INVALID = [c for c in CASES if not c["ok"]]
OUR_PREFIX = "slurm-recovery: --recovery: "
SLURM_ECHO = "Invalid --recovery argument"  # Slurm's own line after ours
UNSET = "<unset>"
SHOW_ENV = f'echo "${{{spec.JOB_ENV}-{UNSET}}}"'


def prolog_script(out_dir: Path) -> str:
    """A prolog that records the raw --recovery option as prologs see it."""
    return ("#!/bin/sh\n"
            f'printf \'%s\\n\' "${{{spec.SPANK_ENV}-{UNSET}}}" > "{out_dir}/prolog-$SLURM_JOB_ID"\n'
            "exit 0\n")


@pytest.fixture(scope="session")
def spank_plugin() -> Path:
    source = ROOT / "spank" / "slurm_recovery.c"
    if os.environ.get("RECOVERY_SPANK_PLUGIN"):
        assert PLUGIN.is_file(), f"RECOVERY_SPANK_PLUGIN={PLUGIN} is not a file"
        return PLUGIN
    if not PLUGIN.exists() or PLUGIN.stat().st_mtime < source.stat().st_mtime:
        built = subprocess.run(["make", "-C", str(PLUGIN.parent)], capture_output=True,
                               text=True, timeout=120)
        if built.returncode != 0:
            pytest.fail(f"make -C spank failed:\n{built.stdout}{built.stderr}")
    return PLUGIN


@pytest.fixture(scope="module")
def hooks_dir(tmp_path_factory) -> Path:
    """Stand-in node hooks: the prolog records the option, the others do nothing."""
    path = tmp_path_factory.mktemp("spank-hooks")
    path.chmod(0o777)
    for hook, name in HOOKS.items():
        script = path / name
        script.write_text(prolog_script(path) if hook == "prolog" else "#!/bin/sh\nexit 0\n")
        script.chmod(0o755)
    return path


@pytest.fixture(scope="module")
def cluster(spank_plugin, hooks_dir):
    # under /tmp, not pytest's 0700 tree: an unprivileged user's sbatch must
    # reach slurm.conf and the munge socket in the state dir
    root = Path(tempfile.mkdtemp(prefix="recovery-spank-cluster-"))
    root.chmod(0o755)
    dev = DevCluster(root)
    dev.up(ClusterSpec(nodes=2, gpus_per_node=0, port=PORT, hooks_bin=str(hooks_dir),
                       spank_plugin=str(spank_plugin), spank_args=SPANK_ARGS))
    yield dev
    dev.down(quiet=True)
    shutil.rmtree(root, ignore_errors=True)


def slurm(cluster: DevCluster, *argv: str, env: dict | None = None):
    runner = cluster.runner(timeout=30)
    if env:
        runner.extra_env = env
    return runner.run(list(argv), check=False)


def sbatch(cluster: DevCluster, *args: str, script: str = "true", env: dict | None = None):
    return slurm(cluster, "sbatch", "--parsable", f"--chdir={cluster.lay.jobs}", "--mem=50",
                 *args, "--wrap", script, env=env)


def known_jobs(cluster: DevCluster) -> int:
    """Jobs slurmctld knows, finished ones included (MinJobAge keeps them)."""
    out = slurm(cluster, "squeue", "-h", "-t", "all", "-o", "%i")
    assert out.returncode == 0, out.stderr
    return len(out.stdout.split())


def submit_printing_env(cluster: DevCluster, name: str, *args: str,
                        env: dict | None = None) -> tuple[str, Path]:
    """Submit a job that writes its SLURM_RECOVERY (or <unset>) to a file."""
    out = cluster.lay.jobs / f"{name}.out"
    done = sbatch(cluster, *args, "-o", str(out), script=SHOW_ENV, env=env)
    assert done.returncode == 0, f"{args}: {done.stderr}"
    return done.stdout.strip().split(";")[0], out


def job_output(path: Path, timeout: float = 30) -> str:
    return wait_for(lambda: path.exists() and path.read_text().endswith("\n")
                    and path.read_text(), timeout, f"job output {path.name}").strip()


def refusal_problems(case_spec: str, error: str, proc) -> list[str]:
    """Why a refusal does not look right (empty when it does)."""
    lines = proc.stderr.strip().splitlines()
    ours = [line for line in lines if "slurm-recovery:" in line]
    noise = [line for line in lines if line not in ours and SLURM_ECHO not in line]
    problems = []
    if proc.returncode == 0:
        problems.append("was accepted")
    if len(ours) != 1 or OUR_PREFIX not in ours[0] or error not in ours[0]:
        problems.append(f"expected one line with {error!r}, got {ours}")
    if noise or sum(error in line for line in lines) != 1:
        problems.append(f"unexpected stderr {lines}")
    return [f"{case_spec!r}: {p}" for p in problems]


def test_invalid_specs_are_refused_and_nothing_is_queued(cluster):
    before = known_jobs(cluster)
    problems = []
    for case in INVALID:
        proc = sbatch(cluster, f"--recovery={case['spec']}")
        problems += refusal_problems(case["spec"], case["error"], proc)
    assert known_jobs(cluster) == before, "a refused sbatch still queued a job"
    assert not problems, "\n".join(problems)


def test_valid_specs_reach_the_job_as_canonical_spec(cluster):
    submitted = [(case, *submit_printing_env(cluster, f"valid-{i}", f"--recovery={case['spec']}"))
                 for i, case in enumerate(VALID)]
    wrong = []
    for case, _job, out in submitted:
        want = spec.parse(case["spec"], default_env="lab").canonical()
        got = job_output(out)
        if got != want:
            wrong.append(f"{case['spec']!r}: SLURM_RECOVERY={got!r}, expected {want!r}")
    assert not wrong, "\n".join(wrong)


def test_srun_refuses_a_bad_spec(cluster):
    before = known_jobs(cluster)
    proc = slurm(cluster, "srun", "--mem=50", "--recovery=prod:acton", "true")
    assert refusal_problems("prod:acton", "invalid mode 'acton'", proc) == []
    assert known_jobs(cluster) == before


def test_environment_outside_allowed_envs_is_refused(cluster):
    proc = sbatch(cluster, "--recovery=team-b:action")
    assert refusal_problems("team-b:action", "environment 'team-b' is not allowed "
                            "(allowed: lab, prod, default, team-a_1, aaaa", proc) == []


def test_an_unprivileged_user_gets_the_allowed_envs_check_too(cluster, unix_users):
    # the check runs in the user's own sbatch (the submit host), not as root
    user = unix_users("spank")
    before = known_jobs(cluster)
    argv = ["sbatch", "--parsable", "--chdir=/tmp", "-o", "/dev/null", "--mem=50"]
    typo = slurm(cluster, *user.argv([*argv, "--recovery=dmeo:action", "--wrap", "true"]))
    assert refusal_problems("dmeo:action", "environment 'dmeo' is not allowed", typo) == []
    assert known_jobs(cluster) == before, "the refused job was queued"
    known = slurm(cluster, *user.argv([*argv, "--recovery=prod", "--wrap", "true"]))
    assert known.returncode == 0, known.stderr
    assert known_jobs(cluster) == before + 1


def test_bare_recovery_gets_default_env_and_prolog_sees_null(cluster, hooks_dir):
    job, out = submit_printing_env(cluster, "bare", "--recovery")
    assert job_output(out) == "lab"
    assert (hooks_dir / f"prolog-{job}").read_text().strip() == "(null)"


def test_prolog_sees_the_raw_option(cluster, hooks_dir):
    job, out = submit_printing_env(cluster, "raw", "--recovery=prod:action,hang=20m")
    assert job_output(out) == "prod:action,hang=1200s"
    assert (hooks_dir / f"prolog-{job}").read_text().strip() == "prod:action,hang=20m"


@pytest.mark.parametrize("export", ["NONE", "NIL", "SLURM_JOB_NAME", "ALL,RECOVERY_X=1"])
def test_every_export_mode_gets_the_spec_and_reaches_the_prolog(cluster, hooks_dir, export):
    # Slurm skips the option callback for a batch step whose environment was
    # not exported; the plugin reads the raw option Slurm left in the job
    # environment instead. The prolog's copy (what registers the job) comes
    # from the job's SPANK environment, whatever the export mode.
    name = "export-" + export.replace(",", "_")
    job, out = submit_printing_env(cluster, name, f"--export={export}", "--recovery=prod:monitor")
    assert job_output(out) == "prod:monitor"
    assert (hooks_dir / f"prolog-{job}").read_text().strip() == "prod:monitor"


def test_a_job_submitted_inside_an_opted_in_job_is_not_opted_in_by_it(cluster, hooks_dir):
    jobs = cluster.lay.jobs
    for stale in jobs.glob("inner-*"):
        stale.unlink()
    inner = (f"sbatch --parsable --mem=50 --chdir={jobs} -o {jobs}/inner-%j.out "
             f"--wrap '{SHOW_ENV}'")
    script = (f"{inner} > {jobs}/inner-plain.id 2> {jobs}/inner-plain.err\n"
              f"{inner} --recovery=lab:monitor > {jobs}/inner-own.id\n"
              f"salloc --no-shell -N1 --mem=50 -t 1 > {jobs}/inner-salloc.err 2>&1\n")
    done = sbatch(cluster, "--recovery=prod:action", "-o", "/dev/null", script=script)
    assert done.returncode == 0, done.stderr
    nesting = done.stdout.strip().split(";")[0]
    plain = job_output(jobs / "inner-plain.id")
    own = job_output(jobs / "inner-own.id")
    # the job that asked is opted in as it asked; the one that did not is not
    assert job_output(jobs / f"inner-{own}.out") == "lab:monitor"
    assert (hooks_dir / f"prolog-{own}").read_text().strip() == "lab:monitor"
    assert job_output(jobs / f"inner-{plain}.out") == UNSET
    assert not (hooks_dir / f"prolog-{plain}").exists()   # the fast path: not opted in
    said = (jobs / "inner-plain.err").read_text()
    assert f"job {nesting}'s --recovery is not passed on to this job" in said, said
    # salloc too: its allocation is not opted in, and salloc says so
    said = wait_for(lambda: "Granted job allocation" in (text := _read(jobs / "inner-salloc.err"))
                    and text, 30, "the inner salloc's allocation")
    allocated = said.split("Granted job allocation ")[1].split()[0]
    try:
        assert f"job {nesting}'s --recovery is not passed on to this job" in said, said
        wait_for(lambda: "JobState=RUNNING" in slurm(cluster, "scontrol", "show", "job",
                                                     allocated).stdout, 30, "it running")
        assert not (hooks_dir / f"prolog-{allocated}").exists()
    finally:
        slurm(cluster, "scancel", allocated)


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def test_job_without_recovery_runs_normally(cluster, hooks_dir):
    # a SLURM_RECOVERY left in the submitting shell must not opt the job in
    job, out = submit_printing_env(cluster, "plain", env={spec.JOB_ENV: "stale:action"})
    assert job_output(out) == UNSET
    # no SPANK option in the prolog's environment: the wrapper's fast path
    # exited before the (stand-in) prolog ran at all
    assert not (hooks_dir / f"prolog-{job}").exists()
    show = wait_for(lambda: (text := slurm(cluster, "scontrol", "show", "job", job).stdout)
                    and "JobState=COMPLETED" in text and text, 30, f"job {job} to complete")
    assert "ExitCode=0:0" in show
