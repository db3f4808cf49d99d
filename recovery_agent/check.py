"""``recovery-ctl check``: is this installation ready? One pass/fail line each.

Checks, in order: the config loads; the store can be opened; a Slurm backend
can run; slurm.conf runs our Prolog, Epilog and HealthCheckProgram; the SPANK
plugin is in plugstack; munge signs and verifies; the agent answers; the
site's pattern packs load; the state and log paths are usable. Slurm's own
settings come from ``scontrol show config`` through the one argv seam.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from .config import Config
from .errors import RecoveryError
from .scheduler.runner import SlurmRunner

HOOK_KEYS = {"Prolog": "recovery-prolog", "Epilog": "recovery-epilog",
             "HealthCheckProgram": "recovery-healthcheck"}
PLUGIN = "slurm_recovery"


@dataclass(frozen=True)
class Result:
    name: str
    ok: bool
    detail: str
    optional: bool = False

    @property
    def word(self) -> str:
        return "PASS" if self.ok else ("WARN" if self.optional else "FAIL")


def _runner(cfg: Config) -> SlurmRunner:
    return SlurmRunner(bin_dir=cfg.scheduler.bin_dir, slurm_conf=cfg.scheduler.slurm_conf,
                       timeout=min(cfg.scheduler.command_timeout, 20))


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
    results = [Result("config", True, cfg.source or "built-in defaults (no file)")]
    # the store
    try:
        from .store import Store
        with Store(cfg.store_path) as store:
            results.append(Result("store", True, f"{cfg.store_path} "
                                  f"({len(store.applied_migrations())} migrations)"))
    except RecoveryError as exc:
        results.append(Result("store", False, str(exc)))
    # Slurm
    from .scheduler import probe_all
    probes = probe_all(_runner(cfg))
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
    import urllib.request
    host = cfg.api.bind if cfg.api.bind not in ("0.0.0.0", "::") else "127.0.0.1"
    url = f"http://{host}:{cfg.api.port}/v1/health"
    try:
        with urllib.request.urlopen(url, timeout=3) as resp:
            results.append(Result("agent", resp.status == 200, f"{url}: HTTP {resp.status}"))
    except OSError as exc:
        results.append(Result("agent", False, f"{url}: {getattr(exc, 'reason', exc)}"))
    # patterns and paths
    try:
        from .detect.patterns import load_rules
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
