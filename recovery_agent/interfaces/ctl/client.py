"""How ``recovery-ctl`` reaches the agent's state: the options that name it and
the :class:`Client` that asks the store or the agent's API."""
from __future__ import annotations

import json
import os
from pathlib import Path

import click
import requests

from slurm_hooks import munge

from ...config import load
from ...errors import RecoveryError
from ...store import Store, files
from ..service import Service, role_of

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


class Client:
    """The same questions and changes, over the store (Service) or over HTTP.

    ``writing``: a change; it goes to the agent's API unless ``--db`` names a
    store, which must then be writable here. ``readonly``: a read command; a
    store is opened read-only (SQLite ``mode=ro``: nothing created, migrated
    or changed)."""

    def __init__(self, config_path: str | None, db_path: str | None, url: str | None,
                 writing: bool = False, readonly: bool = False) -> None:
        try:
            self.cfg = load(config_path)
        except RecoveryError as exc:
            raise click.ClickException(str(exc)) from None
        self.url = url
        self.service = None
        path = Path(db_path) if db_path else self.cfg.store_path
        if db_path or (not url and not writing and os.access(path, os.R_OK)):
            try:
                files.must_exist(path, writable=writing)
                self.service = Service(self.cfg, Store(path, readonly=readonly), via="store")
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
        headers = {}
        data = None
        if method == "POST":
            data = json.dumps(body or {}).encode()
            if self.cfg.api.auth == "munge":
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
    "audit": lambda c, since=None, until=None, job=None: c._http(
        "GET", "/v1/audit", since=since, until=until, job=job, limit=100000)["records"],
    "set_mode": lambda c, env, mode, reason="": c._http(
        "POST", f"/v1/environments/{env}/mode", {"mode": mode, "reason": reason}),
    "clear_mode": lambda c, env, reason="": c._http(
        "POST", f"/v1/environments/{env}/mode/clear", {"reason": reason}),
    "recommendation": lambda c, rec_id: c._http("GET", f"/v1/recommendations/{rec_id}"),
    "exclude": lambda c, name, reason, force=False: c._http(
        "POST", f"/v1/nodes/{name}/exclude", {"reason": reason, "force": force}),
    "include": lambda c, name, reason="": c._http("POST", f"/v1/nodes/{name}/include",
                                                  {"reason": reason}),
    "ack": lambda c, rec_id, reason="": c._http("POST", f"/v1/recommendations/{rec_id}/ack",
                                                {"reason": reason}),
    "complete": lambda c, rec_id, outcome, detail="": c._http(
        "POST", f"/v1/recommendations/{rec_id}/complete",
        {"outcome": outcome, "detail": detail}),
    "goodput": lambda c, since=None, until=None, by=None: c._http(
        "GET", "/v1/goodput", since=_unix(since), until=_unix(until), by=by),
    "job_goodput": lambda c, job_id: c._http("GET", "/v1/goodput", job=job_id)["summary"],
    "cancel": lambda c, rec_id, reason="": c._http("POST",
                                                   f"/v1/recommendations/{rec_id}/cancel",
                                                   {"reason": reason}),
}


def _unix(when: float | None) -> str | None:
    """A time as the API's window bounds take it (Unix seconds, to the ms)."""
    return None if when is None else f"{max(when, 0.0):.3f}"
