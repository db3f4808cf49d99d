"""Where a line was printed: the prefixes log formats and launchers add.

The scanner gives a detection whose rule has no ``host`` group the node the
line's prefixes name (:func:`line_origin`: syslog (with or without a
facility.severity), journald and dmesg formats, a monitoring wrapper quoting a
syslog line or carrying a host label (Loki, journalctl -o json, Elastic's
host.name), NCCL's ``host:pid:tid [dev]``, UCX's ``[host:pid:tid]``, Open MPI's
``[host:pid]`` and its BTLs' ``[host][[job,vpid],rank]``, hydra's
``[proxy:N:N@host]``, srun's ``error: node: task N:``, old slurmd's
``slurmd[host]:``, pdsh's and clush's ``host:``, kubectl's
``[pod/NAME/container]``, a Ray worker's ``ip=``, slurmstepd's ``*** JOB id ON
node CANCELLED`` notices; loopback names, localhost, redaction placeholders and
Docker container ids name no node (:func:`names_no_node`), and an EC2-style
``ip-10-1-2-3`` also gives its address), and PyTorch's ``[rankN]:`` (or its
default process group's ``[PG 0 Rank N]``, or Open MPI's ``[job,N]<stdout>:``)
gives the rank when the rule names none.
"""
from __future__ import annotations

import re
from typing import NamedTuple

__all__ = ["Origin", "line_origin", "names_no_node"]


class Origin(NamedTuple):
    """What a line's prefixes say about where it was printed (all optional)."""

    host: str | None = None      # the node: a name, else an IP address
    rank: int | None = None      # global rank: PyTorch ``[rankN]:``, Open MPI ``[job,N]<stdout>:``
    task: int | None = None      # srun ``--label`` task number
    address: str | None = None   # an IP address the line names its node by (pdsh, Ray)


_HOST = r"[A-Za-z0-9][\w.-]*"
_IPV4 = r"\d{1,3}(?:\.\d{1,3}){3}"
_DAY = r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)"
_MONTH = r"[^\W\d_]{3,4}\.?"   # Jan, and journald's localized forms (jan., févr.)
_TAG = r"[\w./@()-]+(?:\[\d+\])?:(?: |$)"
# syslogd's facility.severity before the tag (busybox, OpenWrt logread, rsyslog
# templates with %syslogfacility-text%.%syslogseverity-text%)
_FACILITY = (r"(?:kern|user|mail|daemon|auth|authpriv|syslog|lpr|news|uucp|cron|ftp|local[0-7])"
             r"\.(?:emerg|alert|crit|err|error|warn|warning|notice|info|debug) ")
# RFC 3164 and journald short/short-precise ("Mar  3 02:11:09 HOST tag: "),
# journald short-full ("Mon 2025-03-03 02:11:09 UTC HOST tag: "), RFC 3339
# (rsyslog high precision, journald short-iso: "2025-03-03T02:11:09.1+00:00 HOST tag: ")
_SYSLOG_CORE = (r"(?:<\d{1,3}>)?(?:(?:" + _DAY + r" )?" + _MONTH + r" {1,2}\d{1,2} [\d:]{8}"
                r"(?:\.\d+)?(?: \d{4})?|" + _DAY + r" \d{4}-\d\d-\d\d [\d:]{8}(?:\.\d+)? \w+"
                r"|\d{4}-\d\d-\d\dT[\d:]{8}(?:\.\d+)?(?:Z|[+-]\d\d:?\d\d)?) (?!" + _FACILITY
                + r"|\d{4} )(" + _HOST + r") (?:" + _FACILITY + r")?" + _TAG)
_SYSLOG = re.compile(_SYSLOG_CORE)
# inside a wrapper, or after grep's "FILE:" (grep -H, or grep over several logs)
_SYSLOG_QUOTED = re.compile(r"(?:(?<=[\s\"'=>|\[(:])|^)" + _SYSLOG_CORE)
_SYSLOG_5424 = re.compile(r"<\d{1,3}>1 \S+ (" + _HOST + r") \S+ \S+ \S+ ")
# journald short-monotonic / short-unix: only with a kernel or daemon[pid] tag
_JOURNAL_CLOCK = re.compile(r"(?:\[ *\d+\.\d+(?: <[ \d.]+>)?\]|\d{9,}\.\d+) (?!" + _FACILITY
                            + r")(" + _HOST + r") (?:kernel|[\w.@-]+\[\d+\]): ")
# prefixes that name nothing: timestamps of collectors, NCCL >= 2.26, dmesg
# (-T), torchrun's [defaultN]: (a local rank), a facility without a host
_STAMP = re.compile(r"\s*(?:\d{4}-\d\d-\d\d[T ][\d:]{8}(?:[.,]\d+)?(?: ?(?:Z|[+-]\d\d:?\d\d|UTC))?"
                    r":? |\[\d{4}-\d\d-\d\d[T ][\d:]{8}(?:[.,]\d+)?\] |\d\d:\d\d:\d\d(?:\.\d+)? "
                    r"|" + _DAY + " " + _MONTH + r" {1,2}\d{1,2} [\d:]{8} \d{4} ?"  # ctime: mpirun
                    r"|\[default\d+\]: ?|" + _FACILITY + r"(?:kernel|[\w.@-]+(?:\[\d+\])?): "
                    r"|\[\d\d?:\d\d:\d\d(?:[.,]\d+)?\]\s"   # [HH:MM:SS] (rich, loguru)
                    r"|\d+\.\d+s: )")   # flux job attach's seconds since start
_KERNEL_STAMP = re.compile(r"\s*(?:\[ *\d+\.\d+\]|\[" + _DAY + " " + _MONTH
                           + r" {1,2}\d{1,2} [\d:]{8} \d{4}\]"
                           r"|\d{4}-\d\d-\d\dT[\d:]{8},\d+[+-]\d\d:\d\d) ")   # dmesg --time-format iso
_TASK = re.compile(r"\s*(\d{1,6}): ")
_CONTROL_DAEMON = re.compile(r"(?:slurmctld|slurmdbd)(?:\[\d+\])?: ")
_QUOTE = re.compile(r"(?:\s*>)+ ")
_RANK = re.compile(r"\[rank(\d+)\]: ?")
# Open MPI's --tag-output [job,rank]<stdout>:, and the BTLs' [host][[job,vpid],rank][file:line:fn]
_MPI_RANK = re.compile(r"\[\d+,(\d+)\]<std(?:out|err)>: ?")
_MPI_BTL = re.compile(r"\[(" + _HOST + r")\]\[\[?\d+,(\d+)\]?,(\d+)\]\[")   # job 0: the daemons
# HPE Cray MPICH's abort line: "MPICH ERROR [Rank R] [job id J] [ctime] [host] - Abort(..."
# (an older one puts "[unknown]" before the host): the rank and the node it ran on
_CRAY_MPICH = re.compile(r"MPICH ERROR \[Rank (\d+)\] (?:\[job id [^\]]{1,80}\] )?"
                         r"(?:\[[^\]]{1,40}\] )?(?:\[unknown\] )?\[(" + _HOST + r")\]")
# a Ray worker's (Class pid=N, ip=A), an old one's (pid=N, ip=A), (raylet, ip=A)
_RAY = re.compile(r"\((?:\w+ pid=\d+|pid=\d+|raylet)(?:, ip=(" + _IPV4 + r"))?[^)]*\) ")
# (srun's "error: slurm_receive_msgs: [[host]:6818] failed" and "error:
# step_launch_notify_io_failure: aborting, ..." name a function, not a node)
_NAMED = re.compile(r"(?:srun: error: (?!slurm_\w+: |[a-z]+_\w*: (?!tasks? \d))|slurmstepd-"
                    r"|pdsh@\S+: |clush: )"
                    r"([A-Za-z0-9][\w.\[\],-]*)"
                    r"(?:: tasks? [\d,\[\]-]+)?: |\[\d\d/\d\d/\d{4} [\d:]{8}\]\[(" + _HOST
                    + r")\]\[\d+\]:"   # ... and cuda_memtest's [date time][host][dev]:
                    r"|\[proxy:[\d:]+@(" + _HOST + r")\] "   # MPICH/Intel MPI hydra's proxy
                    r"|\[pod/(" + _HOST + r")/[\w.-]+\] "   # kubectl logs --prefix
                    r"|slurm(?:d|stepd)\[(?=[\w.-]*[A-Za-z])(" + _HOST + r")\]: ")   # Slurm <= 14
_NCCL = re.compile(r"([\w.][\w.-]*)(?::\w+:\w+)? \[\d+\] (?=(?:\S+:\d+ (?:\(\w+\) )?)?NCCL )")
# UCX's [host:pid:thread] (pid padded), Open MPI's signal report [host:pid]
_UCX = re.compile(r"\[(?!\d+:)(" + _HOST + r"):\d+(?: *:\w+(?::\d+)?)?\]\s")
_PDSH = re.compile(r"(" + _IPV4 + r"|(?=[a-z0-9.-]*\d)[a-z0-9][a-z0-9.-]*): ")
_NOT_A_HOST = re.compile(r"(?:(?:rank|step|epoch|iter|task|python|cuda)[\d.]*|0x\w*|nvidia\S*"
                         r"|(?:ib|eth|en[ops]|bond|br|veth|nvme|loop|md|dm-|sd[a-z]|mlx|hfi"
                         r"|ata|scsi|usb)\d+[\w.]*)$")
# names that name no node: loopback, syslog's placeholder for an unset hostname
_NO_NODE = re.compile(r"(?:localhost(?:\.localdomain)?|127(?:\.\d{1,3}){3}|\(none\))", re.I)
# names that stand for no machine one could exclude: what a poster puts in place
# of a redacted hostname (user, hostname, SERVER_NAME, a digitless name with xxx
# in it: xxx.xxx.xxx.xxx, gpu-xxx; "xxxx108" keeps the node's number),
# and a container's own hostname, which Docker sets to the first 12 hex digits
# of its id (the node the container ran on is not named)
_PLACEHOLDER = re.compile(r"(?:user(?:name)?|(?:my|your)?host(?:name)?|node(?:name)?|server"
                          r"|machine|computer|redacted|hidden|anonymi[sz]ed|\w*_name"
                          r"|(?=\D*$)(?:[\w.-]*xxx[\w.-]*|[\w.-]*\*{3}[\w.*-]*))"
                          r"|(?=[a-f]*\d)(?=\d*[a-f])[0-9a-f]{12}(?:[0-9a-f]{52})?", re.I)
# slurmstepd's cancel notices name the node the step daemon runs on in the
# message: "*** JOB|STEP ID ON NODE CANCELLED AT TIME [DUE TO ...] ***"; older
# releases put the node last ("*** JOB ID CANCELLED AT TIME *** on NODE",
# "... DUE TO TIME LIMIT on NODE ***")
_STEPD_NODE = re.compile(r"\*\*\* (?:JOB|STEP) \S+ (?:ON (" + _HOST + r") CANCELLED AT "
                         r"|CANCELLED AT \S+ (?:[A-Z ]+ )?(?:\*\*\* )?on (" + _HOST + r")\b)")
# PyTorch's ProcessGroupNCCL log prefix for the default group names the global rank:
# "[PG 0 Rank 3]" (2.2, 2.3), "[PG ID 0 PG GUID 0(default_pg) Rank 3]" (2.4 on);
# another group's rank is its own numbering, not the global one
_PG_RANK = re.compile(r"\[PG (?:0|ID 0 PG GUID 0\(default_pg\)) Rank (\d+)\] ")
# a shell prompt (bash's default PS1 on Red Hat, "[user@host dir]$ ", and on
# Debian, "user@host:dir$ ", a conda env's "(name) " before it) before a tool
# that reads the machine it runs on (the GPUs, the HCAs, the kernel log): an
# admin's look at that node. A prompt before anything else names where a
# command was typed (a login node, srun's caller), not where a job failed.
_PROMPT = re.compile(r"(?:\([\w.-]+\) )?\[?[a-z_][\w.-]*@(" + _HOST + r")(?: [^\]\s]*\]|:[^\s$#]*)"
                     r" *[$#] +(?:sudo +)?(?:nvidia-smi|ibstatus|ibstat|ibv_devinfo|ibv_devices"
                     r"|rdma|dmesg|journalctl|lspci|dcgmi|nvidia-bug-report\.sh|mlxlink)\b")
# a hostname that spells its IP address: EC2's ip-10-1-2-3, pods' 10-1-2-3
_DASHED_IP = re.compile(r"(?:ip-)?(\d{1,3})-(\d{1,3})-(\d{1,3})-(\d{1,3})(?:\..*)?")
# a monitoring wrapper's label: host="n1" (Loki, Prometheus), "nodeName":"n1" (JSON),
# journalctl -o json's "_HOSTNAME" : "n1", Elastic ECS's "host":{..."name":"n1"
_LABEL = re.compile(r"(?:\b(?:hostname|host|nodename|node|node_name|instance)=\"|\"(?:hostname|host"
                    r"|nodename|nodeName|node_name|node|_HOSTNAME)\" ?: ?\""
                    r"|\"host\": ?\{[^{}]*?\"(?:hostname|name)\": ?\")(" + _HOST + r")")


def line_origin(line: str) -> Origin:
    """The node, rank and srun task a line's prefixes name (:class:`Origin`).

    Prefixes are peeled from the start of the line; the innermost name wins (a
    pdsh IP address before NCCL's host name gives the name, and the address).
    A line no prefix names may quote a syslog line (a monitoring wrapper) or
    carry a ``host="..."`` label."""
    host = address = None
    rank = task = None
    pos, kernel = 0, False
    quoted = _QUOTE.match(line)   # a log quoted in a mail or a markdown thread
    if quoted:
        pos = quoted.end()
    prompt = _PROMPT.match(line, pos)
    if prompt:
        name = prompt.group(1)
        return Origin(None if names_no_node(name) else name)
    for _ in range(10):
        while pos < len(line) and line[pos] in " \t":
            pos += 1
        found = (_SYSLOG.match(line, pos) or _SYSLOG_5424.match(line, pos)
                 or _JOURNAL_CLOCK.match(line, pos))
        if found:
            # the controller's own log: the host is the control node, which is
            # not where the nodes its lines speak of are
            control = _CONTROL_DAEMON.match(line, found.end(1) + 1)
            host, pos = (None if control else found.group(1)), found.end()
            continue
        found = _STAMP.match(line, pos)
        if found is None and (found := _KERNEL_STAMP.match(line, pos)):
            kernel = True
        if found is None and task is None and (found := _TASK.match(line, pos)):
            task = int(found.group(1))
        if found is None and (found := _RANK.match(line, pos) or _MPI_RANK.match(line, pos)):
            rank = int(found.group(1))
        if found is None and (found := _RAY.match(line, pos)):
            address = found.group(1) or address
        if found is None and (found := _CRAY_MPICH.match(line, pos)):
            host, rank = found.group(2), int(found.group(1))
        if found is None and (found := _MPI_BTL.match(line, pos)):
            host = found.group(1)
            rank = int(found.group(3)) if found.group(2) != "0" else rank
        if found is None and (found := _NAMED.match(line, pos) or _NCCL.match(line, pos)
                              or _UCX.match(line, pos)):
            host = next(name for name in found.groups() if name)
        if found is None and not kernel and (found := _PDSH.match(line, pos)):
            name = found.group(1)
            if _NOT_A_HOST.match(name):
                break
            host = name
        if found is None:
            break
        pos = found.end()
    if host is not None and re.fullmatch(_IPV4, host):
        address, host = host, None
    if host is None and address is None and pos < len(line):
        found = _SYSLOG_QUOTED.search(line, pos) or _LABEL.search(line, pos)
        host = found.group(1) if found else None
        if found is None and "***" in line and (found := _STEPD_NODE.search(line, pos)):
            host = found.group(1) or found.group(2)
    if rank is None and "Rank " in line and (found := _PG_RANK.search(line, pos)):
        rank = int(found.group(1))
    host = None if host is None or names_no_node(host) else host.rstrip(".")
    address = None if address is None or names_no_node(address) else address
    if host and address is None and (spelt := _DASHED_IP.fullmatch(host)):
        address = ".".join(spelt.groups())
    return Origin(host or address, rank, task, address)


def names_no_node(name: str) -> bool:
    """Whether a name the text gives for a machine names none a verdict could
    exclude: loopback, an unset hostname, a redaction placeholder, a
    container id standing in for a hostname."""
    name = name.rstrip(".")
    return bool(_NO_NODE.fullmatch(name) or _PLACEHOLDER.fullmatch(name))
