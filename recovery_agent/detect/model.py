"""What detection produces: detections (what happened, with evidence) and a
verdict (who is to blame). Plain frozen data, no I/O: the scanner, the hang
and straggler detectors, checkpoint tracking and attribution all speak it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

CATEGORIES = ("gpu_hardware", "interconnect", "nccl_timeout_hang", "cuda_error", "oom",
              "system_software", "application", "segfault")
# Actions a pattern may hint at, and a verdict may recommend.
ACTIONS = ("requeue_exclude", "requeue", "kill_requeue", "stop", "none")
SEVERITIES = ("info", "warning", "error", "critical")
# How a detection relates to a failure, for attribution: ``root`` explains
# everything else whatever the order (a fatal XID, a node failure); ``cause`` is
# a first-hand error; ``symptom`` usually follows another failure (a collective
# timeout, a peer that went away); ``exit`` only reports that a process ended
# (an exit code, an abort after an uncaught exception).
ROLES = ("root", "cause", "symptom", "exit")
# Where the line a detection rests on was read, which decides what it may prove:
# "job" is written by the job (its output files, its log-store feed): a user can
# write anything there; "system" comes from the nodes and Slurm (node hook
# reports, node log feeds, GPU metrics, Slurm's own state); "" is not known
# (offline analysis of a file an admin chose), taken at face value.
ORIGINS = ("", "job", "system")
# Failure kinds whose cause is told apart across attempts (Verdict.signature,
# ``family:detail``): one that follows the job onto fresh nodes is the code,
# one that stays with a node is the node. ``write``: a write failure without a
# full disk; twice, it is one. ``hang:OP:SEQ``: a collective timeout at the
# same point of the run twice is the run. ``shm``: DataLoader workers out of
# shared memory; twice, /dev/shm is too small.
SIGNATURES = ("cuda", "segfault", "write", "hang", "shm")


@dataclass(frozen=True)
class Evidence:
    """One line that a detection rests on, and where it was seen."""

    text: str
    source: str = ""         # a log path, "hook:<node>/<hook>", "slurm", ...
    line: int | None = None  # 1-based line number within the source, when known
    time: float | None = None


@dataclass(frozen=True)
class Detection:
    """Something that happened to a job, with evidence.

    ``rule`` is the pattern id (or a detector's name: ``hang``, ``straggler``,
    ``xid``, ``node_fail``...). Attribution fields are filled when the evidence
    names them: ``host``, ``rank``, ``pci``, ``gpu``, ``xid``. ``role`` is one
    of :data:`ROLES` and tells attribution how much the detection explains.
    """

    rule: str
    category: str
    severity: str = "error"
    action_hint: str = "none"
    evidence: tuple[Evidence, ...] = ()
    host: str | None = None
    rank: int | None = None
    pci: str | None = None
    gpu: str | None = None
    xid: int | None = None
    detail: str = ""
    role: str = "cause"
    emitter: str = "job"     # the rule's: who prints such a message (patterns.EMITTERS)
    origin: str = ""         # where this one was read (ORIGINS)
    peer: bool = False       # the rule names the other side: no host is not "the printer"

    @property
    def line(self) -> int | None:
        return self.evidence[0].line if self.evidence else None


@dataclass(frozen=True)
class Verdict:
    """Who is to blame for an interruption.

    ``blame`` is ``node``, ``application`` or ``unknown``. ``nodes`` names the
    hosts to exclude (for ``node``); ``gpus``/``links`` narrow it down when
    known. ``rests_on`` cites the detections used, by index into the list the
    verdict was made from. ``action`` is the recommendation this evidence
    supports on its own (policy may still override it: budgets, retries).

    Read across attempts (policy, with the job's earlier verdicts):
    ``unexplained`` is set when the verdict rests on symptoms and exit reports
    alone (what any failure leaves behind), so it counts against the
    unexplained-failure budget; ``signature`` names a failure that may be the
    code or the node, to be told apart by where it happens next (``cuda``,
    ``segfault``, ``write``: see :data:`SIGNATURES`; ``done``: the work had
    finished before it); ``suspects`` are hosts the evidence names without
    proving them at fault (a peer, a store host): named again by a later
    attempt, they are excluded. ``where`` records where the lines the verdict
    rests on say the failure happened (hosts, PCI addresses), whoever is to
    blame: an OOM on node107 is stopped, and the record still says node107.
    """

    blame: str
    category: str | None
    action: str
    confidence: float
    nodes: tuple[str, ...] = ()
    gpus: tuple[str, ...] = ()
    links: tuple[str, ...] = ()
    rests_on: tuple[int, ...] = ()
    reason: str = ""
    extra: dict = field(default_factory=dict, compare=False, hash=False)
    unexplained: bool = False
    signature: str = ""
    suspects: tuple[str, ...] = ()
    where: tuple[str, ...] = ()
