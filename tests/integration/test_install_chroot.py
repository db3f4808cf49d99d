"""The .deb in a clean Debian 12: what an admin gets from `apt install`.

A debootstrap chroot (minbase, bookworm) made by the test; the package's
dependencies (and Debian's slurmctld and slurmd) are installed first and the
file system is listed, then the .deb is installed, used, upgraded over an older
store, made to recover a job on a dev cluster wired to its installed hooks,
removed and purged, and the listing must come back as it was (bytecode
included: the postinst compiles it, the prerm removes it). lintian, on the
host, must find no error or warning that packaging/debian/lintian-overrides
does not explain. Behind ``-m install`` (``make install-test``): it needs root,
debootstrap, unshare, ip and lintian, and the Debian mirror; about a minute with
the chroot cached, a few without.

Environment: RECOVERY_DEB (the package; else dist/ after ``make deb``),
RECOVERY_DEBIAN_MIRROR (default deb.debian.org), RECOVERY_CHROOT_CACHE (a tar
of the bare chroot, reused when present; default build/install-test/).
"""
from __future__ import annotations

import gzip
import os
import re
import shutil
import subprocess
import tarfile
import tomllib
from pathlib import Path

import pytest

from recovery_agent.store.migrations import MIGRATIONS

pytestmark = pytest.mark.install

REPO = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
# the package's: VERSION and the Debian revision of the changelog's top entry
DEB_VERSION = (REPO / "packaging/debian/changelog").read_text().split()[1].strip("()")
MIRROR = os.environ.get("RECOVERY_DEBIAN_MIRROR", "http://deb.debian.org/debian")
CACHE = Path(os.environ.get("RECOVERY_CHROOT_CACHE",
                            REPO / "build" / "install-test" / "bookworm-minbase.tar"))
PKG = "/tmp/slurm-recovery.deb"
# what apt and dpkg change on their own; everything else must come back as it was
NOISE = ("/proc", "/sys", "/dev", "/tmp", "/run", "/var/cache", "/var/lib/apt",
         "/var/lib/dpkg", "/var/log", "/var/lib/ucf", "/etc/ld.so.cache")


def sh(root: Path, script: str, check: bool = True, **env: str) -> subprocess.CompletedProcess:
    """Run a shell script inside the chroot, with a clean environment."""
    base = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C.UTF-8", "HOME": "/root",
            "DEBIAN_FRONTEND": "noninteractive"}
    proc = subprocess.run(["chroot", str(root), "/bin/sh", "-ec", script], capture_output=True,
                          text=True, env={**base, **env}, timeout=900)
    if check and proc.returncode:
        pytest.fail(f"in the chroot: {script}\nrc={proc.returncode}\n"
                    f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def mounted_under(root: Path) -> list[str]:
    return [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()
            if line.split()[1].startswith(str(root))]


def bare_chroot(root: Path) -> None:
    if CACHE.is_file():
        with tarfile.open(CACHE) as tar:
            tar.extractall(root, filter="fully_trusted")
        return
    subprocess.run(["debootstrap", "--variant=minbase", "bookworm", str(root), MIRROR],
                   check=True, capture_output=True, timeout=1200)
    CACHE.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-C", str(root), "-cf", f"{CACHE}.part", "."], check=True)
    os.replace(f"{CACHE}.part", CACHE)


def depends(deb: Path) -> list[str]:
    """The package's Depends, first alternative of each, without versions."""
    field = subprocess.run(["dpkg-deb", "-f", str(deb), "Depends"], capture_output=True,
                           text=True, check=True).stdout
    return sorted({dep.split("|")[0].split("(")[0].strip() for dep in field.split(",")})


def listing(root: Path) -> set[str]:
    """Every path under the chroot outside NOISE, whose trees are not even
    walked (a mounted /proc changes, and errors, under a walk). Bytecode counts:
    what the package compiled, it must take away."""
    out = set()
    for top, dirs, files in os.walk(root):
        rel_top = "/" + os.path.relpath(top, root) if top != str(root) else ""
        dirs[:] = [d for d in dirs if not f"{rel_top}/{d}".startswith(NOISE)]
        for name in [*dirs, *files]:
            rel = f"{rel_top}/{name}"
            if not rel.startswith(NOISE):
                out.add(rel)
    return out


@pytest.fixture(scope="module")
def deb() -> Path:
    if os.environ.get("RECOVERY_DEB"):
        return Path(os.environ["RECOVERY_DEB"])
    arch = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True,
                          check=True).stdout.strip()
    path = REPO / "dist" / f"slurm-recovery_{DEB_VERSION}_{arch}.deb"
    if not path.is_file():
        subprocess.run(["make", "-s", "-C", str(REPO), "deb"], check=True, timeout=900)
    return path


@pytest.fixture(scope="module")
def chroot(tmp_path_factory, deb):
    """(root, listing before the package): dependencies installed, then the .deb."""
    if os.geteuid() != 0 or not shutil.which("debootstrap") or not shutil.which("chroot"):
        pytest.skip("needs root and debootstrap (apt-get install debootstrap)")
    root = tmp_path_factory.mktemp("chroot") / "bookworm"
    root.mkdir()
    bare_chroot(root)
    subprocess.run(["mount", "-t", "proc", "proc", str(root / "proc")], check=True)
    try:
        shutil.copy("/etc/resolv.conf", root / "etc" / "resolv.conf")
        # no daemon starts inside the chroot (munge's postinst would start munged)
        policy = root / "usr" / "sbin" / "policy-rc.d"
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
        sh(root, "apt-get update -qq && apt-get install -y -qq --no-install-recommends "
                 + " ".join(depends(deb) + ["slurmctld", "slurmd"]))
        before = listing(root)
        shutil.copy(deb, str(root) + PKG)
        sh(root, f"apt-get install -y -qq --no-install-recommends {PKG}")
        yield root, before
    finally:
        subprocess.run(["umount", "-l", str(root / "proc")], check=False)
        if not mounted_under(root):   # never delete through a mount
            shutil.rmtree(root, ignore_errors=True)


def test_the_package_installs_next_to_debians_slurm(chroot):
    root, _ = chroot
    status = sh(root, "dpkg-query -W -f='${Status} ${Version}' slurm-recovery").stdout
    assert status == f"install ok installed {DEB_VERSION}"
    assert DEB_VERSION.startswith(f"{VERSION}-")
    assert (root / "etc/slurm/plugstack.conf.d/slurm-recovery.conf").is_file()
    assert (root / "lib/systemd/system/slurm-recovery-agent.service").is_file()


def test_recovery_ctl_and_the_agent_run_from_path(chroot):
    root, _ = chroot
    for argv in ("recovery-ctl --help", "recovery-agent --help"):
        out = sh(root, argv).stdout      # PATH is /usr/sbin:/usr/bin:/sbin:/bin
        assert out.startswith("Usage: "), argv
    assert sh(root, "command -v recovery-ctl").stdout.strip() == "/usr/bin/recovery-ctl"
    assert sh(root, "command -v recovery-agent").stdout.strip() == "/usr/sbin/recovery-agent"
    config = sh(root, "recovery-ctl show config").stdout
    assert "/var/lib/slurm-recovery" in config
    # an unprivileged user runs it too (the postinst's bytecode, nothing written)
    assert sh(root, "setpriv --reuid=65534 --regid=65534 --clear-groups recovery-ctl --help"
              ).stdout.startswith("Usage: ")


def test_the_postinst_compiled_the_bytecode_the_package_does_not_ship(chroot, deb):
    root, _ = chroot
    shipped = subprocess.run(["dpkg-deb", "-c", str(deb)], capture_output=True, text=True,
                             check=True).stdout
    assert "__pycache__" not in shipped and ".pyc" not in shipped
    site = next((root / "opt/slurm-recovery/lib").glob("python3*/site-packages"))
    assert list(site.glob("recovery_agent/__pycache__/*.cpython-*.pyc"))
    assert list(site.glob("fastapi/__pycache__/*.pyc"))
    owned = sh(root, "dpkg -L slurm-recovery").stdout
    assert "__pycache__" not in owned


def test_the_installed_package_has_no_installer_nor_foreign_commands(chroot):
    root, _ = chroot
    prefix = root / "opt/slurm-recovery"
    ours = sorted(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"])
    commands = sorted(p.name for p in (prefix / "bin").iterdir()
                      if not re.fullmatch(r"python(3(\.\d+)?)?|activate(\..*)?|Activate\.ps1",
                                          p.name))
    assert commands == ours
    assert sh(root, "/opt/slurm-recovery/bin/python -m pip --version", check=False).returncode
    owned = sh(root, "dpkg -L slurm-recovery").stdout
    assert "devcluster" not in owned and "recovery_devtools" not in owned
    so = root / "opt/slurm-recovery/lib/slurm-recovery/slurm_recovery.so"
    sections = subprocess.run(["readelf", "-S", "-W", str(so)], capture_output=True, text=True,
                              check=True).stdout
    assert ".text" in sections and ".symtab" not in sections
    changelog = root / "usr/share/doc/slurm-recovery/changelog.Debian.gz"
    assert changelog.is_file()
    assert gzip.decompress(changelog.read_bytes()).decode().startswith(
        f"slurm-recovery ({DEB_VERSION}) ")


def test_lintian_finds_nothing_the_overrides_do_not_explain(deb):
    """Every error and warning lintian prints fails the test (informational tags
    do not); an override that no longer matches anything is reported by lintian
    as an unused override, which fails it too."""
    if not shutil.which("lintian"):
        pytest.fail("lintian is not installed: apt-get install lintian (make install-test does)")
    proc = subprocess.run(["lintian", "--tag-display-limit", "0", "--fail-on", "none",
                           "--display-info", str(deb)], capture_output=True, text=True, timeout=600)
    tags = [line for line in proc.stdout.splitlines()
            if re.match(r"[EW]: ", line) or "unused-override" in line
            or "mismatched-override" in line]
    assert not tags, "lintian:\n" + "\n".join(tags[:60])
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_hooks_fail_open_without_an_agent(chroot):
    root, _ = chroot
    assert sh(root, "env -i /opt/slurm-recovery/libexec/prolog.sh").returncode == 0
    assert sh(root, "/opt/slurm-recovery/bin/recovery-prolog --help").returncode == 0
    for hook in ("prolog", "epilog"):
        # no agent, no munged, no journal in the chroot: the report is spooled
        sh(root, f"env -i SLURM_RECOVERY=1 SLURM_JOB_ID=7 SLURMD_NODENAME=n1 "
                 f"/opt/slurm-recovery/libexec/{hook}.sh")
    sh(root, "env -i SLURMD_NODENAME=n1 /opt/slurm-recovery/libexec/healthcheck.sh")
    spooled = sorted(p.name for p in (root / "var/spool/slurm-recovery").glob("*.json"))
    assert any("prolog" in name for name in spooled), spooled


def test_sbatch_loads_the_plugin_from_plugstack_conf_d(chroot):
    root, _ = chroot
    (root / "etc/slurm/slurm.conf").write_text(
        "ClusterName=t\nSlurmctldHost=localhost\nNodeName=n1\nPartitionName=p Nodes=n1\n")
    proc = sh(root, "sbatch --help")
    assert "--recovery" in proc.stdout and "error" not in proc.stderr, proc.stderr


def test_reinstalling_backs_up_and_migrates_an_older_store(chroot):
    root, _ = chroot
    sh(root, """/opt/slurm-recovery/bin/python - <<'EOF'
import time
from sqlite_utils import Database
from recovery_agent.store.migrations import MIGRATIONS, MIGRATIONS_TABLE
db = Database("/var/lib/slurm-recovery/recovery.db")
db[MIGRATIONS_TABLE].create({"name": str, "applied_at": float}, pk="name")
for name, step in MIGRATIONS[:3]:
    step(db)
    db[MIGRATIONS_TABLE].insert({"name": name, "applied_at": time.time()})
db["jobs"].insert({"cluster": "c", "job_id": "1", "submit_time": 5})
EOF""")
    out = sh(root, f"dpkg -i {PKG}")
    assert "backed up /var/lib/slurm-recovery/recovery.db" in out.stderr + out.stdout
    # the old prerm removed the bytecode, the new postinst compiled it again
    assert list(root.glob("opt/slurm-recovery/lib/python3*/site-packages/"
                          "recovery_agent/__pycache__/*.pyc"))
    backups = list((root / "var/lib/slurm-recovery").glob("recovery.db.backup-*"))
    assert len(backups) == 1
    counts = sh(root, f"""/opt/slurm-recovery/bin/python - <<'EOF'
import sqlite3
for path in ("/var/lib/slurm-recovery/recovery.db", "/var/lib/slurm-recovery/{backups[0].name}"):
    db = sqlite3.connect(path)
    print(db.execute("select count(*) from _migrations").fetchone()[0],
          db.execute("select count(*) from jobs").fetchone()[0])
EOF""").stdout.split("\n")
    assert counts[0] == f"{len(MIGRATIONS)} 1" and counts[1] == "3 1"


def test_a_dev_cluster_wired_to_the_installed_files_recovers_a_job(chroot):
    """packaging/install-test/recover-in-chroot.sh, in its own network, mount and
    pid namespaces: the hooks, plugstack line and config the package installed,
    the agent from its unit's command line, an XID 79 under a --recovery job,
    and `recovery-ctl check`."""
    root, _ = chroot
    if not (shutil.which("unshare") and shutil.which("ip")):
        pytest.skip("needs unshare (util-linux) and ip (iproute2)")
    src = root / "tmp" / "src"
    (src / "examples").mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "examples" / "train.py", src / "examples" / "train.py")
    shutil.copy(REPO / "packaging" / "install-test" / "recover-in-chroot.sh", src)
    # the dev cluster is a developer tool, not in the package: its source, run with
    # the package's interpreter (it needs only the product and its dependencies)
    shutil.copytree(REPO / "tools" / "recovery_devtools", src / "tools" / "recovery_devtools",
                    ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
    # slurmctld needs a non-loopback address (getaddrinfo's AI_ADDRCONFIG): a
    # documentation address on the namespace's own lo, which nothing leaves
    inner = (f"ip link set lo up && ip addr add 192.0.2.1/32 dev lo && "
             f"mount -t proc proc {root}/proc && mount --rbind /sys {root}/sys && "
             f"exec chroot {root} /bin/bash /tmp/src/recover-in-chroot.sh")
    proc = subprocess.run(["unshare", "--net", "--mount", "--pid", "--fork",
                           "--propagation", "private", "sh", "-c", inner],
                          capture_output=True, text=True, timeout=600,
                          env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C.UTF-8",
                               "HOME": "/root"})
    assert proc.returncode == 0, f"{proc.stdout[-6000:]}\n{proc.stderr[-4000:]}"
    assert re.search(r"^(\d+) of \1 checks passed$", proc.stdout, re.M), proc.stdout[-3000:]
    assert "RECOVERED job=" in proc.stdout.splitlines()[-1]


def test_remove_waits_for_slurm_conf_then_purge_leaves_it_as_it_was(chroot):
    root, before = chroot
    conf = root / "etc/slurm/slurm.conf"
    conf.write_text(conf.read_text() + "Prolog=/opt/slurm-recovery/libexec/prolog.sh\n")
    refused = sh(root, "apt-get remove -y -qq slurm-recovery", check=False)
    assert refused.returncode != 0 and "scontrol reconfigure" in refused.stderr
    assert (root / "opt/slurm-recovery/bin/recovery-ctl").exists()
    conf.unlink()
    removed = sh(root, "apt-get remove -y -qq slurm-recovery")
    assert "not empty" not in removed.stderr + removed.stdout   # dpkg left no directory
    assert not (root / "opt/slurm-recovery").exists()
    assert not (root / "usr/bin/recovery-ctl").exists()
    assert not (root / "etc/slurm/plugstack.conf.d/slurm-recovery.conf").exists()
    assert not (root / "lib/systemd/system/slurm-recovery-agent.service").exists()
    assert (root / "etc/slurm-recovery/recovery.toml").is_file()        # remove keeps
    assert (root / "var/lib/slurm-recovery/recovery.db").is_file()
    sh(root, "apt-get purge -y -qq slurm-recovery")
    assert sh(root, "dpkg-query -W slurm-recovery", check=False).returncode != 0
    after = listing(root)
    assert after == before, (f"left behind: {sorted(after - before)[:20]}; "
                             f"taken away: {sorted(before - after)[:20]}")
