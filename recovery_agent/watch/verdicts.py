"""The verdicts: who is to blame for how an attempt ended, and what is done
about it. An ended attempt waits for its nodes' epilog reports (and the
external sources' last look) before attribution judges it; the decider then
acts on the verdict in the same transaction as its timeline line.

The queues of what the store refused to write live here: ended attempts whose
verdict waits in memory (``closing``, oldest dropped past
``MAX_PENDING_VERDICTS``) and hang/straggler decisions tried again while their
attempt runs. Reports that come after a verdict are counted as late evidence.
"""
from __future__ import annotations

import logging
from dataclasses import replace

from slurm_hooks import kmsg

from ..detect.attribution import attribute
from ..detect.context import AttributionContext, node_addresses
from ..detect.evidence import all_detections
from ..detect.model import Detection, Evidence, Verdict
from ..errors import RecoveryError, SchedulerError, StoreError
from ..decide.policy import STRIKE_WEIGHTS, confined, our_drain
from ..scheduler.base import Job
from ..store import STORE_ERRORS
from ..store import reports as report_rows
from .attempt import AttemptWatch

log = logging.getLogger("recovery_agent.watch")   # one logger for the loop, as before its split
# ended attempts whose verdict cannot be stored (a full or read-only store)
# wait in memory, oldest dropped past this many: nothing is acted on unstored
MAX_PENDING_VERDICTS = 5000
EPILOG_GRACE = 15.0  # how long a verdict waits for the nodes' epilog reports
XID_SLACK = 120.0    # node clocks may lag the controller's by this much
NODE_MAP_TTL = 300.0  # how long a listing of the nodes' addresses is reused
# ended so that more node evidence cannot change what is done (NODE_FAIL: Slurm
# blames the nodes; the others: policy acts on none of them)
NO_WAIT_STATES = frozenset({"NODE_FAIL", "COMPLETED", "CANCELLED", "PREEMPTED"})
QUIET_STATES = frozenset({"COMPLETED", "CANCELLED", "PREEMPTED"})   # policy acts on none
NHC_REASON = "NHC:"   # the drain reason LBNL NHC's helpers/node-mark-offline sets


def shows_run(job: Job, watch: AttemptWatch) -> bool:
    """Whether Slurm still shows the watched run: the same restart count, and
    not another run of that attempt (one Slurm started at another time: a
    pending listing shows no run)."""
    if job.restart_count != watch.attempt:
        return False
    listed = job.run_start
    return not (listed and watch.run_start and listed != watch.run_start)


class Verdicts:
    """The watcher's part that judges ended attempts (a part of
    :class:`~recovery_agent.watch.Watcher`, whose state it shares: ``closing``,
    the store, the decider and the attribution provider)."""

    def _await_verdict(self, watch: AttemptWatch, job: Job | None, now: float) -> None:
        """An ended attempt joins the queue of those to judge, with its grace
        for the epilog reports."""
        self.closing.append((watch, job, now + EPILOG_GRACE))

    def _needs_verdict(self, job_pk: int, attempt: int, run_start: int | None = None) -> bool:
        """Whether an attempt still waits for its verdict; with ``run_start``,
        the run of it that Slurm started then (slurmctld may run an attempt
        again at the same restart count: each run is judged on its own)."""
        judged = self._judged.get((job_pk, attempt), set())
        if judged and (run_start is None or run_start in judged or None in judged):
            return False
        if any(w.job_pk == job_pk and w.attempt == attempt
               and (run_start is None or w.run_start in (None, run_start))
               for w, _, _ in self.closing):
            return False
        runs = report_rows.verdict_runs(self.store, job_pk, attempt)
        if runs:
            self._judged.setdefault((job_pk, attempt), set()).update(runs)
        return not (runs and (run_start is None or run_start in runs or None in runs))

    def _judged_runs(self, job_pk: int, attempt: int, run_start: int | None) -> tuple[int, ...]:
        """The earlier runs of this attempt that have their verdict (their Slurm
        start times): empty for an attempt's first run."""
        if run_start is None:
            return ()
        self._needs_verdict(job_pk, attempt, run_start)   # the store's verdicts, once
        ended = {w.run_start for w, _, _ in self.closing
                 if w.job_pk == job_pk and w.attempt == attempt}   # verdicts on their way
        return tuple(sorted(r for r in self._judged.get((job_pk, attempt), set()) | ended
                            if r is not None and r != run_start))

    def _close_attempts(self, now: float) -> None:
        """Give each ended attempt its verdict once its node evidence is in (see
        :meth:`_evidence_in`); then count the fatal XIDs of reports that came
        after their attempt's verdict."""
        waiting, failed = [], None
        for watch, job, deadline in self.closing:
            if self._evidence_in(watch, job, deadline, now) \
                    and self._last_look(watch, job, deadline, now):
                try:
                    self._verdict(watch, job, now)
                except STORE_ERRORS as exc:   # kept in memory, judged next cycle
                    self._defer(exc)
                    waiting.append((watch, job, deadline))
                except Exception as exc:  # noqa: BLE001 - kept, and judged next cycle
                    failed = failed or exc
                    waiting.append((watch, job, deadline))
                else:
                    self._sources_done(watch)
            else:
                waiting.append((watch, job, deadline))
        if len(waiting) > MAX_PENDING_VERDICTS:
            dropped, waiting = waiting[:-MAX_PENDING_VERDICTS], waiting[-MAX_PENDING_VERDICTS:]
            for watch, _, _ in dropped:
                self._sources_done(watch)
            health = self.store.health
            health["dropped_verdicts"] = health.get("dropped_verdicts", 0) + len(dropped)
            log.error("store unwritable for long: dropped %d pending verdict(s), oldest "
                      "first (jobs %s); nothing was done to them", len(dropped),
                      ", ".join(w.job_id for w, _, _ in dropped[:10]))
        self.closing = waiting
        self.store.health["pending_verdicts"] = len(waiting)
        try:
            self._count_late_evidence(now)
        except STORE_ERRORS as exc:   # counted next cycle
            self._defer(exc)
        if failed is not None:
            raise failed

    def _evidence_in(self, watch: AttemptWatch, job: Job | None, deadline: float,
                     now: float) -> bool:
        """Whether an ended attempt may be judged now: every node's epilog
        report is in; or the grace is over and no node worth waiting for
        (:meth:`_awaited`) is missing; or ``agent.node_report_wait`` has passed
        since the attempt ended. The timeline says what is waited for, and when
        the verdict goes ahead without it."""
        epilogs = report_rows.nodes_reporting(self.store, watch.job_pk, watch.attempt,
                                              "epilog", watch.run_start, watch.earlier_runs)
        if set(watch.nodes) <= epilogs or len(epilogs) >= len(watch.nodes):
            return True
        if now < deadline:
            return False   # the grace: epilog reports normally come within it
        missing = self._awaited(watch, job, epilogs, now)
        if not missing:
            return True
        wait = self.cfg.agent.node_report_wait
        names = ", ".join(missing)
        if now >= deadline - EPILOG_GRACE + wait:
            self._note_once(watch, "node_report_missing",
                            f"deciding without the epilog report of {names}: none came "
                            f"within {wait:.0f}s of the job's end (agent.node_report_wait)",
                            missing)
            return True
        self._note_once(watch, "node_report_wait",
                        f"waiting up to {wait:.0f}s after the job's end for the epilog "
                        f"report of {names}: its prolog reported, so a report it had to "
                        "spool comes when the node replays its spool", missing)
        return False

    def _awaited(self, watch: AttemptWatch, job: Job | None, epilogs: set[str],
                 now: float) -> tuple[str, ...]:
        """The attempt's nodes whose epilog report is worth waiting for: those
        that sent this attempt's prolog report (their hooks work) and not yet
        their epilog's. None when waiting cannot change what is done: the job
        is gone, requeued already, ended NODE_FAIL (Slurm blames its nodes) or
        in a state policy never acts on; or the node reports in already blame a
        node by a fatal XID."""
        if self.cfg.agent.node_report_wait <= EPILOG_GRACE or job is None \
                or not shows_run(job, watch) or job.state in NO_WAIT_STATES:
            return ()
        prologs = report_rows.nodes_reporting(self.store, watch.job_pk, watch.attempt,
                                              "prolog", watch.run_start, watch.earlier_runs)
        missing = tuple(n for n in watch.nodes if n in prologs and n not in epilogs)
        if missing and self._node_blamed(watch, now):
            return ()
        return missing

    def _node_blamed(self, watch: AttemptWatch, now: float) -> bool:
        """Whether the hooks' reports already blame a node of the attempt by a
        root cause (a fatal XID that excludes the node)."""
        context = AttributionContext(nodes=tuple(watch.nodes),
                                     node_events=tuple(self._node_events(watch, now)))
        return any(d.host and d.role == "root" and d.action_hint == "requeue_exclude"
                   for d in all_detections([], context))

    def _note_once(self, watch: AttemptWatch, kind: str, message: str,
                   nodes: tuple[str, ...]) -> None:
        """One timeline line (and log line) per attempt and kind."""
        try:
            with self.store.transaction():
                if report_rows.has_event(self.store, watch.job_pk, watch.attempt, kind):
                    return
                self.store.add_event(watch.job_pk, kind, message, attempt=watch.attempt,
                                     source="watch", data={"nodes": list(nodes)})
        except STORE_ERRORS as exc:   # the wait goes on; the line is tried again
            self._defer(exc)
            return
        log.info("job=%s attempt=%s %s", watch.job_id, watch.attempt, message)

    def _last_look(self, watch: AttemptWatch, job: Job | None, deadline: float,
                   now: float) -> bool:
        """The sources' view of an ended attempt's last moments, stored before
        its verdict; False while they may not hold them yet (bounded: see
        :meth:`SourceFeed.settled`)."""
        if self.sources is None:
            return True
        ended = (float(job.end_time) if job is not None and job.is_finished and job.end_time
                 else deadline - EPILOG_GRACE)
        found = self.sources.last_look(watch, ended, now)
        if found is None:
            return False
        self._store(watch, found, now)
        self.sources.save()
        self.store.health["sources"] = self.sources.counters()
        return True

    def _sources_done(self, watch: AttemptWatch) -> None:
        if self.sources is not None:
            self.sources.done(watch, any(w.job_id == watch.job_id
                                         for w in self.watches.values()))

    def _verdict(self, watch: AttemptWatch, job: Job | None, now: float) -> None:
        """Who is to blame for how this attempt ended, recorded on the timeline,
        and (with a decider) what to do about it, in the same transaction."""
        if watch.unstored:
            self._store(watch, [], now)
            if watch.unstored:   # still refused: the verdict waits with them
                raise self._deferred or StoreError("store refused detections")
        node_fail = tuple(watch.nodes) if job is not None and job.state == "NODE_FAIL" else ()
        node_events = self._node_events(watch, now) + self._reason_events(watch, job, now)
        context = watch.layout.context(nodes=tuple(watch.nodes),
                                       node_events=tuple(node_events),
                                       node_fail=node_fail, addresses=self._addresses(now))
        verdict = attribute(watch.found, context)
        consulted = None
        if self.provider is not None:
            consulted = self.provider.consult(watch.job_id, watch.attempt, watch.nodes,
                                              job.state if job else None,
                                              all_detections(watch.found, context), verdict)
            verdict = consulted.verdict
        verdict = confined(verdict, watch.nodes)   # as the decision will see it
        data = {"blame": verdict.blame, "category": verdict.category,
                "action": verdict.action, "nodes": list(verdict.nodes),
                "gpus": list(verdict.gpus), "confidence": verdict.confidence,
                "reason": verdict.reason, "state": job.state if job else None,
                "run_start": watch.run_start}
        if consulted is not None:
            data["provider"] = {"name": consulted.provider, "outcome": consulted.outcome}
        event = {"kind": "verdict",
                 "message": f"{verdict.blame}: {verdict.category or 'no failure'} -> "
                            f"{verdict.action}"
                            + (f" ({', '.join(verdict.nodes)})" if verdict.nodes else ""),
                 "attempt": watch.attempt, "source": "attribution", "data": data}
        log.info("job=%s attempt=%s verdict blame=%s action=%s nodes=%s", watch.job_id,
                 watch.attempt, verdict.blame, verdict.action, ",".join(verdict.nodes))
        # decide only while Slurm still shows this run: one requeued by someone
        # else, run again by slurmctld, or gone is recorded, not acted on
        if self.decider is not None and job is not None and shows_run(job, watch):
            self._decide(watch, job, verdict, "ended", all_detections(watch.found, context),
                         event)
        else:
            with self.store.lock:
                self.store.add_event(watch.job_pk, **event)
        # recorded: this run is never judged again
        self._judged.setdefault((watch.job_pk, watch.attempt), set()).add(watch.run_start)

    def _decide(self, watch: AttemptWatch, job: Job | None, verdict: Verdict, trigger: str,
                detections: list[Detection], event: dict | None = None) -> None:
        seen = list(watch.found_at) + [None] * (len(detections) - len(watch.found_at))
        try:
            self.decider.decide_attempt(watch.job_pk, watch.attempt, watch.spec, verdict,
                                        trigger=trigger, job=job, nodes=tuple(watch.nodes),
                                        detections=detections, seen_at=seen,
                                        started=watch.started, verdict_event=event,
                                        run_start=watch.run_start)
        except STORE_ERRORS:
            if trigger == "ended":
                raise    # the ended attempt stays pending in self.closing
            # a hang or straggler decision waits in memory for the store
            self._pending_decisions[(watch.job_pk, watch.attempt)] = (verdict, trigger,
                                                                      detections)
            raise
        except RecoveryError as exc:
            log.error("job=%s attempt=%s no decision: %s", watch.job_id, watch.attempt, exc)
            if event:
                with self.store.lock:
                    self.store.add_event(watch.job_pk, **event)

    def _retry_decisions(self, listing: dict[str, Job]) -> None:
        """Hang and straggler decisions the store refused, tried again while
        their attempt still runs (once it ends, its own verdict decides)."""
        for key, (verdict, trigger, detections) in list(self._pending_decisions.items()):
            watch = self.watches.get(key[0])
            job = listing.get(watch.job_id) if watch is not None else None
            if watch is None or watch.attempt != key[1] or job is None \
                    or job.state != "RUNNING" or job.restart_count != key[1]:
                del self._pending_decisions[key]
                continue
            try:
                self._decide(watch, job, verdict, trigger, detections)
            except STORE_ERRORS as exc:
                self._defer(exc)
                return
            self._pending_decisions.pop(key, None)

    def _addresses(self, now: float) -> dict[str, str]:
        """Address -> node from Slurm's node records (``NodeAddr``,
        ``NodeHostname``), so that an NCCL peer's IP address or a node's FQDN
        in a log names the node. Listed when a verdict needs it, at most every
        ``NODE_MAP_TTL`` seconds, or taken from the node state poll's listing
        when that is newer; while the listing fails the last map stays
        (addresses seldom change, and a name outside the job's nodes counts
        for nothing whatever it maps to)."""
        listed_at, known = self._node_map
        polled = self.node_states.listing     # the node state poll's, when newer
        if polled is not None and polled[0] > listed_at:
            listed_at, known = polled[0], node_addresses(
                (n.name, n.address, n.hostname) for n in polled[1])
            self._node_map = (listed_at, known)
        if now - listed_at < NODE_MAP_TTL:
            return known
        try:
            nodes = self.scheduler.list_nodes()
        except SchedulerError as exc:
            log.warning("cannot list nodes for their addresses: %s", exc)
            self._node_map = (now, known)
            return known
        known = node_addresses((n.name, n.address, n.hostname) for n in nodes)
        self._node_map = (now, known)
        return known

    def _node_events(self, watch: AttemptWatch, now: float) -> list[Detection]:
        """Fatal XIDs the node hooks reported for this attempt."""
        events = []
        rows = self.store.attempt_xids(watch.job_pk, watch.attempt)
        # a run again at the same restart count: only its own reports' XIDs
        mine = report_rows.run_reports(self.store, watch.job_pk, watch.attempt,
                                       watch.run_start, watch.earlier_runs)
        for row in rows:
            event = {"xid": row["xid"], "kind": row["kind"], "message": row["message"]}
            if not kmsg.is_fatal(event) or (mine is not None and row["report"] not in mine):
                continue
            if row["time"] and row["time"] < watch.started - XID_SLACK:
                continue   # logged before this attempt began (an old fault, preflight's job)
            events.append(Detection(
                rule=f"node.{row['kind']}", category="gpu_hardware", severity="critical",
                host=row["node"], pci=row["pci"], xid=row["xid"], origin="system",
                emitter="system",
                gpu=str(row["gpu_index"]) if row["gpu_index"] is not None else None,
                evidence=(Evidence(row["raw"], f"hook:{row['node']}", None, row["time"]),)))
        return events

    def _reason_events(self, watch: AttemptWatch, job: Job | None,
                       now: float) -> list[Detection]:
        """What Slurm says of the attempt's nodes that were drained or taken down
        while it ran: the reason of each, read by the packs as a node's own line
        (the site's health check, ``NHC: check_...: ...``, or slurmctld's own
        reasons). Only an admin or Slurm sets a node's reason, never a job, so
        it is node evidence against that node. Left out: a reason with no time
        or set before the attempt began, our own drains, and everything when
        the nodes cannot be listed now (an unseen state proves nothing)."""
        if job is not None and job.state in QUIET_STATES:
            return []      # nothing failed: no evidence is wanted
        # Slurm's end time, to the second (a COMPLETING job has it too); not
        # known, only a listing of this very cycle is after the end
        ended = now
        if job is not None and job.end_time and (job.is_finished or job.state == "COMPLETING"):
            ended = min(now, float(job.end_time) + 1.0)
        nodes = self._nodes_now(now, ended)
        if not nodes:
            return []
        mine = set(watch.nodes)
        events: list[Detection] = []
        for node in nodes:
            if node.name not in mine or not node.reason or not (
                    node.drained or node.state.upper() == "DOWN"):
                continue
            if node.reason_time is None or node.reason_time < watch.started - XID_SLACK:
                continue   # no time, or older than the attempt: not what ended it
            if our_drain(self.store.node(node.name), node):
                continue   # our own verdict of an earlier failure
            source = f"slurm:{node.name}"
            if node.reason.startswith(NHC_REASON):
                found = self._nhc_check(node.reason, source)
            else:
                stream = self.scanner.stream(source, origin="system")
                found = stream.feed(node.reason, 1) + stream.flush()
            evidence = (Evidence(f"{node.name} reason: {node.reason}"[:2048], source, None,
                                 float(node.reason_time)),)
            events += [replace(d, host=node.name, origin="system", evidence=evidence)
                       for d in found if d.severity != "info"]
        return events

    def _nhc_check(self, reason: str, source: str) -> list[Detection]:
        """NHC's drain reason read for its check alone. NHC's message may quote
        what a user chose (a process, a file or user name): only NHC's own
        words at the start count, never a line spelled inside them."""
        rules = sorted((r for r in self.scanner.rules if r.id.startswith("nhc.")),
                       key=lambda r: -r.priority)
        for rule in rules:
            match = rule.compiled.match(reason)
            if match is not None:
                return [self.scanner.detection(rule, match, reason, 1, source)]
        return []

    def _nodes_now(self, now: float, ended: float) -> list:
        """The nodes as Slurm lists them after the attempt ended (at ``ended``):
        the newest listing (the node state poll's, or an earlier verdict's) when
        it is that recent, else one listing now; empty when Slurm does not
        answer."""
        polled = self.node_states.listing
        if polled is not None and polled[0] >= ended:
            return list(polled[1])
        try:
            nodes = list(self.scheduler.list_nodes())
        except SchedulerError as exc:
            log.warning("cannot list nodes for their drain reasons: %s", exc)
            return []
        if nodes:      # the newest listing, for the addresses and the next verdicts
            self.node_states.listing = (now, nodes)
        return nodes

    def _count_late_evidence(self, now: float) -> None:
        """Reports stored after their attempt's verdict: fatal XIDs they carry
        from inside the attempt count against their node, once (a strike in its
        lemon score, with a decider: drains and exclusions follow from strikes
        by policy), and go on the timeline. The verdict itself stands."""
        for row in report_rows.uncounted_after_verdict(self.store):
            fatal = self._late_fatal(row)
            with self.store.transaction():
                if fatal:
                    self._late_strike(row, fatal)
                report_rows.mark_counted(self.store, row["id"], now)

    def _late_fatal(self, row: dict) -> list[int]:
        """The fatal XIDs of a stored report logged during its attempt (its own
        run of it, where the report names the run)."""
        started = row.get("run_start") or report_rows.attempt_start(self.store, row["job"],
                                                                     row["attempt"])
        found = []
        for x in report_rows.report_xids(self.store, row["id"]):
            if not kmsg.is_fatal({k: x[k] for k in ("xid", "kind", "message")}):
                continue
            if started and x["time"] and x["time"] < started - XID_SLACK:
                continue   # older than the attempt: not this job's fault
            if x["xid"] not in found:
                found.append(x["xid"])
        return found

    def _late_strike(self, row: dict, fatal: list[int]) -> None:
        node, job_pk, attempt = row["node"], row["job"], row["attempt"]
        job = self.store.job(job_pk) or {}
        xids = ", ".join(map(str, fatal))
        if node in report_rows.verdict_nodes(self.store, job_pk, attempt):
            counted = f"the verdict blamed {node} already"
        elif self.decider is not None:
            self.store.add_strike(node, "gpu_hardware", STRIKE_WEIGHTS["gpu_hardware"],
                                  job_pk, job.get("user") or "", witnessed=True)
            counted = f"counted against {node} (a gpu_hardware strike)"
        else:
            counted = "recorded"
        message = (f"fatal XID {xids} in {node}'s {row['hook']} report, which came after "
                   f"this attempt's verdict: {counted}; the verdict stands")
        self.store.add_event(job_pk, "late_evidence", message, attempt=attempt,
                             source="watch", data={"node": node, "xids": fatal,
                                                   "report": row["report_id"]})
        log.warning("job=%s attempt=%s %s", job.get("job_id"), attempt, message)
