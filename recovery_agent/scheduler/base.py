"""What every scheduler backend returns and must do.

The agent only ever sees these types. Backends translate whatever their Slurm
gives them (JSON of several vintages, pyslurm objects) into them, so that the
detectors and the policy never learn which Slurm they run against.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterable, Protocol, Sequence, runtime_checkable

from ..errors import JobNotFound, SchedulerError

# Job states in which the job holds (or is about to hold, or is releasing) nodes.
ACTIVE_STATES = frozenset({"RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "STAGE_OUT",
                           "SIGNALING", "RESIZING"})
# states in which the start time is a run's real start
RAN_STATES = frozenset({"RUNNING", "COMPLETING", "SUSPENDED", "STOPPED", "SIGNALING",
                        "STAGE_OUT"})
FINISHED_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                             "PREEMPTED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY"})
# Node flags that keep the scheduler from placing new work on a node.
UNAVAILABLE_NODE_FLAGS = frozenset({"DRAIN", "DRAINING", "DRAINED", "DOWN", "FAIL", "FAILING",
                                    "NOT_RESPONDING", "MAINTENANCE", "POWERED_DOWN",
                                    "REBOOT_REQUESTED", "INVALID_REG"})


@dataclass(frozen=True)
class Job:
    """One Slurm job, or one task of a job array (``job_id`` is then ``"1234_7"``).

    Times are Unix seconds, ``None`` when Slurm has not set them. ``stdout`` and
    ``stderr`` are absolute paths with Slurm's ``%`` patterns already expanded.
    """

    job_id: str
    numeric_id: int
    name: str = ""
    state: str = "UNKNOWN"
    state_flags: frozenset[str] = frozenset()
    reason: str = ""
    exit_code: int | None = None
    exit_signal: int | None = None
    nodes: tuple[str, ...] = ()
    batch_host: str = ""
    excluded_nodes: tuple[str, ...] = ()
    restart_count: int = 0
    array_job_id: int | None = None
    array_task_id: int | None = None
    array_task_spec: str = ""
    submit_time: int | None = None
    start_time: int | None = None
    end_time: int | None = None
    user: str = ""
    user_id: int | None = None    # the job's Unix uid and gid: whose rights its files
    group_id: int | None = None   # are read with (None: not known)
    comment: str = ""
    stdout: str = ""
    stderr: str = ""
    partition: str = ""
    cluster: str = ""
    workdir: str = ""
    command: str = ""            # the batch script's path as Slurm lists it ("" unknown)
    requeue_allowed: bool = True
    held: bool = False
    signal: str = ""             # the job's own --signal ("USR1", "B:USR1"): its
                                 # checkpoint convention; "" when the listing shows none

    @property
    def is_array_task(self) -> bool:
        return self.array_task_id is not None

    @property
    def is_active(self) -> bool:
        return self.state in ACTIVE_STATES

    @property
    def is_finished(self) -> bool:
        return self.state in FINISHED_STATES

    @property
    def is_pending(self) -> bool:
        return self.state == "PENDING"

    @property
    def run_start(self) -> int | None:
        """Slurm's start time of the run this listing shows, or None when it
        shows none begun: pending (the start time is only the expected one),
        held, configuring (it is reset once the nodes are up). With the restart
        count it names the run: slurmctld may run an attempt again at the same
        count (a controller restarted from older state puts it back in the
        queue itself)."""
        if self.state in RAN_STATES or self.is_finished:
            return self.start_time or None
        return None


@dataclass(frozen=True, slots=True)
class Node:
    """One compute node. ``state`` is the base state (``IDLE``, ``MIXED``, ...);
    ``flags`` are the modifiers (``DRAIN``, ``NOT_RESPONDING``, ...)."""

    name: str
    state: str
    flags: frozenset[str] = frozenset()
    reason: str = ""
    reason_user: str = ""
    reason_time: int | None = None
    partitions: tuple[str, ...] = ()
    gres: str = ""
    address: str = ""      # Slurm's NodeAddr (an IP address or a name)
    hostname: str = ""     # Slurm's NodeHostname

    @property
    def drained(self) -> bool:
        return bool(self.flags & {"DRAIN", "DRAINING", "DRAINED"})

    @property
    def available(self) -> bool:
        return self.state not in {"DOWN", "FUTURE", "UNKNOWN"} and not (
            self.flags & UNAVAILABLE_NODE_FLAGS)

    @property
    def state_text(self) -> str:
        """The state as sinfo/scontrol print it: ``IDLE+DRAIN``."""
        return "+".join([self.state, *sorted(self.flags)])


@dataclass(frozen=True)
class Probe:
    """The result of a backend's viability check: can it run here, and if not, why."""

    backend: str
    viable: bool
    reason: str = ""
    version: str = ""


def submit_signal(submit_line: str | None) -> str:
    """The signal of a ``--signal=[{R|B}:]SIG[@TIME]`` on the job's submit line
    (Slurm 23.02 and later list it; 22.05 lists neither the line nor the
    signal), as ``SIG`` or ``B:SIG`` without the ``SIG`` prefix; "" when none is
    seen. Only options before the first word that is no option count (after it
    come the script and its own arguments, or a --wrap command), so a word
    the job's script is given is never read as its convention: the options
    after an option's separate value (``-J name --signal=USR1``) are missed,
    which leaves the job without a convention rather than with a wrong one."""
    words = (submit_line or "").split()
    for word in words[1:]:
        if not word.startswith("-") or word.startswith("--wrap"):
            return ""
        if word.startswith("--signal="):
            value = word[len("--signal="):].split("@", 1)[0]
            batch = value.startswith("B:")
            value = value[2:] if value[:2] in ("B:", "R:") else value
            value = value.upper().removeprefix("SIG")
            if not value.isalnum():
                return ""
            return f"B:{value}" if batch else value
    return ""


def select_jobs(jobs: list["Job"], job_ids: Iterable[str | int] | None) -> list["Job"]:
    """The jobs of a full listing that ``job_ids`` names (by printable or numeric
    id); all of them when ``job_ids`` is None. Every backend lists all jobs and
    filters here (22.05's ``squeue -j`` ignores the filter)."""
    if job_ids is None:
        return jobs
    wanted = {str(j) for j in job_ids}
    return [j for j in jobs if j.job_id in wanted or str(j.numeric_id) in wanted]


def exact_or_first(found: list["Job"], job_id: str) -> "Job":
    """Of the jobs a lookup of ``job_id`` found, the one with that exact printable
    id (an array task's numeric id can equal another job's), else the first."""
    return next((j for j in found if j.job_id == str(job_id)), found[0])


class ListingCheck:
    """An empty job listing right after one that held live jobs is suspect: a
    controller that is failing over, restarting or overloaded can answer with
    nothing. Before such a listing is believed, a targeted query asks for a few
    of the jobs just seen; if slurmctld still knows one, the listing is a
    SchedulerError (nothing is expired, released or judged on it)."""

    SAMPLE = 3

    def __init__(self) -> None:
        self.live: list[str] = []   # live jobs of the last believed listing
        self._lock = threading.Lock()

    def check(self, jobs: Sequence["Job"], lookup) -> None:
        with self._lock:
            before = list(self.live)
        if not jobs and before:
            for job_id in before[:self.SAMPLE]:
                try:
                    found = lookup(job_id)
                except JobNotFound:
                    continue
                raise SchedulerError(
                    f"the job listing came back empty, yet slurmctld still shows job "
                    f"{job_id} ({found.state}): not believing the listing",
                    argv=["squeue", "--json"])
        with self._lock:
            self.live = [j.job_id for j in jobs if not j.is_finished][:64]


@runtime_checkable
class Scheduler(Protocol):
    """The operations the agent needs from Slurm. Every mutating call raises
    :class:`~recovery_agent.errors.SchedulerError` when Slurm refuses it."""

    name: str

    def probe(self) -> Probe: ...

    def list_jobs(self, job_ids: Iterable[str] | None = None) -> list[Job]:
        """All jobs slurmctld still knows (pending, running and recently finished),
        or only those named. One batched query, whatever the number of ids."""
        ...

    def get_job(self, job_id: str) -> Job:
        """One job; raises :class:`~recovery_agent.errors.JobNotFound`."""
        ...

    def lookup_job(self, job_id: str) -> Job:
        """One job by a targeted query, never from the batched listing: what
        confirms that a job a listing lacks is really gone. Raises JobNotFound."""
        ...

    def list_nodes(self, names: Iterable[str] | None = None) -> list[Node]: ...

    def get_node(self, name: str) -> Node:
        """One node; raises :class:`~recovery_agent.errors.NodeNotFound`."""
        ...

    def requeue_hold(self, job_id: str) -> None:
        """Stop the job and put it back in the queue, held until released."""
        ...

    def set_excluded_nodes(self, job_id: str, nodes: Sequence[str]) -> None:
        """Replace the job's excluded node list (an empty list clears it)."""
        ...

    def allow_requeue(self, job_id: str) -> None:
        """Mark the job requeueable (jobs submitted with ``--no-requeue`` refuse requeue)."""
        ...

    def release(self, job_id: str) -> None: ...

    def start_now(self, job_id: str) -> None:
        """Make a pending job eligible at once (skips Slurm's requeue begin-time delay)."""
        ...

    def cancel(self, job_id: str, signal: str | None = None) -> None: ...

    def signal_job(self, job_id: str, signal: str, batch: bool = False) -> None:
        """Send ``signal`` (``USR1``...) without ending the job: to every step
        but the batch shell, as Slurm's ``--signal`` does, or with ``batch``
        to the batch shell only (``scancel --signal=SIG [--batch]``)."""
        ...

    def drain_node(self, name: str, reason: str) -> None: ...

    def resume_node(self, name: str) -> None: ...

