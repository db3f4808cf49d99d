"""The agent's read and steer API: jobs, nodes, recommendations (the Advisor API
for site controllers), operator actions, health and Prometheus metrics.

Who reads: a munge-signed GET (``Authorization: Munge <cred>`` over an empty
body) names its uid; a bearer token (``api.read_token_file``) is a trusted
reader. Without either, on an agent with no read token, a caller on this host
is the uid the kernel records as the owner of its end of the connection
(``/proc/net/tcp``), and one from another host is trusted (the agent warns at
start when it listens beyond localhost without a token). Every mutating call
carries a munge credential over the SHA-256 of its body, as the hooks do. The
uid gives the role: admin (``api.admin_uids``, ``api.admin_groups``) or user,
who reads and cancels only what is theirs. Each mutating call is an audit
record (``/v1/audit``) with the caller's uid and user, the state before and
after and the reason, and a line on the timeline. The rules themselves live in
:mod:`recovery_agent.interfaces.service`.
"""
from __future__ import annotations

import errno
import hmac
import ipaddress
import json
import socket
import struct
import time

from fastapi import FastAPI, HTTPException, Path, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool

from slurm_hooks import munge

from . import api_schema as S
from . import console
from ..config import Config
from .metrics import render as render_metrics
from .service import STATUSES, Caller, Service, ServiceError, role_of
from ..store import DatabaseError, Store

__all__ = ["register", "local_peer_uid", "read_body"]
MAX_BODY = 64 * 1024
MAX_ID = 2 ** 63 - 1     # SQLite's largest row id: a larger one cannot be looked up
CURSOR = ("The next_cursor of the previous page: rows older (with a lower id) than the "
          "last one it showed.")


def _proc_address(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int
                  ) -> tuple[str, str]:
    """(table, address) as /proc/net/tcp or tcp6 spells a socket's address."""
    if ip.version == 4:
        return "tcp", f"{struct.unpack('<I', ip.packed)[0]:08X}:{port:04X}"
    words = struct.unpack("<4I", ip.packed)
    return "tcp6", "".join(f"{w:08X}" for w in words) + f":{port:04X}"


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    ip = ipaddress.ip_address(host)
    return getattr(ip, "ipv4_mapped", None) or ip   # a v4 client of a "::" listener


def _on_this_host(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Is ``ip`` an address of this host? (Only this host's addresses can be bound.)"""
    if ip.is_loopback:
        return True
    family = socket.AF_INET if ip.version == 4 else socket.AF_INET6
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((str(ip), 0))
        except OSError as exc:
            return exc.errno != errno.EADDRNOTAVAIL
    return True


def local_peer_uid(client: tuple | None, server: tuple | None) -> int | None:
    """Who is at the other end of a TCP connection to the agent, when that end
    is a socket of this host: the uid the kernel records as its owner
    (/proc/net/tcp, which unprivileged users cannot change). None for a caller
    on another host, or no TCP peer at all (a Unix socket, a test client).
    Raises LookupError for a caller on this host whose socket cannot be found
    or has no owner any more (closed early: the kernel then shows uid 0)."""
    try:
        peer, port = _ip(client[0]), int(client[1])
        table, mine = _proc_address(peer, port)
        _, theirs = _proc_address(_ip(server[0]), int(server[1]))
    except (TypeError, ValueError, IndexError):
        return None
    if not _on_this_host(peer):
        return None
    try:
        with open(f"/proc/net/{table}", encoding="ascii") as fh:
            next(fh, None)
            for line in fh:
                fields = line.split()
                if fields[1] == mine and fields[2] == theirs:
                    if fields[9] == "0":     # no inode: orphaned, its owner is gone
                        break
                    return int(fields[7])
    except OSError as exc:
        raise LookupError(f"/proc/net/{table}: {exc.strerror or exc}") from None
    raise LookupError(f"no owner found for the local socket {peer}:{port}")


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, or 413 as soon as it is known to pass ``limit``
    bytes: a huge body is never held in memory."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise HTTPException(413, f"body over {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPException(413, f"body over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


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
        """Who reads: a munge-signed GET names a uid; so does, for a caller on
        this host, the kernel (see local_peer_uid). A user then sees only their
        own jobs. A bearer token, an admin, or a caller on another host of an
        agent without a token is a trusted reader (None)."""
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "munge" and given.strip():
            if cfg.api.auth == "none":
                return None
            try:
                uid = munge.verify_body(given.strip(), b"", cfg.api.munge_socket)
            except munge.MungeError as exc:
                raise HTTPException(401, f"munge: {exc}") from None
            return role_of(cfg, uid)
        if token:
            if scheme.lower() == "bearer" and hmac.compare_digest(given.strip(), token):
                return None
            raise HTTPException(401, "a bearer token is required (api.read_token_file)")
        try:
            uid = local_peer_uid(request.client, request.scope.get("server"))
        except LookupError as exc:
            raise HTTPException(401, f"cannot tell which local user asks ({exc}); sign "
                                "the request with munge, as recovery-ctl does") from None
        if uid is None:
            return None
        who = role_of(cfg, uid)
        return None if who.admin else who

    @app.exception_handler(DatabaseError)
    async def store_error(request: Request, exc: DatabaseError) -> JSONResponse:
        # a damaged store has marked store.health already: /healthz is red too
        return JSONResponse({"detail": f"the store cannot answer: {exc}"}, status_code=503)

    async def caller(request: Request) -> tuple[Caller, dict]:
        body = await read_body(request, MAX_BODY)
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

    console.register(app, service, readable)

    # -- health and metrics ----------------------------------------------------
    @app.get("/healthz", tags=["health"], response_model=None, openapi_extra=S.OPEN_EXTRA,
             responses={200: {"model": S.Readiness, "description": "Ready."},
                        503: {"model": S.Readiness,
                              "description": "Not ready: the store fails or the watch "
                                             "loop has stopped."}})
    def healthz() -> JSONResponse:
        """Readiness: the store answers and the watch loop is alive (503 otherwise).
        Once any read found the store damaged, 503 until a restart (which refuses
        a damaged store)."""
        try:
            beat = store.get_state("heartbeat") or {}
        except Exception as exc:  # noqa: BLE001 - any store failure makes us unhealthy
            return JSONResponse({"status": "error", "store": str(exc)}, status_code=503)
        age = time.time() - beat["time"] if beat.get("time") else None
        watching = age is not None and age < max(30.0, 10 * cfg.agent.poll_interval)
        damaged = store.health.get("damaged")
        failing = damaged or store.health.get("error")
        ok = watching and not failing
        return JSONResponse({"status": "ok" if ok else "degraded",
                             "store": "damaged" if damaged else
                                      "failing" if failing else "ok",
                             "last_error": failing, "watch_errors": store.health.get("errors", 0),
                             "watch_heartbeat_age_s": age, "watching": watching},
                            status_code=200 if ok else 503)

    @app.get("/metrics", tags=["health"], response_class=PlainTextResponse,
             openapi_extra=S.READ_EXTRA,
             responses={200: {"description": "The Prometheus text exposition format."},
                        **S.errors(401, 503)})
    def metrics(request: Request) -> Response:
        """Prometheus text format."""
        readable(request)
        body, content_type = render_metrics(store, counters, cfg)
        return Response(body, media_type=content_type)

    # HEAD (a load balancer's or a probe's check): GET's status, no body; left out
    # of the OpenAPI document, which describes the GETs
    @app.head("/healthz", include_in_schema=False)
    def healthz_head() -> Response:
        return Response(status_code=healthz().status_code)

    @app.head("/metrics", include_in_schema=False)
    def metrics_head(request: Request) -> Response:
        answer = metrics(request)   # the same checks and reads (a damaged store: 503)
        return Response(status_code=answer.status_code, media_type=answer.media_type)

    # -- jobs ------------------------------------------------------------------
    @app.get("/v1/jobs", tags=["jobs"], response_model=None, openapi_extra=S.READ_EXTRA,
             responses=S.answers(S.JobList, 401, 503))
    def jobs(request: Request, state: str | None = None, user: str | None = None,
             env: str | None = None, limit: int = Query(500, ge=1, le=10000),
             cursor: int | None = Query(None, ge=1, le=MAX_ID, description=CURSOR)) -> dict:
        """Tracked jobs, newest first (array tasks are jobs of their own), a page
        of at most ``limit``; ``next_cursor`` asks for the next."""
        rows = service.jobs(state, user, env, limit + 1, who=readable(request), before=cursor)
        return {"jobs": rows[:limit], "next_cursor": _next(rows, limit)}

    @app.get("/v1/jobs/{job_id}", tags=["jobs"], response_model=None,
             openapi_extra=S.READ_EXTRA, responses=S.answers(
                 S.JobAnswer, 401, 403, 404, 503,
                 description="The job; for a job array's id, its tasks."))
    def job(job_id: str, request: Request) -> dict:
        """One job: attempts, detections (with evidence lines) and recommendations;
        an array's id gives its tasks (a user's own tasks only)."""
        who = readable(request)
        if store.find_job(cfg.agent.cluster, job_id) is None:
            tasks = service.array(job_id, who)
            if tasks:
                return {"array_job_id": int(job_id), "tasks": tasks}
        return service.job(job_id, who)

    @app.get("/v1/jobs/{job_id}/timeline", tags=["jobs"], response_model=None,
             openapi_extra=S.READ_EXTRA, responses=S.answers(S.Timeline, 401, 403, 404, 503))
    def timeline(job_id: str, request: Request) -> dict:
        """The job's timeline: hook reports, detections, verdicts, decisions, steps."""
        return {"job": job_id, "events": service.timeline(job_id, readable(request))}

    # -- nodes -----------------------------------------------------------------
    @app.get("/v1/nodes", tags=["nodes"], response_model=None, openapi_extra=S.READ_EXTRA,
             responses=S.answers(S.NodeList, 401, 503))
    def nodes(request: Request) -> dict:
        """Nodes: suspect score, health, our drains, operator exclusions, strikes,
        last health report (every reader sees them: they are the cluster's, as in
        sinfo; a user sees which job and user a strike came from for their own
        jobs only)."""
        return {"nodes": service.nodes(readable(request))}

    @app.get("/v1/nodes/{name}", tags=["nodes"], response_model=None,
             openapi_extra=S.READ_EXTRA, responses=S.answers(S.Node, 401, 404, 503))
    def node(name: str, request: Request) -> dict:
        """One node with its strikes (a user sees which job and user each came from
        only for their own jobs)."""
        return service.node(name, readable(request))

    @app.post("/v1/nodes/{name}/exclude", tags=["nodes"], response_model=None,
              openapi_extra=S.signed(S.ExcludeBody),
              responses=S.answers(S.NodeExcluded, 400, 401, 403, 404, 413, 503))
    async def exclude(name: str, request: Request) -> dict:
        """Exclude a node from every tracked job's retries (admin), with a reason:
        one Slurm knows, unless forced."""
        who, data = await caller(request)
        force = data.get("force", False)
        if not isinstance(force, bool):
            raise HTTPException(400, "force must be true or false")
        return await run_in_threadpool(service.exclude, who, name, _text(data, "reason"), force)

    @app.post("/v1/nodes/{name}/include", tags=["nodes"], response_model=None,
              openapi_extra=S.signed(S.ReasonBody, required=False),
              responses=S.answers(S.NodeExcluded, 400, 401, 403, 404, 413, 503))
    async def include(name: str, request: Request) -> dict:
        """Undo an operator exclusion (admin)."""
        who, data = await caller(request)
        return service.include(who, name, _text(data, "reason"))

    # -- the goodput ledger ------------------------------------------------------
    @app.get("/v1/goodput", tags=["goodput"], response_model=None,
             openapi_extra=S.READ_EXTRA,
             responses=S.answers(S.GoodputReport, 400, 401, 403, 404, 503))
    def goodput(request: Request,
                since: str | None = Query(None, pattern=S.WINDOW_BOUND, description=S.SINCE),
                until: str | None = Query(None, pattern=S.WINDOW_BOUND, description=S.UNTIL),
                by: S.GoodputBy | None = Query(None, description="One group per environment, "
                                                                "user, failure category or "
                                                                "node."),
                job: str | None = Query(None, max_length=64,
                                        description="One job's whole history instead "
                                                    "(since, until and by do not apply).")
                ) -> dict:
        """The goodput ledger (docs/goodput.md): incidents by outcome, MTTR,
        GPU time lost and saved against plain Slurm (and what monitor mode
        would have saved), ETTR, the precision of node blame and the false-stop
        evidence, with the assumptions. What ``recovery-ctl report goodput``
        prints; a user's covers their own jobs."""
        return service.goodput(since, until, by, readable(request), job)

    # -- environments ----------------------------------------------------------
    @app.get("/v1/environments", tags=["config"], response_model=None,
             openapi_extra=S.READ_EXTRA, responses=S.answers(S.Environments, 401, 503))
    def environments(request: Request) -> dict:
        """Each environment's configured and effective mode."""
        readable(request)
        return {"environments": service.environments()}

    @app.post("/v1/environments/{env}/mode", tags=["config"], response_model=None,
              openapi_extra=S.signed(S.ModeBody),
              responses=S.answers(S.ModeChanged, 400, 401, 403, 404, 413, 503))
    async def set_mode(env: str, request: Request) -> dict:
        """Switch an environment's mode at run time (admin): it wins over the
        config file until cleared."""
        who, data = await caller(request)
        return service.set_mode(who, env, _text(data, "mode"), _text(data, "reason"))

    @app.post("/v1/environments/{env}/mode/clear", tags=["config"], response_model=None,
              openapi_extra=S.signed(S.ReasonBody, required=False),
              responses=S.answers(S.ModeChanged, 400, 401, 403, 404, 413, 503))
    async def clear_mode(env: str, request: Request) -> dict:
        """Give the environment back the config file's mode (admin); one that
        has it already is left as it is (``cleared``: false)."""
        who, data = await caller(request)
        return service.clear_mode(who, env, _text(data, "reason"))

    # -- the audit trail ---------------------------------------------------------
    @app.get("/v1/audit", tags=["audit"], response_model=None, openapi_extra=S.READ_EXTRA,
             responses=S.answers(S.AuditList, 401, 404, 503))
    def audit(request: Request,
              since: float | None = Query(None, description="Epoch seconds: from then on."),
              until: float | None = Query(None, description="Epoch seconds: up to then."),
              job: str | None = Query(None, description="Only this job's recommendations "
                                                        "and the changes made to them."),
              limit: int = Query(10000, ge=1, le=100000)) -> dict:
        """The audit trail in time order: recommendations with their steps, and
        operator changes (who, when, before and after, why). A user gets those
        of their own jobs; changes of modes and nodes are for admins."""
        records = service.audit(since, until, job, who=readable(request))
        return {"records": records[-limit:], "truncated": len(records) > limit}

    # -- recommendations: the Advisor API ---------------------------------------
    @app.get("/v1/recommendations", tags=["recommendations"], response_model=None,
             openapi_extra=S.READ_EXTRA,
             responses=S.answers(S.RecommendationList, 400, 401, 404, 503))
    def recommendations(request: Request,
                        status: str | None = Query(None, json_schema_extra={"enum": STATUSES}),
                        env: str | None = None,
                        mode: str | None = None, job: str | None = None,
                        limit: int = Query(500, ge=1, le=10000),
                        cursor: int | None = Query(None, ge=1, le=MAX_ID, description=CURSOR)
                        ) -> dict:
        """Recommendations, newest first, a page of at most ``limit``. A site
        controller polls ``?status=proposed&mode=external``, then acks, acts and
        completes (as an admin). A user sees those about their own jobs."""
        rows = service.recommendations(status, env, mode, job, limit + 1,
                                       who=readable(request), before=cursor)
        return {"recommendations": rows[:limit], "next_cursor": _next(rows, limit)}

    @app.get("/v1/recommendations/{rec_id}", tags=["recommendations"], response_model=None,
             openapi_extra=S.READ_EXTRA,
             responses=S.answers(S.RecommendationDetail, 401, 403, 404, 503))
    def recommendation(request: Request, rec_id: int = Path(ge=1, le=MAX_ID)) -> dict:
        """One recommendation with its execution steps."""
        return service.recommendation(rec_id, readable(request))

    @app.post("/v1/recommendations/{rec_id}/ack", tags=["recommendations"],
              response_model=None, openapi_extra=S.signed(S.ReasonBody, required=False),
              responses=S.answers(S.Claimed, 400, 401, 403, 404, 409, 413, 503))
    async def ack(request: Request, rec_id: int = Path(ge=1, le=MAX_ID)) -> dict:
        """Claim an external recommendation (admin: a site controller); the claim
        lasts api.claim_ttl."""
        who, data = await caller(request)
        return service.ack(who, rec_id, _text(data, "reason"))

    @app.post("/v1/recommendations/{rec_id}/complete", tags=["recommendations"],
              response_model=None, openapi_extra=S.signed(S.CompleteBody),
              responses=S.answers(S.Ended, 400, 401, 403, 404, 409, 413, 503))
    async def complete(request: Request, rec_id: int = Path(ge=1, le=MAX_ID)) -> dict:
        """Report the outcome of a claimed recommendation (admin)."""
        who, data = await caller(request)
        return service.complete(who, rec_id, _text(data, "outcome"),
                                _text(data, "detail"))

    @app.post("/v1/recommendations/{rec_id}/cancel", tags=["recommendations"],
              response_model=None, openapi_extra=S.signed(S.CancelBody, required=False),
              responses=S.answers(S.Ended, 400, 401, 403, 404, 409, 413, 503))
    async def cancel(request: Request, rec_id: int = Path(ge=1, le=MAX_ID)) -> dict:
        """Withdraw a recommendation that has not started on Slurm (admin; a job's
        owner may withdraw a job recommendation of their job, never a node's drain)."""
        who, data = await caller(request)
        return service.cancel(who, rec_id, _text(data, "reason"))


def _text(data: dict, key: str) -> str:
    """A string field of a request body ("" when absent); 400 when not a string."""
    value = data.get(key, "")
    if not isinstance(value, str):
        raise HTTPException(400, f"{key} must be a string")
    return value


def _next(rows: list[dict], limit: int) -> int | None:
    """The cursor of the page after ``rows[:limit]``, of ``limit + 1`` rows asked
    for: the last shown row's id while more follow, else None."""
    return rows[limit - 1]["id"] if len(rows) > limit else None
