"""The evidence a verdict weighs: the job's detections with hosts filled in
and vetted (what a line the job wrote itself may prove), then the context's
node reports, NODE_FAIL nodes and bad node states as detections of their own."""
from __future__ import annotations

import re
from dataclasses import replace
from typing import Sequence

from .context import AttributionContext, _expand
from .model import Detection, Evidence
from .origin import line_origin, names_no_node
from .patterns import xid_action, xid_category

__all__ = ["all_detections"]

_BAD_STATE = re.compile(r"DOWN|FAIL|NOT_RESPONDING|NO_RESPOND|\*")
_IPV4 = re.compile(r"\d{1,3}(?:\.\d{1,3}){3}")


def all_detections(detections: Sequence[Detection],
                   context: AttributionContext | None = None) -> list[Detection]:
    """The detections attribution weighs: the input ones with hosts filled in
    (rank -> host, address -> host), then the context's node reports, NODE_FAIL
    nodes and bad node states as detections of their own."""
    context = context or AttributionContext()
    out = _teardown_exits([_vetted(_fill_host(d, context), context) for d in detections])
    for event in context.node_events:
        if _in_window(event, context.window):
            out.append(_node_event(_fill_host(event, context)))
    for node in context.node_fail:
        out.append(_slurm_detection("slurm.node_fail", node, f"NODE_FAIL {node}"))
    for node, state in sorted(context.node_states.items()):
        if (not context.nodes or node in context.nodes) and _BAD_STATE.search(state.upper()):
            out.append(_slurm_detection("slurm.node_state", node, f"{node} state {state}"))
    return out


# Lines that name another node or process by a number, not a name: srun's
# step node index (src/api/step_launch.c: the I/O connection to a node's
# slurmstepd failed or timed out) and task id (the task a node failed to
# launch), and a coordination-service task (XLA's /job:NAME/replica:R/task:N,
# whose task id is the process id: SLURM_PROCID under Slurm; the service is
# task 0's, the "leader" the other tasks lose).
_STEP_NODE = re.compile(r"(?:io error with slurmstepd on|io error and missing step on|step missing "
                        r"and io error on|can not test connection to|Cannot communicate with) "
                        r"node (\d+)\b")
_TASK_ID = re.compile(r"\btask (\d+) launch failed: ")
_COORD_TASK = re.compile(r"/job:[\w-]+/replica:\d+/task:(\d+)\b")
_COORD_LEADER = re.compile(r"Failed to send RPC to coordination service\. Either the leader task")


def _fill_host(d: Detection, context: AttributionContext) -> Detection:
    host = d.host
    named = _named_elsewhere(d, context) if host is None and d.evidence else None
    if named is not None:       # the line's own prefix names the reporter, not this
        host = named or None
    if host is None and named is None and d.rank is not None:
        host = context.rank_hosts.get(d.rank)
    if host is None and named is None and context.task_hosts and d.evidence:
        task = line_origin(d.evidence[0].text).task
        host = context.task_hosts.get(task) if task is not None else None
    if host is not None and names_no_node(host):
        host = None       # a rank or task placed on a container's id, a placeholder
    if host is not None:
        host = _node_name(host, context)
    return d if host == d.host else replace(d, host=host)


def _named_elsewhere(d: Detection, context: AttributionContext) -> str | None:
    """The host a line names by a step node index, an srun task id or a
    coordination task ("" when it names one that the layout does not place:
    then no node, never the reporter's), None when it names none. Task ids
    map through the srun tasks the log placed (launch lines, ``--label``),
    not through ranks (a JAX process drives several NCCL ranks); a one-node
    job's index 0 and task ids are that node."""
    text = d.evidence[0].text
    if "node " in text and (match := _STEP_NODE.search(text)):
        index = int(match.group(1))
        single = context.nodes[0] if len(context.nodes) == 1 and index == 0 else ""
        return context.node_index.get(index) or single
    single = context.nodes[0] if len(context.nodes) == 1 else ""
    if "leader task" in text and _COORD_LEADER.search(text):
        # the service is process 0's, at the step's first node (jax's SlurmCluster)
        return context.task_hosts.get(0) or context.node_index.get(0) or single
    match = _TASK_ID.search(text) or _COORD_TASK.search(text)
    if match is None:
        return None
    return context.task_hosts.get(int(match.group(1))) or single


def _node_name(host: str, context: AttributionContext) -> str:
    """The node a name in the text stands for: through the address map (IP
    addresses, hostnames), else its short name when that is one of the job's
    nodes or a host the log's prefixes name (NCCL prints short names, its
    peers and torchrun's summary the FQDN)."""
    if host in context.addresses:
        return context.addresses[host]
    if "." in host and host not in context.nodes and "[" not in host \
            and not _IPV4.fullmatch(host):
        short = host.split(".")[0]
        if short in context.nodes or short in context.addresses or short in context.printers:
            return context.addresses.get(short, short)
    return host


def _vetted(d: Detection, context: AttributionContext) -> Detection:
    """What a line the job wrote itself may prove. A kernel, driver or daemon
    message (``emitter = "system"``) there proves nothing about a node: the
    user may have printed it, so it only informs. A host it names counts only
    when it is one of the job's own nodes (none, while those are not known)."""
    if d.origin != "job":
        return d
    if d.emitter == "system":
        return replace(d, severity="info", host=None, role="symptom",
                       detail=f"{d.detail} [a system message in the job's own output: "
                              "not node evidence]")
    if d.host is None:
        return d
    own = [h for h in _expand(d.host) if h in context.nodes]
    if len(own) == len(_expand(d.host)):
        return d
    return replace(d, host=",".join(own) or None,
                   detail=f"{d.detail} [names {d.host}, outside the job's nodes: ignored]")


# Information lines after which a task exit is teardown, not a failure: Slurm
# requeued the job (every later exit in that log is the requeue's), or a
# cleanup killall found nothing left to kill (the exit right after it is the
# killall's own status 1).
_REQUEUED = frozenset({"slurm.requeued"})
_NOTHING_KILLED = frozenset({"signal.killall_found_nothing"})
_CLEANUP_REACH = 3          # lines between killall's report and srun's exit line
# CUDA's exit teardown (cudaErrorCudartUnloading): a C++ abort ("terminate called
# after throwing ...") whose what() line, the next one or two, is this error was
# thrown while the process was already exiting
_AT_EXIT = frozenset({"cuda.driver_shutting_down"})
_ABORTS = frozenset({"signal.abort"})
_WHAT_REACH = 2


def _teardown_exits(detections: list[Detection]) -> list[Detection]:
    """Exit reports (task exits, aborts) that follow a requeue notice in the
    same log, or come right after a killall that found nothing (with no other
    failure line between them), demoted to information: they report the
    requeue's or the cleanup's end, not the job's failure. So is an abort whose
    exception is CUDA's exit teardown (driver shutting down): the process was
    already ending. Causes and symptoms are never demoted."""
    out = list(detections)
    at_exit = {(d.evidence[0].source, d.line) for d in detections
               if d.rule in _AT_EXIT and d.evidence and d.line is not None}
    requeued: dict[str, int] = {}
    cleanup: tuple[str, int] | None = None
    for index, d in enumerate(detections):
        source = d.evidence[0].source if d.evidence else ""
        if d.rule in _REQUEUED and d.line is not None:
            requeued.setdefault(source, d.line)
            continue
        if d.rule in _NOTHING_KILLED and d.line is not None:
            cleanup = (source, d.line)
            continue
        if d.severity == "info":
            continue
        if d.role != "exit" or d.line is None:
            cleanup = None
            continue
        why = ""
        if source in requeued and requeued[source] < d.line:
            why = "after Slurm requeued the job: the requeue's teardown"
        elif cleanup and cleanup[0] == source and 0 < d.line - cleanup[1] <= _CLEANUP_REACH:
            why = "right after a killall that found nothing to kill: the cleanup's own status"
        elif d.rule in _ABORTS and any((source, d.line + k) in at_exit
                                       for k in range(1, _WHAT_REACH + 1)):
            why = "on CUDA's exit teardown (driver shutting down): the process was already ending"
        cleanup = None
        if why:
            out[index] = replace(d, severity="info", action_hint="none",
                                 detail=f"{d.detail} [{why}]")
    return out


def _in_window(d: Detection, window: tuple[float, float] | None) -> bool:
    times = [e.time for e in d.evidence if e.time is not None]
    return window is None or not times or any(window[0] <= t <= window[1] for t in times)


def _node_event(d: Detection) -> Detection:
    """A node-report detection; an XID without an action gets the catalog's."""
    if d.xid is None:
        return d
    action = d.action_hint
    text = d.detail or (d.evidence[0].text if d.evidence else "")
    kind = "sxid" if "SXid" in text else "xid"
    if action == "none":
        action = xid_action(d.xid, text, kind)
    return replace(d, action_hint=action, role="root",
                   category=xid_category(d.xid, action, kind))


def _slurm_detection(rule: str, node: str, text: str) -> Detection:
    return Detection(rule=rule, category="system_software", severity="critical",
                     action_hint="requeue_exclude", role="root", host=node, origin="system",
                     evidence=(Evidence(text, "slurm"),), detail=text)
