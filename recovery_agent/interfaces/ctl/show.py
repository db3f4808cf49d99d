"""``recovery-ctl show``: jobs, nodes, recommendations and the config."""
from __future__ import annotations

import json
from dataclasses import asdict

import click

from .client import Client, _config_option, _db_option, _url_option
from .goodput import summary_line
from .inputs import job_states, node_names
from .output import (_dump, _json_option, _score, _table, _when, _yes, listing_options,
                     node_health)


@click.group()
def show() -> None:
    """Show what the agent tracks: jobs, nodes, recommendations, config.

    \b
    Example:
        recovery-ctl show jobs --state R
        recovery-ctl show job 4410
    """


JOB_COLUMNS = [("job_id", "JOBID"), ("name", "NAME"), ("user", "USER"), ("state", "STATE"),
               ("env", "ENV"), ("mode", "MODE"), ("attempts", "ATTEMPTS"),
               ("category", "CATEGORY"), ("last_detection", "LAST_DETECTION"),
               ("last_recommendation", "LAST_RECOMMENDATION")]


@show.command("jobs")
@click.option("--state", default=None, metavar="STATE[,STATE...]",
              help="Only jobs in these Slurm states: names or codes, any case "
                   "(running, R, pd,cg).")
@click.option("--user", default=None, help="Only this user's jobs.")
@click.option("--env", default=None, help="Only jobs of this environment.")
@_config_option
@_db_option
@_url_option
@_json_option
@listing_options
def show_jobs(state, user, env, config_path, db_path, url, as_json, listing) -> None:
    """Tracked jobs, newest first: state, env, mode, attempts, the category that
    decided the last recommendation, last detection and recommendation.

    \b
    Example:
        recovery-ctl show jobs --user ana --env prod
        recovery-ctl show jobs --state R,PD -P -o jobid,state,category
    """
    states = job_states(state)
    client = Client(config_path, db_path, url, readonly=True)
    rows = []
    for one in states or [None]:
        rows += client.call("jobs", one, user, env)
    if len(states) > 1:
        rows.sort(key=lambda r: r.get("id") or 0, reverse=True)
    if as_json:
        _dump(rows)
        return
    for r in rows:
        r["attempts"] = (r["restart_count"] or 0) + 1
    listing.print(rows, JOB_COLUMNS)


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
    try:
        click.echo(f"  Goodput: {summary_line(client.call('job_goodput', job_id))}")
    except click.ClickException as exc:   # an agent without the ledger: the rest still shows
        click.echo(f"  Goodput: not available ({exc.message})")
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


NODE_COLUMNS = [("name", "NODE"), ("health_text", "HEALTH"), ("suspect", "SUSPECT"),
                ("strike_count", "STRIKES"), ("ours", "OUR_DRAIN"),
                ("drain_reason", "REASON"), ("excluded", "EXCLUDED"),
                ("degradation_text", "DEGRADATION"), ("last_report", "LAST_HEALTH")]


def degradation_text(row: dict) -> str:
    """A node's degradation in a few words: ``degraded 1.00 (row_remap_pending)``,
    ``watch 0.25 (thermal_power_slowdown)``, or ``-`` (ok, or never scored)."""
    deg = row.get("degradation") if isinstance(row.get("degradation"), dict) else {}
    if not deg or deg.get("level", "ok") == "ok":
        return "-"
    rules = sorted({r for g in deg.get("gpus") or () if g.get("score") for r in g["rules"]})
    return f"{deg['level']} {_score(deg.get('score') or 0.0)}" + (
        f" ({','.join(rules)})" if rules else "")


def _last_report(health) -> str:
    """The node's last hook report in words: ``prolog: 2 GPUs, ok``."""
    if not isinstance(health, dict) or not health:
        return "-"
    state = {True: "ok", False: "failing"}.get(health.get("ok"), "unknown")
    return f"{health.get('hook') or 'report'}: {health.get('count', '?')} GPUs, {state}"


def _strike_count(row: dict) -> int:
    if "strike_count" in row:
        return int(row["strike_count"] or 0)
    strikes = row.get("strikes")
    return len(strikes) if isinstance(strikes, list) else int(strikes or 0)


@show.command("nodes")
@_config_option
@_db_option
@_url_option
@_json_option
@listing_options
def show_nodes(config_path, db_path, url, as_json, listing) -> None:
    """Nodes: health, suspect (lemon) score, strikes, our drains, operator
    exclusions, degradation (the GPU wear score, docs/proactive.md), the last
    hook report.

    \b
    Example:
        recovery-ctl show nodes
        recovery-ctl show nodes -P -n -o node,health
    """
    rows = Client(config_path, db_path, url, readonly=True).call("nodes")
    if as_json:
        _dump(rows)
        return
    for r in rows:
        r["health_text"] = node_health(r)
        r["suspect"] = _score(r.get("suspect_score") or 0.0)
        r["strike_count"] = _strike_count(r)
        r["ours"] = _yes(r.get("drained_by_us"))
        r["excluded"] = _yes(r.get("excluded_by_operator"))
        r["last_report"] = _last_report(r.get("last_health"))
        r["degradation_text"] = degradation_text(r)
    listing.print(rows, NODE_COLUMNS)


@show.command("node")
@click.argument("name")
@_config_option
@_db_option
@_url_option
@_json_option
def show_node(name, config_path, db_path, url, as_json) -> None:
    """Nodes by name or hostlist: health, score, drain, strikes (which job, what
    category, when). JSON: the node, or a list for a hostlist of several.

    \b
    Example:
        recovery-ctl show node node7
        recovery-ctl show node 'node[1-2]'
    """
    names = node_names(name)
    client = Client(config_path, db_path, url, readonly=True)
    rows, missing = [], []
    for one in names:
        try:
            rows.append(client.call("node", one))
        except click.ClickException as exc:
            if len(names) == 1:
                raise
            missing.append(exc.format_message())
    if as_json:
        _dump(rows[0] if len(names) == 1 else rows)
    else:
        for row in rows:
            _print_node(row)
    for problem in missing:
        click.echo(f"Error: {problem}", err=True)
    if missing:
        raise SystemExit(1)


def _print_node(row: dict) -> None:
    click.secho(f"NodeName={row['name']} Suspect={_score(row.get('suspect_score') or 0.0)} "
                f"Strikes={_strike_count(row)} "
                f"DrainedByUs={_yes(row.get('drained_by_us'))} "
                f"Excluded={_yes(row.get('excluded_by_operator'))} "
                f"Reason={row.get('drain_reason') or '-'}", bold=True)
    click.echo(f"  Health={node_health(row)}")
    deg = row.get("degradation") if isinstance(row.get("degradation"), dict) else {}
    if deg and deg.get("level", "ok") != "ok":
        click.echo(f"  Degradation={degradation_text(row)} since {_when(deg.get('since'))}")
        for g in deg.get("gpus") or ():
            if g.get("score"):
                click.echo(f"  gpu {g['gpu']} {g['level']} score={_score(g['score'])} "
                           f"rules={','.join(g['rules']) or '-'} at {_when(g.get('time'))}")
    for s in row["strikes"] if isinstance(row.get("strikes"), list) else []:
        click.echo(f"  strike {_when(s['ts'])} {s['category']:<14} "
                   f"weight={_score(s['weight'])} job={s.get('job_id') or '-'} "
                   f"user={s['user'] or '-'}")


REC_COLUMNS = [("id", "ID"), ("created_at", "CREATED"), ("job_id", "JOBID"),
               ("attempt", "ATTEMPT"), ("action", "ACTION"), ("target_nodes", "NODES"),
               ("mode", "MODE"), ("status", "STATUS"), ("rule", "RULE"), ("error", "NOTE")]


@show.command("recommendations")
@click.option("--status", default=None, help="proposed, executing, done, failed, expired, "
                                             "would_have, blocked_by_budget, ...")
@click.option("--env", default=None, help="Only this environment's.")
@_config_option
@_db_option
@_url_option
@_json_option
@listing_options
def show_recommendations(status, env, config_path, db_path, url, as_json, listing) -> None:
    """Recommendations, newest first: what, where, why, and where it stands.

    \b
    Example:
        recovery-ctl show recommendations --status blocked_by_budget
        recovery-ctl show recommendations -P -o id,status,nodes
    """
    rows = Client(config_path, db_path, url, readonly=True).call("recommendations", status, env)
    if as_json:
        _dump(rows)
        return
    for r in rows:
        r["created_at"] = _when(r["created"])
    listing.print(rows, REC_COLUMNS)


@show.command("recommendation")
@click.argument("rec_id", type=int)
@_config_option
@_db_option
@_url_option
@_json_option
def show_recommendation(rec_id, config_path, db_path, url, as_json) -> None:
    """One recommendation: what, where, why, its evidence, its times and every
    step taken on Slurm.

    \b
    Example:
        recovery-ctl show recommendation 17
    """
    rec = Client(config_path, db_path, url, readonly=True).call("recommendation", rec_id)
    if as_json:
        _dump(rec)
        return
    click.secho(f"Recommendation={rec['id']} JobId={rec['job_id'] or '-'} "
                f"Attempt={'-' if rec['attempt'] is None else rec['attempt']} "
                f"Action={rec['action']} Nodes={','.join(rec['target_nodes']) or '-'} "
                f"Status={rec['status']} Mode={rec['mode']} Rule={rec['rule'] or '-'}",
                bold=True)
    click.echo(f"  Reason={rec['reason'] or '-'}")
    click.echo(f"  Category={rec['reason_category'] or '-'} Env={rec['env'] or '-'} "
               f"User={rec['user'] or '-'} Exclude={','.join(rec['exclude']) or '-'}")
    click.echo(f"  Created={_when(rec['created'])} Detected={_when(rec['detected_at'])} "
               f"Done={_when(rec['done_at'])}")
    if rec.get("claimed_by"):
        click.echo(f"  ClaimedBy={rec['claimed_by']} Until={_when(rec['claim_expires'])}")
    if rec.get("error"):
        click.echo(f"  Note={rec['error']}")
    for ev in rec["evidence"] if isinstance(rec["evidence"], list) else []:
        for line in ev.get("lines", [])[:1]:
            click.echo(f"  Evidence [{ev.get('pattern', '-')}] {str(line.get('text', ''))[:110]}")
    for s in rec.get("steps", []):
        click.echo(f"    {_when(s['ts'])} {s['step']:<14} {s['state']:<8} {s['detail'] or ''}"
                   .rstrip())


@show.command("config")
@_config_option
@_db_option
@_url_option
@_json_option
def show_config(config_path, db_path, url, as_json) -> None:
    """The effective config (file, then RECOVERY_* variables), and each
    environment's mode in effect with where it comes from: the config file, or
    an operator's `recovery-ctl mode` (who, when, why; `mode ENV --clear`
    gives the file's back). Each [environments.NAME] is shown whole, with what
    it inherits from [environments.default].

    \b
    Example:
        recovery-ctl show config --json | jq .policy
        recovery-ctl show config --json | jq '.environments.prod.mode_source'
    """
    client = Client(config_path, db_path, url, readonly=True)
    data = {k: v for k, v in asdict(client.cfg).items() if k != "environments"}
    data["environments"] = {n: asdict(e) for n, e in client.cfg.environments.items()}
    try:
        modes = client.call("environments")
    except click.ClickException as exc:
        modes, unknown = {}, str(exc)
    else:
        unknown = ""
    for name, env in data["environments"].items():
        info = modes.get(name)
        if info is None:   # the agent's state cannot be read: the file's, as far as known
            env["mode_source"] = {"source": "unknown", "file_mode": env["mode"],
                                  "why": unknown or "not known to the agent"}
            continue
        env["mode"] = info["mode"]
        env["mode_source"] = {"source": info.get("source", "file"),
                              "file_mode": info.get("configured", env["mode"]),
                              **{k: info.get(k) for k in ("set_by", "set_uid", "set_at",
                                                          "reason")}}
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
                source = env.pop("mode_source")
                for key, value in env.items():
                    note = f"  # {_mode_source(source)}" if key == "mode" else ""
                    click.echo(f"{key} = {json.dumps(value)}{note}")
            continue
        click.echo(f"[{section}]")
        for key, value in values.items():
            click.echo(f"{key} = {json.dumps(value)}")


def _mode_source(source: dict) -> str:
    """Where an environment's mode comes from, as a comment on its line."""
    if source["source"] == "file":
        return "from the config file"
    if source["source"] == "unknown":
        return f"the config file's; run-time changes unknown here ({source['why']})"
    who = (f"{source['set_by']} (uid {source['set_uid']})" if source.get("set_by")
           else "an operator")
    when = f" at {_when(source['set_at'])}" if source.get("set_at") else ""
    why = f": {source['reason']}" if source.get("reason") else ""
    return (f"set by {who}{when}{why}; the config file says {json.dumps(source['file_mode'])} "
            "(recovery-ctl mode ENV --clear)")
