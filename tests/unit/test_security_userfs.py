"""The agent reads users' paths as root: each file and checkpoint glob is
resolved with the job user's rights (recovery_agent/inputs/userfs.py), so a user
who points their output or ckpt= at what they may not read gets nothing of it.

Every attacker step here is done by a real unprivileged Unix user (``mallory``,
``alice``: tests/hostile.py), in a directory tree only root builds the secrets
in. The agent side (Tailer, newest_checkpoint, the watch loop) runs as root, as
the agent does.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from recovery_agent.config import Config, from_mapping
from recovery_agent.detect.patterns import load_rules
from recovery_agent.detect.scanner import Scanner
from recovery_agent.inputs import MemoryCursorStore, NotFollowed, Rights, Tailer
from recovery_agent.inputs import userfs
from recovery_agent.inputs.checkpoints import newest_checkpoint
from recovery_agent.scheduler.base import Job
from recovery_agent.store import Store
from recovery_agent.watch import Watcher
from tests.unit.scripted import Script

pytestmark = pytest.mark.security

SECRET = "root:$6$rsecSECRET:19000:0:99999:7:::"
XID = "NVRM: Xid (PCI:0000:b7:00): 79, pid=1, name=x, GPU has fallen off the bus."


@pytest.fixture
def arena(unix_users):
    """A tree under /tmp that the users can reach:

    vault/    root 0700, secret 0600 (root's)     public   root-owned, 0644
    mal/      mallory's own (0755), out            ali/     alice's, 0700, secret 0600
    """
    mallory, alice = unix_users("mallory"), unix_users("alice")
    top = Path(tempfile.mkdtemp(prefix="rsec-files-"))
    top.chmod(0o755)
    vault = top / "vault"
    vault.mkdir(mode=0o700)
    for name in ("secret", "out"):
        (vault / name).write_text(f"{SECRET}\n{XID}\n")
        (vault / name).chmod(0o600)
    (top / "public").write_text(f"{SECRET}\n")
    (top / "public").chmod(0o644)
    mal, ali = top / "mal", top / "ali"
    for folder, user in ((mal, mallory), (ali, alice)):
        folder.mkdir()
        os.chown(folder, user.uid, user.gid)
    ali.chmod(0o700)
    alice.run(["sh", "-c", f"echo '{SECRET}' > {ali}/secret && chmod 600 {ali}/secret"])
    mallory.run(["sh", "-c", f"echo 'step 1 loss 2.0' > {mal}/out"])
    yield {"top": top, "vault": vault, "mal": mal, "ali": ali, "mallory": mallory,
           "alice": alice, "rights": Rights.of(mallory.uid, mallory.gid)}
    shutil.rmtree(top, ignore_errors=True)


def read_as(rights: Rights, path, polls: int = 2, roots=()) -> tuple[list[str], Tailer]:
    tailer = Tailer(MemoryCursorStore(), allowed_roots=roots)
    tailer.add(str(path), "job", rights=rights)
    lines = []
    for _ in range(polls):
        lines += [line.text for line in tailer.poll()]
    lines += [line.text for line in tailer.flush_partial(str(path))]
    return lines, tailer


def refused(rights: Rights, path, why: str, roots=()) -> None:
    """The agent reads nothing of ``path`` and says why, once."""
    lines, tailer = read_as(rights, path, roots=roots)
    assert not any(SECRET in text or "Xid" in text for text in lines), lines
    assert lines == []
    (notice,) = tailer.notices
    assert notice.kind == "not_followed" and why in notice.message, notice.message
    with pytest.raises(NotFollowed, match=why):
        os.close(userfs.open_for(str(path), rights, roots))


def test_a_user_reads_their_own_output(arena):
    lines, tailer = read_as(arena["rights"], arena["mal"] / "out")
    assert lines == ["step 1 loss 2.0"] and tailer.notices == []


def test_output_pointed_at_a_root_only_file_is_not_read(arena):
    refused(arena["rights"], arena["vault"] / "secret", "is not searchable by uid")
    refused(arena["rights"], "/root/.bashrc", "/root is not searchable by uid")


def test_a_world_readable_file_of_root_is_not_the_users_output(arena):
    refused(arena["rights"], arena["top"] / "public", "is owned by uid 0, not by the job's user")


def test_a_symlink_to_root_or_another_users_file_is_not_followed(arena):
    mal, mallory = arena["mal"], arena["mallory"]
    mallory.run(["ln", "-s", str(arena["vault"] / "secret"), str(mal / "to-root")])
    mallory.run(["ln", "-s", str(arena["ali"] / "secret"), str(mal / "to-alice")])
    mallory.run(["ln", "-s", str(arena["vault"]), str(mal / "vault-link")])
    refused(arena["rights"], mal / "to-root", "symbolic link")
    refused(arena["rights"], mal / "to-alice", "symbolic link")
    refused(arena["rights"], mal / "vault-link" / "secret",
            f"is a symbolic link owned by uid {mallory.uid}")


def test_a_hard_link_to_a_root_owned_file_is_refused_by_its_owner(arena):
    mal, mallory = arena["mal"], arena["mallory"]
    # protected_hardlinks lets a user link a file they may read and write
    shared = arena["top"] / "shared-rw"
    shared.write_text(f"{SECRET}\n")
    shared.chmod(0o666)
    mallory.run(["ln", str(shared), str(mal / "hard")])
    assert (mal / "hard").stat().st_ino == shared.stat().st_ino
    refused(arena["rights"], mal / "hard", "is owned by uid 0")
    # where protected_hardlinks is off, any file can be linked: the owner check holds
    os.link(arena["vault"] / "secret", mal / "hard-secret")
    refused(arena["rights"], mal / "hard-secret", "is owned by uid 0")


def test_a_fifo_is_refused_without_being_opened(arena):
    mal = arena["mal"]
    arena["mallory"].run(["mkfifo", str(mal / "fifo")])
    started = time.monotonic()
    refused(arena["rights"], mal / "fifo", "is a FIFO, not a regular file")
    assert time.monotonic() - started < 5     # never blocked on a FIFO


def test_proc_sys_and_dev_are_never_read(arena):
    sleeper = subprocess.Popen(arena["mallory"].argv(["sleep", "30"]))
    try:
        for path in ("/proc/self/environ", f"/proc/{sleeper.pid}/environ", "/dev/fd/0",
                     "/dev/stdin", "/sys/kernel/mm/transparent_hugepage/enabled"):
            lines, tailer = read_as(arena["rights"], path)
            assert lines == [], path
            assert tailer.notices and tailer.notices[0].kind == "not_followed", path
    finally:
        sleeper.kill()
        sleeper.wait()
    with pytest.raises(NotFollowed, match="pseudo file system"):
        userfs.open_for(f"/proc/{os.getpid()}/environ", Rights.of(0, 0))


def test_dotdot_tricks_are_resolved_as_the_kernel_would_and_refused(arena):
    mal, rights = arena["mal"], arena["rights"]
    arena["mallory"].run(["mkdir", str(mal / "sub")])
    refused(rights, f"{mal}/../vault/secret", "is not searchable by uid")
    refused(rights, f"{mal}/sub/../../public", "is owned by uid 0")
    refused(rights, f"{mal}/../ali/secret", "is not searchable by uid")
    # WORKDIR/../x is how Slurm hands out --output=../x: the user's own file reads
    assert read_as(rights, f"{mal}/sub/../out")[0] == ["step 1 loss 2.0"]


def test_a_directory_swapped_for_a_symlink_mid_job_is_not_followed(arena, monkeypatch):
    monkeypatch.setattr(userfs, "DIR_RECHECK", 0.0)   # walk again every poll
    mal, mallory = arena["mal"], arena["mallory"]
    mallory.run(["sh", "-c", f"mkdir {mal}/run && echo 'step 1' > {mal}/run/out"])
    tailer = Tailer(MemoryCursorStore())
    tailer.add(str(mal / "run" / "out"), "job", rights=arena["rights"])
    assert [line.text for line in tailer.poll()] == ["step 1"]
    # the job is running; the user swaps its output directory for a link to root's
    mallory.run(["sh", "-c", f"mv {mal}/run {mal}/run.old && ln -s {arena['vault']} "
                             f"{mal}/run"])
    lines = [line.text for line in tailer.poll() + tailer.poll()]
    lines += [line.text for line in tailer.flush_partial(str(mal / "run" / "out"))]
    assert not any(SECRET in text or "Xid" in text for text in lines)
    (notice,) = tailer.notices
    assert f"is a symbolic link owned by uid {mallory.uid}" in notice.message


def test_a_swap_within_the_recheck_reads_only_the_users_own_directory(arena):
    """Until its directory is walked again, a file is looked at through the
    directory first walked (pinned by its descriptor): the one moved away."""
    mal, mallory = arena["mal"], arena["mallory"]
    mallory.run(["sh", "-c", f"mkdir {mal}/run && echo 'step 1' > {mal}/run/out"])
    tailer = Tailer(MemoryCursorStore())
    tailer.add(str(mal / "run" / "out"), "job", rights=arena["rights"])
    assert [line.text for line in tailer.poll()] == ["step 1"]
    mallory.run(["sh", "-c", f"mv {mal}/run {mal}/run.old && ln -s {arena['vault']} "
                             f"{mal}/run && echo 'step 2' >> {mal}/run.old/out"])
    assert [line.text for line in tailer.poll()] == ["step 2"]


def test_roots_are_checked_on_the_path_the_walk_reached(arena):
    mal, mallory = arena["mal"], arena["mallory"]
    mallory.run(["sh", "-c", f"mkdir {mal}/in {mal}/out-of-roots && echo x > "
                             f"{mal}/out-of-roots/log"])
    refused(arena["rights"], mal / "out-of-roots" / "log", "outside the allowed log roots",
            roots=(str(mal / "in"),))


def test_an_unknown_user_gets_no_rights_at_all(arena):
    nobody = Rights.of_job(Job(job_id="1", numeric_id=1))
    assert nobody.uid is None
    lines, tailer = read_as(nobody, arena["mal"] / "out")
    assert lines == [] and "not known" in tailer.notices[0].message
    job = Job(job_id="1", numeric_id=1, user=arena["mallory"].name)
    assert Rights.of_job(job).uid == arena["mallory"].uid   # the name, when no uid


# -- checkpoint globs --------------------------------------------------------

def fresh(path: Path) -> None:
    os.utime(path, (time.time(), time.time()))


def test_ckpt_globs_into_root_only_and_other_users_dirs_find_nothing(arena):
    rights, mal = arena["rights"], arena["mal"]
    (arena["vault"] / "step-900.pt").write_text("x")
    assert newest_checkpoint(str(arena["vault"] / "*")) is not None   # the agent's own view
    for spec in ("/root/*", "/root", str(arena["vault"] / "*"), str(arena["vault"]),
                 str(arena["vault"] / "step-900.pt"), str(arena["ali"] / "*"),
                 str(arena["ali"]), str(arena["top"] / "*" / "secret")):
        assert newest_checkpoint(spec, rights=rights) is None, spec
    arena["mallory"].run(["ln", "-s", str(arena["vault"]), str(mal / "ck")])
    assert newest_checkpoint(str(mal / "ck" / "*"), rights=rights) is None
    assert newest_checkpoint(str(mal / "ck"), rights=rights) is None


def test_only_the_users_own_checkpoints_count(arena):
    rights, mal, mallory = arena["rights"], arena["mal"], arena["mallory"]
    mallory.run(["sh", "-c", f"mkdir {mal}/ckpt && echo a > {mal}/ckpt/step-100.pt"])
    planted = mal / "ckpt" / "step-999.pt"      # newer, but root's
    planted.write_text("x")
    fresh(planted)
    os.link(arena["vault"] / "secret", mal / "ckpt" / "step-5000.pt")
    fresh(arena["vault"] / "secret")
    found = newest_checkpoint(str(mal / "ckpt"), rights=rights)
    assert found is not None and found.path.endswith("step-100.pt")
    found = newest_checkpoint(str(mal / "ckpt" / "step-*.pt"), rights=rights)
    assert found is not None and found.path.endswith("step-100.pt")


# -- the watch loop ------------------------------------------------------------

def test_the_watcher_reads_with_the_jobs_rights_and_says_so_once(arena, tmp_path):
    mallory = arena["mallory"]
    cfg = from_mapping({"agent": {"cluster": "c1", "log_roots": str(arena["top"])}})
    store = Store(tmp_path / "r.db")
    sched = Script()
    watcher = Watcher(cfg, store, sched, Scanner(load_rules(), engine="re"),
                      Tailer(MemoryCursorStore(), allowed_roots=cfg.allowed_log_roots))
    secret = str(arena["vault"] / "out")
    sched.jobs = [Job(job_id="7", numeric_id=7, state="RUNNING", submit_time=1000,
                      start_time=1001, nodes=("node1",), user=mallory.name,
                      user_id=mallory.uid, group_id=mallory.gid, stdout=secret,
                      stderr=secret, comment=f"recovery=default,ckpt={arena['vault']}/*")]
    for _ in range(3):
        watcher.cycle()
    timeline = list(store.timeline(1))
    refusals = [e for e in timeline if e["kind"] == "output_not_followed"]
    assert len(refusals) == 1 and "is not searchable by uid" in refusals[0]["message"]
    assert store.detections(1) == []
    assert not any(e["kind"] == "checkpoint" for e in timeline)
    assert SECRET not in str(timeline)


def test_the_default_log_roots_leave_out_the_systems_own_directories():
    roots = Config().allowed_log_roots
    assert roots and all(r.startswith("/") for r in roots)
    for system in ("/", "/tmp", "/etc", "/root", "/var", "/proc", "/sys", "/dev", "/run",
                   "/boot", "/usr"):
        assert not any(system == r or system.startswith(r.rstrip("/") + "/")
                       for r in roots), system
    tailer = Tailer(MemoryCursorStore(), allowed_roots=roots)
    tailer.add("/etc/shadow", "k")
    assert "/etc/shadow" in tailer.refused and tailer.poll() == []
