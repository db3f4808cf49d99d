"""Policy: from a verdict and a job's history to a decision. Pure functions, no I/O.

The default table is DESIGN.md's; every limit comes from the job's environment
(``[environments.NAME]``) or the cluster-wide ``[policy]`` section:

==========================================  ==========================================
evidence                                    decision
==========================================  ==========================================
the job completed, or a human cancelled it  nothing
the work had finished before the failure    nothing (a timeout in the teardown)
application error (exception, bad config)   ``stop``: retrying cannot help
full disk or quota                          ``stop``
a CUDA error or segfault that follows the   ``stop``: it is the code
job onto fresh nodes
retry budget (``max-restarts``) spent       ``stop``
no new checkpoint over the last K attempts  ``stop``
GPU hardware on a node                      ``requeue_exclude`` it, and drain it
interconnect error naming a host            ``requeue_exclude`` it; drain after K strikes
other failure naming a node, or a CUDA      ``requeue_exclude`` it
error or segfault staying with one node,
or a suspect named by two attempts
hang / NCCL timeout naming no node          ``kill_requeue`` (``requeue`` once ended)
straggler                                   ``kill_requeue`` without the slow host, only
                                            where ``straggler_action`` allows it
unexplained failure (symptoms and exit      ``requeue``, up to ``unknown_max_restarts``
reports alone), or no evidence at all
==========================================  ==========================================

The earlier attempts come in ``History.previous`` (where each ran, what its
verdict was) and are read with :func:`~.detect.attempts.across_attempts`
before the table. Every requeue also excludes what earlier attempts excluded,
the lemon nodes and the nodes an operator excluded, as long as enough nodes
remain to run the job.

What a job wrote about a node reaches no further than that job's user: a
failure resting on the job's own output alone is an *unwitnessed* strike, and
of those the interconnect strike count and the lemon score hear one per user
(:func:`voiced`). One user's output can keep a node out of their own retries;
it takes another user's failure, or evidence the job did not write (a node
report, Slurm's node state), to drain it for everyone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping, Sequence

from ..detect.attempts import PriorAttempt, across_attempts
from ..detect.model import Verdict

MODE_RANK = {"monitor": 0, "external": 1, "action": 2}
REQUEUES = ("requeue", "requeue_exclude", "kill_requeue")
# How much one failure blamed on a node weighs in its lemon score.
STRIKE_WEIGHTS = {"gpu_hardware": 1.0, "interconnect": 1.0, "system_software": 0.5,
                  "straggler": 0.5, "hang_suspect": 0.25}
_NOTHING_STATES = {"COMPLETED": "the job completed (errors it logged did not stop it)",
                   "CANCELLED": "the job was cancelled by a user or an admin",
                   "PREEMPTED": "the job was preempted; Slurm's preemption handles it"}


@dataclass(frozen=True)
class Limits:
    """The job's effective limits: its environment, with its own directive on top."""

    max_restarts: int = 3
    unknown_max_restarts: int = 1
    no_progress_attempts: int = 3
    straggler_action: str = "none"
    drain_hardware: bool = True
    interconnect_strikes: int = 2


@dataclass(frozen=True)
class History:
    """What happened to the job before this decision."""

    restarts: int = 0                  # Slurm's restart count of the attempt judged
    unknown_requeues: int = 0          # earlier requeues of unexplained failures (since
                                       # the last checkpoint, when checkpoints are tracked)
    attempts_without_ckpt: int = 0     # latest attempts in a row with no new checkpoint
    tracks_checkpoints: bool = False   # ckpt= given, or checkpoints seen before
    excluded: tuple[str, ...] = ()     # exclusions already on the job
    nodes_needed: int = 1              # nodes the job runs on
    nodes: tuple[str, ...] = ()        # where the attempt judged ran
    previous: tuple[PriorAttempt, ...] = ()   # earlier failed attempts, oldest first


@dataclass(frozen=True)
class NodeFacts:
    """What the agent knows about nodes across jobs."""

    lemons: tuple[str, ...] = ()                 # score at or over the threshold
    drained_by_us: tuple[str, ...] = ()
    operator_excluded: tuple[str, ...] = ()
    interconnect_strikes: Mapping[str, int] = field(default_factory=dict)  # in the window
    cluster_nodes: int | None = None             # nodes a retry could use, if known


@dataclass(frozen=True)
class Decision:
    """What to do about one attempt. ``action`` is one of DESIGN.md's actions
    for the job (``none`` means no recommendation); ``drain`` lists nodes that
    each get a ``drain_node`` recommendation of their own."""

    action: str
    rule: str
    reason: str
    category: str | None = None
    exclude: tuple[str, ...] = ()
    drain: tuple[str, ...] = ()
    blamed: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()      # exclusions given up so the job still fits

    @property
    def acts(self) -> bool:
        return self.action != "none"


def effective_mode(env_mode: str, job_mode: str | None) -> str:
    """A job may lower its environment's mode (action > external > monitor), never raise it."""
    if not job_mode or job_mode not in MODE_RANK:
        return env_mode
    return min(env_mode, job_mode, key=MODE_RANK.__getitem__)


def confined(verdict: Verdict, nodes: Sequence[str]) -> Verdict:
    """The verdict with its blame kept to ``nodes``, the attempt's own nodes as
    Slurm lists them: no evidence, however it reads, may point a job's recovery
    at a node outside its allocation. A node verdict left with no node becomes
    an unexplained one."""
    inside = tuple(n for n in verdict.nodes if n in nodes)
    if inside == tuple(verdict.nodes):
        return verdict
    outside = ", ".join(n for n in verdict.nodes if n not in nodes)
    note = f"{verdict.reason}; ignored nodes outside the job's allocation: {outside}"
    if inside or verdict.blame != "node":
        return replace(verdict, nodes=inside, reason=note)
    action = "requeue" if verdict.action == "requeue_exclude" else verdict.action
    return replace(verdict, blame="unknown", nodes=(), gpus=(), links=(), action=action,
                   reason=note)


def decide(verdict: Verdict, *, trigger: str = "ended", state: str = "FAILED",
           history: History = History(), limits: Limits = Limits(),
           facts: NodeFacts = NodeFacts(),
           witnessed: Sequence[str] | None = None) -> Decision:
    """The decision for one attempt.

    ``trigger`` is ``ended`` (the attempt is over, in Slurm ``state``), ``hang``
    or ``straggler`` (the attempt is still running). ``witnessed``: the blamed
    nodes that node-level evidence (their hook reports, node sources, Slurm)
    speaks against; only those are drained for a hardware fault, since a
    job's own output cannot prove one (None: every blamed node).
    """
    category = verdict.category
    if trigger == "ended" and state in _NOTHING_STATES:
        return Decision("none", state.lower(), _NOTHING_STATES[state], category)
    if trigger == "ended" and state == "TIMEOUT" and verdict.action == "none":
        return Decision("stop", "time_limit", "the job reached its time limit; a retry would "
                        "end the same way", "timeout")
    if trigger == "straggler" and limits.straggler_action != "kill_requeue":
        return Decision("none", "straggler_recorded", "straggler recorded; the environment's "
                        "straggler_action does not allow a kill", category,
                        blamed=verdict.nodes)
    if verdict.signature == "done" and verdict.action == "none":
        return Decision("none", "work_done", f"the work had finished: {verdict.reason}"
                        .rstrip(": "), category)
    if trigger == "ended" and state == "OUT_OF_MEMORY" and (
            verdict.action == "none" or (verdict.unexplained and verdict.blame == "unknown")):
        # Slurm's own word (the step's memory cgroup killed a task): it explains
        # the exit reports and symptoms a log may hold, and a retry with the
        # same memory request ends the same way
        return Decision("stop", "out_of_memory", "Slurm ended the job OUT_OF_MEMORY: a task "
                        "went over the memory the job asked for; a retry with the same "
                        "request ends the same way" + (f" ({verdict.reason})" if
                                                      verdict.action != "none" else ""),
                        "oom")
    if trigger != "straggler":
        reread = across_attempts(verdict, history.nodes, history.previous)
        recurring, verdict = reread is not verdict, reread
    else:
        recurring = False
    if verdict.blame == "application" or verdict.action == "stop":
        if recurring:
            return Decision("stop", "recurring", f"retrying cannot help: {verdict.reason}"
                            .rstrip(": "), category)
        what = "application error, " if verdict.blame == "application" else ""
        return Decision("stop", "application", f"{what}retrying cannot help: "
                        f"{verdict.reason}".rstrip(": "), category)

    # a verdict that asks for nothing (no evidence, or only what the catalog
    # calls harmless: a sympathetic Xid 45 on a named node) is a failure
    # without evidence: never a reason to exclude or drain the node it names
    unknown = verdict.action == "none"
    unexplained = (verdict.unexplained and verdict.blame == "unknown" and trigger == "ended")
    spent = history.restarts >= limits.max_restarts or (
        limits.no_progress_attempts and history.tracks_checkpoints
        and history.attempts_without_ckpt >= limits.no_progress_attempts)
    if trigger == "straggler" and spent:
        # a slow job still advances: without retries left, leave it running
        return Decision("none", "straggler_recorded", "straggler recorded; no retries left "
                        "to spend on it", category, blamed=verdict.nodes)
    if history.restarts >= limits.max_restarts:
        return Decision("stop", "retry_budget", f"retry budget spent: {history.restarts} of "
                        f"{limits.max_restarts} restarts used", category)
    if (limits.no_progress_attempts and history.tracks_checkpoints
            and history.attempts_without_ckpt >= limits.no_progress_attempts):
        return Decision("stop", "no_progress", f"no new checkpoint over the last "
                        f"{history.attempts_without_ckpt} attempts", category)
    if unknown:
        if trigger != "ended":
            return Decision("none", "no_evidence", "nothing to act on", category)
        if history.unknown_requeues >= limits.unknown_max_restarts:
            return Decision("stop", "unknown_budget", f"failure without evidence, "
                            f"{history.unknown_requeues} unexplained requeue(s) already "
                            f"(unknown_max_restarts={limits.unknown_max_restarts})", category)
        seen = (f" ({verdict.reason}: it asks for no action)"
                if verdict.category and verdict.reason else "")
        return _requeue("requeue", "unknown", f"failure without evidence{seen}: requeue "
                        "once more", None, (), history, facts, ())
    if unexplained and history.unknown_requeues >= limits.unknown_max_restarts:
        return Decision("stop", "unknown_budget", f"unexplained failure, "
                        f"{history.unknown_requeues} unexplained requeue(s) already "
                        f"(unknown_max_restarts={limits.unknown_max_restarts}): "
                        f"{verdict.reason}".rstrip(": "), category)

    blamed = tuple(verdict.nodes) if verdict.blame == "node" else ()
    if trigger == "straggler":
        return _requeue("kill_requeue", "straggler", f"straggler on {', '.join(blamed)}: "
                        "kill and requeue without it", category, blamed, history, facts, ())
    if blamed:
        drain: tuple[str, ...] = ()
        rule = "node"
        if category == "gpu_hardware":
            rule = "hardware"
            drain = tuple(n for n in blamed if witnessed is None or n in witnessed) \
                if limits.drain_hardware else ()
        elif category == "interconnect":
            rule = "interconnect"
            if limits.interconnect_strikes:
                drain = tuple(n for n in blamed if facts.interconnect_strikes.get(n, 0)
                              >= limits.interconnect_strikes)
        action = "requeue_exclude"
        reason = f"{category or 'failure'} on {', '.join(blamed)}: {verdict.reason}".rstrip(": ")
        unproven = [n for n in blamed if witnessed is not None and n not in witnessed]
        if rule == "hardware" and limits.drain_hardware and unproven:
            reason += (f"; {', '.join(unproven)} not drained: only the job's own output "
                       "speaks against it")
        return _requeue(action, rule, reason, category, blamed, history, facts, drain)
    if category == "nccl_timeout_hang" or trigger == "hang" or verdict.action == "kill_requeue":
        action = "kill_requeue" if trigger != "ended" else "requeue"
        return _requeue(action, "hang", f"hang or collective timeout naming no node: "
                        f"{verdict.reason}".rstrip(": "), category, (), history, facts, ())
    if unexplained:
        return _requeue("requeue", "unexplained", f"unexplained failure, requeue once more: "
                        f"{verdict.reason}".rstrip(": "), category, (), history, facts, ())
    return _requeue("requeue", "requeue", f"{category or 'failure'}: {verdict.reason}"
                    .rstrip(": "), category, (), history, facts, ())


def _requeue(action: str, rule: str, reason: str, category: str | None,
             blamed: tuple[str, ...], history: History, facts: NodeFacts,
             drain: tuple[str, ...]) -> Decision:
    """A requeue decision with the full exclusion list: the blamed nodes first,
    then earlier exclusions, lemons and operator exclusions, dropping from the
    end what would leave too few nodes to run the job."""
    wanted = _unique([*blamed, *history.excluded, *facts.lemons, *facts.operator_excluded])
    dropped: list[str] = []
    if facts.cluster_nodes is not None:
        room = max(facts.cluster_nodes - history.nodes_needed, len(blamed))
        while len(wanted) > room and len(wanted) > len(blamed):
            dropped.insert(0, wanted.pop())
    lemons = tuple(n for n in facts.lemons if n not in facts.drained_by_us)
    drain = tuple(_unique([*drain, *lemons]))
    if blamed and action == "requeue":
        action = "requeue_exclude"
    return Decision(action, rule, reason, category, tuple(wanted), drain, blamed,
                    tuple(dropped))


def _unique(values: Iterable[str]) -> list[str]:
    out: list[str] = []
    for value in values:
        if value and value not in out:
            out.append(value)
    return out


def our_drain(row: dict | None, node) -> bool:
    """Is ``node`` (as Slurm shows it now) still drained by the drain we
    recorded in ``row`` (the store's nodes row)? The reason, the user and the
    time Slurm stamped on it must all be the ones we saw right after our drain:
    a human who drains the node again changes the time, however the reason reads."""
    if not row or not row.get("drained_by_us") or node is None or not node.drained:
        return False
    recorded = row.get("drain_slurm_reason") or row.get("drain_reason") or ""
    if node.reason != recorded:
        return False
    if row.get("drain_slurm_time") and node.reason_time != row["drain_slurm_time"]:
        return False
    return not row.get("drain_slurm_user") or node.reason_user == row["drain_slurm_user"]


# -- node scores and budgets ----------------------------------------------------

@dataclass(frozen=True)
class Strike:
    """One failure blamed on a node, as the store keeps it."""

    ts: float
    weight: float
    user: str = ""
    witnessed: bool = False      # evidence the job did not write speaks against the node


def voiced(strikes: Iterable[Strike]) -> list[Strike]:
    """The strikes that count beyond their own jobs: every witnessed one, and
    of the unwitnessed ones (only the job's own output, which its user
    controls, spoke against the node) one per user, the heaviest, the newest
    of equals. Several jobs of one user saying the same thing are one voice."""
    out: list[Strike] = []
    loudest: dict[str, Strike] = {}
    for strike in strikes:
        if strike.witnessed:
            out.append(strike)
            continue
        held = loudest.get(strike.user)
        if held is None or (strike.weight, strike.ts) > (held.weight, held.ts):
            loudest[strike.user] = strike
    return sorted([*out, *loudest.values()], key=lambda s: s.ts)


def lemon_score(strikes: Iterable[tuple[float, float]], now: float, half_life: float) -> float:
    """Sum of strike weights, each halved every ``half_life`` seconds since it
    happened. ``strikes`` are (time, weight); a strike from the future (a
    skewed clock) counts as now."""
    total = 0.0
    for ts, weight in strikes:
        age = max(0.0, now - ts)
        total += weight * math.pow(0.5, age / half_life)
    return round(total, 6)


@dataclass(frozen=True)
class BudgetState:
    drains_last_hour: int = 0
    partition_sizes: Mapping[str, int] = field(default_factory=dict)
    drained_by_us: Mapping[str, int] = field(default_factory=dict)   # per partition


def drain_budget(node_partitions: Sequence[str], state: BudgetState, max_per_hour: int,
                 max_percent: float) -> str:
    """Why draining one more node (in ``node_partitions``) is over budget, or ``""``."""
    if state.drains_last_hour >= max_per_hour:
        return (f"drain budget spent: {state.drains_last_hour} drain(s) in the last hour "
                f"(policy.max_drains_per_hour={max_per_hour})")
    for part in node_partitions:
        size = state.partition_sizes.get(part, 0)
        if size <= 0:
            continue
        after = state.drained_by_us.get(part, 0) + 1
        if after * 100.0 / size > max_percent + 1e-9:
            return (f"partition {part}: draining one more would put {after} of {size} nodes "
                    f"({after * 100.0 / size:.0f}%) in our drains "
                    f"(policy.max_drained_percent={max_percent:g})")
    return ""
