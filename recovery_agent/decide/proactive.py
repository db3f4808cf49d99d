"""The proactive move: what to do about the jobs on a degrading node before it
fails. Pure functions over small dataclasses, no I/O (docs/proactive.md).

A node whose degradation level (:mod:`~recovery_agent.detect.degradation`)
is ``degraded`` gets a :class:`NodePlan`: for each job running on it either a
``migrate`` (ask the job to checkpoint by its own convention, wait for the
checkpoint up to a bound, requeue it without the node, drain the node with a
reason that says "degraded, not failed") or a refusal with its rule and its
reason. A node at ``watch`` or ``ok`` gets no plan: nothing to move yet.

The safety rules, in the order they are checked (the first that applies is
the job's answer):

==================  =========================================================
rule                refused when
==================  =========================================================
``opted_out``       the job said ``proactive=no``
``proactive_off``   the job's environment has ``proactive = "off"``
``busy``            another recommendation of the job is still open
``no_convention``   the job has no checkpoint convention: ``ckpt-signal=none``,
                    or no ``ckpt-signal=`` and no ``--signal`` Slurm shows, or
                    a ``--signal`` that is not USR1, USR2 or TERM
``cooldown``        the job was moved less than ``migrate_cooldown`` ago
``too_few_nodes``   without the node (and the job's other exclusions) fewer
                    healthy nodes remain than the job needs
``drain_budget``    draining the node would go over the drain budget
                    (:func:`~.policy.drain_budget`)
==================  =========================================================

A job that passes them all is moved in the mode of its environment, lowered
by its own directive and by the environment's ``proactive`` (``monitor``:
``would_have`` only), the way :func:`~.policy.effective_mode` lowers modes.
Every refusal is a :class:`JobMove` too, for the job's and the node's
timelines.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from .policy import effective_mode

# the signals the agent sends as a checkpoint request (and their Linux numbers,
# as a --signal may give them)
CKPT_SIGNALS = ("USR1", "USR2", "TERM")
_SIGNAL_NUMBERS = {"10": "USR1", "12": "USR2", "15": "TERM"}
PROACTIVE_MODES = ("action", "monitor", "off")
DRAIN_WORDS = "degraded, not failed"


@dataclass(frozen=True)
class NodeCondition:
    """A node's degradation as the score left it: its worst GPU's score and
    level, and the rules that fired on its GPUs (the evidence, as
    ``RuleHit.as_dict`` gives it, each with a ``gpu`` key)."""

    node: str
    level: str
    score: float
    evidence: tuple[Mapping, ...] = ()

    @property
    def rules(self) -> tuple[str, ...]:
        out: list[str] = []
        for hit in self.evidence:
            rule = str(hit.get("rule") or "")
            if rule and rule not in out:
                out.append(rule)
        return tuple(out)


@dataclass(frozen=True)
class RunningJob:
    """One job on the node, with what its directive and Slurm say."""

    job_id: str
    nodes: tuple[str, ...]
    env: str = "default"
    job_mode: str | None = None          # the directive's :monitor / :action
    ckpt_signal: str | None = None       # the directive's ckpt-signal= (None: not given)
    proactive: bool | None = None        # the directive's proactive= (None: not given)
    slurm_signal: str = ""               # the job's own --signal, as Slurm lists it
    excluded: tuple[str, ...] = ()       # exclusions already on the job
    last_migration: float | None = None  # when the agent last moved it
    open_recommendation: int | None = None   # a recommendation of the job still open


@dataclass(frozen=True)
class EnvRules:
    """The job's environment, as it bears on a move."""

    mode: str = "monitor"         # the environment's mode now (overrides applied)
    proactive: str = "monitor"    # action, monitor or off


@dataclass(frozen=True)
class Room:
    """The cluster around the node. ``healthy`` lists the nodes a moved job
    could run on: available in Slurm and not degraded (the node itself and the
    job's own other nodes included; they are taken out per job). ``drain_refusal``
    is :func:`~.policy.drain_budget`'s answer for this node ("" within budget)."""

    healthy: tuple[str, ...] = ()
    drain_refusal: str = ""


@dataclass(frozen=True)
class MoveLimits:
    cooldown: float = 6 * 3600.0
    checkpoint_wait: float = 600.0


@dataclass(frozen=True)
class JobMove:
    """The answer for one job: ``action`` is ``migrate`` or ``none`` (refused:
    ``rule`` names the safety rule, ``reason`` says it in words)."""

    job_id: str
    action: str
    rule: str
    reason: str
    mode: str = "monitor"
    signal: str = ""              # USR1, USR2 or TERM
    target: str = ""              # steps (scancel --signal) or batch (scancel --batch)
    checkpoint_wait: float = 0.0
    exclude: tuple[str, ...] = ()
    drain_reason: str = ""

    @property
    def moves(self) -> bool:
        return self.action == "migrate"


@dataclass(frozen=True)
class NodePlan:
    node: str
    jobs: tuple[JobMove, ...]
    drain: bool               # the node is drained after the moves (some job moves)
    drain_reason: str
    drain_mode: str = "monitor"   # the most acting mode of the moves


def checkpoint_signal(job: RunningJob) -> tuple[str, str, str]:
    """(signal, target, refusal) of the job's checkpoint convention: its
    ``ckpt-signal=``, else its own ``--signal``. ``target`` is ``batch`` for a
    ``B:`` signal (the batch shell only) and ``steps`` otherwise, as Slurm
    sends a ``--signal``. A refusal (no convention) leaves the first two empty."""
    given = job.ckpt_signal
    if given == "none":
        return "", "", "the job said ckpt-signal=none: it has no checkpoint convention"
    source = "ckpt-signal" if given else "--signal"
    value = given or job.slurm_signal
    if not value:
        return "", "", ("no checkpoint convention: no ckpt-signal= in the directive and no "
                        "--signal that Slurm shows for the job")
    batch = value.startswith("B:")
    name = value[2:] if batch else value
    name = _SIGNAL_NUMBERS.get(name, name.upper().removeprefix("SIG"))
    if name not in CKPT_SIGNALS:
        return "", "", (f"the job's {source}={value} is not a checkpoint signal the agent "
                        f"sends ({', '.join(CKPT_SIGNALS)})")
    return name, "batch" if batch else "steps", ""


def drain_text(condition: NodeCondition) -> str:
    """The drain's full reason: degraded, not failed, and which rules on which GPUs."""
    parts = []
    for hit in condition.evidence:
        rule, gpu = hit.get("rule"), hit.get("gpu")
        text = f"{rule} on {gpu}" if gpu not in (None, "") else str(rule)
        if rule and text not in parts:
            parts.append(text)
    return f"{DRAIN_WORDS}: {', '.join(parts)}" if parts else DRAIN_WORDS


def plan_node(condition: NodeCondition, jobs: Sequence[RunningJob],
              envs: Mapping[str, EnvRules], room: Room, limits: MoveLimits,
              now: float) -> NodePlan | None:
    """The plan for a degraded node (None when it is not degraded). ``envs``
    holds each job's environment by name (an unknown name: ``default``'s, or
    the :class:`EnvRules` defaults)."""
    if condition.level != "degraded":
        return None
    reason = drain_text(condition)
    moves = tuple(_job_move(condition, job, _env(envs, job.env), room, limits, now, reason)
                  for job in jobs)
    moving = [m for m in moves if m.moves]
    mode = max((m.mode for m in moving), key=_rank, default="monitor")
    return NodePlan(condition.node, moves, bool(moving), reason, mode)


def _env(envs: Mapping[str, EnvRules], name: str) -> EnvRules:
    return envs.get(name) or envs.get("default") or EnvRules()


def _rank(mode: str) -> int:
    return {"monitor": 0, "external": 1, "action": 2}.get(mode, 0)


def _job_move(condition: NodeCondition, job: RunningJob, env: EnvRules, room: Room,
              limits: MoveLimits, now: float, drain_reason: str) -> JobMove:
    node = condition.node

    def refuse(rule: str, why: str) -> JobMove:
        return JobMove(job.job_id, "none", rule, f"not moved off {node}: {why}")

    if job.proactive is False:
        return refuse("opted_out", "the job opted out (proactive=no)")
    if env.proactive == "off":
        return refuse("proactive_off", f"environment {job.env}'s proactive is off")
    if job.open_recommendation is not None:
        return refuse("busy", f"recommendation #{job.open_recommendation} of the job is "
                      "still open")
    signal, target, missing = checkpoint_signal(job)
    if missing:
        return refuse("no_convention", missing)
    if job.last_migration is not None and now - job.last_migration < limits.cooldown:
        ago = max(0.0, now - job.last_migration)
        return refuse("cooldown", f"the job was moved {_human(ago)} ago (migrate_cooldown "
                      f"{_human(limits.cooldown)})")
    needed = max(1, len(job.nodes))
    left = [n for n in room.healthy if n != node and n not in job.excluded]
    if len(left) < needed:
        return refuse("too_few_nodes", f"without it {len(left)} healthy node(s) remain for "
                      f"a job that needs {needed}")
    if room.drain_refusal:
        return refuse("drain_budget", room.drain_refusal)
    mode = effective_mode(effective_mode(env.mode, job.job_mode),
                          "monitor" if env.proactive == "monitor" else None)
    rules = ", ".join(condition.rules) or "degraded"
    how = "scancel --batch" if target == "batch" else "its steps"
    return JobMove(job.job_id, "migrate", "degraded",
                   f"{node} is degraded ({rules}, score {condition.score:g}): ask for a "
                   f"checkpoint with SIG{signal} ({how}), wait up to "
                   f"{_human(limits.checkpoint_wait)}, requeue without {node}",
                   mode=mode, signal=signal, target=target,
                   checkpoint_wait=limits.checkpoint_wait,
                   exclude=(node,), drain_reason=drain_reason)


def _human(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds // 3600}h"
    if seconds >= 3600:
        return f"{seconds // 3600}h{(seconds % 3600) // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m" + (f"{seconds % 60:02d}s" if seconds % 60 else "")
    return f"{seconds}s"
