"""The Recovery Console: server-rendered pages for the on-call engineer.

``GET /console`` shows a banner (each environment's mode, the agent's health),
the recommendations still open or blocked, the jobs (filtered by state,
environment, user, node and category, searched by id, name or user, paged
with ``?before=``), the nodes and the operators' latest changes (who, what,
before and after, why: the audit trail's); ``GET /console/job/{id}`` one job: its
attempts with their output files, its recommendations, the ``recovery-ctl``
commands to run next, and its timeline in labelled lanes, attempt by attempt,
each detection beside its own evidence line; ``GET /console/node/{name}`` one
node: its XIDs, strikes, drains and exclusions with who and why, and the jobs
that ran there; ``GET /console/goodput`` the goodput ledger over a window
(``?since=30d``): lost GPU-hours by category over time, MTTR, ETTR per
environment and the worst nodes, drawn on the server as inline SVG
(:mod:`.charts`), with node blame, stops and every incident. Each live section is also served alone under
``/console/part/...``; a small script fetches those every few seconds and
swaps them in, so a page stays current without a reload (without the script
a page is complete, only not refreshed). Templates are Jinja2, shipped in the
package (``templates/``); no build step, no external assets.

The access rules are the API's (:mod:`.views`, :mod:`recovery_agent.interfaces.service`).
"""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse

from .views import Console
from ..service import Service, ServiceError

__all__ = ["Console", "register"]


def register(app: FastAPI, service: Service, readable) -> None:
    console = Console(service)

    def page(request: Request, render, *args, **kwargs) -> HTMLResponse:
        who = readable(request)
        try:
            return HTMLResponse(render(*args, who=who, **kwargs))
        except ServiceError as exc:     # 404 not tracked, 403 another user's job
            return HTMLResponse(console.error_page(exc.status, str(exc)),
                                status_code=exc.status)

    def query(request: Request) -> dict:
        return dict(request.query_params)

    @app.get("/console", response_class=HTMLResponse, tags=["console"])
    def overview(request: Request) -> HTMLResponse:
        """The Recovery Console."""
        return page(request, console.overview, args=query(request))

    @app.get("/console/job/{job_id}", response_class=HTMLResponse, tags=["console"])
    def job_page(job_id: str, request: Request) -> HTMLResponse:
        return page(request, console.job_page, job_id)

    @app.get("/console/goodput", response_class=HTMLResponse, tags=["console"])
    def goodput_page(request: Request) -> HTMLResponse:
        """The goodput ledger: lost GPU-hours by category over time, MTTR, ETTR
        per environment, the worst nodes, node blame and stops (?since=30d)."""
        return page(request, console.goodput_page, args=query(request))

    # an HTML page for people, not part of the API: kept out of the OpenAPI document
    @app.get("/console/node/{name}", response_class=HTMLResponse, include_in_schema=False)
    def node_page(name: str, request: Request) -> HTMLResponse:
        return page(request, console.node_page, name)

    @app.get("/console/part/{name}", response_class=HTMLResponse, tags=["console"])
    def part(name: str, request: Request) -> HTMLResponse:
        if name == "jobs":
            return page(request, console.jobs_part, args=query(request))
        parts = {"recommendations": console.recs_part, "nodes": console.nodes_part,
                 "changes": console.changes_part}
        if name not in parts:
            return HTMLResponse("unknown part", status_code=404)
        return page(request, parts[name])

    @app.get("/console/part/job/{job_id}/timeline", response_class=HTMLResponse,
             tags=["console"])
    def timeline_part(job_id: str, request: Request) -> HTMLResponse:
        return page(request, console.timeline_part, job_id)
