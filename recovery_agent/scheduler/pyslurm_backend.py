"""A scheduler backend that talks to slurmctld through pyslurm 25.11's C-API bindings.

pyslurm only builds against the libslurm of its own Slurm release, so it is imported
lazily: importing this module never needs it, and :meth:`PyslurmScheduler.probe` says
why the backend cannot run (missing, built for another Slurm, slurmctld unreachable).
The translators read pyslurm objects with ``getattr`` only, so tests can feed them
stand-ins carrying pyslurm's attribute names.
"""
from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
import logging
from typing import Any, Callable, Iterable, Sequence

from ..errors import JobNotFound, NodeNotFound, SchedulerError
from .base import Job, ListingCheck, Node, Probe, select_jobs
from .cli_parse import expand_nodes

log = logging.getLogger(__name__)

INSTALL_HINT = ("pip install 'slurm-recovery[pyslurm]' (it compiles against the "
                "Slurm 25.11 headers and libslurm, which must be installed first)")

# pyslurm's Job.state is one word (Slurm's job_state_string): a state flag wins
# over the base state. Words that stand for a flag on a pending job map here.
_PENDING_FLAG_WORDS = frozenset({"REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
                                 "SPECIAL_EXIT", "RESV_DEL_HOLD"})
# Words the rest of the agent already treats as states, kept as state and flag.
_TRANSITION_WORDS = frozenset({"COMPLETING", "CONFIGURING", "RESIZING", "STAGE_OUT",
                               "SIGNALING"})


# --------------------------------------------------------------------------- translation

def _import_crashes() -> str:
    """Import pyslurm in a child first: its slurm_init() can end the whole
    process when libslurm cannot read the Slurm config. Empty when it is safe."""
    try:
        proc = subprocess.run([sys.executable, "-c", "import pyslurm"], capture_output=True,
                              text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    if proc.returncode == 0:
        return ""
    tail = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
    return tail


def _int_or_none(value: Any) -> int | None:
    # pyslurm returns None for unset values and the string "UNLIMITED" for infinite.
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _time(value: Any) -> int | None:
    number = _int_or_none(value)
    return number if number else None


def _job_state(word: str) -> tuple[str, frozenset[str]]:
    word = (word or "UNKNOWN").upper()
    if word in _PENDING_FLAG_WORDS:
        return "PENDING", frozenset({word})
    if word in _TRANSITION_WORDS:
        return word, frozenset({word})
    return word, frozenset()


def _array_ids(obj: Any) -> tuple[int | None, int | None, str]:
    """(array job id, task id, pending task spec) for an array record."""
    array_job_id = _int_or_none(getattr(obj, "array_id", None))
    task_id = _int_or_none(getattr(obj, "array_task_id", None))
    spec = getattr(obj, "array_tasks_waiting", None) or ""
    if array_job_id is not None and task_id is None and not spec:
        # pyslurm treats a zero task id as "unset" (u32_parse), so task 0 of an
        # array arrives as None; a record with no pending spec is a real task.
        task_id = 0
    return array_job_id, task_id, spec


def _text(obj: Any, name: str) -> str:
    return getattr(obj, name, None) or ""


def job_from_pyslurm(obj: Any) -> Job:
    """Translate a ``pyslurm.Job`` (pyslurm/core/job/job.pyx) into a :class:`Job`."""
    numeric_id = int(getattr(obj, "id"))
    array_job_id, task_id, spec = _array_ids(obj)
    if array_job_id is None:
        job_id = str(numeric_id)
    elif task_id is not None:
        job_id = f"{array_job_id}_{task_id}"
    else:
        job_id = f"{array_job_id}_[{spec}]"
    state, flags = _job_state(_text(obj, "state"))
    reason = _text(obj, "state_reason")
    # A held job is a pending one whose priority Slurm set to zero.
    held = state == "PENDING" and (getattr(obj, "priority", None) == 0
                                   or "held" in reason.lower())
    requeueable = getattr(obj, "is_requeueable", None)
    return Job(
        job_id=job_id, numeric_id=numeric_id, name=_text(obj, "name"),
        state=state, state_flags=flags, reason="" if reason == "None" else reason,
        exit_code=_int_or_none(getattr(obj, "exit_code", None)),
        exit_signal=_int_or_none(getattr(obj, "exit_code_signal", None)),
        nodes=expand_nodes(_text(obj, "allocated_nodes")), batch_host=_text(obj, "batch_host"),
        excluded_nodes=expand_nodes(_text(obj, "excluded_nodes")),
        restart_count=_int_or_none(getattr(obj, "requeue_count", None)) or 0,
        array_job_id=array_job_id, array_task_id=task_id, array_task_spec=spec,
        submit_time=_time(getattr(obj, "submit_time", None)),
        start_time=_time(getattr(obj, "start_time", None)),
        end_time=_time(getattr(obj, "end_time", None)),
        user=_text(obj, "user_name"), user_id=_int_or_none(getattr(obj, "user_id", None)),
        group_id=_int_or_none(getattr(obj, "group_id", None)), comment=_text(obj, "comment"),
        # libslurm's slurm_get_job_stdout/-stderr behind these two properties already
        # substitute %j/%A/%a/%u/%x and prefix the working directory. The pending
        # rest of an array has no file of its own yet.
        stdout="" if spec else _text(obj, "standard_output"),
        stderr="" if spec else _text(obj, "standard_error"),
        partition=_text(obj, "partition"), cluster=_text(obj, "cluster"),
        workdir=_text(obj, "working_directory"), command=_text(obj, "command"),
        requeue_allowed=True if requeueable is None else bool(requeueable), held=held)


def _gres_text(gres: Any) -> str:
    # pyslurm parses the node's Gres string into {"gpu:a100": 4} or, with
    # indexes, {"gpu:a100": {"count": 4, "indexes": "0-3"}}; we keep the text form.
    if not gres or isinstance(gres, str):
        return gres or ""
    return ",".join(f"{key}:{value['count'] if isinstance(value, dict) else value}"
                    for key, value in gres.items())


def node_from_pyslurm(obj: Any) -> Node:
    """Translate a ``pyslurm.Node`` (pyslurm/core/node.pyx) into a :class:`Node`.

    pyslurm gives the state as one ``BASE+FLAG+FLAG`` string (Slurm's
    node_state_string_complete), which we split into state and flags.
    """
    words = [w for w in (_text(obj, "state") or "UNKNOWN").upper().split("+") if w]
    return Node(
        name=getattr(obj, "name"), state=words[0] if words else "UNKNOWN",
        flags=frozenset(words[1:]), reason=_text(obj, "reason"),
        reason_user=_text(obj, "reason_user"),
        reason_time=_time(getattr(obj, "reason_time", None)),
        partitions=tuple(getattr(obj, "partitions", None) or ()),
        gres=_gres_text(getattr(obj, "configured_gres", None)),
        address=_text(obj, "address"), hostname=_text(obj, "hostname"))


# --------------------------------------------------------------------------- helpers, errors

def _major_minor(version: str) -> str:
    return ".".join(str(version).split(".")[:2])


def _signal_name(signal: str) -> str | int:
    # pyslurm's signal_to_num wants "SIGUSR1" or a number.
    text = str(signal).strip().upper()
    if text.isdigit():
        return int(text)
    return text if text.startswith("SIG") else f"SIG{text}"


def scheduler_error(argv: Sequence[str], exc: BaseException, pyslurm: Any = None) -> SchedulerError:
    """Turn a pyslurm exception into our error, choosing the not-found subclasses
    from Slurm's errno (``RPCError.errno``) or, failing that, the message."""
    text = str(exc) or type(exc).__name__
    low, errno = text.lower(), getattr(exc, "errno", None)
    # The ESLURM_* numbers are module attributes of pyslurm (pyslurm/deprecated.pyx
    # includes pydefines/slurm_errno_enums.pxi and pyslurm star-imports it).
    def is_errno(name: str) -> bool:
        return errno is not None and errno == getattr(pyslurm, name, None)

    cls = SchedulerError
    if is_errno("ESLURM_INVALID_JOB_ID") or "invalid job id" in low:
        cls = JobNotFound
    elif is_errno("ESLURM_INVALID_NODE_NAME") or "invalid node name" in low or (
            "node" in low and "does not exist" in low):  # Node.load's own message
        cls = NodeNotFound
    return cls(f"{' '.join(argv)} failed", argv=argv, returncode=None, stderr=text)


def _job_not_found(job_id: str) -> JobNotFound:
    return JobNotFound(f"job {job_id} not found", argv=["pyslurm", "Jobs.load"],
                       stderr=f"slurmctld has no job {job_id}")


# --------------------------------------------------------------------------- backend

class PyslurmScheduler:
    """The :class:`~recovery_agent.scheduler.base.Scheduler` backed by pyslurm."""

    name = "pyslurm"

    def __init__(self) -> None:
        self._module: Any = None
        self.listings = ListingCheck()

    def lookup_job(self, job_id: str) -> Job:
        """A targeted query for one job (Job.load, one RPC): what confirms that a
        job a listing lacks is gone. Array tasks are not looked up this way (it
        would list every job): JobNotFound."""
        if not str(job_id).isdigit():
            raise _job_not_found(job_id)
        return self.get_job(job_id)

    def _pyslurm(self) -> Any:
        """Import pyslurm on first use (importing it also runs slurm_init)."""
        if self._module is None:
            self._module = importlib.import_module("pyslurm")
        return self._module

    def _call(self, description_argv: list[str], fn: Callable[..., Any], *args: Any) -> Any:
        """Run one pyslurm call; its failures become SchedulerError and friends."""
        ps = self._pyslurm()
        errors = tuple(getattr(ps, n) for n in ("PyslurmError", "RPCError") if hasattr(ps, n))
        try:
            return fn(*args)
        except errors + (ValueError,) as exc:
            raise scheduler_error(description_argv, exc, ps) from exc

    # -- viability --------------------------------------------------------------------

    def probe(self) -> Probe:
        """Viable when pyslurm imports, reaches slurmctld, and both are the same
        Slurm major.minor; ``version`` is then slurmctld's Slurm version."""
        if self._module is None and "pyslurm" not in sys.modules:
            if importlib.util.find_spec("pyslurm") is None:
                return self._not_viable(f"pyslurm is not installed: {INSTALL_HINT}")
            crash = _import_crashes()
        else:
            crash = ""
        if crash:
            return self._not_viable(f"importing pyslurm fails in a test process ({crash}); "
                                    f"it must match the running Slurm: {INSTALL_HINT}")
        try:
            ps = self._pyslurm()
        except ModuleNotFoundError as exc:
            if exc.name == "pyslurm":
                return self._not_viable(f"pyslurm is not installed: {INSTALL_HINT}")
            return self._not_viable(f"pyslurm failed to import ({exc}): {INSTALL_HINT}")
        except Exception as exc:  # a libslurm of another release fails right here
            return self._not_viable(
                f"pyslurm is installed but cannot load ({exc}); it must be built against the "
                f"libslurm of the running Slurm: {INSTALL_HINT}")
        try:
            # pyslurm/core/slurmctld/config.pyx: Config.load() (slurm_load_ctl_conf RPC)
            config = self._call(["pyslurm", "slurmctld.Config.load"], ps.slurmctld.Config.load)
        except SchedulerError as exc:
            return self._not_viable(f"pyslurm cannot reach slurmctld: {exc}")
        slurm_version = str(getattr(config, "version", "") or "")
        pyslurm_version = str(getattr(ps, "__version__", ""))
        if _major_minor(slurm_version) != _major_minor(pyslurm_version):
            return self._not_viable(
                f"pyslurm {pyslurm_version} is built for Slurm {_major_minor(pyslurm_version)} but "
                f"slurmctld runs {slurm_version}; install the pyslurm release matching "
                f"{_major_minor(slurm_version)} or use the CLI backend")
        return Probe(backend=self.name, viable=True, reason="", version=slurm_version)

    def _not_viable(self, reason: str) -> Probe:
        return Probe(backend=self.name, viable=False, reason=reason)

    # -- reading ----------------------------------------------------------------------

    def list_jobs(self, job_ids: Iterable[str] | None = None) -> list[Job]:
        ps = self._pyslurm()
        # pyslurm/core/job/job.pyx: Jobs.load() -- one slurm_load_jobs RPC for all jobs
        loaded = self._call(["pyslurm", "Jobs.load"], ps.Jobs.load)
        # pyslurm/xcollections.pyx: the collection's values() walks every cluster's jobs
        jobs = [job_from_pyslurm(obj) for obj in loaded.values()]
        self.listings.check(jobs, self.lookup_job)
        return select_jobs(jobs, job_ids)

    def get_job(self, job_id: str) -> Job:
        job_id = str(job_id)
        if job_id.isdigit():
            ps = self._pyslurm()
            # pyslurm/core/job/job.pyx: Job.load(job_id) -- slurm_load_job RPC
            obj = self._call(["pyslurm", "Job.load", job_id], ps.Job.load, int(job_id))
            if int(obj.id) == int(job_id):
                return job_from_pyslurm(obj)
        # An array task ("A_T"), or an array id whose first record is another task.
        found = self.list_jobs([job_id])
        if not found:
            raise _job_not_found(job_id)
        return next((j for j in found if j.job_id == job_id), found[0])

    def list_nodes(self, names: Iterable[str] | None = None) -> list[Node]:
        ps = self._pyslurm()
        # pyslurm/core/node.pyx: Nodes.load() -- node and partition RPCs, once
        loaded = self._call(["pyslurm", "Nodes.load"], ps.Nodes.load)
        nodes = [node_from_pyslurm(obj) for obj in loaded.values()]
        if names is None:
            return nodes
        wanted = set(names)
        return [n for n in nodes if n.name in wanted]

    def get_node(self, name: str) -> Node:
        ps = self._pyslurm()
        # pyslurm/core/node.pyx: Node.load(name) -- slurm_load_node_single RPC
        return node_from_pyslurm(self._call(["pyslurm", "Node.load", name], ps.Node.load, name))

    # -- changing jobs ----------------------------------------------------------------

    def _numeric_id(self, job_id: str) -> int:
        """pyslurm addresses jobs by number only; find an array task's own number."""
        job_id = str(job_id)
        if job_id.isdigit():
            return int(job_id)
        array_id, _, task = job_id.partition("_")
        if not (array_id.isdigit() and task.isdigit()):
            raise SchedulerError(f"not a job id: {job_id!r}", argv=["pyslurm", job_id])
        jobs = self.list_jobs()
        for job in jobs:
            if job.job_id == job_id:
                return job.numeric_id
        if any(j.array_job_id == int(array_id) and j.array_task_id is None for j in jobs):
            raise SchedulerError(
                f"array task {job_id} is still pending inside its array record and has no "
                "job id of its own; pyslurm cannot address it (use the CLI backend)",
                argv=["pyslurm", "Jobs.load"])
        raise _job_not_found(job_id)

    def _on_job(self, job_id: str, words: list[str], action: Callable[[Any], Any]) -> None:
        """Apply ``action`` to ``pyslurm.Job(number)``; ``words`` describe it for errors."""
        ps = self._pyslurm()
        number = self._numeric_id(job_id)
        self._call(["pyslurm", words[0], str(number), *words[1:]], lambda: action(ps.Job(number)))

    def _modify(self, job_id: str, words: list[str], **changes: Any) -> None:
        ps = self._pyslurm()
        # pyslurm/core/job/job.pyx: Job.modify(JobSubmitDescription) -- slurm_update_job;
        # pyslurm/core/job/submission.pyx: JobSubmitDescription(**attributes)
        self._on_job(job_id, ["Job.modify", *words],
                     lambda job: job.modify(ps.JobSubmitDescription(**changes)))

    def requeue_hold(self, job_id: str) -> None:
        # pyslurm/core/job/job.pyx: Job.requeue(hold=True) -- slurm_requeue, JOB_REQUEUE_HOLD
        self._on_job(job_id, ["Job.requeue", "hold=True"], lambda job: job.requeue(hold=True))

    def set_excluded_nodes(self, job_id: str, nodes: Sequence[str]) -> None:
        if not nodes:
            # pyslurm turns an empty value into NULL, which slurmctld reads as
            # "leave unchanged", so the list cannot be cleared through it.
            raise SchedulerError("pyslurm cannot clear a job's excluded nodes "
                                 "(use the CLI backend: scontrol update ExcNodeList=)",
                                 argv=["pyslurm", "Job.modify", str(job_id), "excluded_nodes="])
        self._modify(job_id, [f"excluded_nodes={','.join(nodes)}"], excluded_nodes=list(nodes))

    def allow_requeue(self, job_id: str) -> None:
        self._modify(job_id, ["is_requeueable=True"], is_requeueable=True)

    def start_now(self, job_id: str) -> None:
        # "now" goes through libslurm's time parser, like scontrol's StartTime=now.
        self._modify(job_id, ["begin_time=now"], begin_time="now")

    def release(self, job_id: str) -> None:
        # pyslurm/core/job/job.pyx: Job.release() -- priority reset via slurm_update_job
        self._on_job(job_id, ["Job.release"], lambda job: job.release())

    def cancel(self, job_id: str, signal: str | None = None) -> None:
        if signal is None:
            # pyslurm/core/job/job.pyx: Job.cancel() -- SIGKILL through slurm_kill_job
            self._on_job(job_id, ["Job.cancel"], lambda job: job.cancel())
            return
        sig = _signal_name(signal)
        # pyslurm/core/job/job.pyx: Job.send_signal(sig) -- every step but the batch
        # shell, as a plain `scancel --signal` does
        self._on_job(job_id, ["Job.send_signal", str(sig)], lambda job: job.send_signal(sig))

    def signal_job(self, job_id: str, signal: str, batch: bool = False) -> None:
        sig = _signal_name(signal)
        steps = "batch" if batch else "children"
        # pyslurm/core/job/job.pyx: Job.send_signal(sig, steps=...) -- "children": every
        # step but the batch shell; "batch": the batch shell only
        self._on_job(job_id, ["Job.send_signal", str(sig), f"steps={steps}"],
                     lambda job: job.send_signal(sig, steps=steps))

    # -- changing nodes ---------------------------------------------------------------

    def drain_node(self, name: str, reason: str) -> None:
        ps = self._pyslurm()
        # pyslurm/core/node.pyx: Node.modify(Node(state=..., reason=...)) -- slurm_update_node
        self._call(["pyslurm", "Node.modify", name, "state=DRAIN", f"reason={reason}"],
                   lambda: ps.Node(name).modify(ps.Node(state="DRAIN", reason=reason)))

    def resume_node(self, name: str) -> None:
        ps = self._pyslurm()
        # pyslurm/core/node.pyx: Node.modify(Node(state="RESUME")) -- also lifts a drain
        self._call(["pyslurm", "Node.modify", name, "state=RESUME"],
                   lambda: ps.Node(name).modify(ps.Node(state="RESUME")))
