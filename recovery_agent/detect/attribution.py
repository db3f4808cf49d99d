"""Attribution: from detections to a verdict -- a node, the application, or unknown.

``attribute(detections, context)`` weighs what the scanner found in a job's
logs together with what the context adds: the job's nodes, a rank -> host map,
XIDs and GPU faults from the node reports in the job's window, Slurm's
NODE_FAIL and node states, and the verdicts of the job's earlier attempts.

How the winning detection is chosen (roles are model.ROLES):

1. A ``root`` detection that excludes a node (a fatal XID, a GPU off the bus,
   a node failure) explains everything else, whatever the order.
2. Else the earliest ``cause``: the first error in the log is the one the
   others follow from (an application error before the NCCL timeouts it
   causes; an IB error before the tracebacks it provokes).
3. Else the earliest ``symptom`` (timeouts, peers that went away), then the
   earliest ``exit`` report (exit codes, aborts). Info-level lines never win.

Within the winner's tier, the strongest action among detections of its
category is taken (two XIDs: the one asking to requeue beats the one asking
to stop). A ``requeue_exclude`` verdict names the hosts the evidence names
(ranks mapped to hosts, peer addresses to names); a single-node job names its
node. A failure that names no node, repeated over attempts that share exactly
one node, blames that node.

``rests_on`` indexes :func:`~.evidence.all_detections` (the input detections,
then the context's own), which equals the input list when the context adds
nothing.
"""
from __future__ import annotations

import re
from dataclasses import replace
from typing import Iterable, Sequence

from .attempts import across_attempts
from .context import AttributionContext, _expand
from .evidence import _node_name, all_detections
from .model import Detection, Verdict
from .origin import line_origin

__all__ = ["attribute"]

_STRENGTH = {"none": 0, "stop": 1, "requeue": 2, "kill_requeue": 3, "requeue_exclude": 4}
_TIER_CONFIDENCE = {0: 0.9, 1: 0.8, 2: 0.6, 3: 0.5, 4: 0.4}
_APPLICATION = {"application", "oom", "segfault", "cuda_error", "nccl_timeout_hang",
                "gpu_hardware"}


# -- the verdict ------------------------------------------------------------------

# What the chosen lines say, read off the emitters' own wording (CUDA runtime
# strings, errno texts, PyTorch's store and launcher messages), whichever rule
# surfaced the line. These decide what a verdict is, not whether a line fires.
_FULL_DISK = re.compile(r"No space left on device|\[Errno 28\]|\bENOSPC\b|Disk quota exceeded"
                        r"|\[Errno 122\]|\bEDQUOT\b")
_QUOTA = re.compile(r"Disk quota exceeded|\[Errno 122\]|\bEDQUOT\b")
_WRITE_FAILED = re.compile(r"PytorchStreamWriter failed writing|unexpected pos \d+ vs \d+"
                           r"|Input/output error|\[Errno 5\]|\bEIO\b")
# cudaGetErrorString() of the errors a failing GPU causes as well as a bad kernel
# (700, 719, 46, 214, 999, with the driver's CUDA_ERROR_* names; THC's old
# "cuda runtime error (N) : <string>" too; ROCm's names for the first)
_GPU_MAYBE = (("illegal_address", re.compile(r"an illegal memory access was encountered"
                                             r"|cudaErrorIllegalAddress|CUDA_ERROR_ILLEGAL_ADDRESS"
                                             r"|hipErrorIllegalAddress|Memory access fault by GPU node-")),
              ("launch_failure", re.compile(r"unspecified launch failure|cudaErrorLaunchFailure"
                                            r"|CUDA_ERROR_LAUNCH_FAILED")),
              ("ecc", re.compile(r"uncorrectable ECC error encountered|cudaErrorECCUncorrectable"
                                 r"|CUDA_ERROR_ECC_UNCORRECTABLE")),
              ("busy", re.compile(r"busy or unavailable|cudaErrorDevicesUnavailable"
                                  r"|CUDA_ERROR_DEVICE_UNAVAILABLE")),
              ("unknown", re.compile(r"\bunknown error\b|cudaErrorUnknown|CUDA_ERROR_UNKNOWN")),
              # 220 and 226: the GPU's NVLink or its error containment saw a hardware fault
              ("nvlink", re.compile(r"uncorrectable NVLink error detected|cudaErrorNvlinkUncorrectable"
                                    r"|CUDA_ERROR_NVLINK_UNCORRECTABLE")),
              ("contained", re.compile(r"Invalid access of peer GPU memory over nvlink or a hardware "
                                       r"error|cudaErrorContained|CUDA_ERROR_CONTAINED")))
# 3 cudaErrorInitializationError, and PyTorch's own refusal (torch/cuda/__init__.py
# _lazy_init) to start CUDA in a child forked after the parent started it
_CUDA_INIT = re.compile(r"\binitialization error\b|cudaErrorInitializationError"
                        r"|CUDA_ERROR_NOT_INITIALIZED|Cannot re-initialize CUDA in forked subprocess")
# A forked worker's own lines: PyTorch's DataLoader re-raising a worker's exception
# (torch/_utils.py ExceptionWrapper: "Caught <E> in DataLoader worker process N";
# before 1.2 the worker's whole traceback as the message: "RuntimeError: Traceback
# (most recent call last):", the header of the traceback the scanner reads), a
# worker that died (torch/utils/data/dataloader.py "DataLoader worker (pid N) is
# killed by signal" / "exited unexpectedly"), multiprocessing's "Process Process-N:"
# before a child's traceback, and PyTorch's message for CUDA in a forked child
_FORKED = re.compile(r"in DataLoader worker process \d+|DataLoader worker \(pids?\(?s?\)? ?[\d, ]+\)?"
                     r" (?:is killed by signal|exited unexpectedly)"
                     r"|\b[A-Z]\w*(?:Error|Exception): Traceback \(most recent call last\)"
                     r"|^Process (?:Fork)?Process-\d+:|Cannot re-initialize CUDA in forked subprocess")
# c10d's TCPStore, its socket and the rendezvous on top (torch/csrc/distributed/c10d,
# torch/distributed/elastic/rendezvous): the store host, not a node's fabric. The
# store side (a broken or timed-out store connection, a store key never set, a
# rendezvous that timed out) is a collective setup timeout; a client that cannot
# connect to the store endpoint at all keeps its rule's category.
_STORE = re.compile(r"\[c10d\]|TCPStore|C10d store|c10d key-value store|store->get\("
                    r"|Rendezvous(?:Connection|Timeout|Closed)Error|SocketImpl\(|clients joined"
                    r"|The client socket has (?:timed out|failed to connect)")
_DEVICE_STATE = ("ecc", "busy", "unknown", "nvlink")   # the device's own state, not a kernel's fault
_STORE_SIDE = re.compile(r"TCPStore|c10d key-value store|store->get\(|SocketImpl\("
                         r"|clients joined|RendezvousTimeoutError|wait timeout after \d+ms")
# DataLoader workers that died of a bus error in /dev/shm: retried once (another
# job's leftovers may have filled it), stopped when it comes back (too small)
_SHM_RULES = ("pytorch.dataloader_shm", "signal.dataloader_bus_error")
# The collective a PyTorch watchdog gave up on: WorkNCCL's own description of it
# ("WorkNCCL(SeqNum=808, OpType=ALLREDUCE, NumelIn=9801523, NumelOut=...,
# Timeout(ms)=...)", NumelIn since 2.1): where in the job's run the hang was
_TIMED_OUT_WORK = re.compile(r"WorkNCCL\(SeqNum=(\d+), OpType=(\w+)(?:, NumelIn=(\d+))?")
# The work was done: the frameworks' own end-of-training messages
_DONE = re.compile(r"`Trainer\.fit` stopped: `max_(?:epochs|steps|time)=[^`]*` reached"
                   r"|worker group successfully finished"
                   r"|Training completed\. Do not forget to share your model"
                   r"|End time of running main:")
# A stack frame (Open MPI / glibc "path(sym+0x..)[0x..]", UCX " N 0x.. sym()  file:line"
# or " N path(sym+0x..) [0x..]", gdb "#N 0x.. in sym () from path") and the kernel's
# "segfault at .. in <object>[..]": the object or symbol a fault was in.
_FRAME = re.compile(r"(?:^|\]\s*|\s)(?:\[\s*\d+\]\s+|\d+\s+(?:0x[0-9a-f]+\s+)?|#\d+\s+0x[0-9a-f]+ in )"
                    r"(?P<where>[^\s(]+)\s?\(")
_GDB_FROM = re.compile(r"#\d+\s+0x[0-9a-f]+ in \S+ \(.*?\) from (?P<where>\S+)")
_KERNEL_IN = re.compile(r"(?:segfault at|general protection(?: fault)?|traps:).*? in "
                        r"(?P<where>[^\s\[]+)\[")
# frames of the signal handler itself (UCX's, glibc's trampoline): not where it crashed
# (UCX's handler lives in libucs: a fault in UCX itself shows libuct/libucp frames)
_HANDLER = re.compile(r"ucs_handle_error|ucs_error_signal_handler|__sigaction|__restore_rt"
                      r"|_sigtramp|<signal handler called>|(?:^|/)libc\.so|(?:^|/)libpthread\.so"
                      r"|(?:^|/)ld-linux|(?:^|/)libucs\.so|libSegFault|\bbacktrace\b")
# NCCL, verbs and its providers, UCX, libfabric/EFA, Open MPI's transport
# components, PSM2, HCOLL, SHARP: the communication stack, which runs its own
# progress threads and reacts to fabric events (a peer or link that went away)
_FABRIC_CODE = re.compile(r"lib(?:nccl|rccl|ibverbs|mlx[45]|rdmacm|efa|fabric|ucs|ucp|uct|ucm"
                          r"|psm2|hcoll|sharp)\b"
                          r"|\bmca_(?:btl|pml|mtl|coll|osc)_|\bp?nccl[A-Z]\w*|\bibv_\w+"
                          r"|\bmlx[45]_\w+|\bu(?:ct|cp)_\w+|^the process group backend\b")
# the CUDA driver and NVIDIA's user-space driver libraries (libcuda's cu* entry
# points): entered only from the job's own calls, so a crash there repeats with
# the same code and driver (an invalid handle or pointer passed in, a driver
# regression) unless node evidence (an XID) blames the GPU
_DRIVER_CODE = re.compile(r"lib(?:cuda|nvidia-[\w-]+|nvcuda)\b|\bcu[A-Z][A-Za-z]+(?:_v\d)?\b")
_SYSTEM_CODE = re.compile(f"{_FABRIC_CODE.pattern}|{_DRIVER_CODE.pattern}")
# faulthandler's dump (signal.faulthandler_* rules): the crashing thread's
# header, and a frame of torch.distributed's collective API under it
_CURRENT_THREAD = "signal.faulthandler_current_thread"
_COLLECTIVE_FRAME = re.compile(r'File "[^"]*torch/distributed/distributed_c10d\.py", line \d+ '
                               r"in (?P<call>\w+)")
_BUS = re.compile(r"Bus error|SIGBUS|[Ss]ignal 7\b")
_FRAME_WINDOW = 40          # lines after a fault report where its backtrace is read


def attribute(detections: Sequence[Detection],
              context: AttributionContext | None = None) -> Verdict:
    """The verdict the detections (and the context) support; see the module doc."""
    context = context or AttributionContext()
    combined = all_detections(detections, context)
    weighed = [(i, d) for i, d in enumerate(combined) if d.severity != "info"]
    if not weighed:
        reason = "no failure evidence" if not combined else "only informational lines"
        return Verdict(blame="unknown", category=None, action="none", confidence=0.0,
                       reason=reason)
    tier = min(_tier(d) for _, d in weighed)
    pool = [(i, d) for i, d in weighed if _tier(d) == tier]
    win_index, winner = pool[0]
    if tier == 0:
        chosen = pool
        action = "requeue_exclude"
    else:
        chosen = [(i, d) for i, d in pool if d.category == winner.category]
        action = max((d.action_hint for _, d in chosen), key=_STRENGTH.__getitem__)
    if tier in (2, 3):
        verdict = _unexplained(winner, chosen, action, tier, combined, context)
    else:
        verdict = _blame(winner, chosen, action, tier, context)
        if tier == 1:
            verdict = _read_cause(verdict, winner, chosen, weighed, combined, context)
    verdict = replace(verdict, where=_where_named(d for _, d in chosen))
    return across_attempts(verdict, context.nodes, context.previous)



def _where_named(detections: Iterable[Detection]) -> tuple[str, ...]:
    """The hosts and PCI addresses the lines name, in order, each once."""
    found = list(detections)
    return tuple(_unique([*_hosts(found), *(d.pci for d in found)]))


def _tier(d: Detection) -> int:
    if d.role == "root" and d.action_hint == "requeue_exclude":
        return 0
    if d.action_hint == "none":
        return 4
    return {"root": 1, "cause": 1, "symptom": 2, "exit": 3}.get(d.role, 1)


def _where(d: Detection) -> str:
    return f"{d.rule}" + (f" at line {d.line}" if d.line else "")


def _blame(winner: Detection, chosen: list[tuple[int, Detection]], action: str, tier: int,
           context: AttributionContext) -> Verdict:
    category = winner.category
    rests_on = tuple(sorted(i for i, _ in chosen))[:20]
    confidence = _TIER_CONFIDENCE[tier] + (0.05 if len(chosen) > 1 else 0.0)
    where = _where(winner)
    node_side = action == "requeue_exclude" or (category == "gpu_hardware" and action != "stop")
    if not node_side:
        blame = "application" if action == "stop" and category in _APPLICATION else "unknown"
        return Verdict(blame=blame, category=category, action=action,
                       confidence=round(min(confidence, 0.95), 2), rests_on=rests_on,
                       reason=f"{where}: {winner.detail}".strip(": "),
                       suspects=tuple(_peers((d for _, d in chosen), context)))
    hosts = _hosts(d for _, d in chosen)
    if not hosts and action == "requeue_exclude":
        hosts = _the_one_node(chosen, context)
    gpus = _unique(d.pci or d.gpu for _, d in chosen if d.category == "gpu_hardware")
    links = _unique(d.pci for _, d in chosen if d.category == "interconnect")
    if action == "requeue_exclude" and not (hosts or gpus or links):
        confidence -= 0.15
    return Verdict(blame="node", category=category, action=action,
                   confidence=round(min(confidence + (0.05 if hosts else 0), 0.97), 2),
                   nodes=tuple(hosts), gpus=tuple(gpus), links=tuple(links),
                   rests_on=rests_on, reason=f"{where}: {winner.detail}".strip(": "))


def _unexplained(winner: Detection, chosen: list[tuple[int, Detection]], action: str,
                 tier: int, combined: Sequence[Detection],
                 context: AttributionContext) -> Verdict:
    """A verdict made of symptoms (timeouts, peers that went away, store errors)
    and exit reports (task exits, aborts, launcher summaries) alone. These are
    what any failure leaves behind: no blame, no stop, no exclusion. The
    category is the symptom's layer (a store or rendezvous timeout is a
    collective setup timeout, not a node's fabric); an exit code, or any
    line filed under the application, has none: only a cause can say the
    program is at fault.
    Policy requeues it within ``unknown_max_restarts``."""
    rests_on = tuple(sorted(i for i, _ in chosen))[:20]
    texts = [_text(d) for _, d in chosen]
    store = any(_STORE.search(t) for t in texts)
    # an exit code or a symptom does not say the program is at fault (no stop,
    # no application blame from them); a signal (SIGKILL, SIGSEGV) or a
    # timeout's layer does
    category = None if winner.category == "application" else winner.category
    if category in ("interconnect", "system_software", None) and any(
            _STORE_SIDE.search(t) for t in texts):
        category = "nccl_timeout_hang"
    if store:
        suspects = [h for h in _hosts(d for _, d in chosen) if h in context.nodes]
        kind = "a store or rendezvous failure (the store host went away, or the job raced at start)"
    else:
        suspects = _peers((d for _, d in chosen), context)
        kind = "only symptoms and exit reports, what any failure leaves behind"
    reason = f"{_where(winner)}: {winner.detail}".strip(": ")
    done = _finished_before(winner, combined)
    if done is not None:
        return Verdict(blame="unknown", category=category, action="none",
                       confidence=_TIER_CONFIDENCE[tier], rests_on=rests_on,
                       signature="done",
                       reason=f"{reason}; the work had finished before it "
                              f"({_where(done)}: {_text(done)[:120]}): nothing to redo")
    return Verdict(blame="unknown", category=category,
                   action="kill_requeue" if action == "kill_requeue" else "requeue",
                   confidence=_TIER_CONFIDENCE[tier], rests_on=rests_on, unexplained=True,
                   suspects=tuple(suspects), signature=_hang_signature(texts),
                   reason=f"{reason}; unexplained: {kind}")


def _hang_signature(texts: Sequence[str]) -> str:
    """``hang:OP:SEQ[:NUMEL]`` for the first collective a watchdog timed out
    on, which tells two attempts' hangs at the same point of the run apart
    from hangs at different points (see across_attempts)."""
    for text in texts:
        work = _TIMED_OUT_WORK.search(text)
        if work:
            seq, op, numel = work.groups()
            return f"hang:{op}:{seq}" + (f":{numel}" if numel else "")
    return ""


def _read_cause(verdict: Verdict, winner: Detection, chosen: list[tuple[int, Detection]],
                weighed: list[tuple[int, Detection]], combined: Sequence[Detection],
                context: AttributionContext) -> Verdict:
    """A first-hand cause read for what it says about the node or the code:
    a full disk, a write failure, a CUDA error a GPU may cause, a segfault and
    where it happened, a store failure."""
    texts = [_text(d) for _, d in chosen]
    if winner.category == "system_software" and any(d.rule in _SHM_RULES for _, d in chosen):
        verdict = replace(verdict, signature="shm")
    if any(d.rule == "cuda.driver_too_old" for _, d in chosen):
        # the node's driver stack, or the job's build or library path where
        # every node answers the same: told apart by where it happens next
        verdict = replace(verdict, signature="cuda:driver")
    if winner.category == "system_software":
        full = next((d for _, d in chosen if _FULL_DISK.search(_text(d))), None)
        if full is not None:
            what = ("over its quota" if _QUOTA.search(_text(full))
                    else "full (no space left on device)")
            return replace(verdict, action="stop", blame="unknown", nodes=(), gpus=(),
                           links=(), reason=f"{_where(full)}: the filesystem is {what}: "
                           f"free space or raise the quota, a retry fails the same way "
                           f"({_text(full)[:160]})")
        if verdict.action == "stop" and any(_WRITE_FAILED.search(t) for t in texts):
            return replace(verdict, action="requeue", blame="unknown",
                           signature="io:write",
                           reason=f"{verdict.reason}; an I/O error without a full disk "
                                  "or quota: retried (stopped if it comes back)")
    # (NCCL runs in the training process, never in a forked data worker)
    if winner.category == "cuda_error" and any(_CUDA_INIT.search(t) and "NCCL" not in t
                                               for t in texts):
        forked = next((d for d in combined if _FORKED.search(_text(d))), None)
        if forked is not None:
            return replace(verdict, blame="application", action="stop", nodes=(), gpus=(),
                           links=(), signature="",
                           reason=f"{verdict.reason}; in a forked worker process "
                                  f"({_where(forked)}: {_text(forked)[:120]}): CUDA was started "
                                  "before the fork; start workers with 'spawn' or keep CUDA out "
                                  "of them (the job's code, not the node)")
    if winner.category == "cuda_error":
        kind = next((name for name, rx in _GPU_MAYBE if any(rx.search(t) for t in texts)), "")
        if kind:
            return _gpu_maybe(verdict, kind, chosen, weighed, context)
    if winner.category == "segfault":
        return _segfault(verdict, winner, chosen, combined, context)
    if any(_STORE.search(t) for t in texts) and verdict.category in ("interconnect",
                                                                     "system_software"):
        hosts = [h for h in verdict.nodes if h in context.nodes]
        if verdict.action == "requeue_exclude":
            return replace(verdict, blame="unknown", action="requeue", nodes=(), gpus=(),
                           links=(), suspects=tuple(hosts),
                           reason=f"{verdict.reason}; a store or rendezvous failure: not a "
                                  "node's fabric")
    return verdict


def _gpu_maybe(verdict: Verdict, kind: str, chosen: list[tuple[int, Detection]],
               weighed: list[tuple[int, Detection]], context: AttributionContext) -> Verdict:
    """A CUDA error that a failing GPU causes as well as a bad kernel. With a
    GPU fault that node-level evidence reports (an XID, a GPU gone: not one the
    application causes), the node; without, the first one is requeued (policy
    stops it once it follows the job onto fresh nodes, and excludes the node it
    stays with)."""
    faults = [(i, d) for i, d in weighed if d.category == "gpu_hardware"
              and d.action_hint in ("requeue", "requeue_exclude", "kill_requeue")
              and (d.host or d.pci or d.gpu)]
    suspects = tuple(_hosts(d for _, d in chosen))
    if suspects and any(d.host for _, d in faults):    # the fault must be where it happened
        faults = [(i, d) for i, d in faults if d.host in suspects]
    if kind == "contained":     # Xid 94 (contained: restart the program) leaves the GPU usable
        faults = [(i, d) for i, d in faults if d.action_hint == "requeue_exclude"]
    signature = f"cuda:{kind}"
    where = f"CUDA error ({kind.replace('_', ' ')})"
    if faults:
        hosts = _hosts(d for _, d in faults)
        gpus = _unique(d.pci or d.gpu for _, d in faults)
        return replace(verdict, blame="node", category="gpu_hardware",
                       action="requeue_exclude", nodes=tuple(hosts), gpus=tuple(gpus),
                       rests_on=tuple(sorted({*verdict.rests_on, *(i for i, _ in faults)}))[:20],
                       signature=signature, confidence=0.85,
                       reason=f"{verdict.reason}; with a GPU fault on "
                              f"{', '.join(hosts or gpus)} ({_where(faults[0][1])}): the GPU")
    if kind in _DEVICE_STATE and verdict.action != "stop":   # the device reports itself
        return replace(verdict, signature=signature, suspects=suspects)
    return replace(verdict, blame="unknown", action="requeue", nodes=(), gpus=(), links=(),
                   signature=signature, suspects=suspects,
                   reason=f"{verdict.reason}; {where} may be the GPU or the code: requeued "
                          "once, stopped if it follows the job to other nodes")


def _segfault(verdict: Verdict, winner: Detection, chosen: list[tuple[int, Detection]],
              combined: Sequence[Detection], context: AttributionContext) -> Verdict:
    """Where a segfault happened, from its backtrace or the kernel's report:
    inside NCCL or a fabric library it is not the job's bug: requeued, the
    node it happened on a suspect (excluded once the crash stays with it);
    inside the CUDA driver it repeats with the same code and driver (stop);
    elsewhere (the job's code, its framework, or not known) it stops."""
    where = _fault_object(winner, chosen, combined)
    if where is None or not _SYSTEM_CODE.search(where):
        return replace(verdict, signature="segfault:code" if where else "segfault",
                       reason=verdict.reason + (f"; in {where}" if where else ""))
    if not _FABRIC_CODE.search(where):
        return _driver_segfault(verdict, where)
    # a bus error there is most often shared memory the container or the job
    # sized too small (NCCL's /dev/shm segments): not the node's fault either
    bus = any(_BUS.search(_text(d)) for _, d in chosen)
    hosts = [] if bus else _hosts(d for _, d in chosen)
    reason = (f"{verdict.reason}; the fault is in {where} (a communication library), "
              "not the job's code: requeued, stopped if it follows the job to other nodes")
    if hosts:
        reason += f", {', '.join(hosts)} excluded if it stays there"
    return replace(verdict, blame="unknown", action="requeue", nodes=(), gpus=(), links=(),
                   signature="segfault:library", suspects=tuple(hosts), reason=reason)


def _driver_segfault(verdict: Verdict, where: str) -> Verdict:
    """A segfault inside the CUDA driver's libraries, with no GPU fault that
    outranks it (an XID asking to exclude the node is a root and wins before
    this): the
    driver is only entered from the job's calls, so the same code on the same
    driver crashes again."""
    return replace(verdict, blame="application", action="stop", nodes=(), gpus=(), links=(),
                   signature="segfault:driver",
                   reason=f"{verdict.reason}; the fault is in {where} (the CUDA driver), "
                          "reached from the job's own calls: the same code and driver crash "
                          "the same way (an invalid handle or pointer, a driver regression)")


def _fault_object(winner: Detection, chosen: list[tuple[int, Detection]],
                  combined: Sequence[Detection]) -> str | None:
    """The object (library, binary) or symbol the fault was in: the kernel's
    ``in <object>`` on a fault report, else the first frame of the backtrace
    printed with it that is not the signal handler's own (frames that a rule
    surfaced, as a cause or as context)."""
    for _, d in chosen:
        match = _KERNEL_IN.search(_text(d))
        if match:
            return match.group("where")
    start, source = winner.line, winner.evidence[0].source if winner.evidence else ""
    near = [d for _, d in chosen]
    if start is not None:
        near += [d for d in combined if d.line is not None
                 and start <= d.line <= start + _FRAME_WINDOW
                 and d.evidence and d.evidence[0].source == source]
    collective = _collective_frame(sorted(near, key=lambda d: d.line or 0))
    if collective:
        return collective
    for text in dict.fromkeys(_text(d) for d in sorted(near, key=lambda d: d.line or 0)):
        match = _GDB_FROM.search(text) or _FRAME.search(text) or _KERNEL_IN.search(text)
        if match and not _HANDLER.search(match.group("where")) and not _HANDLER.search(text):
            return match.group("where")
    return None


def _collective_frame(near: Sequence[Detection]) -> str | None:
    """The crashing thread's innermost Python frame, when faulthandler's dump
    puts it in a torch.distributed collective (the line right after the
    "Current thread" header): the fault is in the process group's backend
    (NCCL, Gloo), which ``_FABRIC_CODE`` reads as the communication stack."""
    header = None
    for d in near:
        if d.rule == _CURRENT_THREAD:
            header = d
            continue
        if header is not None and d.line is not None and header.line is not None:
            match = _COLLECTIVE_FRAME.search(_text(d))
            if match and d.line == header.line + 1:
                return f"the process group backend (torch.distributed {match.group('call')})"
            header = None if d.line > header.line + 1 else header
    return None


def _finished_before(winner: Detection, combined: Sequence[Detection]) -> Detection | None:
    """A line saying the work was done (the trainer reached its last epoch or
    step, torchrun's workers succeeded) before the first symptom."""
    source = winner.evidence[0].source if winner.evidence else ""
    for d in combined:
        if (d.line is not None and winner.line is not None and d.line < winner.line
                and d.evidence and d.evidence[0].source == source and _marks_done(d)):
            return d
    return None


def _marks_done(d: Detection) -> bool:
    """A line a training framework prints once its work is saved: the
    lifecycle pack's rules, or the wording ``_DONE`` knows."""
    return d.rule.startswith("lifecycle.") or bool(_DONE.search(_text(d)))


def _the_one_node(chosen: list[tuple[int, Detection]], context: AttributionContext) -> list[str]:
    """The node hostless node-side evidence is on when the job (or the log)
    has only one: the job's single node; else, while the job's nodes are not
    known (a log read offline), the one host every prefixed line of the log
    was printed on (a pasted single-node log whose failure line carries no
    prefix: a Python traceback, a CUDA error). Never for a line whose rule
    names the other side (its peer was not read: the printer is not it)."""
    if len(context.nodes) == 1:
        return list(context.nodes)
    if context.nodes or len(context.printers) != 1 or any(d.peer for _, d in chosen):
        return []
    return [_node_name(context.printers[0], context)]


def _text(d: Detection) -> str:
    return " ".join(e.text for e in d.evidence[:3])


def _peers(detections: Iterable[Detection], context: AttributionContext) -> list[str]:
    """Hosts the lines name as the other side (a peer address, a remote
    host), not the node that printed them."""
    out: list[str] = []
    for d in detections:
        if not d.host or not d.evidence or "," in d.host:
            continue
        origin = line_origin(d.evidence[0].text)
        printed = {origin.host, context.rank_hosts.get(d.rank) if d.rank is not None else None,
                   context.task_hosts.get(origin.task) if origin.task is not None else None}
        printed |= {_node_name(h, context) for h in printed if h}
        if d.host not in printed and d.host not in out:
            out.append(d.host)
    return out


def _hosts(detections: Iterable[Detection]) -> list[str]:
    out: list[str] = []
    for d in detections:
        for host in _expand(d.host) if d.host else ():
            if host not in out:
                out.append(host)
    return out


def _unique(values: Iterable[str | None]) -> list[str]:
    out: list[str] = []
    for value in values:
        if value and value not in out:
            out.append(value)
    return out
