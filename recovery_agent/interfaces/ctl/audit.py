"""The record: ``recovery-ctl audit`` (every recommendation with its evidence
and steps) and ``recovery-ctl report`` (monitor mode scored against humans;
``report goodput`` is :mod:`.goodput`)."""
from __future__ import annotations

import csv
import io
import time

import click

from ...errors import RecoveryError
from ...scheduler import scheduler_for
from ..report import build
from .client import Client, _config_option, _db_option, _url_option
from .goodput import goodput
from .output import _dump, _json_option, _parse_time, _table, _when


# the CSV's columns: plain values, times as ISO 8601 (no JSON inside a cell)
AUDIT_FIELDS = ("id", "created", "job_id", "attempt", "workload", "user", "env", "mode",
                "action", "target_nodes", "exclude", "status", "rule", "reason_category",
                "reason", "pattern_ids", "blame", "confidence", "attributed_nodes",
                "suspects", "evidence", "detected_at", "done_at", "error", "steps",
                # after the recommendation's columns (added later): what kind of
                # record, and an operator change's own
                "kind", "actor", "actor_uid", "role", "via", "target", "before", "after")
_TIMES = ("created", "detected_at", "done_at")
_VIA = {"api": "through the agent's API", "store": "straight on the store (--db)"}


def _operator_csv_row(change: dict) -> list:
    """One operator change in the same columns: its time in ``created``, its
    verb in ``action``, the node in ``target_nodes``, why in ``reason``."""
    values = {**change, "created": _when(change["created"]),
              "target_nodes": change.get("node") or "", "status": change.get("after")}
    return ["" if values.get(key) is None else values[key] for key in AUDIT_FIELDS]


def _csv_row(rec: dict) -> list:
    """One recommendation as the CSV's plain cells."""
    attribution = rec.get("attribution") if isinstance(rec.get("attribution"), dict) else {}
    evidence = rec.get("evidence") if isinstance(rec.get("evidence"), list) else []
    first = [f"[{ev.get('pattern', '-')}] {line.get('text', '')}"
             for ev in evidence[:1] for line in ev.get("lines", [])[:1]]
    confidence = attribution.get("confidence")
    values = {
        **rec,
        **{key: _when(rec.get(key)) if rec.get(key) else "" for key in _TIMES},
        "blame": attribution.get("blame"),
        "confidence": "" if confidence is None else f"{float(confidence):.2f}",
        "attributed_nodes": attribution.get("nodes"),
        "suspects": attribution.get("suspects"),
        "evidence": first[0] if first else "",
        "steps": "; ".join(f"{s['step']}:{s['state']}" for s in rec.get("steps") or []),
        "kind": "recommendation",
    }
    row = []
    for key in AUDIT_FIELDS:
        value = values.get(key)
        if isinstance(value, (list, tuple)):
            value = ",".join(map(str, value))
        elif isinstance(value, dict):
            value = "; ".join(f"{k}={v}" for k, v in sorted(value.items()))
        row.append("" if value is None else value)
    return row


@click.command()
@click.option("--since", default=None, help="ISO time, or a duration back (30m, 2h, 7d).")
@click.option("--until", default=None, help="ISO time, or a duration back.")
@click.option("--job", "job_id", default=None,
              help="Only this job's recommendations and the operators' changes to them.")
@click.option("--format", "fmt", type=click.Choice(["text", "json", "csv"]), default="text",
              show_default=True, help="json: one object per line; csv: one row each.")
@click.option("--json", "as_json", is_flag=True, help="Same as --format json.")
@_config_option
@_db_option
@_url_option
def audit(since, until, job_id, fmt, as_json, config_path, db_path, url) -> None:
    """The audit trail, in time order: each recommendation (stored before any
    action) with its evidence, attribution, mode, timestamps and every step
    taken on Slurm, and each operator change (mode, exclude, include, ack,
    complete, cancel) with who made it, when, the state before and after, and
    why. Users see those of their own jobs.

    \b
    Example:
        recovery-ctl audit --since 24h
        recovery-ctl audit --job 4410
        recovery-ctl audit --since 2026-11-01 --format csv > november.csv
    """
    recs = Client(config_path, db_path, url, readonly=True).call(
        "audit", _parse_time(since), _parse_time(until), job_id)
    fmt = "json" if as_json else fmt
    if fmt == "json":
        for rec in recs:
            _dump(rec)
        return
    if fmt == "csv":
        buffer = io.StringIO()
        writer = csv.writer(buffer)
        writer.writerow(AUDIT_FIELDS)
        for rec in recs:
            writer.writerow(_operator_csv_row(rec) if rec.get("kind") == "operator"
                            else _csv_row(rec))
        click.echo(buffer.getvalue(), nl=False)
        return
    for rec in recs:
        if rec.get("kind") == "operator":
            _print_change(rec)
        else:
            _print_rec(rec)


def _print_change(change: dict) -> None:
    role = ", ".join(filter(None, [f"uid {change['actor_uid']}", change.get("role"),
                                   _VIA.get(change.get("via") or "")]))
    click.secho(f"operator #{change['id']} {change['action']} {change['target'] or '-'}: "
                f"{change['before'] or '?'} -> {change['after'] or '?'} "
                f"by {change['actor']} ({role})", bold=True)
    if change.get("job_id"):
        click.echo(f"    job:      {change['job_id']} ({change.get('user') or '?'})")
    if change.get("reason"):
        click.echo(f"    reason:   {change['reason']}")
    forced = (change.get("data") or {}).get("forced")
    click.echo(f"    at {_when(change['created'])}" + (f", forced: {forced}" if forced else ""))


def _print_rec(rec: dict) -> None:
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
               + (f", note: {rec['error']}" if rec["error"] else ""))
    for s in rec["steps"]:
        click.echo(f"      {_when(s['ts'])} {s['step']:<14} {s['state']:<8} {s['detail']}")


@click.group(invoke_without_command=True)
@click.option("--since", default="7d", show_default=True,
              help="ISO time, or a duration back (24h, 7d).")
@click.option("--until", default=None, help="ISO time, or a duration back [default: now].")
@_config_option
@_db_option
@_json_option
@click.pass_context
def report(ctx, since, until, config_path, db_path, as_json) -> None:
    """Score monitor mode: each would_have recommendation against what humans did
    in Slurm meanwhile (requeues, cancels, drains with their reasons: those the
    agent saw come and go, lifted ones included, and those in place). Prints the
    agreement, precision and recall of node exclusions, and every case where the
    two differ. Run it before switching an environment to action mode.
    ``report goodput``: what recovery saved (docs/goodput.md).

    \b
    Example:
        recovery-ctl report --since 14d
        recovery-ctl report goodput --since 30d --by category
    """
    if ctx.invoked_subcommand is not None:
        return
    client = Client(config_path, db_path, None, readonly=True)
    if client.service is None:
        raise click.ClickException(f"report: cannot read the store {client.cfg.store_path} "
                                   "here (run it on the agent's host, or name it with --db)")
    sched = scheduler_for(client.cfg)
    if sched is None:
        raise click.ClickException("report: Slurm is not reachable (node drains come from "
                                   "sinfo)")
    try:
        nodes = sched.list_nodes()
    except RecoveryError as exc:
        raise click.ClickException(f"report: {exc}") from None
    start, end = _parse_time(since), _parse_time(until) or time.time()
    result = build(client.store, nodes, start, end, client.cfg.agent.cluster)
    if as_json:
        _dump(result.as_dict())
        return

    def pct(value):
        return "-" if value is None else f"{value * 100:.0f}%"
    click.echo(f"window {_when(start)} .. {_when(end)}")
    click.echo(f"would_have decisions compared: {result.compared}; agreed with what humans "
               f"did: {result.agreed} ({pct(result.agreement)})")
    click.echo(f"node exclusions: ours {','.join(sorted(result.our_nodes)) or '-'}, drained by "
               f"humans {','.join(sorted(result.human_nodes)) or '-'}; precision "
               f"{pct(result.precision)}, "
               f"recall {pct(result.recall)}")
    for node, why in sorted(result.human_nodes.items()):
        click.echo(f"  human drain {node}: {why}")
    if result.differ:
        click.echo("differences:")
        _table(result.differ, [("rec", "REC"), ("job", "JOBID"), ("attempt", "ATTEMPT"),
                               ("would_have", "WOULD_HAVE"), ("nodes", "NODES"),
                               ("humans", "HUMANS"), ("reason", "REASON")])


report.add_command(goodput)
