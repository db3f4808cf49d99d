"""NVIDIA XID and NVSwitch SXid events from a node's kernel log (standard library only).

The prolog, epilog and health check call this on every opted-in job's start
path, so it imports nothing heavy and reads no more than it must.

Sources, named by one string (``hooks.kernel_log``):

* ``file:PATH`` -- a kernel-log file (the dev cluster's per-node ``kern.log``,
  or ``/var/log/kern.log``); only the last ``tail_bytes`` (8 MiB) are read.
* ``kmsg`` -- ``/dev/kmsg``, read non-blocking until the ring buffer is drained.
* ``journal`` -- ``journalctl -k -o short-iso`` run with an argv list and a 2 s timeout.

Errors: :func:`read_xids` returns a list, or raises :class:`KernelLogError` when
the source cannot be read at all (missing file, no permission, no journalctl,
timeout, unknown source string). Hooks catch it, log it and carry on with no
XIDs: they fail open. What is *in* the log never raises: junk bytes, NULs,
huge lines and lines without a timestamp are skipped or kept as described on
:func:`read_xids`.

Record (a plain dict, cheap to JSON-encode into a hook report)::

    {"xid": 79, "kind": "xid" | "sxid", "pci": "0000:3b:00" | None,
     "pid": 1234 | None, "process": "python" | None, "message": "...",
     "raw": "<the line, at most RAW_MAX characters>", "time": 1764406545.0 | None}

``time`` (unix seconds) is added by :func:`read_xids`; :func:`parse_xid` alone
does not look at timestamps.
"""
from __future__ import annotations

import errno
import os
import re
import time

DEFAULT_TAIL_BYTES = 8 << 20
DEFAULT_LIMIT_LINES = 200_000
DEFAULT_MAX_LINE = 4096
RAW_MAX = 1024
JOURNAL_TIMEOUT = 2.0
KMSG_PATH = "/dev/kmsg"
JOURNALCTL = "journalctl"

# XIDs after which the GPU, or the node holding it, should not take the next job.
# Derived from /work/shared/corpus/xid_catalog.jsonl: every code whose
# job_recovery_action is "requeue_exclude_node" (the catalog's reading of
# NVIDIA's immediate/investigatory action buckets as "the fault stays with the
# node: run the job elsewhere"). Codes read as requeue/stop/none (application
# faults, contained errors, informational events) are left out.
# tests/unit/test_kmsg.py re-derives this set from the catalog; update both together.
FATAL_XIDS = frozenset({
    46, 48, 54, 62, 64, 74, 78, 79, 95, 109, 110, 119, 120, 136, 140, 143, 144, 145,
    146, 147, 148, 149, 150, 151, 155, 156, 158, 166, 167, 168, 169, 170, 171, 172,
})
XID_RECOVERY_ACTION = 154   # "GPU recovery action changed from A to B"

# "NVRM: Xid (PCI:0000:3b:00): 79, ..." and the older "NVRM: Xid (0000:3b:00): 13, ..."
_XID = re.compile(r"NVRM: Xid \((?:PCI:)?([0-9A-Fa-f]{1,8}):([0-9A-Fa-f]{1,2}):"
                  r"([0-9A-Fa-f]{1,2})(?:\.[0-7])?\): ?(\d{1,6}),? ?(.*)")
# "nvidia-nvswitch3: SXid (PCI:0000:c3:00.0): 12028, Non-fatal, Link 46 ..."
_SXID = re.compile(r"(?:nvidia-nvswitch\d*: )?SXid \((?:PCI:)?([0-9A-Fa-f]{1,8}):"
                   r"([0-9A-Fa-f]{1,2}):([0-9A-Fa-f]{1,2})(?:\.[0-7])?\): ?(\d{1,6}),? ?(.*)")
_PID = re.compile(r"pid=('?)(<unknown>|\d+|[^,]*)\1, ?")
_NAME = re.compile(r"name=([^,]*)(?:, ?|$)")
_NON_FATAL = re.compile(r"\bnon-?fatal\b", re.IGNORECASE)
_ACTION_TO = re.compile(r"\bto (0x[0-9A-Fa-f]+)")

_ISO = re.compile(r"\s*(\d{4})-(\d{2})-(\d{2})[T ](\d{2}):(\d{2}):(\d{2})(\.\d+)?"
                  r"(Z|[+-]\d{2}:?\d{2})?\b")
_SYSLOG = re.compile(r"\s*([A-Z][a-z]{2}) {1,2}(\d{1,2}) (\d{2}):(\d{2}):(\d{2})\b")
_KMSG = re.compile(r"(\d{1,3}),(\d+),(\d+),[^;]{0,64};")
_DMESG_HUMAN = re.compile(r"\s*\[[A-Z][a-z]{2} ([A-Z][a-z]{2}) {1,2}(\d{1,2}) "
                          r"(\d{2}):(\d{2}):(\d{2}) (\d{4})\]")
_DMESG = re.compile(r"\s*\[\s*(\d+)\.(\d+)\]")
_MONTHS = {m: i for i, m in enumerate(
    ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"), 1)}

_boot_time: float | None = None


class KernelLogError(Exception):
    """The kernel-log source could not be read; ``source`` names it."""

    def __init__(self, source: str, reason: str) -> None:
        self.source = source
        self.reason = reason
        super().__init__(f"kernel log {source}: {reason}")


# -- one line ------------------------------------------------------------------

def normalize_pci(domain: str, bus: str, device: str) -> str:
    """``0000:3b:00``: lowercase domain:bus:device, function dropped."""
    return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(device, 16):02x}"


def parse_xid(line: str) -> dict | None:
    """The XID or SXid event on one kernel-log line, or None.

    Any prefix before ``NVRM:``/``nvidia-nvswitchN:`` is ignored (syslog,
    journal, dmesg, /dev/kmsg headers, or a tool quoting the line).
    """
    if "Xid" not in line:
        return None
    match = _XID.search(line)
    kind = "xid"
    if match is None:
        match = _SXID.search(line)
        kind = "sxid"
        if match is None:
            return None
    domain, bus, device, code, rest = match.groups()
    pid = process = None
    if kind == "xid":
        found = _PID.match(rest)
        if found:
            pid = int(found.group(2)) if found.group(2).isdigit() else None
            rest = rest[found.end():]
            found = _NAME.match(rest)
            if found:
                name = found.group(1).strip()
                process = None if name in ("", "<unknown>") else name
                rest = rest[found.end():]
    rest = rest.rstrip()
    if rest.endswith('"') and '"' in line[:match.start()]:
        rest = rest[:-1]   # a tool quoted the whole kernel line
    return {"xid": int(code), "kind": kind, "pci": normalize_pci(domain, bus, device),
            "pid": pid, "process": process, "message": rest, "raw": line[:RAW_MAX]}


def is_fatal(event: dict) -> bool:
    """Whether one parsed event, on its own, means the GPU/node should not take work.

    An XID in FATAL_XIDS unless its text says non-fatal (the NVLink5 XIDs
    144-150 carry their own severity); XID 154 when the driver's new recovery
    action is anything but "none" (0x0); an SXid whose text says Fatal.
    """
    message = event.get("message") or ""
    if event.get("kind") == "sxid":
        return message.lower().startswith("fatal")
    code = event.get("xid")
    if code == XID_RECOVERY_ACTION:
        found = _ACTION_TO.search(message)
        return bool(found) and int(found.group(1), 16) != 0
    return code in FATAL_XIDS and not _NON_FATAL.search(message)


# -- timestamps ----------------------------------------------------------------

def boot_time() -> float:
    """Unix time of this boot (cached): now minus CLOCK_BOOTTIME, else /proc/stat btime."""
    global _boot_time
    if _boot_time is None:
        try:
            _boot_time = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
        except (AttributeError, OSError):
            _boot_time = _btime()
    return _boot_time


def _btime() -> float:
    try:
        with open("/proc/stat", "rb") as fh:
            for raw in fh:
                if raw.startswith(b"btime "):
                    return float(raw.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return time.time() - time.monotonic()


def _valid(month: int, day: int, hh: int, mm: int, ss: int) -> bool:
    return 1 <= month <= 12 and 1 <= day <= 31 and hh < 24 and mm < 60 and ss <= 60


def _local(year: int, month: int, day: int, hh: int, mm: int, ss: int) -> float | None:
    if not _valid(month, day, hh, mm, ss):
        return None
    try:
        return time.mktime((year, month, day, hh, mm, ss, 0, 0, -1))
    except (OverflowError, ValueError):
        return None


def _iso(m: re.Match) -> float | None:
    year, month, day, hh, mm, ss = (int(g) for g in m.groups()[:6])
    frac = float(m.group(7)) if m.group(7) else 0.0
    zone = m.group(8)
    if not _valid(month, day, hh, mm, ss):
        return None
    if zone is None:
        base = _local(year, month, day, hh, mm, ss)
        return None if base is None else base + frac
    import calendar   # small, and only needed for zoned stamps
    try:
        base = calendar.timegm((year, month, day, hh, mm, ss, 0, 0, 0))
    except (OverflowError, ValueError):
        return None
    if zone != "Z":
        sign = -1 if zone[0] == "-" else 1
        digits = zone[1:].replace(":", "")
        base -= sign * (int(digits[:2]) * 3600 + int(digits[2:]) * 60)
    return base + frac


def _syslog(m: re.Match, now: float) -> float | None:
    month = _MONTHS.get(m.group(1))
    if month is None:
        return None
    day, hh, mm, ss = (int(g) for g in m.groups()[1:])
    year = time.localtime(now).tm_year
    stamp = _local(year, month, day, hh, mm, ss)
    if stamp is not None and stamp > now + 86400:   # December's lines read in January
        stamp = _local(year - 1, month, day, hh, mm, ss)
    return stamp


def parse_time(line: str, *, boot: float | None = None, now: float | None = None) -> float | None:
    """Unix seconds of a kernel-log line, or None when it carries no usable stamp.

    Understood: journalctl ``short-iso`` (``2026-11-29T08:55:45+0000``, with
    fractions or ``+00:00``), classic syslog (``Nov 29 08:55:45``, local time,
    current year), ``/dev/kmsg`` records (``6,1234,5678901234,-;``, microseconds
    since boot), ``dmesg -T`` (``[Fri Aug 30 11:43:09 2024]``, local) and plain
    dmesg (``[12345.678901]``, seconds since boot). Boot-relative stamps use
    ``boot`` or this machine's boot time.
    """
    m = _ISO.match(line)
    if m:
        return _iso(m)
    m = _SYSLOG.match(line)
    if m:
        return _syslog(m, time.time() if now is None else now)
    m = _KMSG.match(line)
    if m:
        return (boot_time() if boot is None else boot) + int(m.group(3)) / 1e6
    m = _DMESG_HUMAN.match(line)
    if m:
        month = _MONTHS.get(m.group(1))
        if month is None:
            return None
        day, hh, mm, ss, year = (int(g) for g in m.groups()[1:])
        return _local(year, month, day, hh, mm, ss)
    m = _DMESG.match(line)
    if m:
        return (boot_time() if boot is None else boot) + float(f"{m.group(1)}.{m.group(2)}")
    return None


# -- sources -------------------------------------------------------------------

def read_xids(source: str, since: float | None, limit_lines: int = DEFAULT_LIMIT_LINES,
              max_line: int = DEFAULT_MAX_LINE, tail_bytes: int = DEFAULT_TAIL_BYTES
              ) -> list[dict]:
    """XID/SXid events from ``source``, oldest first, each with ``time``.

    Only the last ``limit_lines`` lines (and, for a file, the last
    ``tail_bytes``) are looked at; each is cut to ``max_line`` characters
    after NULs are dropped, and undecodable bytes are replaced. With ``since``
    (unix seconds) only events stamped at or after it are kept, compared at
    whole-second resolution (short-iso and syslog stamps carry no fractions);
    events without a stamp are kept only when ``since`` is None.

    Raises KernelLogError when the source cannot be read at all.
    """
    if source.startswith("file:"):
        data = _file_data(source, source[5:], tail_bytes)
    elif source == "kmsg":
        data = _kmsg_data(source, KMSG_PATH, limit_lines)
    elif source == "journal":
        data = _journal_data(source, since, limit_lines)
    else:
        raise KernelLogError(source, "unknown source (expected journal, kmsg or file:PATH)")
    cutoff = None if since is None else float(int(since))
    events = []
    for raw in _xid_lines(data, limit_lines):
        if b"\x00" in raw:
            raw = raw.replace(b"\x00", b"")
        line = raw[:max_line].decode("utf-8", errors="replace").rstrip("\r")
        event = parse_xid(line)
        if event is None:
            continue
        stamp = parse_time(line)
        if cutoff is not None and (stamp is None or stamp < cutoff):
            continue
        event["time"] = stamp
        events.append(event)
    return events


def _xid_lines(data: bytes, limit_lines: int):
    """The lines holding "Xid" among the last ``limit_lines`` lines of ``data``.

    Searching the whole buffer for "Xid" and cutting out just those lines is
    several times faster than splitting megabytes into lines first.
    """
    end = len(data) - 1 if data.endswith(b"\n") else len(data)
    start = 0
    if limit_lines <= 0:
        return
    if data.count(b"\n", 0, end) >= limit_lines:
        start = end
        for _ in range(limit_lines):
            start = data.rfind(b"\n", 0, start)
        start += 1
    pos = data.find(b"Xid", start, end)
    while pos >= 0:
        first = max(data.rfind(b"\n", start, pos) + 1, start)
        last = data.find(b"\n", pos, end)
        last = end if last < 0 else last
        yield data[first:last]
        pos = data.find(b"Xid", last, end)


def _file_data(source: str, path: str, tail_bytes: int) -> bytes:
    if not path:
        raise KernelLogError(source, "no path after file:")
    tail_bytes = max(tail_bytes, 1)
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            start = max(0, size - tail_bytes)
            if start:
                fh.seek(start)
            data = fh.read(tail_bytes)
    except OSError as exc:
        raise KernelLogError(source, exc.strerror or str(exc)) from None
    if start:
        cut = data.find(b"\n")   # began mid-line: drop that part line
        data = data[cut + 1:] if cut >= 0 else b""
    return data


def _kmsg_data(source: str, path: str, limit_lines: int) -> bytes:
    """Every record now in the kernel ring buffer, without ever blocking.

    Each read() of /dev/kmsg returns one record: ``prio,seq,usec,flags;text``
    and then continuation lines starting with a space (dropped here). EPIPE
    means a record was overwritten while we read; we skip on.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise KernelLogError(source, exc.strerror or str(exc)) from None
    lines: list[bytes] = []
    pending = b""
    try:
        for _ in range(limit_lines + 1000):
            try:
                chunk = os.read(fd, 16384)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    continue
                if exc.errno == errno.EINVAL and not lines:
                    raise KernelLogError(source, exc.strerror or str(exc)) from None
                break
            if not chunk:
                break
            parts = (pending + chunk).split(b"\n")
            pending = parts.pop()
            lines.extend(p for p in parts if p and not p.startswith(b" "))
            if len(lines) > 2 * limit_lines:
                del lines[:-limit_lines]
    finally:
        os.close(fd)
    if pending and not pending.startswith(b" "):
        lines.append(pending)
    return b"\n".join(lines[-limit_lines:])


def _journal_data(source: str, since: float | None, limit_lines: int) -> bytes:
    import subprocess   # only this source needs it
    argv = [JOURNALCTL, "-k", "-o", "short-iso", "--no-pager", "-n", str(limit_lines)]
    if since is not None:
        argv += ["--since", f"@{int(since)}"]
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=JOURNAL_TIMEOUT, check=False)
    except subprocess.TimeoutExpired:
        raise KernelLogError(source, f"journalctl took longer than {JOURNAL_TIMEOUT:g} s") \
            from None
    except OSError as exc:
        raise KernelLogError(source, f"cannot run journalctl: {exc.strerror or exc}") from None
    if done.returncode != 0:
        detail = done.stderr.decode("utf-8", errors="replace").strip().splitlines()
        raise KernelLogError(source, f"journalctl exited {done.returncode}"
                             + (f": {detail[-1][:200]}" if detail else ""))
    return done.stdout
