"""Start, inspect and stop a real Slurm cluster on this one machine.

One munged (own key, own socket), one slurmctld and N ``slurmd -N nodeK``, all
from the distribution's Slurm, on non-default ports, recorded by pid and start
time in ``cluster.json`` so that ``down`` stops exactly what ``up`` started.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import psutil

from recovery_agent.errors import RecoveryError, SchedulerError
from recovery_agent.scheduler.cli_backend import CliScheduler
from recovery_agent.scheduler.runner import SlurmRunner
from .config import ClusterSpec, Layout, agent_toml, slurm_release, write_files

log = logging.getLogger(__name__)

DAEMONS = ("munged", "slurmctld", "slurmd")
REST_USER = "nobody"   # whom slurmrestd runs as when the dev cluster runs as root
START_TIMEOUT = 60.0
MIN_FREE_BYTES = 64 * 1024 * 1024


DRAIN_FLAGS = frozenset({"DRAIN", "DRAINED", "DRAINING"})


class DevClusterError(RecoveryError):
    """The dev cluster could not be started, found or stopped."""


def default_state_dir() -> Path:
    env = os.environ.get("RECOVERY_DEVCLUSTER_DIR")
    return Path(env) if env else Path(f"/tmp/recovery-devcluster-{os.getuid()}")


@dataclass
class Daemon:
    name: str          # "munged", "slurmctld", "slurmd-node1"
    pid: int
    started: float     # psutil create_time, guards against pid reuse

    def process(self) -> psutil.Process | None:
        """The live process, or None when it is gone, a zombie, or a new
        process that reused the pid."""
        try:
            proc = psutil.Process(self.pid)
            if abs(proc.create_time() - self.started) > 1.0:
                return None
            if proc.status() == psutil.STATUS_ZOMBIE:
                return None
            return proc
        except psutil.Error:
            return None

    @property
    def alive(self) -> bool:
        return self.process() is not None


class DevCluster:
    """One dev cluster, identified by its state dir."""

    def __init__(self, state_dir: Path | str | None = None,
                 progress: Callable[[str], None] | None = None) -> None:
        self.lay = Layout(Path(state_dir or default_state_dir()).absolute())
        self.progress = progress or (lambda msg: log.info("%s", msg))
        self._children: list[subprocess.Popen] = []

    # -- the record --------------------------------------------------------
    def _load(self) -> dict | None:
        try:
            return json.loads(self.lay.record.read_text())
        except (OSError, ValueError):
            return None

    def daemons(self) -> list[Daemon]:
        record = self._load() or {}
        return [Daemon(**d) for d in record.get("daemons", [])]

    def _save(self, spec: ClusterSpec, daemons: list[Daemon]) -> None:
        record = {"spec": spec.comparable(), "user": spec.user,
                  "nodes": spec.node_names, "slurm_conf": str(self.lay.slurm_conf),
                  "daemons": [d.__dict__ for d in daemons]}
        if spec.rest:
            record["rest"] = {"url": f"http://127.0.0.1:{spec.rest_port}",
                              "socket": f"unix:{self.lay.rest_socket}",
                              "token_file": str(self.lay.rest_token), "user": spec.user}
        tmp = self.lay.record.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        tmp.replace(self.lay.record)

    @property
    def slurm_conf(self) -> Path:
        return self.lay.slurm_conf

    def runner(self, timeout: float = 20.0) -> SlurmRunner:
        return SlurmRunner(slurm_conf=str(self.lay.slurm_conf), timeout=timeout)

    def scheduler(self) -> CliScheduler:
        return CliScheduler(self.runner())

    def node_names(self) -> list[str]:
        return list((self._load() or {}).get("nodes", []))

    # -- health ------------------------------------------------------------
    def is_healthy(self) -> bool:
        daemons = self.daemons()
        if not daemons or not all(d.alive for d in daemons):
            return False
        try:
            self.runner(timeout=10).run(["scontrol", "ping"])
        except SchedulerError:
            return False
        return True

    # -- up ----------------------------------------------------------------
    def up(self, spec: ClusterSpec) -> str:
        """Start the cluster (or reuse a healthy one of the same shape); return a
        one-line summary. Raises DevClusterError with the daemon log tail."""
        _require_binaries(spec)
        record = self._load()
        if record and self.is_healthy():
            if record.get("spec") == spec.comparable():
                # the daemons stay; the agent's config follows this version's
                # (a newer checkout may add keys, e.g. agent.log_roots)
                self.lay.agent_config.write_text(agent_toml(spec, self.lay))
                self._wait_idle(spec, time.monotonic() + START_TIMEOUT)
                return f"reusing healthy dev cluster in {self.lay.root}"
            self.progress("cluster shape changed: restarting it")
            self.down()
        elif record or self.lay.root.exists():
            self._clean_stale()
        self._check_ports(spec)
        self._prepare_dir(spec)
        deadline = time.monotonic() + START_TIMEOUT
        daemons: list[Daemon] = []
        try:
            daemons.append(self._start_munged())
            self._save(spec, daemons)
            self._wait_for(lambda: self.lay.munge_socket.exists(), deadline, "munged")
            daemons.append(self._start("slurmctld", ["slurmctld", "-D", "-i", "-f",
                                                     str(self.lay.slurm_conf)]))
            self._save(spec, daemons)
            self._wait_for(self._ctld_answers, deadline, "slurmctld")
            if spec.rest:
                daemons.extend(self._start_rest(spec))
                self._save(spec, daemons)
                self._wait_for(lambda: self._rest_answers(spec), deadline, "slurmrestd")
            for name in spec.node_names:
                daemons.append(self._start(f"slurmd-{name}", ["slurmd", "-D", "-N", name,
                                                               "-f", str(self.lay.slurm_conf)]))
            self._save(spec, daemons)
            self._wait_idle(spec, deadline)
        except DevClusterError:
            self.down(quiet=True)
            raise
        return (f"dev cluster up: {spec.nodes} nodes x {spec.gpus_per_node} GPUs, "
                f"slurmctld on port {spec.port}, state in {self.lay.root}")

    def _prepare_dir(self, spec: ClusterSpec) -> None:
        try:
            self.lay.root.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(self.lay.root).free
            if free < MIN_FREE_BYTES:
                raise DevClusterError(
                    f"not enough free space in {self.lay.root}: {free // 1024} KiB free, "
                    f"need {MIN_FREE_BYTES // 2**20} MiB")
            write_files(spec, self.lay, self._release())
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise DevClusterError(f"state dir {self.lay.root} is on a full disk") from None
            raise DevClusterError(f"cannot write state dir {self.lay.root}: "
                                  f"{exc.strerror or exc}") from None

    def _release(self) -> tuple[int, int]:
        """The installed Slurm's (major, minor); (0, 0) when it does not say."""
        try:
            return slurm_release(self.runner(timeout=10).run(["slurmctld", "-V"]).stdout)
        except SchedulerError:
            return 0, 0

    def _clean_stale(self) -> None:
        """Stop whatever a crashed run left and wipe its state dir."""
        root = self.lay.root
        if root.exists() and any(root.iterdir()) and not self.lay.marker.exists():
            raise DevClusterError(f"{root} exists and is not a dev cluster state dir; "
                                  f"choose another --state-dir")
        if self.daemons():
            self.progress(f"cleaning a stale dev cluster in {root}")
            self._stop_daemons()
        if root.exists():
            shutil.rmtree(root)

    def _check_ports(self, spec: ClusterSpec) -> None:
        for owner, port in spec.ports.items():
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            # as the daemons do: a socket in TIME_WAIT is no obstacle, a listener is
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                raise DevClusterError(f"port {port} (for {owner}) is already in use; "
                                      f"choose another base port with --port") from None
            finally:
                sock.close()

    def _start_munged(self) -> Daemon:
        lay = self.lay
        return self._start("munged", [
            "munged", "--foreground", "--force", f"--key-file={lay.munge_key}",
            f"--socket={lay.munge_socket}", f"--pid-file={lay.run_dir}/munged.pid",
            f"--log-file={lay.daemon_log('munged')}", f"--seed-file={lay.munge_dir}/seed",
        ])

    # -- slurmrestd (opt-in: ClusterSpec.rest) --------------------------------
    def _start_rest(self, spec: ClusterSpec) -> list[Daemon]:
        """Two slurmrestd: one on 127.0.0.1:rest_port with auth/jwt, one on a unix
        socket with rest_auth/local. They cannot be one process: auth/jwt
        becomes slurmrestd's own auth type only with SLURM_JWT=daemon, and then
        local auth (munge) is gone. slurmrestd refuses to run as root or as
        SlurmUser, so as root it drops to ``nobody`` (``-u``); as anyone else the
        dev cluster's SlurmUser is that same user and the check is turned off."""
        lay = self.lay
        token = self.runner().run(["scontrol", "token", f"username={spec.user}",
                                   "lifespan=86400"]).stdout
        fd = os.open(lay.rest_token, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(token.strip() + "\n")
        if lay.rest_socket.exists():
            lay.rest_socket.unlink()
        # slurmrestd binds its socket after dropping to its user: a folder of its own
        lay.rest_socket.parent.mkdir(mode=0o755, exist_ok=True)
        drop: list[str] = []
        env: dict[str, str] = {}
        if os.getuid() == 0:
            user = pwd.getpwnam(REST_USER)
            os.chown(lay.rest_socket.parent, user.pw_uid, user.pw_gid)
            # by number: 26.05's slurmrestd refuses the name "nobody" itself
            # (Slurm's SLURM_AUTH_NOBODY_NAME: "Unable to resolve user: nobody")
            drop = ["-u", str(user.pw_uid), "-g", str(user.pw_gid)]
            _reachable_by_others(lay.root)
        else:
            env["SLURMRESTD_SECURITY"] = "disable_user_check"
        # nobody reads slurm.conf and reaches munge's socket through the state dir
        os.chmod(lay.root, 0o755)
        base = ["slurmrestd", *drop, "-f", str(lay.slurm_conf), "-s", _openapi_plugins()]
        # SLURM_JWT: each request's token, not slurmrestd's munge credential, reaches slurmctld
        jwt = self._start("slurmrestd", [*base, "-a", "rest_auth/jwt",
                                         f"127.0.0.1:{spec.rest_port}"],
                          dict(env, SLURM_JWT="daemon"))
        local = self._start("slurmrestd-local", [*base, "-a", "rest_auth/local",
                                                 f"unix:{lay.rest_socket}"], env)
        return [jwt, local]

    def _rest_answers(self, spec: ClusterSpec) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", spec.rest_port), timeout=1):
                return self.lay.rest_socket.exists()
        except OSError:
            return False

    def rest_settings(self) -> dict[str, str]:
        """How the REST backend reaches this cluster's slurmrestd: URL, socket,
        token file, user (empty dict when the cluster runs without it)."""
        record = self._load() or {}
        return dict(record.get("rest") or {})

    def _start(self, name: str, argv: list[str], extra_env: dict | None = None) -> Daemon:
        exe = shutil.which(argv[0])
        assert exe, argv[0]
        env = dict(os.environ, SLURM_CONF=str(self.lay.slurm_conf), **(extra_env or {}))
        stderr = open(self.lay.logs / f"{name}.stderr", "ab")
        try:
            proc = subprocess.Popen([exe, *argv[1:]], cwd=self.lay.logs, env=env,
                                    stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr,
                                    start_new_session=True)
        finally:
            stderr.close()
        self._children.append(proc)
        started = psutil.Process(proc.pid).create_time()
        log.debug("started %s pid=%s", name, proc.pid)
        return Daemon(name, proc.pid, started)

    def _ctld_answers(self) -> bool:
        try:
            self.runner(timeout=5).run(["scontrol", "ping"])
            return True
        except SchedulerError:
            return False

    def _wait_for(self, ready: Callable[[], bool], deadline: float, what: str) -> None:
        while time.monotonic() < deadline:
            self._fail_if_dead()
            if ready():
                return
            time.sleep(0.2)
        raise DevClusterError(f"{what} did not become ready within {START_TIMEOUT:.0f}s"
                              + self._log_tail(what))

    def _fail_if_dead(self) -> None:
        for daemon in self.daemons():
            if not daemon.alive:
                raise DevClusterError(f"{daemon.name} exited during start-up"
                                      + self._log_tail(daemon.name))

    def _wait_idle(self, spec: ClusterSpec, deadline: float) -> None:
        sched = self.scheduler()
        pending: list[str] = spec.node_names
        last_report = 0.0
        while time.monotonic() < deadline:
            self._fail_if_dead()
            try:
                nodes = {n.name: n for n in sched.list_nodes()}
            except SchedulerError:
                nodes = {}
            drained = [n for n in spec.node_names if n in nodes and nodes[n].state == "IDLE"
                       and nodes[n].drained and nodes[n].flags <= DRAIN_FLAGS]
            for name in drained:
                # slurmctld keeps drains across restarts; a fresh dev cluster has none
                self.progress(f"resuming {name}, drained before the restart "
                              f"({nodes[name].reason or 'no reason'})")
                try:
                    sched.resume_node(name)
                except SchedulerError as exc:
                    self.progress(f"cannot resume {name}: {exc}")
            pending = [n for n in spec.node_names
                       if n not in nodes or nodes[n].state != "IDLE" or nodes[n].flags]
            if not pending:
                return
            if time.monotonic() - last_report > 5:
                self.progress(f"waiting for {len(pending)} node(s) to become idle: "
                              + ", ".join(f"{n}={nodes[n].state_text if n in nodes else '?'}"
                                          for n in pending[:4]))
                last_report = time.monotonic()
            time.sleep(0.3)
        worst = pending[0] if pending else "slurmctld"
        raise DevClusterError(f"nodes not idle within {START_TIMEOUT:.0f}s: {', '.join(pending)}"
                              + self._log_tail("slurmctld") + self._log_tail(f"slurmd-{worst}"))

    def _log_tail(self, daemon: str, lines: int = 15) -> str:
        chunks = []
        for path in (self.lay.daemon_log(daemon), self.lay.logs / f"{daemon}.stderr"):
            try:
                text = path.read_text(errors="replace").strip().splitlines()[-lines:]
            except OSError:
                continue
            if text:
                chunks.append(f"\n--- last lines of {path} ---\n" + "\n".join(text))
        return "".join(chunks)

    # -- the controller, for fault tests -----------------------------------
    def kill_ctld(self, sig: int = signal.SIGKILL) -> None:
        """Kill slurmctld (SIGKILL by default: no chance to save state) and wait
        until it is gone. Jobs keep running on the slurmd's meanwhile."""
        for d in self.daemons():
            proc = d.process() if d.name == "slurmctld" else None
            if proc is not None:
                with _quiet():
                    proc.send_signal(sig)
                psutil.wait_procs([proc], timeout=15)
        self._reap_children()

    def start_ctld(self, timeout: float = 60.0) -> None:
        """Start slurmctld again on its saved state (a restart after a crash)
        and wait until it answers."""
        record = self._load()
        if not record:
            raise DevClusterError(f"no dev cluster recorded in {self.lay.root}")
        daemons = [Daemon(**d) for d in record["daemons"] if d["name"] != "slurmctld"]
        daemons.insert(1, self._start("slurmctld", ["slurmctld", "-D", "-i", "-f",
                                                    str(self.lay.slurm_conf)]))
        record["daemons"] = [d.__dict__ for d in daemons]
        tmp = self.lay.record.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        tmp.replace(self.lay.record)
        deadline = time.monotonic() + timeout
        while not self._ctld_answers():
            if time.monotonic() > deadline:
                raise DevClusterError("slurmctld did not answer after a restart"
                                      + self._log_tail("slurmctld"))
            time.sleep(0.2)

    # -- down --------------------------------------------------------------
    def down(self, quiet: bool = False) -> list[str]:
        """Cancel every job, stop every daemon we started, and sweep job
        processes left behind. Returns the names of what was stopped."""
        daemons = self.daemons()
        if not daemons:
            return []
        if any(d.name == "slurmctld" and d.alive for d in daemons):
            self._cancel_all_jobs()
        stopped = self._stop_daemons()
        self._sweep_job_processes()
        record = self._load()
        if record:
            record["daemons"] = []
            self.lay.record.write_text(json.dumps(record, indent=1) + "\n")
        if not quiet:
            self.progress(f"stopped {len(stopped)} daemon(s)")
        return stopped

    def _cancel_all_jobs(self) -> None:
        try:
            jobs = self.scheduler().list_jobs()
        except SchedulerError:
            return
        live = sorted({str(j.numeric_id) for j in jobs if not j.is_finished})
        if not live:
            return
        try:
            self.runner().run(["scancel", *live])
        except SchedulerError as exc:
            log.warning("scancel during down failed: %s", exc)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and self._stepds():
            time.sleep(0.3)

    def _stop_daemons(self) -> list[str]:
        # slurmd first, munged last: the others need it to say goodbye
        order = {"slurmd": 0, "slurmrestd": 0, "slurmctld": 1, "munged": 2}
        daemons = sorted(self.daemons(), key=lambda d: order.get(d.name.split("-")[0], 3))
        stopped = []
        for group in sorted(set(order.values())):
            procs = []
            for d in daemons:
                if order.get(d.name.split("-")[0], 3) != group:
                    continue
                proc = d.process()
                if proc is not None:
                    with _quiet():
                        proc.send_signal(signal.SIGTERM)
                    procs.append(proc)
                    stopped.append(d.name)
            _gone, alive = psutil.wait_procs(procs, timeout=10)
            for proc in alive:
                with _quiet():
                    proc.kill()
            psutil.wait_procs(alive, timeout=5)
        self._reap_children()
        return stopped

    def _stepds(self) -> list[psutil.Process]:
        """slurmstepd processes of this cluster: they keep our slurmd log open and
        run in our log dir, so they are told apart from a real cluster's."""
        found = []
        root = str(self.lay.root)
        for proc in psutil.process_iter(["name", "cwd"]):
            if proc.info["name"] != "slurmstepd":
                continue
            try:
                cwd = proc.info["cwd"] or ""
                files = [f.path for f in proc.open_files()]
            except psutil.Error:
                continue
            if cwd.startswith(root) or any(p.startswith(root) for p in files):
                if proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc)
        return found

    def _sweep_job_processes(self) -> None:
        victims = []
        for stepd in self._stepds():
            with _quiet():
                victims.extend(stepd.children(recursive=True))
            victims.append(stepd)
        for proc in victims:
            with _quiet():
                proc.kill()
        psutil.wait_procs(victims, timeout=5)

    def _reap_children(self) -> None:
        for child in self._children:
            with _quiet():
                child.wait(timeout=1)

    # -- status ------------------------------------------------------------
    def status(self) -> dict:
        """Daemons (alive or not) and, when slurmctld answers, node states."""
        daemons = [{"name": d.name, "pid": d.pid, "alive": d.alive} for d in self.daemons()]
        nodes = []
        if any(d["name"] == "slurmctld" and d["alive"] for d in daemons):
            try:
                nodes = [{"name": n.name, "state": n.state_text, "reason": n.reason}
                         for n in self.scheduler().list_nodes()]
            except SchedulerError as exc:
                nodes = [{"name": "?", "state": "unreachable", "reason": str(exc)}]
        return {"state_dir": str(self.lay.root), "slurm_conf": str(self.lay.slurm_conf),
                "configured": self.lay.record.exists(), "daemons": daemons, "nodes": nodes}


class _quiet:
    """Ignore a process that vanished between looking and acting."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        return exc_type is not None and issubclass(exc_type, (psutil.Error,
                                                              subprocess.TimeoutExpired))


def _reachable_by_others(root: Path) -> None:
    """slurmrestd, as ``nobody``, must reach slurm.conf and munge's socket
    under the state dir: every folder above it must let others pass."""
    for folder in [*reversed(root.parents)]:
        if not os.stat(folder).st_mode & 0o001:
            raise DevClusterError(f"slurmrestd runs as {REST_USER} and cannot reach "
                                  f"{root}: {folder} does not let others pass (mode "
                                  f"{os.stat(folder).st_mode & 0o777:o}); choose a state "
                                  f"dir under /tmp")


PLUGIN_DIRS = ("/usr/lib/x86_64-linux-gnu/slurm-wlm", "/usr/lib/aarch64-linux-gnu/slurm-wlm",
               "/usr/lib64/slurm", "/usr/lib/slurm", "/usr/local/lib/slurm")


def _openapi_plugins() -> str:
    """The OpenAPI plugins slurmrestd should load: only slurmctld's (the dbv*
    and slurmdbd ones refuse to start without slurmdbd, which the dev cluster
    lacks). 23.11+ ships one ``openapi/slurmctld``; 22.05 one plugin per
    version, of which the newest is taken."""
    found = []
    for folder in PLUGIN_DIRS:
        try:
            found += os.listdir(folder)
        except OSError:
            continue
    if "openapi_slurmctld.so" in found:
        return "openapi/slurmctld"
    versions = sorted((tuple(int(p) for p in name[len("openapi_v"):-3].split("_")), name)
                      for name in found if name.startswith("openapi_v") and name.endswith(".so")
                      and name[len("openapi_v"):-3].replace("_", "").isdigit())
    if not versions:
        raise DevClusterError("no slurmrestd OpenAPI plugin found (apt-get install slurmrestd)")
    return "openapi/v" + ".".join(str(p) for p in versions[-1][0])


def _require_binaries(spec: ClusterSpec | None = None) -> None:
    wanted = DAEMONS + ("scontrol", "sinfo", "squeue")
    if spec is not None and spec.rest:
        if shutil.which("slurmrestd") is None:
            raise DevClusterError("slurmrestd is not installed (apt-get install slurmrestd "
                                  "slurm-wlm-jwt-plugin)")
    missing = [b for b in wanted if shutil.which(b) is None]
    if missing:
        raise DevClusterError(f"Slurm is not installed: {', '.join(missing)} not found "
                              f"(run `make deps`, or apt-get install slurm-wlm munge)")
