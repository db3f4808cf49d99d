"""``recovery-ctl``: the operator's command line for slurm-recovery.

Each command is a few lines over the library; library errors become
``click.ClickException`` here, at the edge.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Iterator

import click

from ..detect.attribution import attribute
from ..detect.context import context_from_lines, read_node_addresses, with_host
from ..detect.evidence import all_detections
from ..detect.model import Detection, Verdict
from ..detect.patterns import load_rules
from ..detect.scanner import MAX_LINE, Scanner
from ..errors import RecoveryError
from ..scheduler import scheduler_for

CHUNK = 16 << 20


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Inspect and steer slurm-recovery: jobs, nodes, recommendations, modes,
    the audit trail, the watchdog, checks and reports, and pattern packs.

    \b
    Examples:
        recovery-ctl show jobs
        recovery-ctl check --sources
        recovery-ctl patterns test slurm-4410.out
    """


@main.group()
def patterns() -> None:
    """Work with the detection pattern packs (etc/patterns/*.toml and site packs).

    \b
    Example:
        recovery-ctl patterns test --patterns-dir /etc/slurm-recovery/patterns job.log
    """


def _packs_and_files(command):
    """The arguments ``patterns test`` and ``patterns score`` share: the files,
    site pack directories and the matcher."""
    for option in reversed([
            click.argument("files", nargs=-1, required=True,
                           type=click.Path(exists=True, dir_okay=False, path_type=Path)),
            click.option("--patterns-dir", "dirs", multiple=True,
                         type=click.Path(exists=True, file_okay=False, path_type=Path),
                         help="A directory of site packs, loaded after the shipped ones "
                              "(repeatable)."),
            click.option("--engine", type=click.Choice(["auto", "re", "hyperscan"]),
                         default="auto", show_default=True,
                         help="Matcher: hyperscan when it imports, else Python re.")]):
        command = option(command)
    return command


@patterns.command("test")
@_packs_and_files
@click.option("--node", metavar="NAME",
              help="The node the logs came from (a node's kernel log, one node's job "
                   "output): lines that name no node are that node's.")
@click.option("--nodes-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Node names and the addresses the logs may name them by, one node a "
                   "line: 'name address...' (IPs, hostnames), or scontrol's "
                   "'NodeName=... NodeAddr=... NodeHostName=...'.")
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object per input file, one per line.")
def patterns_test(files: tuple[Path, ...], dirs: tuple[Path, ...], engine: str,
                  node: str | None, nodes_file: Path | None, as_json: bool) -> None:
    """Run the scanner and attribution over log files, offline.

    Prints each detection (line, rule, category, host) and the verdict for
    each file. Hosts come from the lines' prefixes (syslog, journald, dmesg,
    NCCL, srun, pdsh...), ranks through the layout the log states (SLURM_*
    node lists, srun --label, NCCL init lines), peer addresses through
    --nodes-file. Nothing is sent anywhere: use it to check packs against
    your own logs before the agent runs them.

    \b
    Example:
        recovery-ctl patterns test slurm-4410.out
        recovery-ctl patterns test --node gpu07 gpu07-kern.log
        recovery-ctl patterns test --nodes-file nodes.txt --json logs/*.err | jq .verdict
    """
    try:
        scanner = Scanner(load_rules(dirs), engine=engine)
    except RecoveryError as exc:
        raise click.ClickException(str(exc)) from None
    addresses = {}
    if nodes_file is not None:
        try:
            addresses = read_node_addresses(nodes_file.read_text(encoding="utf-8",
                                                                 errors="replace"))
        except OSError as exc:
            raise click.ClickException(f"{nodes_file}: {exc.strerror or exc}") from None
    for path in files:
        detections = _scan_file(scanner, path)
        if node:
            detections = with_host(detections, node)
        context = context_from_lines(_read_lines(path), addresses=addresses)
        verdict = attribute(detections, context)
        shown = all_detections(detections, context)[:len(detections)]
        if as_json:
            click.echo(json.dumps(_as_json(path, shown, verdict)))
        else:
            _print_report(path, shown, verdict)


@patterns.command("score")
@_packs_and_files
@click.option("--json", "as_json", is_flag=True, help="One JSON object with every figure.")
def patterns_score(files: tuple[Path, ...], dirs: tuple[Path, ...], engine: str,
                   as_json: bool) -> None:
    """Score the packs on labelled incidents: your own, before action mode.

    FILES are JSON lines, one incident a line, in the corpus format:
    {"id", "lines": [...], "category", "expected_action", "node_attributable"}
    (category: gpu_hardware, interconnect, nccl_timeout_hang, cuda_error, oom,
    system_software, application, segfault or benign; expected_action:
    requeue_exclude_node, requeue, stop or none). Each incident's lines are
    judged as `patterns test` judges a log. Printed: category and coarse action
    accuracy (overall, per labelled category, per labelled action), both
    confusion matrices, how often the node is named where the text names it,
    benign incidents on which a rule fired, and every miss with the rule that
    decided it. A row that is not well formed is named (line and field) and
    left out; the rest are scored. Exit 0 whatever the score; 1 when no row
    could be scored.

    \b
    Example:
        recovery-ctl patterns score incidents.jsonl
        recovery-ctl patterns score --json incidents.jsonl | jq .action
    """
    from ..detect.score import read_labels, render, score
    from ..detect.score import as_dict as score_dict
    try:
        scanner = Scanner(load_rules(dirs), engine=engine)
    except RecoveryError as exc:
        raise click.ClickException(str(exc)) from None
    rows, problems = [], []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            raise click.ClickException(f"{path}: {exc.strerror or exc}") from None
        found, bad = read_labels(text)
        rows += found
        problems += [f"{path}: {p}" for p in bad]
    result = score(scanner, rows, problems)
    if as_json:
        click.echo(json.dumps(score_dict(result), indent=1))
    else:
        click.echo(render(result, title=", ".join(str(f) for f in files)), nl=False)
    for problem in problems:
        click.echo(f"left out: {problem}", err=True)
    if not rows:
        raise click.ClickException("no row could be scored")


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


# -- the agent's state: jobs, nodes, recommendations, the audit trail ----------------
#
# Reads come from the store file (``--db``, else the config's store when this host
# can read it), opened read-only, or from the agent's API (``--url``), signed with
# munge or with the read token where this user can read it. Changes go to the
# agent's API, signed with munge, so the agent checks the caller's role and audits
# the uid; with ``--db`` they are written to the store directly (for when the agent
# is down), which needs the store writable here. The store is the agent's (0600):
# users read through the API, which shows them their own jobs.

_config_option = click.option(
    "-c", "--config", "config_path", type=click.Path(dir_okay=False), default=None,
    help="Agent config [default: $RECOVERY_CONFIG or /etc/slurm-recovery/recovery.toml].")
_db_option = click.option("--db", "db_path", default=None,
                          type=click.Path(dir_okay=False, readable=False),
                          help="Use this store file directly (works with the agent down).")
_url_option = click.option("--url", default=None, envvar="RECOVERY_URL",
                           help="The agent's API [default: from api.bind and api.port].")
_json_option = click.option("--json", "as_json", is_flag=True, help="JSON for scripts.")


class Client:
    """The same questions and changes, over the store (Service) or over HTTP.

    ``writing``: a change; it goes to the agent's API unless ``--db`` names a
    store, which must then be writable here. ``readonly``: a read command; a
    store is opened read-only (SQLite ``mode=ro``: nothing created, migrated
    or changed)."""

    def __init__(self, config_path: str | None, db_path: str | None, url: str | None,
                 writing: bool = False, readonly: bool = False) -> None:
        from ..config import load
        try:
            self.cfg = load(config_path)
        except RecoveryError as exc:
            raise click.ClickException(str(exc)) from None
        self.url = url
        self.service = None
        path = Path(db_path) if db_path else self.cfg.store_path
        if db_path or (not url and not writing and os.access(path, os.R_OK)):
            from .service import Service
            from ..store import Store, files
            try:
                files.must_exist(path, writable=writing)
                self.service = Service(self.cfg, Store(path, readonly=readonly))
            except RecoveryError as exc:
                raise click.ClickException(str(exc)) from None
        elif not url:
            host = self.cfg.api.bind if self.cfg.api.bind not in ("0.0.0.0", "::") \
                else "127.0.0.1"
            self.url = f"http://{host}:{self.cfg.api.port}"

    @property
    def store(self):
        return self.service.store if self.service else None

    def _http(self, method: str, path: str, body: dict | None = None, **params) -> dict:
        import requests
        headers = {}
        data = None
        if method == "POST":
            data = json.dumps(body or {}).encode()
            if self.cfg.api.auth == "munge":
                from slurm_hooks import munge
                try:
                    headers["Authorization"] = "Munge " + munge.sign_body(
                        data, self.cfg.api.munge_socket)
                except munge.MungeError as exc:
                    raise click.ClickException(f"cannot sign the request with munge: "
                                               f"{exc}") from None
            else:
                headers["X-Recovery-Uid"] = str(os.getuid())
            headers["Content-Type"] = "application/json"
        else:
            headers.update(self._read_auth())
        params = {k: v for k, v in params.items() if v is not None}
        try:
            resp = requests.request(method, f"{self.url}{path}", data=data, params=params,
                                    headers=headers, timeout=30)
        except requests.RequestException as exc:
            raise click.ClickException(f"the agent at {self.url} is not reachable "
                                       f"({exc.__class__.__name__}); with the agent down, "
                                       "use --db STORE") from None
        try:
            answer = resp.json()
        except ValueError:
            answer = {"detail": resp.text[:200]}
        if resp.status_code >= 400:
            raise click.ClickException(f"{answer.get('detail', answer)} (HTTP "
                                       f"{resp.status_code})")
        return answer

    def _read_auth(self) -> dict:
        """A read's credential: the read token where this user can read it (a
        trusted reader); else a munge-signed read, which the agent answers as
        this uid (a user sees their own jobs); else none (an unexposed agent
        then goes by who owns the connection)."""
        token_file = self.cfg.api.read_token_file
        problem = ""
        if token_file:
            try:
                return {"Authorization": "Bearer "
                        + Path(token_file).read_text(encoding="utf-8").strip()}
            except OSError as exc:
                problem = f"cannot read the token {token_file}: {exc.strerror or exc}"
        if self.cfg.api.auth == "munge":
            from slurm_hooks import munge
            try:
                return {"Authorization": "Munge " + munge.sign_body(
                    b"", self.cfg.api.munge_socket)}
            except munge.MungeError as exc:
                if problem:
                    raise click.ClickException(f"{problem}, nor sign the read with munge: "
                                               f"{exc}") from None
        return {}

    def call(self, name: str, *args, **kwargs):
        """Run a Service method here, or its endpoint at the agent."""
        if self.service is not None:
            from ..store import files
            try:
                return getattr(self.service, name)(*args, **kwargs)
            except RecoveryError as exc:
                raise click.ClickException(str(exc)) from None
            except files.DB_ERRORS as exc:
                raise click.ClickException(str(files.explain(self.store.path, exc,
                                                             "use"))) from None
        return _HTTP[name](self, *args, **kwargs)

    def change(self, name: str, *args, **kwargs):
        """A change: the caller is this process's uid (its role from the config)."""
        if self.service is not None:
            from .service import role_of
            return self.call(name, role_of(self.cfg, os.getuid()), *args, **kwargs)
        return _HTTP[name](self, *args, **kwargs)


_HTTP = {
    "jobs": lambda c, state=None, user=None, env=None, limit=500: c._http(
        "GET", "/v1/jobs", state=state, user=user, env=env, limit=limit)["jobs"],
    "job": lambda c, job_id: c._http("GET", f"/v1/jobs/{job_id}"),
    "array": lambda c, job_id: c._http("GET", f"/v1/jobs/{job_id}").get("tasks", []),
    "timeline": lambda c, job_id: c._http("GET", f"/v1/jobs/{job_id}/timeline")["events"],
    "nodes": lambda c: c._http("GET", "/v1/nodes")["nodes"],
    "node": lambda c, name: c._http("GET", f"/v1/nodes/{name}"),
    "environments": lambda c: c._http("GET", "/v1/environments")["environments"],
    "recommendations": lambda c, status=None, env=None, mode=None, job=None, limit=500:
        c._http("GET", "/v1/recommendations", status=status, env=env, mode=mode, job=job,
                limit=limit)["recommendations"],
    "audit": lambda c, since=None, until=None, job=None: [
        c._http("GET", f"/v1/recommendations/{r['id']}") for r in c._http(
            "GET", "/v1/recommendations", job=job, limit=10000)["recommendations"][::-1]
        if (since is None or r["created"] >= since) and (until is None or r["created"] <= until)],
    "set_mode": lambda c, env, mode: c._http("POST", f"/v1/environments/{env}/mode",
                                             {"mode": mode}),
    "exclude": lambda c, name, reason: c._http("POST", f"/v1/nodes/{name}/exclude",
                                               {"reason": reason}),
    "include": lambda c, name: c._http("POST", f"/v1/nodes/{name}/include"),
    "ack": lambda c, rec_id: c._http("POST", f"/v1/recommendations/{rec_id}/ack"),
    "cancel": lambda c, rec_id, reason="": c._http("POST",
                                                   f"/v1/recommendations/{rec_id}/cancel",
                                                   {"reason": reason}),
}


def _when(ts: float | None) -> str:
    if not ts:
        return "-"
    return time.strftime("%H:%M:%S", time.localtime(ts)) + f".{int(ts % 1 * 1000):03d}"


def _table(rows: list[dict], columns: list[tuple[str, str]]) -> None:
    """Aligned columns, scontrol/squeue style; ``columns`` are (key, header)."""
    cells = [[h for _, h in columns]] + [
        ["-" if r.get(k) in (None, "", []) else
         (",".join(map(str, r[k])) if isinstance(r[k], list) else str(r[k]))
         for k, _ in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    for row in cells:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())


def _dump(value) -> None:
    click.echo(json.dumps(value, default=str))


def _parse_time(text: str | None) -> float | None:
    """``--since``: an ISO date/time, or a duration back from now (30m, 2h, 7d)."""
    if not text:
        return None
    from datetime import datetime

    from ..config import parse_duration
    try:
        return time.time() - parse_duration(text, "--since/--until")
    except RecoveryError:
        pass
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise click.BadParameter(f"{text!r}: use an ISO time (2026-11-29T10:00) or a "
                                 "duration back from now (30m, 2h, 7d)") from None


@main.group()
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
                f"Env={row['env']} Mode={row.get('effective_mode') or row['mode'] or '-'} "
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
    from dataclasses import asdict
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


@main.command()
@click.argument("env")
@click.argument("mode", type=click.Choice(["monitor", "action", "external"]))
@_config_option
@_db_option
@_url_option
@_json_option
def mode(env, mode, config_path, db_path, url, as_json) -> None:
    """Switch an environment's mode (admin): persisted, and audited with who did it.

    \b
    Example:
        recovery-ctl mode prod action
    """
    answer = Client(config_path, db_path, url, writing=True).change("set_mode", env, mode)
    if as_json:
        _dump(answer)
        return
    click.echo(f"environment {env}: {answer['before']} -> {answer['mode']}")


@main.command()
@click.argument("node")
@click.option("--reason", required=True, help="Why (recorded in the audit trail).")
@_config_option
@_db_option
@_url_option
def exclude(node, reason, config_path, db_path, url) -> None:
    """Exclude NODE from every tracked job's retries (admin). Drains stay ours:
    this never drains or resumes a node in Slurm.

    \b
    Example:
        recovery-ctl exclude node7 --reason "IB link flaps, ticket 4411"
    """
    Client(config_path, db_path, url, writing=True).change("exclude", node, reason)
    click.echo(f"{node}: excluded from retries")


@main.command()
@click.argument("node")
@_config_option
@_db_option
@_url_option
def include(node, config_path, db_path, url) -> None:
    """Undo `exclude NODE` (admin).

    \b
    Example:
        recovery-ctl include node7
    """
    Client(config_path, db_path, url, writing=True).change("include", node)
    click.echo(f"{node}: no longer excluded")


@main.command()
@click.argument("rec_id", type=int)
@_config_option
@_db_option
@_url_option
def ack(rec_id, config_path, db_path, url) -> None:
    """Claim an external-mode recommendation (admin: as a site controller does,
    before it acts on Slurm and reports the outcome).

    \b
    Example:
        recovery-ctl ack 17
    """
    answer = Client(config_path, db_path, url, writing=True).change("ack", rec_id)
    click.echo(f"#{rec_id}: claimed by {answer['claimed_by']}")


@main.command()
@click.argument("rec_id", type=int)
@click.option("--reason", default="", help="Why (recorded).")
@_config_option
@_db_option
@_url_option
def cancel(rec_id, reason, config_path, db_path, url) -> None:
    """Withdraw a recommendation that has not started on Slurm. A user may
    withdraw those for their own jobs; a node's drain or resume needs an admin.

    \b
    Example:
        recovery-ctl cancel 17 --reason "maintenance tonight, will requeue by hand"
    """
    Client(config_path, db_path, url, writing=True).change("cancel", rec_id, reason)
    click.echo(f"#{rec_id}: cancelled")


AUDIT_FIELDS = ("id", "created", "job_id", "attempt", "workload", "user", "env", "mode",
                "action", "target_nodes", "exclude", "status", "rule", "reason_category",
                "pattern_ids", "attribution", "detected_at", "done_at", "error", "steps")


@main.command()
@click.option("--since", default=None, help="ISO time, or a duration back (30m, 2h, 7d).")
@click.option("--until", default=None, help="ISO time, or a duration back.")
@click.option("--job", "job_id", default=None, help="Only this job's recommendations.")
@click.option("--format", "fmt", type=click.Choice(["text", "json", "csv"]), default="text",
              show_default=True, help="json: one object per line; csv: one row each.")
@click.option("--json", "as_json", is_flag=True, help="Same as --format json.")
@_config_option
@_db_option
@_url_option
def audit(since, until, job_id, fmt, as_json, config_path, db_path, url) -> None:
    """The audit trail: each recommendation (stored before any action) with its
    evidence, attribution, mode, timestamps and every step taken on Slurm.

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
        import csv
        import io
        buffer = io.StringIO()
        writer = csv.writer(buffer)
        writer.writerow(AUDIT_FIELDS)
        for rec in recs:
            row = []
            for key in AUDIT_FIELDS:
                value = rec.get(key)
                if key == "steps":
                    value = "; ".join(f"{s['step']}:{s['state']}" for s in value or [])
                elif isinstance(value, (list, dict)):
                    value = json.dumps(value, sort_keys=True)
                row.append("" if value is None else value)
            writer.writerow(row)
        click.echo(buffer.getvalue(), nl=False)
        return
    for rec in recs:
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

    from ..store import StoreLock

    client = Client(config_path, db_path, None)
    if client.service is None:
        raise click.ClickException(f"watchdog: cannot read the store {client.cfg.store_path} "
                                   "here (run it on the agent's host, or name it with --db)")
    cfg, store = client.cfg, client.store
    beat = (store.get_state("heartbeat") or {}).get("time", 0)
    age = _time.time() - beat
    lock = StoreLock(store.path)
    try:
        lock.acquire()   # held while acting: no agent starts on the store meanwhile
    except OSError as exc:   # no lock file can be made (a full disk): fail open
        click.echo(f"watchdog: cannot take the store lock ({exc.strerror}); going on "
                   "without it")
    except RecoveryError:
        if not force and age < cfg.policy.decision_timeout:
            click.echo(f"watchdog: the agent is running (heartbeat {age:.0f}s ago) and runs "
                       "the watchdog itself; nothing to do")
            return
        click.echo(f"watchdog: the agent holds the store but its heartbeat is {age:.0f}s old"
                   + (" (--force)" if force else "") + "; releasing what it left held")
    try:
        _watchdog_pass(cfg, store)
    finally:
        lock.release()


def _watchdog_pass(cfg, store) -> None:
    """One watchdog pass from this process. The releases run even when the store
    refuses writes (full disk, read-only): their record then waits in the side
    journal (``<store>.journal``) and reaches the store on a later run."""
    import time as _time

    from ..act.actuator import Actuator
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
        click.echo(f"watchdog: {written} record(s) from the side journal written to the store")
    released = actuator.watchdog(listing, _time.time())
    for pk in released:
        rec = store.rec(pk)
        status = "released (recorded in the side journal)" \
            if pk in actuator.journaled else rec.status
        click.echo(f"watchdog: released job {rec.job_id} (recommendation #{pk}, {status})")
    click.echo(f"watchdog: {len(released)} job(s) released"
               + (f"; {len(actuator.journal)} record(s) wait in {actuator.journal.path} for "
                  "the store to take writes" if len(actuator.journal) else ""))


@main.command()
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
    (WARN lines are optional parts).

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
    from ..config import load
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
    from .check import run_checks
    results = run_checks(cfg)
    if as_json:
        _dump([{"check": r.name, "result": r.word, "detail": r.detail} for r in results])
    else:
        width = max(len(r.name) for r in results)
        for r in results:
            click.echo(f"{r.word}  {r.name:<{width}}  {r.detail}")
    failed = [r for r in results if r.word == "FAIL"]
    if not as_json:
        click.echo(f"{len(results) - len(failed)} of {len(results)} checks passed"
                   + (f"; failed: {', '.join(r.name for r in failed)}" if failed else ""))
    if failed:
        raise SystemExit(1)


def _check_sources(cfg, as_json: bool) -> None:
    from dataclasses import asdict

    from .check import check_sources_of
    from ..inputs.sources import summary_lines
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


@main.command()
@click.option("--since", default="7d", show_default=True,
              help="ISO time, or a duration back (24h, 7d).")
@click.option("--until", default=None, help="ISO time, or a duration back [default: now].")
@_config_option
@_db_option
@_json_option
def report(since, until, config_path, db_path, as_json) -> None:
    """Score monitor mode: each would_have recommendation against what humans did
    in Slurm meanwhile (requeues, cancels, drains with their reasons). Prints the
    agreement, precision and recall of node exclusions, and every case where the
    two differ. Run it before switching an environment to action mode.

    \b
    Example:
        recovery-ctl report --since 14d
    """
    from .report import build
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
    result = build(client.store, nodes, start, end)
    if as_json:
        _dump(result.as_dict())
        return

    def pct(value):
        return "-" if value is None else f"{value * 100:.0f}%"
    click.echo(f"window {_when(start)} .. {_when(end)}")
    click.echo(f"would_have decisions compared: {result.compared}; agreed with what humans "
               f"did: {result.agreed} ({pct(result.agreement)})")
    click.echo(f"node exclusions: ours {sorted(result.our_nodes) or '-'}, drained by humans "
               f"{sorted(result.human_nodes) or '-'}; precision {pct(result.precision)}, "
               f"recall {pct(result.recall)}")
    for node, why in sorted(result.human_nodes.items()):
        click.echo(f"  human drain {node}: {why}")
    if result.differ:
        click.echo("differences:")
        _table(result.differ, [("rec", "REC"), ("job", "JOBID"), ("attempt", "ATTEMPT"),
                               ("would_have", "WOULD_HAVE"), ("nodes", "NODES"),
                               ("humans", "HUMANS"), ("reason", "REASON")])
