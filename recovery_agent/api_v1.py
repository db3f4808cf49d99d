"""The agent's read and steer API: jobs, nodes, recommendations (the Advisor API
for site controllers), operator actions, health and Prometheus metrics.

Reads need nothing while the agent listens on localhost, or a bearer token
(``api.read_token_file``) once exposed. Every mutating call carries a munge
credential over the SHA-256 of its body (``Authorization: Munge <cred>``), as
the hooks do; the uid inside gives the role: admin (``api.admin_uids``,
``api.admin_groups``) or user, who may act only on their own jobs. Each
mutating call is written to the timeline with the caller's uid. The rules
themselves live in :mod:`recovery_agent.service`.
"""
from __future__ import annotations

import hmac
import json
import time

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse, Response

from slurm_hooks import munge

from .config import Config
from .service import Caller, Service, ServiceError, role_of
from .store import Store

__all__ = ["register"]
MAX_BODY = 64 * 1024


def register(app: FastAPI, cfg: Config, store: Store, counters) -> None:
    service = Service(cfg, store)
    token = ""
    if cfg.api.read_token_file:
        with open(cfg.api.read_token_file, encoding="utf-8") as fh:
            token = fh.read().strip()

    @app.exception_handler(ServiceError)
    async def service_error(request: Request, exc: ServiceError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=exc.status)

    def readable(request: Request) -> Caller | None:
        """Who reads: a munge-signed GET names a uid (a user then sees only their
        own jobs); a bearer token, or no credential on an unexposed agent, is a
        trusted reader (None)."""
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "munge" and given.strip():
            if cfg.api.auth == "none":
                return None
            try:
                uid = munge.verify_body(given.strip(), b"", cfg.api.munge_socket)
            except munge.MungeError as exc:
                raise HTTPException(401, f"munge: {exc}") from None
            return role_of(cfg, uid)
        if not token:
            return None
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip(), token):
            return None
        raise HTTPException(401, "a bearer token is required (api.read_token_file)")

    def own(who: Caller | None, user: str | None, what: str) -> None:
        if who is not None and not who.admin and (user or "") != who.name:
            raise HTTPException(403, f"{what} belongs to {user or 'another user'}; "
                                f"{who.name} may read only their own jobs")

    async def caller(request: Request) -> tuple[Caller, dict]:
        body = await request.body()
        if len(body) > MAX_BODY:
            raise HTTPException(413, f"body over {MAX_BODY} bytes")
        if cfg.api.auth == "none":
            try:
                uid = int(request.headers.get("x-recovery-uid", "0") or 0)
            except ValueError:
                raise HTTPException(400, "X-Recovery-Uid must be a number") from None
        else:
            scheme, _, cred = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "munge" or not cred.strip():
                raise HTTPException(401, "missing 'Authorization: Munge <credential>' header")
            try:
                uid = munge.verify_body(cred.strip(), body, cfg.api.munge_socket)
            except munge.MungeError as exc:
                raise HTTPException(401, f"munge: {exc}") from None
        try:
            data = json.loads(body) if body.strip() else {}
        except ValueError:
            raise HTTPException(400, "body is not JSON") from None
        if not isinstance(data, dict):
            raise HTTPException(400, "body must be a JSON object")
        return role_of(cfg, uid), data

    from . import console
    console.register(app, service, readable)

    # -- health and metrics ----------------------------------------------------
    @app.get("/healthz", tags=["health"])
    def healthz() -> JSONResponse:
        """Readiness: the store answers and the watch loop is alive (503 otherwise)."""
        try:
            beat = store.get_state("heartbeat") or {}
        except Exception as exc:  # noqa: BLE001 - any store failure makes us unhealthy
            return JSONResponse({"status": "error", "store": str(exc)}, status_code=503)
        age = time.time() - beat["time"] if beat.get("time") else None
        watching = age is not None and age < max(30.0, 10 * cfg.agent.poll_interval)
        failing = store.health.get("error")
        ok = watching and not failing
        return JSONResponse({"status": "ok" if ok else "degraded",
                             "store": "failing" if failing else "ok",
                             "last_error": failing, "watch_errors": store.health.get("errors", 0),
                             "watch_heartbeat_age_s": age, "watching": watching},
                            status_code=200 if ok else 503)

    @app.get("/metrics", tags=["health"])
    def metrics(request: Request) -> Response:
        """Prometheus text format."""
        readable(request)
        from .metrics import render
        body, content_type = render(store, counters)
        return Response(body, media_type=content_type)

    # -- jobs ------------------------------------------------------------------
    @app.get("/v1/jobs", tags=["jobs"])
    def jobs(request: Request, state: str | None = None, user: str | None = None,
             env: str | None = None, limit: int = Query(500, ge=1, le=10000)) -> dict:
        """Tracked jobs, newest first (array tasks are jobs of their own)."""
        who = readable(request)
        if who is not None and not who.admin:
            user = who.name
        return {"jobs": service.jobs(state, user, env, limit)}

    @app.get("/v1/jobs/{job_id}", tags=["jobs"])
    def job(job_id: str, request: Request) -> dict:
        """One job: attempts, detections (with evidence lines) and recommendations;
        an array's id gives its tasks."""
        who = readable(request)
        if store.find_job(cfg.agent.cluster, job_id) is None:
            tasks = service.array(job_id)
            if tasks:
                return {"array_job_id": int(job_id), "tasks": tasks}
        detail = service.job(job_id)
        own(who, detail["job"]["user"], f"job {job_id}")
        return detail

    @app.get("/v1/jobs/{job_id}/timeline", tags=["jobs"])
    def timeline(job_id: str, request: Request) -> dict:
        """The job's timeline: hook reports, detections, verdicts, decisions, steps."""
        who = readable(request)
        own(who, service.job_row(job_id)["user"], f"job {job_id}")
        return {"job": job_id, "events": service.timeline(job_id)}

    # -- nodes -----------------------------------------------------------------
    @app.get("/v1/nodes", tags=["nodes"])
    def nodes(request: Request) -> dict:
        """Nodes: suspect score, our drains, operator exclusions, last health report."""
        readable(request)
        return {"nodes": service.nodes()}

    @app.get("/v1/nodes/{name}", tags=["nodes"])
    def node(name: str, request: Request) -> dict:
        readable(request)
        return service.node(name)

    @app.post("/v1/nodes/{name}/exclude", tags=["nodes"])
    async def exclude(name: str, request: Request) -> dict:
        """Exclude a node from every tracked job's retries (admin). Body: {"reason": "..."}"""
        who, data = await caller(request)
        return service.exclude(who, name, str(data.get("reason") or ""))

    @app.post("/v1/nodes/{name}/include", tags=["nodes"])
    async def include(name: str, request: Request) -> dict:
        """Undo an operator exclusion (admin)."""
        who, _ = await caller(request)
        return service.include(who, name)

    # -- environments ----------------------------------------------------------
    @app.get("/v1/environments", tags=["config"])
    def environments(request: Request) -> dict:
        """Each environment's configured and effective mode."""
        readable(request)
        return {"environments": service.environments()}

    @app.post("/v1/environments/{env}/mode", tags=["config"])
    async def set_mode(env: str, request: Request) -> dict:
        """Switch an environment's mode at run time (admin). Body: {"mode": "action"}"""
        who, data = await caller(request)
        return service.set_mode(who, env, str(data.get("mode") or ""))

    # -- recommendations: the Advisor API ---------------------------------------
    @app.get("/v1/recommendations", tags=["recommendations"])
    def recommendations(request: Request, status: str | None = None, env: str | None = None,
                        mode: str | None = None, job: str | None = None,
                        limit: int = Query(500, ge=1, le=10000)) -> dict:
        """Recommendations, newest first. A site controller polls
        ``?status=proposed&mode=external``, then acks, acts and completes."""
        who = readable(request)
        rows = service.recommendations(status, env, mode, job, limit)
        if who is not None and not who.admin:
            rows = [r for r in rows if (r.get("user") or "") == who.name]
        return {"recommendations": rows}

    @app.get("/v1/recommendations/{rec_id}", tags=["recommendations"])
    def recommendation(rec_id: int, request: Request) -> dict:
        who = readable(request)
        rec = service.recommendation(rec_id)
        own(who, rec.get("user"), f"recommendation {rec_id}")
        return rec

    @app.post("/v1/recommendations/{rec_id}/ack", tags=["recommendations"])
    async def ack(rec_id: int, request: Request) -> dict:
        """Claim an external recommendation; the claim lasts api.claim_ttl."""
        who, _ = await caller(request)
        return service.ack(who, rec_id)

    @app.post("/v1/recommendations/{rec_id}/complete", tags=["recommendations"])
    async def complete(rec_id: int, request: Request) -> dict:
        """Report the outcome of a claimed recommendation.
        Body: {"outcome": "done" | "failed", "detail": "..."}"""
        who, data = await caller(request)
        return service.complete(who, rec_id, str(data.get("outcome") or ""),
                                str(data.get("detail") or ""))

    @app.post("/v1/recommendations/{rec_id}/cancel", tags=["recommendations"])
    async def cancel(rec_id: int, request: Request) -> dict:
        """Withdraw a recommendation that has not started on Slurm."""
        who, data = await caller(request)
        return service.cancel(who, rec_id, str(data.get("reason") or ""))
