"""make install, make uninstall and make deb build what docs/install.md describes.

One `make install DESTDIR=<stage> PREFIX=<final>` per module: the PREFIX tree is
then moved from the stage to <final>, so the virtualenv runs at the path it was
made for and the test proves it does not need the staging path. `make deb` is
checked with dpkg-deb. Together they take 70-80 s (two virtualenvs); a
reinstall over an install is a third, behind ``-m slow``.
"""
from __future__ import annotations

import configparser
import gzip
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

from recovery_agent import config
from recovery_agent.detect import patterns

REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
VERSION = PROJECT["version"]
CHANGELOG = REPO / "packaging" / "debian" / "changelog"
# the package's version: the changelog's top entry, VERSION plus a Debian revision
DEB_VERSION = CHANGELOG.read_text().split("\n", 1)[0].split()[1].strip("()")
OURS = sorted(PROJECT["scripts"])
UNITS = ("slurm-recovery-agent.service", "slurm-recovery-watchdog.service",
         "slurm-recovery-watchdog.timer")
HOOKS = {"prolog.sh": "recovery-prolog", "epilog.sh": "recovery-epilog",
         "healthcheck.sh": "recovery-healthcheck"}

needs_tools = pytest.mark.skipif(
    not (shutil.which("dpkg-deb") and Path("/usr/include/slurm/spank.h").exists()
         and Path("/usr/bin/python3").exists()),
    reason="make install needs Debian's python3, dpkg-deb and libslurm-dev")


def make(*args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["make", "-s", "-C", str(REPO), *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=600)
    if check and proc.returncode:
        pytest.fail(f"make {' '.join(args)} failed ({proc.returncode}):\n"
                    f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """(stage, final): the files outside PREFIX under stage, the PREFIX tree at final."""
    base = tmp_path_factory.mktemp("install")
    stage, final = base / "stage", base / "final"
    make("install", f"DESTDIR={stage}", f"PREFIX={final}")
    shutil.move(str(stage) + str(final), final)
    return stage, final


def unit(path: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str
    parser.read(path)
    return parser


def venv_commands(bin_dir: Path) -> list[str]:
    """bin/ less the virtualenv's own interpreter links and activate scripts."""
    return sorted(p.name for p in bin_dir.iterdir()
                  if not re.fullmatch(r"python(3(\.\d+)?)?|activate(\..*)?|Activate\.ps1", p.name))


def text_files(root: Path):
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink() and path.suffix not in (".pyc", ".so"):
            yield path


# ---- the pattern packs: where an installed wheel puts them --------------------

def test_wheel_data_files_put_the_packs_where_shipped_dir_looks():
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert data["data-files"] == {"share/slurm-recovery/patterns": ["etc/patterns/*.toml"]}


def test_shipped_dir_falls_back_to_the_prefix_then_the_distribution_record(tmp_path,
                                                                            monkeypatch):
    site = tmp_path / "lib" / "site-packages"
    info = site / "slurm_recovery-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: slurm-recovery\n"
                                   "Version: 0.1.0\n")
    (info / "RECORD").write_text("../../share/slurm-recovery/patterns/cuda.toml,,\n"
                                 "recovery_agent/__init__.py,,\n")
    packs = tmp_path / "share" / "slurm-recovery" / "patterns"
    packs.mkdir(parents=True)
    (packs / "cuda.toml").write_text("")
    monkeypatch.setattr(patterns, "__file__", str(tmp_path / "x" / "detect" / "patterns.py"))
    prefix = tmp_path / "prefix"
    monkeypatch.setattr(sys, "prefix", str(prefix))
    monkeypatch.setattr(metadata, "distribution",
                        lambda name: metadata.PathDistribution(info))
    assert patterns.shipped_dir() == packs          # pip install --user / --prefix
    in_prefix = prefix / "share" / "slurm-recovery" / "patterns"
    in_prefix.mkdir(parents=True)
    assert patterns.shipped_dir() == in_prefix      # a virtualenv, make install, the .deb

    def missing(name):
        raise metadata.PackageNotFoundError(name)
    shutil.rmtree(in_prefix)
    monkeypatch.setattr(metadata, "distribution", missing)
    assert patterns.shipped_dir() == in_prefix      # named in the loader's error


# ---- make install -------------------------------------------------------------

@needs_tools
def test_install_lays_out_the_tree(tree):
    stage, final = tree
    for name in ("recovery-agent", "recovery-ctl", *HOOKS.values()):
        assert os.access(final / "bin" / name, os.X_OK), name
    # on PATH through links (BINDIR, SBINDIR)
    assert os.readlink(stage / "usr/local/bin/recovery-ctl") == f"{final}/bin/recovery-ctl"
    assert os.readlink(stage / "usr/local/sbin/recovery-agent") == f"{final}/bin/recovery-agent"
    # what built the tree, and our dependencies' commands, stay out of it
    assert venv_commands(final / "bin") == OURS
    site = next(final.glob("lib/python3*/site-packages"))
    assert not [p.name for p in site.iterdir() if p.name.split("-")[0] in ("pip", "setuptools")]
    # the developer tools (tools/) stay out of what sites install
    assert not (final / "bin" / "recovery-devcluster").exists()
    assert not list(final.glob("lib/python3*/site-packages/recovery_devtools"))
    assert list(final.glob("lib/python3*/site-packages/recovery_agent"))
    assert (final / "lib" / "slurm-recovery" / "slurm_recovery.so").is_file()
    shipped = sorted(p.name for p in (REPO / "etc" / "patterns").glob("*.toml"))
    installed = final / "share" / "slurm-recovery" / "patterns"
    assert sorted(p.name for p in installed.glob("*.toml")) == shipped
    docs = final / "share" / "doc" / "slurm-recovery"
    assert (docs / "README.md").is_file() and (docs / "docs" / "install.md").is_file()
    for name in UNITS:
        assert (stage / "lib" / "systemd" / "system" / name).is_file(), name
    snippet = stage / "etc" / "slurm" / "plugstack.conf.d" / "slurm-recovery.conf"
    lines = [line for line in snippet.read_text().splitlines() if not line.startswith("#")]
    assert lines == [f"optional {final}/lib/slurm-recovery/slurm_recovery.so"]
    manifest = (final / "share" / "slurm-recovery" / "install-manifest").read_text()
    assert f"file /lib/systemd/system/{UNITS[0]}" in manifest
    assert re.search(r"^conf /etc/slurm-recovery/recovery.toml [0-9a-f]{64}$", manifest, re.M)


@needs_tools
def test_config_is_the_commented_example_and_loads(tree):
    stage, _ = tree
    installed = stage / "etc" / "slurm-recovery" / "recovery.toml"
    assert installed.read_bytes() == (REPO / "etc" / "recovery.toml").read_bytes()
    assert sum(line.startswith("#") for line in installed.read_text().splitlines()) > 50
    assert config.load(installed).agent.state_dir == "/var/lib/slurm-recovery"


@needs_tools
def test_units_start_installed_commands(tree):
    stage, final = tree
    for name in UNITS:
        svc = unit(stage / "lib" / "systemd" / "system" / name)
        if "Service" not in svc:
            continue
        argv = shlex.split(svc["Service"]["ExecStart"])
        assert argv[0].startswith(f"{final}/bin/") and os.access(argv[0], os.X_OK), argv
        assert svc["Service"]["Environment"] == \
            "RECOVERY_CONFIG=/etc/slurm-recovery/recovery.toml"
    docs = unit(stage / "lib" / "systemd" / "system" / UNITS[0])["Unit"]["Documentation"]
    assert Path(docs.removeprefix("file://")).is_file()


@needs_tools
def test_the_virtualenv_runs_where_it_was_installed(tree):
    stage, final = tree
    for program in ("recovery-ctl", "recovery-agent"):
        proc = subprocess.run([final / "bin" / program, "--help"], capture_output=True,
                              text=True, timeout=60, cwd="/")
        assert proc.returncode == 0 and "Usage:" in proc.stdout, proc.stderr
    assert (final / "bin" / "recovery-ctl").read_text().startswith(f"#!{final}/bin/python\n")
    staged = [str(p) for p in text_files(final) if str(stage).encode() in p.read_bytes()]
    assert not staged, f"files naming the staging path: {staged[:5]}"
    probe = subprocess.run(
        [final / "bin" / "python", "-c",
         "from recovery_agent.detect.patterns import shipped_dir, load_rules;"
         "print(shipped_dir()); print(len(load_rules()))"],
        capture_output=True, text=True, timeout=60, cwd="/", check=True)
    where, count = probe.stdout.split()
    assert where == f"{final}/share/slurm-recovery/patterns" and int(count) > 50


@needs_tools
def test_hook_wrappers_fast_path_and_fail_open(tree, tmp_path):
    _, final = tree
    for wrapper, program in HOOKS.items():
        path = final / "libexec" / wrapper
        assert os.access(path, os.X_OK)
        assert path.read_text().splitlines()[-1] == f'exec {final}/bin/{program} "$@"'
    bare = subprocess.run([final / "libexec" / "prolog.sh"], env={}, timeout=10)
    assert bare.returncode == 0              # a job that did not opt in
    conf = tmp_path / "recovery.toml"
    conf.write_text("[hooks]\n"
                    'agent_url = "http://127.0.0.1:9"\ntimeout = "200ms"\n'
                    f'spool_dir = "{tmp_path / "spool"}"\nlog_file = "{tmp_path / "hooks.log"}"\n'
                    'kernel_log = "file:/dev/null"\n'
                    f'munge_socket = "{tmp_path / "no-munge"}"\n')
    env = {"PATH": "/usr/bin:/bin", "RECOVERY_CONFIG": str(conf), "SLURM_RECOVERY": "1",
           "SLURM_JOB_ID": "42", "SLURMD_NODENAME": "node1"}
    opted = subprocess.run([final / "libexec" / "prolog.sh"], env=env, timeout=60,
                           capture_output=True, text=True)
    assert opted.returncode == 0, opted.stderr   # no agent, no munge: fails open
    assert list((tmp_path / "spool").rglob("*prolog*.json")), "the report was not spooled"


@needs_tools
@pytest.mark.skipif(not shutil.which("sbatch"), reason="needs Slurm's sbatch")
def test_installed_plugstack_line_loads_the_plugin(tree, tmp_path):
    stage, _ = tree
    snippet = stage / "etc" / "slurm" / "plugstack.conf.d" / "slurm-recovery.conf"
    (tmp_path / "slurm.conf").write_text(
        "ClusterName=t\nSlurmctldHost=localhost\n"
        f"PlugStackConfig={snippet}\nNodeName=n1\nPartitionName=p Nodes=n1\n")
    proc = subprocess.run(["sbatch", "--help"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SLURM_CONF": str(tmp_path / "slurm.conf")})
    assert "--recovery" in proc.stdout, proc.stderr
    assert "error" not in proc.stderr


def copy_tree(tree, dest: Path) -> None:
    """The installed tree again, under DESTDIR=dest, for a test that changes it."""
    stage, final = tree
    shutil.copytree(stage, dest, symlinks=True)
    shutil.copytree(final, str(dest) + str(final), symlinks=True)


@needs_tools
def test_uninstall_removes_what_install_added(tree, tmp_path):
    _, final = tree
    dest = tmp_path / "dest"
    copy_tree(tree, dest)
    toml = dest / "etc" / "slurm-recovery" / "recovery.toml"
    toml.write_text(toml.read_text() + "# site edit\n")
    snippet = dest / "etc" / "slurm" / "plugstack.conf.d" / "slurm-recovery.conf"
    snippet.write_text(snippet.read_text().rstrip() + " default_env=prod\n")
    store = dest / "var" / "lib" / "slurm-recovery" / "recovery.db"
    store.parent.mkdir(parents=True)
    store.write_bytes(b"audit")
    out = make("uninstall", f"DESTDIR={dest}", f"PREFIX={final}").stdout
    left = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert left == ["etc/slurm-recovery/plugstack.conf.saved", "etc/slurm-recovery/recovery.toml",
                    "var/lib/slurm-recovery/recovery.db"]
    assert "default_env=prod" in (dest / "etc/slurm-recovery/plugstack.conf.saved").read_text()
    for line in ("/etc/slurm-recovery/recovery.toml (changed since install)",
                 "/etc/slurm-recovery/plugstack.conf.saved", "/var/lib/slurm-recovery/"):
        assert line in out, out
    assert not (dest / "lib").exists() and not (dest / "tmp").exists()
    assert not (dest / "usr").exists()          # the links to recovery-ctl and recovery-agent


@needs_tools
@pytest.mark.slow   # a third virtualenv: about 25 s
def test_reinstall_keeps_an_edited_config_and_replaces_the_tree(tree, tmp_path):
    _, final = tree
    dest = tmp_path / "dest"
    copy_tree(tree, dest)
    toml = dest / "etc" / "slurm-recovery" / "recovery.toml"
    toml.write_text(toml.read_text() + "# site edit\n")
    stray = Path(str(dest) + str(final)) / "stray-file"
    stray.write_text("from the old tree")
    make("install", f"DESTDIR={dest}", f"PREFIX={final}")
    assert toml.read_text().endswith("# site edit\n")
    assert (dest / "etc" / "slurm-recovery" / "recovery.toml.dist").read_bytes() == \
        (REPO / "etc" / "recovery.toml").read_bytes()
    assert not stray.exists()
    make("uninstall", f"DESTDIR={dest}", f"PREFIX={final}")
    assert not (dest / "etc" / "slurm-recovery" / "recovery.toml.dist").exists()
    assert toml.exists()


def test_uninstall_refuses_while_slurm_conf_runs_the_hooks(tmp_path):
    prefix = tmp_path / "opt"
    manifest = prefix / "share" / "slurm-recovery" / "install-manifest"
    manifest.parent.mkdir(parents=True)
    manifest.write_text("# test\n")
    conf = tmp_path / "slurm.conf"
    conf.write_text(f"ClusterName=t\nProlog={prefix}/libexec/prolog.sh\n")
    proc = make("uninstall", f"PREFIX={prefix}", env={"SLURM_CONF": str(conf)}, check=False)
    assert proc.returncode != 0 and f"Prolog={prefix}/libexec/prolog.sh" in proc.stderr
    assert manifest.exists()


def test_a_system_prefix_is_refused():
    proc = make("uninstall", "PREFIX=/usr/local", check=False)
    assert proc.returncode != 0 and "system directory" in proc.stderr


# ---- make deb -----------------------------------------------------------------

@pytest.fixture(scope="module")
def deb():
    make("deb")
    arch = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True,
                          check=True).stdout.strip()
    path = REPO / "dist" / f"slurm-recovery_{DEB_VERSION}_{arch}.deb"
    assert path.is_file()
    return path


def dpkg_deb(*args: str) -> str:
    return subprocess.run(["dpkg-deb", *args], capture_output=True, text=True,
                          check=True).stdout


@needs_tools
def test_deb_control_fields(deb):
    fields = dict(line.split(": ", 1) for line in dpkg_deb("-f", str(deb)).splitlines()
                  if ": " in line and not line.startswith(" "))
    assert fields["Package"] == "slurm-recovery" and fields["Version"] == DEB_VERSION
    # pyproject's one version, plus a Debian revision (not a native package)
    assert re.fullmatch(re.escape(VERSION) + r"-\d+", fields["Version"]), fields["Version"]
    author = PROJECT["authors"][0]
    assert fields["Maintainer"] == f"{author['name']} <{author['email']}>"
    assert not re.search(r"@(example\.(org|com|net)|localhost|invalid)\b|\.invalid>|<>",
                         fields["Maintainer"]), fields["Maintainer"]
    depends = fields["Depends"]
    for dep in ("python3 (>= 3.11)", "python3 (<< 3.12)", "munge",
                "slurm-wlm-basic-plugins (>= 22.05)", "slurm-client | slurmd"):
        assert dep in depends, depends
    assert int(fields["Installed-Size"]) > 10_000
    assert dpkg_deb("-I", str(deb), "conffiles").split() == ["/etc/slurm-recovery/recovery.toml"]


@needs_tools
def test_deb_contents_and_maintainer_scripts(deb, tmp_path):
    names = {line.split()[-1] for line in dpkg_deb("-c", str(deb)).splitlines()}
    for path in ("bin/recovery-ctl", "bin/recovery-agent", "libexec/prolog.sh",
                 "libexec/store-upgrade", "lib/slurm-recovery/slurm_recovery.so",
                 "share/slurm-recovery/plugstack.conf",
                 "share/slurm-recovery/patterns/nccl.toml"):
        assert f"./opt/slurm-recovery/{path}" in names, path
    for path in ("./lib/systemd/system/slurm-recovery-agent.service",
                 "./etc/slurm-recovery/recovery.toml", "./usr/share/doc/slurm-recovery/copyright"):
        assert path in names, path
    assert not any("install-manifest" in n or "plugstack.conf.d" in n for n in names)
    assert not any("recovery_devtools" in n or "devcluster" in n or "configref" in n
                   for n in names), "a developer tool in the .deb"
    root = tmp_path / "x"
    subprocess.run(["dpkg-deb", "-R", str(deb), str(root)], check=True)
    assert (root / "opt/slurm-recovery/bin/recovery-ctl").read_text().startswith(
        "#!/opt/slurm-recovery/bin/python\n")
    for script in ("postinst", "prerm", "postrm"):
        path = root / "DEBIAN" / script
        assert os.access(path, os.X_OK) and "@" not in path.read_text(), script
        subprocess.run(["sh", "-n", str(path)], check=True)


@needs_tools
def test_deb_holds_no_bytecode_no_installer_and_only_our_commands(deb):
    names = [line.split()[5] for line in dpkg_deb("-c", str(deb)).splitlines()]
    assert not [n for n in names if "__pycache__" in n or n.endswith((".pyc", ".pyo"))]
    assert not [n for n in names if re.search(r"/site-packages/(pip|setuptools|wheel)[-/]", n)]
    assert not [n for n in names if "devcluster" in n or "recovery_devtools" in n]
    in_bin = [n.removeprefix("./opt/slurm-recovery/bin/") for n in names
              if re.fullmatch(r"\./opt/slurm-recovery/bin/[^/]+", n)]
    assert sorted(n for n in in_bin if not re.fullmatch(
        r"python(3(\.\d+)?)?|activate(\..*)?|Activate\.ps1", n)) == OURS
    assert not [n for n in names if n.startswith("./opt/slurm-recovery/share/man/")]


@needs_tools
def test_deb_puts_recovery_ctl_and_the_agent_on_path_with_man_pages(deb, tmp_path):
    links = {}
    for line in dpkg_deb("-c", str(deb)).splitlines():
        if " -> " in line:
            name, target = line.split(None, 5)[5].split(" -> ")
            links[name] = target
    assert links["./usr/bin/recovery-ctl"] == "/opt/slurm-recovery/bin/recovery-ctl"
    assert links["./usr/sbin/recovery-agent"] == "/opt/slurm-recovery/bin/recovery-agent"
    root = tmp_path / "x"
    subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    for page, verb in (("man1/recovery-ctl.1.gz", "watchdog"),
                       ("man8/recovery-agent.8.gz", "--no-watch")):
        text = gzip.decompress((root / "usr/share/man" / page).read_bytes()).decode()
        assert text.startswith(".TH ") and verb.replace("-", "\\-") in text, page


@needs_tools
def test_deb_ships_a_debian_changelog_and_the_lintian_overrides(deb, tmp_path):
    root = tmp_path / "x"
    subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    doc = root / "usr/share/doc/slurm-recovery"
    changelog = gzip.decompress((doc / "changelog.Debian.gz").read_bytes()).decode()
    assert changelog == CHANGELOG.read_text()
    assert changelog.startswith(f"slurm-recovery ({DEB_VERSION}) ")
    assert not (doc / "changelog.gz").exists()     # that name is a native package's
    overrides = (root / "usr/share/lintian/overrides/slurm-recovery").read_text()
    assert overrides == (REPO / "packaging/debian/lintian-overrides").read_text()
    lines = overrides.splitlines()
    for i, line in enumerate(lines):             # every override says why, just above it
        if line and not line.startswith("#"):
            assert line.startswith("slurm-recovery: "), line
            above = next(lines[j] for j in range(i - 1, -1, -1) if not lines[j].startswith(
                "slurm-recovery: "))
            assert above.startswith("# "), f"no comment says why: {line}"


@needs_tools
def test_deb_shared_objects_are_stripped(deb, tmp_path):
    root = tmp_path / "x"
    subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    elves = [p for p in root.rglob("*.so*") if p.is_file() and p.read_bytes()[:4] == b"\x7fELF"]
    assert root / "opt/slurm-recovery/lib/slurm-recovery/slurm_recovery.so" in elves
    assert len(elves) > 3     # the plugin and the wheels' extension modules
    with_symbols = [str(p.relative_to(root)) for p in elves
                    if ".symtab" in subprocess.run(["readelf", "-S", "-W", str(p)],
                                                   capture_output=True, text=True,
                                                   check=True).stdout]
    assert not with_symbols, with_symbols


@needs_tools
def test_deb_maintainer_scripts_leave_systemd_to_its_debian_helpers(deb, tmp_path):
    control = tmp_path / "DEBIAN"
    subprocess.run(["dpkg-deb", "-e", str(deb), str(control)], check=True)
    scripts = {name: (control / name).read_text() for name in ("postinst", "prerm", "postrm")}
    for name, text in scripts.items():
        code = [line.strip() for line in text.splitlines() if not line.strip().startswith("#")]
        # the one systemctl call debhelper's snippets make too (lintian allows it): the
        # reload, guarded by a running systemd
        calls = [line for line in code if re.match(r"(?:.+(?:;|&&|\|\||then|do))?\s*systemctl\b",
                                                   line)]
        assert all(line == "systemctl --system daemon-reload >/dev/null || true"
                   for line in calls), (name, calls)
        assert "/run/systemd/system" in text or not calls, name
    assert "deb-systemd-helper update-state" in scripts["postinst"]
    assert "deb-systemd-invoke start" in scripts["postinst"]
    assert "deb-systemd-invoke stop" in scripts["prerm"]
    assert "deb-systemd-helper purge" in scripts["postrm"]
    assert "compileall" in scripts["postinst"] and "__pycache__" in scripts["prerm"]


def test_the_changelog_top_entry_is_pyprojects_version_with_a_revision():
    assert re.fullmatch(re.escape(VERSION) + r"-\d+", DEB_VERSION), DEB_VERSION
    first = CHANGELOG.read_text().splitlines()[0]
    assert re.fullmatch(r"slurm-recovery \([^)]+\) [a-z-]+; urgency=\w+", first), first


def test_build_deb_refuses_a_changelog_behind_pyproject(tmp_path):
    proc = subprocess.run(["sh", str(REPO / "packaging/debian/build-deb.sh"),
                           str(tmp_path / "root"), str(tmp_path / "x.deb")],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "VERSION": "99.0.0", "PREFIX": "/opt/x",
                               "SYSCONFDIR": "/etc", "PLUGSTACK_DIR": "/etc/p", "ARCH": "amd64"})
    assert proc.returncode != 0 and "add an entry '99.0.0-1'" in proc.stderr, proc.stderr
    assert not (tmp_path / "x.deb").exists()
