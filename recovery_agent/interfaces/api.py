"""The agent's HTTP service: hook ingest at ``POST /v1/hooks/{hook}`` (here) and
the read, Advisor and operator API (:mod:`recovery_agent.interfaces.api_v1`).

Each request carries ``Authorization: Munge <credential>``; the credential's
payload is the SHA-256 of the body, so a report cannot be altered in flight or
sent by a host without the cluster's munge key. Answers:

* 201 stored, 200 already stored (a spool replay), 400 bad body (with the
  reason), 401 bad/expired/replayed credential, 403 uid not allowed,
  413 body too large.
"""
from __future__ import annotations

import json
import logging
import tempfile
import threading
from importlib import metadata

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse

from slurm_hooks import munge

from . import api_schema as S
from . import api_v1
from .api_v1 import read_body
from ..config import Config
from ..inputs.ingest import HOOKS, Ingest, ReportError, parse_body
from ..store import Store

log = logging.getLogger(__name__)
MAX_BODY = 4 * 1024 * 1024


class Counters:
    """Ingest counters, for tests, benchmarks and (later) /metrics."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.values: dict[str, int] = {}

    def add(self, name: str) -> None:
        with self.lock:
            self.values[name] = self.values.get(name, 0) + 1


def package_version() -> str:
    """The installed package's version (pyproject.toml's): the API's too."""
    try:
        return metadata.version("slurm-recovery")
    except metadata.PackageNotFoundError:   # run from a source tree never installed
        return "0+unknown"


def create_app(cfg: Config, ingest: Ingest) -> FastAPI:
    app = FastAPI(title="slurm-recovery agent", version=package_version(),
                  description="Hook ingest, jobs, nodes, the Advisor API for site "
                              "controllers, operator actions, health and metrics.")
    counters = Counters()
    app.state.counters = counters
    app.state.ingest = ingest
    api_v1.register(app, cfg, ingest.store, counters)
    S.install(app)

    def refuse(status: int, reason: str, hook: str) -> JSONResponse:
        counters.add(f"refused_{status}")
        log.warning("refused %s report: %s %s", hook, status, reason)
        return JSONResponse({"error": reason}, status_code=status)

    def authenticate(request: Request, body: bytes, hook: str) -> tuple[int | None, str]:
        if cfg.api.auth == "none":
            return None, ""
        header = request.headers.get("authorization", "")
        scheme, _, cred = header.partition(" ")
        if scheme.lower() != "munge" or not cred.strip():
            return None, "missing 'Authorization: Munge <credential>' header"
        try:
            uid = munge.verify_body(cred.strip(), body, cfg.api.munge_socket)
        except munge.MungeError as exc:
            return None, f"munge: {exc}"
        if uid not in cfg.allowed_hook_uids:
            return uid, f"uid {uid} may not send hook reports"
        return uid, ""

    @app.get("/v1/health", tags=["health"], response_model=None, openapi_extra=S.OPEN_EXTRA,
             responses={200: {"model": S.Liveness, "description": "The agent answers."}})
    def health() -> dict:
        """Liveness: the agent answers."""
        return {"status": "ok"}

    refused = {code: {"model": S.HookRefusal, "description": why} for code, why in (
        (400, "The report is not valid (error names the field)."),
        (401, "A missing, bad, expired or replayed munge credential."),
        (403, "The credential's uid may not send hook reports (hooks.allowed_uids)."),
        (404, "No such hook."), (413, "The report is over the size limit."))}

    @app.post("/v1/hooks/{hook}", tags=["hooks"], response_model=None, status_code=201,
              openapi_extra=S.signed(S.HookReport),
              responses={201: {"model": S.HookStored, "description": "Stored."},
                         200: {"model": S.HookStored,
                               "description": "Stored already (a spool replay)."},
                         **refused, **S.errors(503)})
    async def hook_report(hook: str, request: Request) -> JSONResponse:
        """Store one report from recovery-prolog, -epilog or -healthcheck."""
        if hook not in HOOKS:
            return refuse(404, f"unknown hook {hook!r}", hook)
        try:
            body = await read_body(request, MAX_BODY)
        except HTTPException as exc:
            return refuse(exc.status_code, exc.detail, hook)
        uid, problem = authenticate(request, body, hook)
        if problem:
            return refuse(403 if uid is not None else 401, problem, hook)
        try:
            report = parse_body(hook, body)
        except ReportError as exc:
            return refuse(400, str(exc), hook)
        stored = ingest.store_report(hook, report, sender_uid=uid)
        counters.add("duplicate" if stored.duplicate else "stored")
        return JSONResponse({"status": "duplicate" if stored.duplicate else "stored",
                             "id": stored.row_id, "job": stored.job_row},
                            status_code=200 if stored.duplicate else 201)

    return app


def openapi_spec() -> dict:
    """The API's OpenAPI document, as checked in at docs/openapi.json."""
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(f"{tmp}/spec.db")
        try:
            return create_app(Config(), Ingest(store, "default")).openapi()
        finally:
            store.close()


if __name__ == "__main__":   # python -m recovery_agent.interfaces.api > docs/openapi.json
    print(json.dumps(openapi_spec(), indent=1, sort_keys=True))
