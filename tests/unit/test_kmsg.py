"""slurm_hooks.kmsg: XID/SXid lines, timestamps, the three sources, FATAL_XIDS."""
from __future__ import annotations

import calendar
import json
import os
import time
from pathlib import Path

import pytest

from slurm_hooks import kmsg
from slurm_hooks.kmsg import FATAL_XIDS, KernelLogError, parse_time, parse_xid, read_xids

# copied from the shared corpus (real lines from public reports; see its README)
CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "corpus"
T0 = calendar.timegm((2026, 11, 29, 8, 55, 45, 0, 0, 0))


def _rows(name: str) -> list[dict]:
    with open(CORPUS / name) as fh:
        return [json.loads(line) for line in fh if line.strip()]


# -- parse_xid -----------------------------------------------------------------

def test_current_format():
    line = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus."
    assert parse_xid(line) == {
        "xid": 79, "kind": "xid", "pci": "0000:3b:00", "pid": 1234, "process": "python",
        "message": "GPU has fallen off the bus.", "raw": line}


def test_older_format_without_pci_prefix_or_pid():
    event = parse_xid("NVRM: Xid (0000:3B:00): 13, Graphics SM Warp Exception on "
                      "(GPC 1, TPC 0, SM 1): Out Of Range Address")
    assert event["xid"] == 13 and event["pci"] == "0000:3b:00"
    assert event["pid"] is None and event["process"] is None
    assert event["message"].startswith("Graphics SM Warp Exception")


def test_sxid_drops_function_and_keeps_severity():
    event = parse_xid("nvidia-nvswitch3: SXid (PCI:0000:c3:00.0): 12028, Non-fatal, "
                      "Link 46 egress non-posted PRIV error")
    assert event["kind"] == "sxid" and event["xid"] == 12028 and event["pci"] == "0000:c3:00"
    assert event["message"].startswith("Non-fatal, Link 46")
    assert not kmsg.is_fatal(event)


def test_unknown_pid_and_name():
    event = parse_xid("NVRM: Xid (PCI:0000:91:00): 79, pid='<unknown>', name=<unknown>, "
                      "GPU has fallen off the bus.")
    assert (event["pid"], event["process"]) == (None, None)
    assert event["message"] == "GPU has fallen off the bus."


@pytest.mark.parametrize("prefix", [
    "2026-11-29T08:55:45+0000 node2 kernel: ",
    "Nov 29 08:55:45 gpu-a17 kernel: [12345.678901] ",
    "6,1234,5678901234,-;",
    "[12345.678901] ",
    "[Sun Nov 29 08:55:45 2026] ",
    '[XID found] (5 minutes ago) "',
])
def test_any_prefix(prefix):
    line = prefix + "NVRM: Xid (PCI:0000:3b:00): 48, pid=77, name=pt_main_thread, DBE"
    event = parse_xid(line + ('"' if prefix.endswith('"') else ""))
    assert (event["xid"], event["pid"], event["process"]) == (48, 77, "pt_main_thread")
    assert event["message"] == "DBE"


@pytest.mark.parametrize("line", [
    "", "Xid", "NVRM: GPU at PCI:0000:91:00: GPU-b6c3b2be", "NVRM: Xid (PCI:zz:00:00): 79, x",
    "training step 100 loss=Xid(3)", "NVRM: Xid (PCI:0000:3b:00): , nothing",
])
def test_not_an_event(line):
    assert parse_xid(line) is None


def test_raw_is_capped():
    line = "NVRM: Xid (PCI:0000:3b:00): 79, " + "x" * 10_000
    assert len(parse_xid(line)["raw"]) == kmsg.RAW_MAX


def test_every_kernel_xid_line_in_the_corpus_parses():
    checked = 0
    for row in _rows("dev_failures.jsonl"):
        codes = []
        for line in row["lines"]:
            if "Xid (" not in line:   # e.g. a device plugin's "Xid=69": not a kernel line
                continue
            event = parse_xid(line)
            assert event is not None, (row["id"], line)
            assert event["kind"] == ("sxid" if "SXid (" in line else "xid")
            assert len(event["pci"]) == 10 and event["pci"] == event["pci"].lower()
            codes.append(event["xid"])
            checked += 1
        if codes and row.get("xid") is not None:
            assert row["xid"] in codes, row["id"]
    assert checked >= 20


@pytest.mark.parametrize("line, fatal", [
    ("NVRM: Xid (PCI:0000:91:00): 79, pid=1, name=x, GPU has fallen off the bus.", True),
    ("NVRM: Xid (PCI:0000:cb:00): 13, pid=1, name=x, Graphics SM Warp Exception", False),
    ("NVRM: Xid (PCI:0009:01:00): 149, NETIR_LINK_EVT  Fatal   XC0 i0 Link 01", True),
    ("NVRM: Xid (PCI:0018:01:00): 145, RLW_RXPIPE Nonfatal XC0 i0 Link 13", False),
    ("NVRM: Xid (PCI:0019:01:00): 154, GPU recovery action changed from 0x4 (Drain and "
     "Reset) to 0x1 (GPU Reset Required)", True),
    ("NVRM: Xid (PCI:0019:01:00): 154, GPU recovery action changed from 0x1 (GPU Reset "
     "Required) to 0x0 (None)", False),
    ("nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 20034, Fatal, Link 48 LTSSM Fault Up", True),
    ("nvidia-nvswitch2: SXid (PCI:0000:07:00.0): 20034, Severity 1 Engine instance 60", False),
])
def test_is_fatal_reads_severity_and_recovery_action(line, fatal):
    assert kmsg.is_fatal(parse_xid(line)) is fatal


# -- FATAL_XIDS ----------------------------------------------------------------

def test_fatal_xids_match_the_catalog():
    """The embedded set is every catalog code read as requeue_exclude_node."""
    derived = {row["xid"] for row in _rows("xid_catalog.jsonl")
               if row.get("job_recovery_action") == "requeue_exclude_node"}
    assert set(FATAL_XIDS) == derived, (
        f"missing {sorted(derived - FATAL_XIDS)}, extra {sorted(FATAL_XIDS - derived)}")


def test_fatal_xids_spot_checks():
    assert {48, 79, 95, 119, 140}.issubset(FATAL_XIDS)
    assert not {13, 31, 43, 63, 154}.intersection(FATAL_XIDS)


# -- parse_time ----------------------------------------------------------------

@pytest.mark.parametrize("stamp", [
    "2026-11-29T08:55:45+0000", "2026-11-29T08:55:45+00:00", "2026-11-29T08:55:45Z",
    "2026-11-29T09:55:45+0100", "2026-11-29T03:25:45-05:30",
])
def test_iso_with_zone(stamp):
    assert parse_time(f"{stamp} node2 kernel: NVRM: Xid ...") == T0


def test_iso_fraction():
    got = parse_time("2026-11-29T08:55:45.250000+00:00 h kernel: NVRM: ...")
    assert got == pytest.approx(T0 + 0.25)


def test_iso_without_zone_is_local():
    expected = time.mktime((2026, 11, 29, 8, 55, 45, 0, 0, -1))
    assert parse_time("2026-11-29T08:55:45 h kernel: x") == expected


def test_syslog_is_local_this_year():
    now = time.mktime((2026, 12, 1, 0, 0, 0, 0, 0, -1))
    line = "Nov 29 08:55:45 host kernel: [12345.678901] NVRM: Xid (PCI:0000:3b:00): 79, x"
    assert parse_time(line, now=now) == time.mktime((2026, 11, 29, 8, 55, 45, 0, 0, -1))
    assert parse_time("Nov  9 08:55:45 host kernel: x", now=now) == \
        time.mktime((2026, 11, 9, 8, 55, 45, 0, 0, -1))


def test_syslog_from_december_read_in_january_is_last_year():
    now = time.mktime((2027, 1, 2, 0, 0, 0, 0, 0, -1))
    assert parse_time("Dec 31 23:00:00 host kernel: x", now=now) == \
        time.mktime((2026, 12, 31, 23, 0, 0, 0, 0, -1))


def test_boot_relative_stamps():
    boot = 1_700_000_000.0
    assert parse_time("6,1234,5678901234,-;NVRM: Xid ...", boot=boot) == \
        pytest.approx(boot + 5678.901234)
    assert parse_time("4,99,12000000,c,caller=T1;NVRM: x", boot=boot) == pytest.approx(boot + 12)
    assert parse_time("[12345.678901] NVRM: Xid ...", boot=boot) == \
        pytest.approx(boot + 12345.678901)
    assert parse_time("[    3.500000] x", boot=boot) == pytest.approx(boot + 3.5)


def test_dmesg_human_stamp():
    assert parse_time("[Fri Aug 30 11:43:09 2024] NVRM: Xid ...") == \
        time.mktime((2024, 8, 30, 11, 43, 9, 0, 0, -1))


def test_boot_time_is_in_the_past():
    assert 0 < kmsg.boot_time() <= time.time()


@pytest.mark.parametrize("line", ["", "NVRM: Xid (PCI:0000:3b:00): 79, x",
                                  '[XID found] (5 minutes ago) "NVRM: x"',
                                  "2026-13-45T99:99:99+0000 x", "Foo 29 08:55:45 h x"])
def test_no_usable_stamp(line):
    assert parse_time(line) is None


# -- file source ---------------------------------------------------------------

def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S+0000", time.gmtime(t))


def _xid_line(t: float, code: int = 79, host: str = "node2") -> str:
    return (f"{_iso(t)} {host} kernel: NVRM: Xid (PCI:0000:18:00): {code}, pid=42, "
            f"name=python, test")


def test_file_since_filtering(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("\n".join([
        _xid_line(T0 - 600, 48),
        f"{_iso(T0 - 5)} node2 kernel: usb 1-1: new device",
        _xid_line(T0, 79),
        "NVRM: Xid (PCI:0000:18:00): 13, no stamp at all",
        _xid_line(T0 + 30, 94),
    ]) + "\n")
    assert [e["xid"] for e in read_xids(f"file:{log}", since=T0)] == [79, 94]
    assert [e["time"] for e in read_xids(f"file:{log}", since=T0)] == [T0, T0 + 30]
    every = read_xids(f"file:{log}", since=None)
    assert [e["xid"] for e in every] == [48, 79, 13, 94]
    assert every[2]["time"] is None


def test_file_since_compares_whole_seconds(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text(_xid_line(T0) + "\n")
    assert len(read_xids(f"file:{log}", since=T0 + 0.9)) == 1
    assert read_xids(f"file:{log}", since=T0 + 1) == []


def test_file_binary_junk_nuls_and_a_huge_line(tmp_path):
    log = tmp_path / "kern.log"
    with open(log, "wb") as fh:
        fh.write(os.urandom(64 * 1024).replace(b"\n", b"."))
        fh.write(b"\n" + b"\x00" * 4096 + _xid_line(T0, 64).encode() + b"\n")
        fh.write(b"\xff\xfe broken utf-8 NVRM: Xid (PCI:0000:18:00): 95, pid=1, name=x, \xc3\n")
        fh.write(b"A" * (5 << 20) + b" NVRM: Xid (PCI:0000:18:00): 48, too far in\n")
        fh.write(b"Xid" * 2_000_000 + b"\n")
        fh.write(_xid_line(T0 + 1, 79).encode() + b"\n")
    started = time.monotonic()
    events = read_xids(f"file:{log}", since=None, tail_bytes=64 << 20)
    assert time.monotonic() - started < 2
    assert [e["xid"] for e in events] == [64, 95, 79]
    assert "\ufffd" in events[1]["raw"]
    assert all(len(e["raw"]) <= kmsg.RAW_MAX for e in events)


def test_file_reads_only_the_tail(tmp_path):
    log = tmp_path / "kern.log"
    old = _xid_line(T0, 48) + "\n"
    filler = f"{_iso(T0)} node2 kernel: {'x' * 100}\n" * 20_000   # ~2.5 MB
    log.write_text(old + filler + _xid_line(T0 + 1, 79) + "\n")
    assert [e["xid"] for e in read_xids(f"file:{log}", None, tail_bytes=1 << 20)] == [79]
    assert [e["xid"] for e in read_xids(f"file:{log}", None)] == [48, 79]


def test_file_limit_lines(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("".join(_xid_line(T0 + i, 79) + "\n" for i in range(10)))
    events = read_xids(f"file:{log}", None, limit_lines=3)
    assert [e["time"] for e in events] == [T0 + 7, T0 + 8, T0 + 9]


def test_file_missing_or_unreadable(tmp_path):
    with pytest.raises(KernelLogError) as caught:
        read_xids(f"file:{tmp_path / 'nope.log'}", since=None)
    assert "nope.log" in str(caught.value) and caught.value.source.startswith("file:")
    with pytest.raises(KernelLogError):
        read_xids(f"file:{tmp_path}", since=None)   # a directory
    with pytest.raises(KernelLogError):
        read_xids("file:", since=None)


def test_empty_file(tmp_path):
    log = tmp_path / "kern.log"
    log.touch()
    assert read_xids(f"file:{log}", since=None) == []


@pytest.mark.parametrize("source", ["", "syslog", "journal:x", "kmsg:/dev/kmsg", "FILE:/x"])
def test_unknown_source(source):
    with pytest.raises(KernelLogError):
        read_xids(source, since=None)


# -- kmsg source ---------------------------------------------------------------

def test_kmsg_records(tmp_path, monkeypatch):
    boot = float(int(time.time()) - 3600)
    monkeypatch.setattr(kmsg, "_boot_time", boot)
    dev = tmp_path / "kmsg"
    dev.write_bytes(
        b"6,100,1000000,-;usb 1-1: new device\n"
        b" SUBSYSTEM=usb\n"
        b"4,101,2000000,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=9, name=python, "
        b"GPU has fallen off the bus.\n"
        b" SUBSYSTEM=pci\n DEVICE=+pci:0000:3b:00.0\n"
        b"4,102,3000000,c;NVRM: Xid (PCI:0000:3b:00): 48, pid=9, name=python, DBE\n")
    monkeypatch.setattr(kmsg, "KMSG_PATH", str(dev))
    events = read_xids("kmsg", since=None)
    assert [(e["xid"], e["time"]) for e in events] == [(79, pytest.approx(boot + 2)),
                                                       (48, pytest.approx(boot + 3))]
    assert [e["xid"] for e in read_xids("kmsg", since=boot + 3)] == [48]
    # since is compared at whole seconds, so an event in the same second stays
    assert [e["xid"] for e in read_xids("kmsg", since=boot + 2.5)] == [79, 48]


def test_kmsg_reads_a_nonblocking_pipe_without_blocking(tmp_path, monkeypatch):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)   # held open: a reader would block
    try:
        os.write(writer, b"4,1,5000000,-;NVRM: Xid (PCI:0000:3b:00): 79, x\n")
        monkeypatch.setattr(kmsg, "KMSG_PATH", str(fifo))
        started = time.monotonic()
        assert [e["xid"] for e in read_xids("kmsg", since=None)] == [79]
        assert time.monotonic() - started < 1
    finally:
        os.close(writer)


def test_kmsg_unavailable_fails_open(tmp_path, monkeypatch):
    monkeypatch.setattr(kmsg, "KMSG_PATH", str(tmp_path / "no-kmsg"))
    with pytest.raises(KernelLogError) as caught:
        read_xids("kmsg", since=None)
    assert caught.value.source == "kmsg"


# -- journal source ------------------------------------------------------------

def _fake_journalctl(tmp_path: Path, body: str) -> str:
    script = tmp_path / "journalctl"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)
    return str(script)


def test_journal_argv_and_lines(tmp_path, monkeypatch):
    out = tmp_path / "argv"
    lines = "\n".join([
        "-- Logs begin at Sun 2026-11-29 08:00:00 UTC. --",
        _xid_line(T0 - 100, 48),
        _xid_line(T0, 79),
        f"{_iso(T0 + 1)} node2 kernel: nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 20034, "
        f"Fatal, Link 63 LTSSM Fault Up",
    ])
    monkeypatch.setattr(kmsg, "JOURNALCTL", _fake_journalctl(
        tmp_path, f'printf "%s\\n" "$@" > {out}\ncat <<"EOF"\n{lines}\nEOF\n'))
    events = read_xids("journal", since=T0 + 0.5, limit_lines=500)
    assert [(e["kind"], e["xid"]) for e in events] == [("xid", 79), ("sxid", 20034)]
    assert out.read_text().split("\n")[:-1] == [
        "-k", "-o", "short-iso", "--no-pager", "-n", "500", "--since", f"@{int(T0)}"]


def test_journal_missing_binary_fails_open(tmp_path, monkeypatch):
    monkeypatch.setattr(kmsg, "JOURNALCTL", str(tmp_path / "no-journalctl"))
    with pytest.raises(KernelLogError, match="cannot run journalctl"):
        read_xids("journal", since=None)


def test_journal_error_exit_fails_open(tmp_path, monkeypatch):
    monkeypatch.setattr(kmsg, "JOURNALCTL", _fake_journalctl(
        tmp_path, 'echo "Failed to open journal: Permission denied" >&2\nexit 1\n'))
    with pytest.raises(KernelLogError, match="Permission denied"):
        read_xids("journal", since=None)


def test_journal_timeout_fails_open(tmp_path, monkeypatch):
    monkeypatch.setattr(kmsg, "JOURNALCTL", _fake_journalctl(tmp_path, "exec sleep 30\n"))
    monkeypatch.setattr(kmsg, "JOURNAL_TIMEOUT", 0.3)
    started = time.monotonic()
    with pytest.raises(KernelLogError, match="longer than"):
        read_xids("journal", since=None)
    assert time.monotonic() - started < 5


def test_module_imports_only_the_standard_library():
    import ast
    tree = ast.parse(Path(kmsg.__file__).read_text())
    names = {alias.name.split(".")[0] for node in ast.walk(tree)
             if isinstance(node, ast.Import) for alias in node.names}
    names |= {node.module.split(".")[0] for node in ast.walk(tree)
              if isinstance(node, ast.ImportFrom) and node.module}
    assert names <= {"__future__", "calendar", "errno", "os", "re", "subprocess", "time"}
