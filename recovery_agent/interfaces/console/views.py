"""The Recovery Console: server-rendered pages for the on-call engineer.

``GET /console`` shows the jobs, the recommendations still open or blocked,
and the nodes (suspect score, our drains); ``GET /console/job/{id}`` shows one
job's timeline on a time axis (Slurm and hook events, XIDs, detections with
their log lines, recommendations and every Slurm step) and its attempts. Each
section is also served alone under ``/console/part/...``; a few lines of
JavaScript fetch those every few seconds and swap them in, so the page stays
current without a reload. No build step, no external assets.

Every page and part is read as its caller, with the API's rules
(:mod:`recovery_agent.interfaces.service`): a user sees their own jobs and the
recommendations about them, gets 403 for another user's job, and sees the
nodes as everyone does (the cluster's, as in sinfo).
"""
from __future__ import annotations

import html
import time

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse

from .service import Caller, Service, ServiceError
from ..store import Status

REFRESH_MS = 5000
LANES = (("slurm", "Slurm / agent"), ("hooks", "node hooks"), ("detected", "detections"),
         ("decision", "decisions"), ("step", "Slurm steps"))
BAD = {"FAILED", "NODE_FAIL", "TIMEOUT", "OUT_OF_MEMORY", "BOOT_FAIL"}

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;background:#f6f7f9;color:#1c2330}
header{background:#1c2330;color:#fff;padding:10px 18px;display:flex;gap:18px;align-items:baseline}
header a{color:#9cc3ff;text-decoration:none} h1{font-size:18px;margin:0}
main{padding:12px 18px} section{background:#fff;border:1px solid #dde2ea;border-radius:6px;
margin:0 0 14px;padding:8px 12px} h2{font-size:15px;margin:4px 0 8px}
table{border-collapse:collapse;width:100%} th,td{text-align:left;padding:3px 8px;
border-bottom:1px solid #eef1f5;vertical-align:top;font-size:13px} th{color:#5b6678;font-weight:600}
.tag{display:inline-block;padding:0 6px;border-radius:9px;font-size:12px;background:#e8edf5}
.bad{background:#ffe1e1;color:#8a1010} .ok{background:#dff5e3;color:#14561f}
.warn{background:#fff1cc;color:#7a5300} .mono{font-family:ui-monospace,monospace;font-size:12px}
.muted{color:#7b8494} svg text{font-size:11px;fill:#5b6678}
"""
SCRIPT = """
async function refresh(){
  for (const el of document.querySelectorAll('[data-part]')) {
    try {
      const r = await fetch(el.dataset.part, {cache: 'no-store'});
      if (r.ok) { el.innerHTML = await r.text(); }
    } catch (e) { /* the agent restarts: try again next time */ }
  }
  const s = document.getElementById('stamp');
  if (s) s.textContent = new Date().toLocaleTimeString();
}
setInterval(refresh, %d);
""" % REFRESH_MS


def _e(value) -> str:
    return html.escape("" if value is None else str(value))


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def _state(state: str | None) -> str:
    kind = "bad" if state in BAD else ("ok" if state in ("RUNNING", "COMPLETED") else "")
    return f'<span class="tag {kind}">{_e(state or "-")}</span>'


def _status(status: str) -> str:
    kind = {"done": "ok", "failed": "bad", "blocked_by_budget": "bad", "expired": "warn",
            "released_by_watchdog": "warn", "would_have": ""}.get(status, "warn")
    return f'<span class="tag {kind}">{_e(status)}</span>'


def _page(title: str, body: str) -> str:
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{_e(title)}</title>"
            f"<style>{STYLE}</style></head><body><header><h1>slurm-recovery</h1>"
            f"<a href='/console'>jobs</a><span class='muted'>updated "
            f"<span id='stamp'>{time.strftime('%H:%M:%S')}</span></span></header>"
            f"<main>{body}</main><script>{SCRIPT}</script></body></html>")


class Console:
    def __init__(self, service: Service) -> None:
        self.service = service

    # -- the overview ---------------------------------------------------------
    def jobs_part(self, who: Caller | None = None) -> str:
        rows = []
        for job in self.service.jobs(limit=200, who=who):
            flags = []
            if job["restart_count"]:
                flags.append(f"requeued x{job['restart_count']}")
            if job.get("last_detection"):
                flags.append(job["last_detection"])
            rows.append(
                f"<tr><td><a href='/console/job/{_e(job['job_id'])}'>{_e(job['job_id'])}</a>"
                f"</td><td>{_e(job['name'])}</td><td>{_e(job['user'])}</td>"
                f"<td>{_state(job['state'])}</td><td>{_e(job['env'])}</td>"
                f"<td>{_e(job['effective_mode'])}</td><td>{(job['restart_count'] or 0) + 1}</td>"
                f"<td>{_e(job.get('last_detection') or '-')}</td>"
                f"<td>{' '.join(f'<span class=tag>{_e(f)}</span>' for f in flags)}</td>"
                f"<td>{_e(job.get('last_recommendation') or '-')}</td></tr>")
        return ("<h2>Jobs</h2><table><tr><th>job</th><th>name</th><th>user</th><th>state</th>"
                "<th>env</th><th>mode</th><th>attempts</th><th>last detection</th>"
                "<th>flags</th><th>last recommendation</th></tr>" + "".join(rows)
                + "</table>" + ("" if rows else "<p class='muted'>no tracked jobs yet</p>"))

    def recs_part(self, who: Caller | None = None) -> str:
        rows = [r for r in self.service.recs(limit=1000, who=who)
                if r.status.is_open or r.status == Status.BLOCKED_BY_BUDGET]
        body = "".join(
            f"<tr><td>#{r.id}</td><td>{_when(r.created)}</td>"
            f"<td><a href='/console/job/{_e(r.job_id)}'>{_e(r.job_id)}</a></td>"
            f"<td>{_e(r.action)}</td><td>{_e(','.join(r.target_nodes))}</td>"
            f"<td>{_e(r.mode)}</td><td>{_status(r.status)}</td>"
            f"<td>{_e(r.error or r.reason)}</td></tr>" for r in rows)
        return ("<h2>Pending and blocked recommendations</h2><table><tr><th>id</th>"
                "<th>created</th><th>job</th><th>action</th><th>nodes</th><th>mode</th>"
                "<th>status</th><th>why</th></tr>" + body + "</table>"
                + ("" if rows else "<p class='muted'>none</p>"))

    def nodes_part(self, who: Caller | None = None) -> str:
        """The same for every reader: no user's jobs in it."""
        drained = "<span class='tag bad'>drained by us</span>"
        rows = "".join(
            f"<tr><td>{_e(n['name'])}</td><td>{n['suspect_score']:.2f}</td>"
            f"<td>{drained if n.get('drained_by_us') else ''}</td>"
            f"<td class='mono'>{_e(n.get('drain_reason') or '')}</td>"
            f"<td>{'excluded' if n.get('excluded_by_operator') else ''}</td></tr>"
            for n in self.service.nodes())
        return ("<h2>Nodes</h2><table><tr><th>node</th><th>suspect score</th><th>drain</th>"
                "<th>reason</th><th>operator</th></tr>" + rows + "</table>")

    def overview(self, who: Caller | None = None) -> str:
        return _page("slurm-recovery console", "".join(
            f"<section id='{name}' data-part='/console/part/{name}'>{part(who)}</section>"
            for name, part in (("recommendations", self.recs_part), ("jobs", self.jobs_part),
                               ("nodes", self.nodes_part))))

    # -- one job ----------------------------------------------------------------
    @staticmethod
    def _lane(event: dict) -> str:
        kind = event["kind"]
        if kind == "step":
            return "step"
        if kind.startswith("hook_") or kind == "checkpoint":
            return "hooks" if kind.startswith("hook_") else "slurm"
        if kind in ("detected", "xid"):
            return "detected"
        if kind in ("verdict", "recommendation", "blocked_by_budget", "policy") \
                or kind.startswith("rec_"):
            return "decision"
        return "slurm"

    def timeline_part(self, job_id: str, who: Caller | None = None) -> str:
        events = self.service.timeline(job_id, who)
        detail = self.service.job(job_id, who)
        if not events:
            return "<h2>Timeline</h2><p class='muted'>no events yet</p>"
        start, end = events[0]["ts"], events[-1]["ts"]
        span = max(end - start, 1.0)
        width, left, lane_h = 1000, 120, 26
        height = lane_h * len(LANES) + 24
        colors = {"slurm": "#6b7a90", "hooks": "#3b82c4", "detected": "#d9822b",
                  "decision": "#7d4cc2", "step": "#1f9d55"}
        svg = [f"<svg id='axis' viewBox='0 0 {width + left + 20} {height}' width='100%'>"]
        for i, (lane, label) in enumerate(LANES):
            y = 12 + i * lane_h
            svg.append(f"<text x='0' y='{y + 4}'>{_e(label)}</text><line x1='{left}' "
                       f"x2='{left + width}' y1='{y}' y2='{y}' stroke='#e3e7ee'/>")
        for event in events:
            lane = self._lane(event)
            i = [name for name, _ in LANES].index(lane)
            x = left + (event["ts"] - start) / span * width
            svg.append(f"<circle class='ev ev-{lane}' cx='{x:.1f}' cy='{12 + i * lane_h}' "
                       f"r='5' fill='{colors[lane]}'><title>{_e(_when(event['ts']))} "
                       f"{_e(event['kind'])}: {_e(event['message'])}</title></circle>")
        svg.append(f"<text x='{left}' y='{height - 4}'>{_e(_when(start))}</text>"
                   f"<text x='{left + width - 120}' y='{height - 4}'>+{span:.1f} s</text>"
                   "</svg>")
        lines = {}
        for d in detail["detections"]:
            first = (d["evidence"].get("lines") or [{}])[0]
            lines.setdefault(d["pattern_id"], first.get("text", ""))
        rows = []
        for event in events:
            extra = ""
            if event["kind"] == "detected":
                rule = event["message"].split(" ", 1)[0]
                if lines.get(rule):
                    extra = f"<div class='mono muted'>{_e(lines[rule][:300])}</div>"
            attempt = "" if event["attempt"] is None else event["attempt"]
            rows.append(f"<tr class='row-{self._lane(event)}'><td class='mono'>"
                        f"{_e(time.strftime('%H:%M:%S', time.localtime(event['ts'])))}"
                        f".{int(event['ts'] % 1 * 1000):03d}</td><td>{_e(attempt)}</td>"
                        f"<td>{_e(event['kind'])}</td><td>{_e(event['message'])}{extra}</td>"
                        "</tr>")
        return ("<h2>Timeline</h2>" + "".join(svg) + "<table><tr><th>time</th><th>attempt</th>"
                "<th>what</th><th>detail</th></tr>" + "".join(rows) + "</table>")

    def job_page(self, job_id: str, who: Caller | None = None) -> str:
        detail = self.service.job(job_id, who)
        job = detail["job"]
        attempts = "".join(
            f"<tr><td>{a['attempt']}</td><td>{_state(a['state'])}</td>"
            f"<td>{_e(','.join(a['nodes']))}</td><td>{_when(a['start_time'])}</td>"
            f"<td class='mono'>{_e(a['ckpt_path'] or '-')}</td></tr>"
            for a in detail["attempts"])
        recs = "".join(
            f"<tr><td>#{r['id']}</td><td>{r['attempt']}</td><td>{_e(r['action'])}</td>"
            f"<td>{_e(','.join(r['exclude'] or r['target_nodes']))}</td>"
            f"<td>{_status(r['status'])}</td><td>{_e(r['mode'])}</td><td>{_e(r['reason'])}</td>"
            "</tr>" for r in detail["recommendations"])
        body = (f"<section><h2>Job {_e(job['job_id'])} {_e(job['name'])} "
                f"{_state(job['state'])}</h2><p>user {_e(job['user'])} · env "
                f"{_e(job['env'])} · mode {_e(job['effective_mode'])} · restarts "
                f"{job['restart_count']}</p><table><tr><th>attempt</th><th>state</th>"
                f"<th>nodes</th><th>started</th><th>newest checkpoint</th></tr>{attempts}"
                "</table></section>"
                f"<section><h2>Recommendations</h2><table><tr><th>id</th><th>attempt</th>"
                f"<th>action</th><th>nodes</th><th>status</th><th>mode</th><th>reason</th>"
                f"</tr>{recs}</table></section>"
                f"<section id='timeline' data-part='/console/part/job/{_e(job_id)}/timeline'>"
                f"{self.timeline_part(job_id, who)}</section>")
        return _page(f"job {job_id}", body)


def register(app: FastAPI, service: Service, readable) -> None:
    console = Console(service)

    def page(request: Request, render, *args) -> HTMLResponse:
        who = readable(request)
        try:
            return HTMLResponse(render(*args, who=who))
        except ServiceError as exc:     # 404 not tracked, 403 another user's job
            title = "not found" if exc.status == 404 else "not allowed"
            return HTMLResponse(_page(title, f"<section><p>{_e(exc)}</p></section>"),
                                status_code=exc.status)

    @app.get("/console", response_class=HTMLResponse, tags=["console"])
    def overview(request: Request) -> HTMLResponse:
        """The Recovery Console."""
        return page(request, console.overview)

    @app.get("/console/job/{job_id}", response_class=HTMLResponse, tags=["console"])
    def job_page(job_id: str, request: Request) -> HTMLResponse:
        return page(request, console.job_page, job_id)

    @app.get("/console/part/{name}", response_class=HTMLResponse, tags=["console"])
    def part(name: str, request: Request) -> HTMLResponse:
        parts = {"jobs": console.jobs_part, "recommendations": console.recs_part,
                 "nodes": console.nodes_part}
        if name not in parts:
            return HTMLResponse("unknown part", status_code=404)
        return page(request, parts[name])

    @app.get("/console/part/job/{job_id}/timeline", response_class=HTMLResponse,
             tags=["console"])
    def timeline_part(job_id: str, request: Request) -> HTMLResponse:
        return page(request, console.timeline_part, job_id)
