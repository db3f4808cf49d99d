"""``recovery-ctl show``: jobs, nodes, recommendations and the config."""
from __future__ import annotations

import json
from dataclasses import asdict

import click

from .client import Client, _config_option, _db_option, _url_option
from .output import _dump, _json_option, _table, _when


@click.group()
def show() -> None:
    """Show what the agent tracks: jobs, nodes, recommendations, config.

    \b
    Example:
        recovery-ctl show jobs --state RUNNING
        recovery-ctl show job 4410
    """


@show.command("jobs")
@click.option("--state", default=None, help="Only jobs in this Slurm state.")
@click.option("--user", default=None, help="Only this user's jobs.")
@click.option("--env", default=None, help="Only jobs of this environment.")
@_config_option
@_db_option
@_url_option
@_json_option
def show_jobs(state, user, env, config_path, db_path, url, as_json) -> None:
    """Tracked jobs, newest first: state, env, mode, attempts, last detection.

    \b
    Example:
        recovery-ctl show jobs --user ana --env prod
    """
    rows = Client(config_path, db_path, url, readonly=True).call("jobs", state, user, env)
    if as_json:
        _dump(rows)
        return
    for r in rows:
        r["attempts"] = (r["restart_count"] or 0) + 1
    _table(rows, [("job_id", "JOBID"), ("name", "NAME"), ("user", "USER"), ("state", "STATE"),
                  ("env", "ENV"), ("mode", "MODE"), ("attempts", "ATTEMPTS"),
                  ("last_detection", "LAST_DETECTION"),
                  ("last_recommendation", "LAST_RECOMMENDATION")])


@show.command("job")
@click.argument("job_id")
@_config_option
@_db_option
@_url_option
@_json_option
def show_job(job_id: str, config_path, db_path, url, as_json: bool) -> None:
    """A job's attempts, detections with their evidence, recommendations and
    timeline. An array's id lists its tasks, each tracked and acted on alone
    (show one with ID_TASK).

    \b
    Example:
        recovery-ctl show job 4410
        recovery-ctl show job 1234_7 --json | jq '.timeline[].message'
    """
    client = Client(config_path, db_path, url, readonly=True)
    tasks = client.call("array", job_id) if job_id.isdigit() else []
    if tasks and (client.store is None
                  or client.store.find_job(client.cfg.agent.cluster, job_id) is None):
        if as_json:
            _dump({"array_job_id": int(job_id), "tasks": tasks})
            return
        click.secho(f"array {job_id}: {len(tasks)} task(s) tracked", bold=True)
        _table(tasks, [("job_id", "TASK"), ("state", "STATE"), ("restarts", "RESTARTS"),
                       ("recommendations", "RECOMMENDATIONS")])
        return
    detail = client.call("job", job_id)
    timeline = client.call("timeline", job_id)
    if as_json:
        _dump({**detail, "timeline": timeline})
        return
    row = detail["job"]
    click.secho(f"JobId={row['job_id']} Name={row['name'] or '-'} User={row['user'] or '-'} "
                f"Env={row['env']}{' EnvKnown=no' if row.get('env_known') is False else ''} "
                f"Mode={row.get('effective_mode') or row['mode'] or '-'} "
                f"State={row['state']} "
                f"Restarts={row['restart_count']}", bold=True)
    for a in detail["attempts"]:
        click.echo(f"  Attempt={a['attempt']} State={a['state'] or '-'} "
                   f"Nodes={','.join(a['nodes']) or '-'} Checkpoint={a['ckpt_path'] or '-'}")
    for d in detail["detections"]:
        lines = d["evidence"].get("lines") or [{}]
        click.echo(f"  Detection [{d['attempt']}] {d['pattern_id']} ({d['category']}) "
                   f"node={d['node'] or '-'}: {str(lines[0].get('text', ''))[:100]}")
    for r in detail["recommendations"]:
        click.echo(f"  Recommendation #{r['id']} [{r['attempt']}] {r['action']} "
                   f"{','.join(r['target_nodes'])} -> {r['status']} (mode {r['mode']}): "
                   f"{r['reason']}")
    click.echo("  Timeline:")
    for e in timeline:
        attempt = "" if e["attempt"] is None else f"[{e['attempt']}]"
        click.echo(f"    {_when(e['ts'])} {attempt:<4} {e['kind']:<16} {e['message']}")


@show.command("nodes")
@_config_option
@_db_option
@_url_option
@_json_option
def show_nodes(config_path, db_path, url, as_json) -> None:
    """Nodes: suspect (lemon) score, our drains, operator exclusions, last health.

    \b
    Example:
        recovery-ctl show nodes
    """
    rows = Client(config_path, db_path, url, readonly=True).call("nodes")
    if as_json:
        _dump(rows)
        return
    for r in rows:
        health = r.get("last_health") or {}
        r["health"] = (f"{health.get('hook', '')} gpus={health.get('count')} "
                       f"ok={health.get('ok')}" if isinstance(health, dict) and health
                       else "-")
        r["ours"] = "drained" if r.get("drained_by_us") else ""
        r["excluded"] = "yes" if r.get("excluded_by_operator") else ""
    _table(rows, [("name", "NODE"), ("suspect_score", "SUSPECT"), ("ours", "OUR_DRAIN"),
                  ("drain_reason", "REASON"), ("excluded", "EXCLUDED"),
                  ("health", "LAST_HEALTH")])


@show.command("node")
@click.argument("name")
@_config_option
@_db_option
@_url_option
@_json_option
def show_node(name, config_path, db_path, url, as_json) -> None:
    """One node: score, drain, strikes (which job, what category, when).

    \b
    Example:
        recovery-ctl show node node7
    """
    row = Client(config_path, db_path, url, readonly=True).call("node", name)
    if as_json:
        _dump(row)
        return
    click.secho(f"NodeName={row['name']} Suspect={row['suspect_score']} "
                f"DrainedByUs={bool(row.get('drained_by_us'))} "
                f"Excluded={bool(row.get('excluded_by_operator'))} "
                f"Reason={row.get('drain_reason') or '-'}", bold=True)
    for s in row["strikes"]:
        click.echo(f"  strike {_when(s['ts'])} {s['category']:<14} weight={s['weight']} "
                   f"job_row={s['job'] or '-'} user={s['user'] or '-'}")


@show.command("recommendations")
@click.option("--status", default=None, help="proposed, executing, done, failed, expired, "
                                             "would_have, blocked_by_budget, ...")
@click.option("--env", default=None, help="Only this environment's.")
@_config_option
@_db_option
@_url_option
@_json_option
def show_recommendations(status, env, config_path, db_path, url, as_json) -> None:
    """Recommendations, newest first: what, where, why, and where it stands.

    \b
    Example:
        recovery-ctl show recommendations --status blocked_by_budget
    """
    rows = Client(config_path, db_path, url, readonly=True).call("recommendations", status, env)
    if as_json:
        _dump(rows)
        return
    for r in rows:
        r["created_at"] = _when(r["created"])
    _table(rows, [("id", "ID"), ("created_at", "CREATED"), ("job_id", "JOBID"),
                  ("attempt", "ATTEMPT"), ("action", "ACTION"), ("target_nodes", "NODES"),
                  ("mode", "MODE"), ("status", "STATUS"), ("rule", "RULE"),
                  ("error", "NOTE")])


@show.command("config")
@_config_option
@_db_option
@_url_option
@_json_option
def show_config(config_path, db_path, url, as_json) -> None:
    """The effective config (file, then RECOVERY_* variables), and each
    environment's mode as changed at run time.

    \b
    Example:
        recovery-ctl show config --json | jq .policy
    """
    client = Client(config_path, db_path, url, readonly=True)
    data = {k: v for k, v in asdict(client.cfg).items() if k != "environments"}
    data["environments"] = {n: asdict(e) for n, e in client.cfg.environments.items()}
    try:
        modes = client.call("environments")
    except click.ClickException:
        modes = {}
    for name, info in modes.items():
        data["environments"].setdefault(name, {})["mode"] = info["mode"]
    if as_json:
        _dump(data)
        return
    click.echo(f"# {client.cfg.source or 'built-in defaults'}")
    for section, values in data.items():
        if section == "source":
            continue
        if section == "environments":
            for name, env in values.items():
                click.echo(f"[environments.{name}]")
                for key, value in env.items():
                    click.echo(f"{key} = {json.dumps(value)}")
            continue
        click.echo(f"[{section}]")
        for key, value in values.items():
            click.echo(f"{key} = {json.dumps(value)}")
