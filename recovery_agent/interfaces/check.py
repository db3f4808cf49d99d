"""``recovery-ctl check``: is this installation ready? One pass/fail line each.

Checks, in order: the config loads (with a NOTE for each environment key
set to what it inherits from ``[environments.default]`` anyway); the store
can be opened; a Slurm backend can run; slurm.conf runs our Prolog, Epilog
and HealthCheckProgram; the SPANK plugin is in plugstack; munge signs and
verifies; the agent answers; the site's pattern packs load; the state and
log paths are usable. Slurm's own settings come from ``scontrol show
config`` through the one argv seam.

``check --sources`` (:func:`check_sources_of`) instead probes the external
sources (Prometheus/VictoriaMetrics, Loki, VictoriaLogs) against the cluster's
nodes and running opted-in jobs.
"""
from __future__ import annotations

import os
import re
import tomllib
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ..config import Config
from ..config.loading import inherited_anyway
from ..detect.patterns import load_rules
from ..errors import RecoveryError
from ..scheduler import RestSettings, probe_all, select_scheduler
from ..scheduler.runner import SlurmRunner
from ..inputs.sources import build_sources, check_sources
from ..store import Store

HOOK_KEYS = {"Prolog": "recovery-prolog", "Epilog": "recovery-epilog",
             "HealthCheckProgram": "recovery-healthcheck"}
PLUGIN = "slurm_recovery"


@dataclass(frozen=True)
class Result:
    name: str
    ok: bool
    detail: str
    optional: bool = False
    note: bool = False     # worth knowing, not a check: never a failure, not counted

    @property
    def word(self) -> str:
        if self.note:
            return "NOTE"
        return "PASS" if self.ok else ("WARN" if self.optional else "FAIL")


def config_notes(cfg: Config) -> list[Result]:
    """Keys of ``[environments.NAME]`` set to what they would inherit from
    ``[environments.default]`` anyway: harmless, but they stop following a
    later change of ``default``. One NOTE each."""
    if not cfg.source:
        return []
    try:
        with open(cfg.source, "rb") as fh:
            raw = tomllib.load(fh).get("environments", {})
    except (OSError, tomllib.TOMLDecodeError):
        return []    # it loaded a moment ago; a file changed since is the next run's
    return [Result(f"config environments.{env}.{key}", True,
                   f"set to {value!r}, the value it inherits from [environments.default] "
                   "anyway; drop it to follow default", note=True)
            for env, key, value in inherited_anyway(raw)]


def _runner(cfg: Config) -> SlurmRunner:
    return SlurmRunner.from_config(cfg.scheduler, timeout=min(cfg.scheduler.command_timeout, 20))


def slurm_config(cfg: Config) -> dict[str, str]:
    """``scontrol show config`` as a dict (raises SchedulerError)."""
    out = _runner(cfg).run(["scontrol", "show", "config"]).stdout
    values = {}
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            values[key.strip()] = value.strip()
    return values


def _mentions(path: str, needle: str) -> bool:
    """The hook path is our entry point, or a wrapper script that runs it."""
    if not path or path == "(null)":
        return False
    if needle in Path(path).name:
        return True
    try:
        with open(path, "rb") as fh:
            return needle.encode() in fh.read(64 * 1024)
    except OSError:
        return False


def _plugstack_has_plugin(path: str, depth: int = 0) -> bool:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        if text.startswith("include") and depth < 3:
            pattern = text.split(None, 1)[1] if len(text.split()) > 1 else ""
            base = Path(pattern) if pattern.startswith("/") else Path(path).parent / pattern
            if any(_plugstack_has_plugin(str(p), depth + 1)
                   for p in sorted(base.parent.glob(base.name))):
                return True
        elif PLUGIN in text and re.match(r"^(required|optional)\s", text):
            return True
    return False


def run_checks(cfg: Config) -> list[Result]:
    results = [Result("config", True, cfg.source or "built-in defaults (no file)"),
               *config_notes(cfg)]
    # the store
    try:
        with Store(cfg.store_path) as store:
            results.append(Result("store", True, f"{cfg.store_path} "
                                  f"({len(store.applied_migrations())} migrations)"))
    except RecoveryError as exc:
        results.append(Result("store", False, str(exc)))
    # Slurm
    probes = probe_all(_runner(cfg), RestSettings.from_config(cfg.scheduler))
    viable = [p for p in probes if p.viable]
    wanted = cfg.scheduler.backend
    ok = any(p.backend == wanted for p in viable) if wanted != "auto" else bool(viable)
    detail = "; ".join(f"{p.backend}: " + (f"ok (Slurm {p.version})" if p.viable else p.reason)
                       for p in probes)
    results.append(Result("slurm", ok, f"backend {wanted}: {detail}"))
    try:
        conf = slurm_config(cfg)
    except RecoveryError as exc:
        conf = None
        results.append(Result("slurm.conf", False, f"cannot read it: {exc}"))
    if conf is not None:
        for key, entry in HOOK_KEYS.items():
            value = conf.get(key, "")
            results.append(Result(f"slurm.conf {key}", _mentions(value, entry),
                                  f"{key}={value or '(unset)'}"
                                  + ("" if _mentions(value, entry) else f"; expected {entry} "
                                     "or a wrapper that runs it")))
        stack = conf.get("PlugStackConfig") or "/etc/slurm/plugstack.conf"
        found = _plugstack_has_plugin(stack)
        results.append(Result("plugstack", found, f"{stack}: "
                              + ("slurm_recovery.so listed" if found else
                                 "slurm_recovery.so not listed; jobs can still opt in "
                                 "with --comment=recovery=..."), optional=True))
    # munge
    try:
        from slurm_hooks import munge
        cred = munge.sign_body(b"recovery-ctl check", cfg.api.munge_socket)
        uid = munge.verify_body(cred, b"recovery-ctl check", cfg.api.munge_socket)
        results.append(Result("munge", True, f"signed and verified (uid {uid})"))
    except Exception as exc:  # noqa: BLE001 - any failure here is the finding
        results.append(Result("munge", cfg.api.auth == "none",
                              f"{exc}" + (" (api.auth = none: not needed)"
                                          if cfg.api.auth == "none" else "")))
    # the agent
    host = cfg.api.bind if cfg.api.bind not in ("0.0.0.0", "::") else "127.0.0.1"
    url = f"http://{host}:{cfg.api.port}/v1/health"
    try:
        with urllib.request.urlopen(url, timeout=3) as resp:
            results.append(Result("agent", resp.status == 200, f"{url}: HTTP {resp.status}"))
    except OSError as exc:
        results.append(Result("agent", False, f"{url}: {getattr(exc, 'reason', exc)}"))
    # patterns and paths
    try:
        rules = load_rules([cfg.agent.patterns_dir] if cfg.agent.patterns_dir else [])
        results.append(Result("patterns", True, f"{len(rules)} rules"
                              + (f" (site packs from {cfg.agent.patterns_dir})"
                                 if cfg.agent.patterns_dir else "")))
    except RecoveryError as exc:
        results.append(Result("patterns", False, str(exc)))
    state = Path(cfg.agent.state_dir)
    usable = state.is_dir() and os.access(state, os.W_OK)
    results.append(Result("state_dir", usable, f"{state} "
                          + ("writable" if usable else "missing or not writable")))
    if cfg.agent.patterns_dir:
        readable = os.access(cfg.agent.patterns_dir, os.R_OK)
        results.append(Result("patterns_dir", readable, cfg.agent.patterns_dir))
    return results


# -- check --sources ------------------------------------------------------------------

@dataclass
class SourcesReport:
    """What ``recovery-ctl check --sources`` found: one result per configured
    source, judged against the cluster's nodes and its running opted-in jobs;
    ``notes`` say where those came from, or why they are missing."""

    results: list
    nodes: list[str]
    jobs: dict[str, list[str]]
    notes: list[str]

    @property
    def ok(self) -> bool:
        return bool(self.results) and all(r.ok for r in self.results)


def check_sources_of(cfg: Config, scheduler=None, store=None,
                     now: float | None = None) -> SourcesReport:
    """Probe every source the config names (see :mod:`recovery_agent.inputs.sources.check`).

    Nodes come from ``sinfo`` through ``scheduler`` (made from the config when
    None); running opted-in jobs are the store's RUNNING jobs (``store``, else
    the config's store file when readable) placed with ``squeue``. Slurm or the
    store being unavailable narrows the check, with a note, but does not fail
    it. Raises ConfigError when a credentials file cannot be read.
    """
    sources = build_sources(cfg)
    if not sources:
        return SourcesReport([], [], {}, [])
    notes: list[str] = []
    if scheduler is None:
        try:
            scheduler = select_scheduler(cfg.scheduler.backend, _runner(cfg),
                                         RestSettings.from_config(cfg.scheduler))
        except RecoveryError as exc:
            notes.append(f"Slurm unavailable ({exc}): nodes and jobs not checked")
    nodes = _node_names(scheduler, notes)
    jobs = _running_jobs(cfg, scheduler, store, notes)
    return SourcesReport(check_sources(sources, nodes, jobs, now=now), nodes, jobs, notes)


def _node_names(scheduler, notes: list[str]) -> list[str]:
    if scheduler is None:
        return []
    try:
        return sorted(n.name for n in scheduler.list_nodes())
    except RecoveryError as exc:
        notes.append(f"sinfo failed ({exc}): nodes not checked")
        return []


def _running_jobs(cfg: Config, scheduler, store, notes: list[str]) -> dict[str, list[str]]:
    """Job id -> nodes of the opted-in jobs the store has RUNNING and squeue agrees."""
    if scheduler is None:
        return {}
    ids = _store_running_ids(cfg, store, notes)
    if not ids:
        return {}
    try:
        listed = scheduler.list_jobs(ids)
    except RecoveryError as exc:
        notes.append(f"squeue failed ({exc}): jobs not checked")
        return {}
    return {j.job_id: list(j.nodes) for j in listed if j.state == "RUNNING" and j.nodes}


def _store_running_ids(cfg: Config, store, notes: list[str]) -> list[str]:
    cluster = cfg.agent.cluster
    if store is not None:
        return [r["job_id"] for r in store.jobs("RUNNING") if r["cluster"] == cluster]
    path = cfg.store_path
    if not (path.exists() and os.access(path, os.R_OK)):
        notes.append(f"no readable store at {path}: running jobs not checked")
        return []
    try:
        with Store(path) as opened:
            return [r["job_id"] for r in opened.jobs("RUNNING") if r["cluster"] == cluster]
    except RecoveryError as exc:
        notes.append(f"store {path}: {exc}: running jobs not checked")
        return []
