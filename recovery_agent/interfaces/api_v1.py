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
who reads and cancels only what is theirs. Each mutating call is written to
the timeline with the caller's uid. The rules themselves live in
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

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse, Response

from slurm_hooks import munge

from . import console
from ..config import Config
from .metrics import render as render_metrics
from .service import Caller, Service, ServiceError, role_of
from ..store import DatabaseError, Store

__all__ = ["register", "local_peer_uid", "read_body"]
MAX_BODY = 64 * 1024


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
    @app.get("/healthz", tags=["health"])
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

    @app.get("/metrics", tags=["health"])
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
    @app.get("/v1/jobs", tags=["jobs"])
    def jobs(request: Request, state: str | None = None, user: str | None = None,
             env: str | None = None, limit: int = Query(500, ge=1, le=10000)) -> dict:
        """Tracked jobs, newest first (array tasks are jobs of their own)."""
        return {"jobs": service.jobs(state, user, env, limit, who=readable(request))}

    @app.get("/v1/jobs/{job_id}", tags=["jobs"])
    def job(job_id: str, request: Request) -> dict:
        """One job: attempts, detections (with evidence lines) and recommendations;
        an array's id gives its tasks (a user's own tasks only)."""
        who = readable(request)
        if store.find_job(cfg.agent.cluster, job_id) is None:
            tasks = service.array(job_id, who)
            if tasks:
                return {"array_job_id": int(job_id), "tasks": tasks}
        return service.job(job_id, who)

    @app.get("/v1/jobs/{job_id}/timeline", tags=["jobs"])
    def timeline(job_id: str, request: Request) -> dict:
        """The job's timeline: hook reports, detections, verdicts, decisions, steps."""
        return {"job": job_id, "events": service.timeline(job_id, readable(request))}

    # -- nodes -----------------------------------------------------------------
    @app.get("/v1/nodes", tags=["nodes"])
    def nodes(request: Request) -> dict:
        """Nodes: suspect score, our drains, operator exclusions, last health report
        (every reader sees them: they are the cluster's, as in sinfo)."""
        readable(request)
        return {"nodes": service.nodes()}

    @app.get("/v1/nodes/{name}", tags=["nodes"])
    def node(name: str, request: Request) -> dict:
        """One node with its strikes (a user sees which job and user each came from
        only for their own jobs)."""
        return service.node(name, readable(request))

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
        ``?status=proposed&mode=external``, then acks, acts and completes (as an
        admin). A user sees those about their own jobs."""
        return {"recommendations": service.recommendations(status, env, mode, job, limit,
                                                           who=readable(request))}

    @app.get("/v1/recommendations/{rec_id}", tags=["recommendations"])
    def recommendation(rec_id: int, request: Request) -> dict:
        return service.recommendation(rec_id, readable(request))

    @app.post("/v1/recommendations/{rec_id}/ack", tags=["recommendations"])
    async def ack(rec_id: int, request: Request) -> dict:
        """Claim an external recommendation (admin: a site controller); the claim
        lasts api.claim_ttl."""
        who, _ = await caller(request)
        return service.ack(who, rec_id)

    @app.post("/v1/recommendations/{rec_id}/complete", tags=["recommendations"])
    async def complete(rec_id: int, request: Request) -> dict:
        """Report the outcome of a claimed recommendation (admin).
        Body: {"outcome": "done" | "failed", "detail": "..."}"""
        who, data = await caller(request)
        return service.complete(who, rec_id, str(data.get("outcome") or ""),
                                str(data.get("detail") or ""))

    @app.post("/v1/recommendations/{rec_id}/cancel", tags=["recommendations"])
    async def cancel(rec_id: int, request: Request) -> dict:
        """Withdraw a recommendation that has not started on Slurm (admin; a job's
        owner may withdraw a job recommendation of their job, never a node's drain)."""
        who, data = await caller(request)
        return service.cancel(who, rec_id, str(data.get("reason") or ""))
