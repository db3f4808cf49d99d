"""The commands for the agent's host: ``recovery-ctl watchdog`` (fail open,
from a timer, with the agent down) and ``recovery-ctl check`` (is this
installation, or are its external sources, ready?)."""
from __future__ import annotations

import time
from dataclasses import asdict

import click

from ...act.actuator import Actuator
from ...config import load
from ...errors import RecoveryError
from ...inputs.sources import summary_lines
from ...scheduler import scheduler_for
from ...store import StoreLock
from ..check import check_sources_of, run_checks
from .client import Client, _config_option, _db_option
from .output import _dump, _json_option


@click.command()
@_config_option
@_db_option
@click.option("--force", is_flag=True, help="Run even while a live agent holds the store.")
@_json_option
def watchdog(config_path, db_path, force: bool, as_json: bool) -> None:
    """Release jobs held for a recovery decision longer than
    policy.decision_timeout (fail open). Meant for a systemd timer or cron:
    it works from the store and Slurm alone, while the agent is down. When a
    live agent holds the store and its heartbeat is fresh, it does nothing
    (the agent runs the same watchdog itself). --json prints one object: the
    notes, and each job released.

    \b
    Example:
        recovery-ctl watchdog          # from contrib/systemd/slurm-recovery-watchdog.timer
    """
    report = _Report(as_json)
    client = Client(config_path, db_path, None)
    if client.service is None:
        raise click.ClickException(f"watchdog: cannot read the store {client.cfg.store_path} "
                                   "here (run it on the agent's host, or name it with --db)")
    cfg, store = client.cfg, client.store
    beat = (store.get_state("heartbeat") or {}).get("time", 0)
    age = time.time() - beat
    lock = StoreLock(store.path)
    try:
        lock.acquire()   # held while acting: no agent starts on the store meanwhile
    except OSError as exc:   # no lock file can be made (a full disk): fail open
        report.note(f"watchdog: cannot take the store lock ({exc.strerror}); going on "
                    "without it")
    except RecoveryError:
        if not force and age < cfg.policy.decision_timeout:
            report.note(f"watchdog: the agent is running (heartbeat {age:.0f}s ago) and runs "
                        "the watchdog itself; nothing to do")
            report.done(agent_running=True)
            return
        report.note(f"watchdog: the agent holds the store but its heartbeat is {age:.0f}s old"
                    + (" (--force)" if force else "") + "; releasing what it left held")
    try:
        _watchdog_pass(cfg, store, report)
    finally:
        lock.release()
    report.done(agent_running=False)


class _Report:
    """What the watchdog says: lines as it goes, or one JSON object at the end."""

    def __init__(self, as_json: bool) -> None:
        self.as_json, self.notes, self.released = as_json, [], []

    def note(self, text: str) -> None:
        if self.as_json:
            self.notes.append(text)
        else:
            click.echo(text)

    def done(self, **extra) -> None:
        if self.as_json:
            _dump({**extra, "released": self.released, "notes": self.notes})


def _watchdog_pass(cfg, store, report: _Report) -> None:
    """One watchdog pass from this process. The releases run even when the store
    refuses writes (full disk, read-only): their record then waits in the side
    journal (``<store>.journal``) and reaches the store on a later run."""
    sched = scheduler_for(cfg)
    if sched is None:
        raise click.ClickException("watchdog: no usable Slurm backend (see the log line above)")
    try:
        listing = {j.job_id: j for j in sched.list_jobs()}
    except RecoveryError as exc:
        raise click.ClickException(f"watchdog: cannot list jobs: {exc}") from None
    actuator = Actuator(cfg, store, sched)
    if len(actuator.journal):
        written = actuator.journal.replay(store)
        report.note(f"watchdog: {written} record(s) from the side journal written to the "
                    "store")
    released = actuator.watchdog(listing, time.time())
    for pk in released:
        rec = store.rec(pk)
        journaled = pk in actuator.journaled
        status = "released (recorded in the side journal)" if journaled else rec.status
        report.released.append({"job_id": rec.job_id, "recommendation": pk,
                                "status": str(getattr(rec.status, "value", rec.status)),
                                "journaled": journaled})
        report.note(f"watchdog: released job {rec.job_id} (recommendation #{pk}, {status})")
    report.note(f"watchdog: {len(released)} job(s) released"
                + (f"; {len(actuator.journal)} record(s) wait in {actuator.journal.path} for "
                   "the store to take writes" if len(actuator.journal) else ""))


@click.command()
@_config_option
@click.option("--sources", "sources", is_flag=True,
              help="Check the external sources instead (GPU metrics, log stores): "
                   "reachable, recent data for the nodes and running jobs, the "
                   "configured labels, lag.")
@_json_option
def check(config_path, sources, as_json) -> None:
    """Is this installation ready? Checks the config, the store, Slurm, the hooks
    in slurm.conf, the SPANK plugin in plugstack, munge, the agent, the pattern
    packs and the state dir, with one PASS/FAIL line each. Exits 1 on any FAIL
    (WARN lines are optional parts). NOTE lines are not checks: an
    [environments.NAME] key set to the value it inherits from
    [environments.default] anyway.

    With --sources, checks each configured external source instead
    (sources.prometheus_url, loki_url, victorialogs_url): it answers, holds
    data from the last 15 minutes for the nodes sinfo lists and for the
    running opted-in jobs, carries the labels the label map names, and lags
    real time by under 5 minutes. One PASS/FAIL line per source, with the
    reason, then a summary; exits 1 on any FAIL, or when no source is
    configured. Run it before switching an environment to action mode: a FAIL
    means the agent would decide without what that source knows.

    \b
    Example:
        RECOVERY_CONFIG=/etc/slurm-recovery/recovery.toml recovery-ctl check
        recovery-ctl check --sources
        RECOVERY_SOURCES_PROMETHEUS_URL=http://prom:9090 recovery-ctl check --sources
    """
    try:
        cfg = load(config_path)
    except RecoveryError as exc:
        if sources:
            raise click.ClickException(str(exc)) from None
        click.echo(f"FAIL  config: {exc}")
        raise SystemExit(1) from None
    if sources:
        _check_sources(cfg, as_json)
        return
    results = run_checks(cfg)
    if as_json:
        _dump([{"check": r.name, "result": r.word, "detail": r.detail} for r in results])
    else:
        width = max(len(r.name) for r in results)
        for r in results:
            click.echo(f"{r.word}  {r.name:<{width}}  {r.detail}")
    failed = [r for r in results if r.word == "FAIL"]
    checks = [r for r in results if not r.note]
    if not as_json:
        click.echo(f"{len(checks) - len(failed)} of {len(checks)} checks passed"
                   + (f"; failed: {', '.join(r.name for r in failed)}" if failed else ""))
    if failed:
        raise SystemExit(1)


def _check_sources(cfg, as_json: bool) -> None:
    try:
        report = check_sources_of(cfg)
    except RecoveryError as exc:
        raise click.ClickException(str(exc)) from None
    if not report.results:
        raise click.ClickException(
            "no external source is configured: set sources.prometheus_url, "
            "sources.loki_url or sources.victorialogs_url in the config (or "
            "RECOVERY_SOURCES_PROMETHEUS_URL, ...); see docs/connectors.md")
    if as_json:
        _dump({"ok": report.ok, "nodes": report.nodes, "jobs": report.jobs,
               "notes": report.notes, "sources": [asdict(r) for r in report.results]})
    else:
        click.echo(f"checking {len(report.results)} source(s) against {len(report.nodes)} "
                   f"node(s) from sinfo and {len(report.jobs)} running opted-in job(s)")
        for note in report.notes:
            click.echo(f"note: {note}")
        for line in summary_lines(report.results):
            click.echo(line)
    if not report.ok:
        raise SystemExit(1)
