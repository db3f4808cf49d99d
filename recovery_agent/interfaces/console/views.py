"""The Console's pages: what each shows, gathered through the service (and
the store's named queries), rendered with the package's Jinja2 templates.

Every page and part is read as its caller, with the API's rules
(:mod:`recovery_agent.interfaces.service`): a user sees their own jobs and the
recommendations about them, gets 403 for another user's job, and sees the
nodes as everyone does (the cluster's, as in sinfo) but, on a node's page, not
which of other users' jobs ran there or met trouble there.
"""
from __future__ import annotations

import time
from urllib.parse import urlencode

from jinja2 import Environment, PackageLoader

from . import charts, timeline
from ..ledger import window_time
from ..service import Caller, NotFound, Service, sees_all
from ...store import STORE_ERRORS, Status

REFRESH_MS = 5000
PAGE = 100          # jobs per page of the list, unless ?limit= says otherwise
MAX_PAGE = 500
CHANGES = 50                  # operator changes on the overview, the newest
CHANGES_WINDOW = 30 * 86400   # ... of the last 30 days
FILTERS = ("state", "env", "user", "node", "category", "q")
WINDOWS = ("7d", "30d", "90d", "365d")   # the goodput page's choices
WORST_NODES = 10
LIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED",
        "REQUEUE_HOLD", "RESIZING", "STAGE_OUT", "SIGNALING"}
BAD = {"FAILED", "NODE_FAIL", "TIMEOUT", "OUT_OF_MEMORY", "BOOT_FAIL"}
STATUS_TAGS = {"done": "ok", "failed": "bad", "blocked_by_budget": "bad", "expired": "warn",
               "released_by_watchdog": "warn", "would_have": "", "cancelled": ""}


def when(ts: float | None, ms: bool = False) -> str:
    """A time as the Console prints it: ISO 8601, local, to the second (and
    the millisecond where steps follow each other closely)."""
    if not ts:
        return "-"
    text = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(ts))
    return f"{text}.{int(ts % 1 * 1000):03d}" if ms else text


def finished(state: str | None) -> bool:
    """Has an attempt in this state ended? (A running one's end time is
    Slurm's estimate from its time limit, not an end.)"""
    return bool(state) and state not in LIVE


def state_tag(state: str | None) -> str:
    return "bad" if state in BAD else ("ok" if state in ("RUNNING", "COMPLETED") else "")


def _environment() -> Environment:
    env = Environment(loader=PackageLoader("recovery_agent.interfaces.console", "templates"),
                      autoescape=True, trim_blocks=True,
                      lstrip_blocks=True)
    env.filters.update(when=when, state_tag=state_tag, finished=finished, seconds=_duration,
                       gpu_hours=_gpu_hours,
                       status_tag=lambda s: STATUS_TAGS.get(str(s), "warn"))
    env.globals.update(refresh_ms=REFRESH_MS, lanes=timeline.LANES)
    return env


def agent_health(service: Service, now: float) -> dict:
    """How the agent fares, as /healthz tells it: the watch loop's last cycle
    (its heartbeat) and whether the store answers."""
    store = service.store
    try:
        beat = store.get_state("heartbeat") or {}
    except STORE_ERRORS as exc:
        return {"ok": False, "watching": False, "age": None, "cycles": None,
                "store": "failing", "error": str(exc)}
    age = now - beat["time"] if beat.get("time") else None
    watching = age is not None and age < max(30.0, 10 * service.cfg.agent.poll_interval)
    damaged = store.health.get("damaged")
    failing = damaged or store.health.get("error")
    return {"ok": bool(watching and not failing), "watching": watching, "age": age,
            "cycles": beat.get("cycles"), "error": failing or None,
            "store": "damaged" if damaged else "failing" if failing else "ok"}


def job_commands(job: dict, recs: list[dict], who: Caller | None) -> list[dict]:
    """The ``recovery-ctl`` commands an admin (or the job's owner) would run
    next on this job: look at it, and claim or withdraw what is still open."""
    admin = who is None or who.admin
    out = [{"cmd": f"recovery-ctl show job {job['job_id']}", "why": "the job as text"},
           {"cmd": f"recovery-ctl audit --job {job['job_id']}",
            "why": "every recommendation with its evidence and steps"}]
    for rec in recs:
        status, mine = rec["status"], rec.get("scope", "job") == "job"
        if status == Status.PROPOSED.value and rec["mode"] == "external" and admin:
            out.append({"cmd": f"recovery-ctl ack {rec['id']}",
                        "why": f"claim #{rec['id']} ({rec['action']}) to carry it out"})
        if status in (Status.PROPOSED.value, Status.EXECUTING.value) and (admin or mine):
            out.append({"cmd": f"recovery-ctl cancel {rec['id']} --reason \"...\"",
                        "why": f"withdraw #{rec['id']} ({rec['action']}) before it acts"})
    if admin:
        for node in sorted({n for r in recs for n in (r.get("exclude") or [])}):
            out.append({"cmd": f"recovery-ctl show node {node}",
                        "why": f"why {node} was left out"})
    return out


def node_commands(node: dict, who: Caller | None) -> list[dict]:
    name = node["name"]
    out = [{"cmd": f"recovery-ctl show node {name}", "why": "the node as text"}]
    if who is None or who.admin:
        if node.get("excluded_by_operator"):
            out.append({"cmd": f"recovery-ctl include {name}",
                        "why": "let retries use it again"})
        else:
            out.append({"cmd": f"recovery-ctl exclude {name} --reason \"...\"",
                        "why": "keep every tracked job's retries off it"})
    return out


def _masked(row: dict, who: Caller | None, user_key: str = "user",
            job_keys: tuple[str, ...] = ("job_id",)) -> dict:
    """``row`` as ``who`` may see it: when it came from another user's job,
    that job's id and user blanked, as the service does for a node's strikes
    (a row of no job, a node's own health check, is nobody's)."""
    if sees_all(who) or row.get("job") is None or (row.get(user_key) or "") == who.name:
        return row
    return {**row, user_key: None, **{k: None for k in job_keys}}


class Console:
    def __init__(self, service: Service, clock=time.time) -> None:
        self.service, self.clock = service, clock
        self.templates = _environment()

    @property
    def cluster(self) -> str:
        return self.service.cfg.agent.cluster

    def render(self, name: str, **values) -> str:
        return self.templates.get_template(name).render(**values)

    def page(self, name: str, title: str, **values) -> str:
        now = self.clock()
        return self.render(name, title=title, now=now,
                           banner={"environments": self.service.environments(),
                                   "health": agent_health(self.service, now)}, **values)

    def error_page(self, status: int, message: str) -> str:
        return self.page("error.html", "not found" if status == 404 else "not allowed",
                         status=status, message=message)

    # -- the overview ---------------------------------------------------------
    def filters(self, args: dict, who: Caller | None) -> dict:
        """The job list's filters from the query string (empty ones dropped; a
        user's list is always their own, whatever ``user`` says)."""
        chosen = {k: str(args.get(k) or "").strip() for k in FILTERS}
        chosen = {k: v for k, v in chosen.items() if v}
        if not sees_all(who):
            chosen.pop("user", None)
        return chosen

    @staticmethod
    def _number(value, default: int | None, top: int | None = None) -> int | None:
        try:
            number = int(value)
        except (TypeError, ValueError):
            return default
        if number < 1:
            return default
        return min(number, top) if top else number

    def _paging(self, args: dict) -> tuple[int, int | None]:
        return (self._number(args.get("limit"), PAGE, MAX_PAGE),
                self._number(args.get("before"), None))

    def jobs_part(self, who: Caller | None = None, args: dict | None = None) -> str:
        """One page of the job list, newest first, as filtered by ``args``;
        links to the older page (``before=`` the last row's id) and back to
        the newest keep the filters."""
        args = args or {}
        chosen = self.filters(args, who)
        limit, before = self._paging(args)
        user = chosen.get("user") if sees_all(who) else who.name
        store = self.service.store
        rows = store.search_jobs(self.cluster, state=chosen.get("state"), user=user,
                                 env=chosen.get("env"), node=chosen.get("node"),
                                 category=chosen.get("category"), text=chosen.get("q"),
                                 limit=limit + 1, before=before)
        more = len(rows) > limit
        rows = rows[:limit]
        jobs = []
        for row in rows:
            recs = [r for r in store.recommendations(job_pk=row["id"]) if r.scope == "job"]
            attempts = store.attempts(row["id"])
            jobs.append({**row, "effective_mode": self.service.effective_mode(row),
                         "attempts": (row["restart_count"] or 0) + 1,
                         "nodes": attempts[-1]["nodes"] if attempts else [],
                         "last_recommendation": (f"{recs[-1].action} {recs[-1].status}"
                                                 if recs else None)})
        keep = {**chosen, **({"limit": limit} if limit != PAGE else {})}
        return self.render(
            "jobs.html", jobs=jobs, chosen=chosen,
            older=f"/console?{urlencode({**keep, 'before': rows[-1]['id']})}" if more else None,
            newest=f"/console?{urlencode(keep)}" if before else None)

    def jobs_part_url(self, who: Caller | None, args: dict) -> str:
        """Where the script refreshes this list from: the same filters and page."""
        limit, before = self._paging(args)
        keep = {**self.filters(args, who), **({"limit": limit} if limit != PAGE else {}),
                **({"before": before} if before else {})}
        return "/console/part/jobs" + (f"?{urlencode(keep)}" if keep else "")

    def recs_part(self, who: Caller | None = None) -> str:
        rows = [r for r in self.service.recs(limit=1000, who=who)
                if r.status.is_open or r.status == Status.BLOCKED_BY_BUDGET]
        return self.render("recs.html", recs=rows)

    def changes_part(self, who: Caller | None = None) -> str:
        """The newest operator changes (the audit trail's), newest first: an
        admin's every one, a user's those made to their own jobs'
        recommendations."""
        rows = self.service.changes(since=self.clock() - CHANGES_WINDOW, who=who,
                                    limit=CHANGES)
        return self.render("changes.html", changes=rows[::-1])

    def nodes_part(self, who: Caller | None = None) -> str:
        """The same for every reader: no user's jobs in it."""
        return self.render("nodes.html", nodes=self.service.nodes())

    def overview(self, who: Caller | None = None, args: dict | None = None) -> str:
        args = args or {}
        facets = self.service.store.job_facets(
            self.cluster, user=None if sees_all(who) else who.name)
        if not sees_all(who):
            facets["user"] = []      # a user's list is their own: nothing to choose
        nodes = self.service.nodes()
        return self.page("overview.html", "slurm-recovery console",
                         jobs=self.jobs_part(who, args), recs=self.recs_part(who),
                         changes=self.changes_part(who),
                         nodes=self.render("nodes.html", nodes=nodes),
                         jobs_part=self.jobs_part_url(who, args),
                         chosen=self.filters(args, who), facets=facets,
                         node_names=[n["name"] for n in nodes])

    # -- one job ----------------------------------------------------------------
    def timeline_part(self, job_id: str, who: Caller | None = None) -> str:
        events = self.service.timeline(job_id, who)
        detail = self.service.job(job_id, who)
        drawn = timeline.layout(events, detail["detections"], detail["attempts"])
        return self.render("timeline.html", t=drawn)

    def job_page(self, job_id: str, who: Caller | None = None) -> str:
        detail = self.service.job(job_id, who)
        recs = detail["recommendations"]
        return self.page("job.html", f"job {job_id}", job=detail["job"],
                         attempts=detail["attempts"], recs=recs,
                         commands=job_commands(detail["job"], recs, who),
                         timeline=self.timeline_part(job_id, who))

    # -- one node ---------------------------------------------------------------
    def _job_id(self, job_pk: int | None) -> str | None:
        """The Slurm job id of a job row (None for none, or one gone)."""
        if job_pk is None:
            return None
        try:
            return self.service.store.job(job_pk)["job_id"]
        except STORE_ERRORS:
            return None

    def node_page(self, name: str, who: Caller | None = None) -> str:
        """A node: its state with us, XIDs, strikes, drains and exclusions with
        who and why, and the jobs that ran there (a user's own, and a count of
        the others)."""
        store = self.service.store
        # another user's XID keeps its number and message, not its kernel line
        # (which names their process) nor their job
        xids = [_masked(x, who, job_keys=("job_id", "raw")) for x in store.node_xids(name)]
        ran = store.node_jobs(self.cluster, name)
        try:
            node = self.service.node(name, who)
        except NotFound:
            if not xids and not ran:
                raise
            node = {"name": name, "strikes": [], "suspect_score": 0.0}
        strikes = [{**s, "job_id": self._job_id(s["job"])} for s in node.get("strikes") or []]
        drains = [_masked(r.to_dict(), who) for r in store.node_drains(name)]
        operator = store.node_operator_events(name)
        mine = ran if sees_all(who) else [r for r in ran if (r["user"] or "") == who.name]
        return self.page("node.html", f"node {name}", node=node, xids=xids,
                         strikes=strikes, drains=drains, operator=operator,
                         jobs=mine, others=len(ran) - len(mine),
                         commands=node_commands(node, who))

    # -- the goodput ledger -----------------------------------------------------
    def goodput_page(self, who: Caller | None = None, args: dict | None = None) -> str:
        """The goodput ledger over a window (``?since=``, one of WINDOWS or any
        duration back; 30d by default): lost GPU-hours by category over time,
        MTTR, ETTR per environment, the worst nodes, node blame and stops. A
        user's page covers their own jobs."""
        args = args or {}
        now = self.clock()
        chosen = str(args.get("since") or "30d").strip()
        try:
            since = window_time(chosen, now, "since")
        except ValueError:
            since = None
        if since is None or since >= now:
            chosen, since = "30d", now - 30 * 86400
        led = self.service.goodput_overview(since, now, who)
        return self.page("goodput.html", "goodput", led=led, chosen=chosen, windows=WINDOWS,
                         mine=not sees_all(who), **goodput_charts(led))


def _gpu_hours(value: float | None) -> str:
    """GPU-hours as the page prints them: two decimals, three figures below 1."""
    if value is None:
        return "unknown"
    return f"{value:.2f}" if abs(value) >= 1 or value == 0 else f"{value:.3g}"


def _hours(value: float | None) -> str:
    return "unknown" if value is None else f"{_gpu_hours(value)} GPU-h"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def goodput_charts(led: dict) -> dict:
    """The page's charts and tables from one overview (:func:`charts`)."""
    cats = sorted(led["category"].items(), key=lambda kv: -kv[1]["incidents"])
    mttr = charts.bars([(cat, g["mttr_median_s"],
                         f"median {_duration(g['mttr_median_s'])}, p95 "
                         f"{_duration(g['mttr_p95_s'])} ({g['recovered']} recovered)"
                         if g["recovered"] else "no recovered incident")
                        for cat, g in cats])
    ettr = charts.bars([(env, g["ettr"],
                         ("unknown" if g["ettr"] is None else f"{g['ettr'] * 100:.1f} %")
                         + f" ({g['ettr_jobs']} jobs"
                         + (f", {g['ettr_unknown_jobs']} unknown)" if g["ettr_unknown_jobs"]
                            else ")"))
                        for env, g in sorted(led["env"].items())], top=1.0)
    verdicts: dict[str, dict] = {}
    for check in led["blame"]["detail"]:
        mine = verdicts.setdefault(check["node"], {"confirmed": 0, "cleared": 0,
                                                   "no_evidence": 0})
        mine[check["verdict"]] += 1
    ranked = sorted(((node, g) for node, g in led["node"].items() if node != "-"),
                    key=lambda kv: (-kv[1]["gpu_hours_lost"], -kv[1]["incidents"], kv[0]))
    worst = [{"node": node, **g, "blame": verdicts.get(node)}
             for node, g in ranked[:WORST_NODES]]
    worst_bars = charts.bars([(w["node"], w["gpu_hours_lost"], _hours(w["gpu_hours_lost"])
                               + f" ({w['incidents']} incident{'' if w['incidents'] == 1 else 's'})")
                              for w in worst])
    return {"lost": charts.lost_over_time(led["incidents"], led["since"], led["until"]),
            "mttr": mttr, "ettr": ettr, "worst": worst, "worst_bars": worst_bars}
