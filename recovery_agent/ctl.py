"""``recovery-ctl``: the operator's command line for slurm-recovery.

Each command is a few lines over the library; library errors become
``click.ClickException`` here, at the edge.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import click

from .detect.attribution import attribute, context_from_lines
from .detect.model import Detection, Verdict
from .detect.patterns import load_rules
from .detect.scanner import MAX_LINE, Scanner
from .errors import RecoveryError

CHUNK = 16 << 20


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Inspect and steer slurm-recovery: detections, verdicts, pattern packs.

    \b
    Example:
        recovery-ctl patterns test slurm-4410.out
    """


@main.group()
def patterns() -> None:
    """Work with the detection pattern packs (etc/patterns/*.toml and site packs).

    \b
    Example:
        recovery-ctl patterns test --patterns-dir /etc/slurm-recovery/patterns job.log
    """


@patterns.command("test")
@click.argument("files", nargs=-1, required=True,
                type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--patterns-dir", "dirs", multiple=True,
              type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="A directory of site packs, loaded after the shipped ones (repeatable).")
@click.option("--engine", type=click.Choice(["auto", "re", "hyperscan"]), default="auto",
              show_default=True, help="Matcher: hyperscan when it imports, else Python re.")
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object per input file, one per line.")
def patterns_test(files: tuple[Path, ...], dirs: tuple[Path, ...], engine: str,
                  as_json: bool) -> None:
    """Run the scanner and attribution over log files, offline.

    Prints each detection (line, rule, category, host) and the verdict for
    each file. Nothing is sent anywhere: use it to check packs against your
    own logs before the agent runs them.

    \b
    Example:
        recovery-ctl patterns test slurm-4410.out
        recovery-ctl patterns test --json logs/*.err | jq .verdict
    """
    try:
        scanner = Scanner(load_rules(dirs), engine=engine)
    except RecoveryError as exc:
        raise click.ClickException(str(exc)) from None
    for path in files:
        detections = _scan_file(scanner, path)
        verdict = attribute(detections, context_from_lines(_read_lines(path)))
        if as_json:
            click.echo(json.dumps(_as_json(path, detections, verdict)))
        else:
            _print_report(path, detections, verdict)


def _scan_file(scanner: Scanner, path: Path) -> list[Detection]:
    """The scanner over a file read in chunks (any size, any bytes)."""
    stream = scanner.stream(str(path))
    detections: list[Detection] = []
    try:
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(CHUNK), b""):
                detections.extend(stream.feed_bytes(chunk))
    except OSError as exc:
        raise click.ClickException(f"{path}: {exc.strerror or exc}") from None
    return detections + stream.flush()


def _read_lines(path: Path) -> Iterator[str]:
    """A log file's lines, leniently decoded, each cut to MAX_LINE bytes."""
    try:
        with open(path, "rb") as fh:
            while True:
                raw = fh.readline(MAX_LINE)
                if not raw:
                    return
                if not raw.endswith(b"\n"):
                    while True:   # drop the rest of an over-long line
                        rest = fh.readline(1 << 20)
                        if not rest or rest.endswith(b"\n"):
                            break
                yield raw.decode("utf-8", "replace")
    except OSError as exc:
        raise click.ClickException(f"{path}: {exc.strerror or exc}") from None


def _as_json(path: Path, detections: list[Detection], verdict: Verdict) -> dict:
    return {"file": str(path),
            "detections": [{"rule": d.rule, "category": d.category, "line": d.line,
                            "host": d.host} for d in detections],
            "verdict": {"category": verdict.category, "action": verdict.action,
                        "nodes": list(verdict.nodes)}}


def _print_report(path: Path, detections: list[Detection], verdict: Verdict) -> None:
    click.secho(str(path), bold=True)
    if not detections:
        click.echo("  no detections")
    for d in detections:
        click.echo(f"  line {d.line or '-':>6}  {d.rule:<32} {d.category:<18} "
                   f"host={d.host or '-'}")
    where = "".join(f" {name}={','.join(values)}" for name, values in
                    (("nodes", verdict.nodes), ("gpus", verdict.gpus), ("links", verdict.links))
                    if values)
    click.echo(f"  verdict: category={verdict.category or '-'} action={verdict.action} "
               f"blame={verdict.blame}{where} confidence={verdict.confidence:.2f}")
    if verdict.reason:
        click.echo(f"           {verdict.reason}")


# -- the store: jobs, the audit trail, the watchdog ------------------------------

_config_option = click.option(
    "-c", "--config", "config_path", type=click.Path(dir_okay=False), default=None,
    help="Agent config [default: $RECOVERY_CONFIG or /etc/slurm-recovery/recovery.toml].")
_db_option = click.option("--db", "db_path", type=click.Path(dir_okay=False), default=None,
                          help="Read this store file instead of the config's.")


def _open(config_path: str | None, db_path: str | None):
    from .config import load
    from .store import Store
    try:
        cfg = load(config_path)
        path = Path(db_path) if db_path else cfg.store_path
        if not path.exists():
            raise click.ClickException(f"no store at {path} (has the agent run? --db PATH)")
        return cfg, Store(path)
    except RecoveryError as exc:
        raise click.ClickException(str(exc)) from None


def _job_row(store, cluster: str, job_id: str) -> dict:
    row = store.find_job(cluster, job_id)
    if row is None:
        raise click.ClickException(f"job {job_id} is not tracked")
    return row


def _when(ts: float | None) -> str:
    import time as _time
    return _time.strftime("%H:%M:%S", _time.localtime(ts)) + f".{int(ts % 1 * 1000):03d}" \
        if ts else "-"


@main.group()
def show() -> None:
    """Show what the agent tracks (read straight from its store).

    \b
    Example:
        recovery-ctl show job 4410
    """


@show.command("job")
@click.argument("job_id")
@_config_option
@_db_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object.")
def show_job(job_id: str, config_path, db_path, as_json: bool) -> None:
    """A job's attempts and timeline: registration, detections, verdicts,
    recommendations and what was done. An array's id lists its tasks, each
    tracked and acted on alone (show one with ID_TASK).

    \b
    Example:
        recovery-ctl show job 4410
        recovery-ctl show job 1234_7 --json | jq '.timeline[] | .message'
    """
    cfg, store = _open(config_path, db_path)
    if store.find_job(cfg.agent.cluster, job_id) is None and job_id.isdigit():
        tasks = list(store.db["jobs"].rows_where("cluster = ? and array_job_id = ?",
                                                 [cfg.agent.cluster, int(job_id)],
                                                 order_by="array_task_id"))
        if tasks:
            _show_array(store, job_id, tasks, as_json)
            return
    row = _job_row(store, cfg.agent.cluster, job_id)
    attempts = store.attempts(row["id"])
    timeline = list(store.timeline(row["id"]))
    if as_json:
        click.echo(json.dumps({"job": row, "attempts": attempts, "timeline": timeline},
                              default=str))
        return
    click.secho(f"job {row['job_id']} ({row['name'] or '-'}) user={row['user'] or '-'} "
                f"env={row['env']} state={row['state']} restarts={row['restart_count']}",
                bold=True)
    for a in attempts:
        click.echo(f"  attempt {a['attempt']}: {a['state'] or '-':<10} nodes="
                   f"{','.join(a['nodes']) or '-'}  checkpoint={a['ckpt_path'] or '-'}")
    click.echo("  timeline:")
    for e in timeline:
        attempt = "" if e["attempt"] is None else f"[{e['attempt']}]"
        click.echo(f"    {_when(e['ts'])} {attempt:<4} {e['kind']:<16} {e['message']}")


def _show_array(store, array_id: str, tasks: list[dict], as_json: bool) -> None:
    """A job array: one line per task (each is tracked and acted on alone)."""
    rows = []
    for task in tasks:
        recs = [r for r in store.recommendations(job_pk=task["id"]) if r["scope"] == "job"]
        rows.append({"job_id": task["job_id"], "state": task["state"],
                     "restarts": task["restart_count"],
                     "recommendations": [f"#{r['id']} {r['action']} {r['status']}"
                                         for r in recs]})
    if as_json:
        click.echo(json.dumps({"array_job_id": int(array_id), "tasks": rows}))
        return
    click.secho(f"array {array_id}: {len(rows)} task(s) tracked", bold=True)
    for r in rows:
        click.echo(f"  {r['job_id']:<14} {r['state'] or '-':<10} restarts={r['restarts']}  "
                   + ("; ".join(r["recommendations"]) or "-"))


@main.command()
@click.option("--job", "job_id", default=None, help="Only this job's recommendations.")
@_config_option
@_db_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object per recommendation.")
def audit(job_id: str | None, config_path, db_path, as_json: bool) -> None:
    """The audit trail: each recommendation (written before any action), its
    evidence, and every step taken on Slurm, with timestamps.

    \b
    Example:
        recovery-ctl audit --job 4410
    """
    cfg, store = _open(config_path, db_path)
    job_pk = _job_row(store, cfg.agent.cluster, job_id)["id"] if job_id else None
    for rec in store.recommendations(job_pk=job_pk):
        steps = store.steps(rec["id"])
        if as_json:
            click.echo(json.dumps({**rec, "steps": steps}, default=str))
            continue
        click.secho(f"#{rec['id']} job {rec['job_id'] or '-'} attempt {rec['attempt']}: "
                    f"{rec['action']} {','.join(rec['target_nodes'])} -> {rec['status']} "
                    f"(mode {rec['mode']}, rule {rec['rule']})", bold=True)
        click.echo(f"    reason:   {rec['reason']}")
        if rec["exclude"]:
            click.echo(f"    exclude:  {','.join(rec['exclude'])}")
        for ev in rec["evidence"][:3] if isinstance(rec["evidence"], list) else []:
            for line in ev.get("lines", [])[:1]:
                click.echo(f"    evidence: [{ev['pattern']}] {line['text'][:110]}")
        click.echo(f"    proposed {_when(rec['created'])}"
                   + (f", done {_when(rec['done_at'])}" if rec["done_at"] else "")
                   + (f", error: {rec['error']}" if rec["error"] else ""))
        for s in steps:
            click.echo(f"      {_when(s['ts'])} {s['step']:<14} {s['state']:<8} {s['detail']}")


@main.command()
@_config_option
@_db_option
@click.option("--force", is_flag=True, help="Run even while a live agent holds the store.")
def watchdog(config_path, db_path, force: bool) -> None:
    """Release jobs held for a recovery decision longer than
    policy.decision_timeout (fail open). Meant for a systemd timer or cron:
    it works from the store and Slurm alone, while the agent is down. When a
    live agent holds the store and its heartbeat is fresh, it does nothing
    (the agent runs the same watchdog itself).

    \b
    Example:
        recovery-ctl watchdog          # from contrib/systemd/slurm-recovery-watchdog.timer
    """
    import time as _time

    from .actuator import Actuator
    from .agent import scheduler_for
    from .store import StoreLock

    cfg, store = _open(config_path, db_path)
    beat = (store.get_state("heartbeat") or {}).get("time", 0)
    age = _time.time() - beat
    if not force and StoreLock(store.path).held_elsewhere() \
            and age < cfg.policy.decision_timeout:
        click.echo(f"watchdog: the agent is running (heartbeat {age:.0f}s ago) and runs the "
                   "watchdog itself; nothing to do")
        return
    sched = scheduler_for(cfg)
    if sched is None:
        raise click.ClickException("watchdog: no usable Slurm backend (see the log line above)")
    try:
        listing = {j.job_id: j for j in sched.list_jobs()}
    except RecoveryError as exc:
        raise click.ClickException(f"watchdog: cannot list jobs: {exc}") from None
    released = Actuator(cfg, store, sched).watchdog(listing, _time.time())
    for pk in released:
        rec = store.rec(pk)
        click.echo(f"watchdog: released job {rec['job_id']} (recommendation #{pk}, "
                   f"{rec['status']})")
    click.echo(f"watchdog: {len(released)} job(s) released")
