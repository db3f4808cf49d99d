"""Fault injection for the dev cluster: XID/SXid lines in a node's kernel-log
file and edits to its fake-GPU state file.

Everything here only writes files under the state dir; no cluster has to be
running. The kernel lines are in the format the real driver writes, stamped
like ``journalctl -k -o short-iso``, so the node hooks read them exactly as
they would read a real node's log (``hooks.kernel_log = "file:..."``).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import click

from slurm_hooks.kmsg import normalize_pci

from recovery_agent.errors import RecoveryError
from .cluster import default_state_dir
from .config import Layout, fake_gpus

# Default texts for injected XIDs: short descriptions in the style of the
# driver's own messages, enough for a reader to tell the faults apart.
XID_MESSAGES = {
    13: "Graphics SM Warp Exception on (GPC 0, TPC 0, SM 0): Illegal Instruction Parameter",
    31: "MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f3c_00000000. "
        "Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ",
    43: "Ch 00000010, engmask 00000101",
    45: "Ch 00000010, engmask 00000101, intr 10000000",
    48: "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer.",
    63: "Row remapping event: the GPU recorded a row remapping for the next reset.",
    64: "Row remapping failure: no spare rows left in the affected bank.",
    74: "NVLink: fatal error detected on link 3 (0x0 0x10000 0x0 0x0 0x0 0x0 0x0)",
    79: "GPU has fallen off the bus.",
    92: "High single-bit ECC error rate detected.",
    94: "Contained: SM (0x1). RST: No, D-RST: No",
    95: "Uncontained: FBHUB. RST: Yes, D-RST: No",
    119: "Timeout after 6s of waiting for RPC response from GPU0 GSP! "
         "Expected function 76 (GSP_RM_CONTROL) (0x20800a4c 0x4).",
    120: "GSP task exception: the GPU System Processor stopped responding.",
    140: "An uncorrectable ECC error escaped containment in the framebuffer.",
    149: "NETIR_LINK_EVT Fatal XC0 i0 Link 01 (0x021425c6 0x0 0x0 0x0 0x0 0x0)",
    154: "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)",
}
SXID_MESSAGES = {
    12028: "Non-fatal, Link 46 egress non-posted PRIV error (First)",
    20034: "Fatal, Link 48 LTSSM Fault Up",
}
DEFAULT_MESSAGE = "injected test fault"
SWITCH_PCI_BASE = 0xC3   # fake NVSwitch N sits at 0000:(c3+N):00.0
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class InjectError(RecoveryError):
    """The injection target or value is invalid; the message says which."""


# -- library ---------------------------------------------------------------------

def _check_node(lay: Layout, node: str) -> None:
    if lay.node_dir(node).is_dir():
        return
    nodes_dir = lay.root / "nodes"
    known = sorted(p.name for p in nodes_dir.iterdir()) if nodes_dir.is_dir() else []
    if not known:
        raise InjectError(f"no dev cluster files in {lay.root}; "
                          "run `recovery-devcluster up` (or pass --state-dir)")
    raise InjectError(f"unknown node {node!r} (known: {', '.join(known)})")


def load_gpus(lay: Layout, node: str) -> dict:
    """The node's fake-GPU state as stored."""
    _check_node(lay, node)
    path = lay.gpu_state(node)
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InjectError(f"{path}: cannot read GPU state ({exc})") from None
    if not isinstance(state, dict) or not isinstance(state.get("gpus"), list):
        raise InjectError(f"{path}: not a GPU state file (no 'gpus' list)")
    return state


def _find_gpu(state: dict, node: str, index: int) -> dict:
    for gpu in state["gpus"]:
        if isinstance(gpu, dict) and gpu.get("index") == index:
            return gpu
    known = ", ".join(str(g.get("index")) for g in state["gpus"] if isinstance(g, dict))
    raise InjectError(f"{node} has no GPU {index} (GPUs: {known or 'none'})")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise InjectError(f"{path}: cannot write ({exc.strerror or exc})") from None


def _append_line(lay: Layout, node: str, line: str) -> None:
    path = lay.kernel_log(node)
    try:
        with open(path, "a+b") as fh:
            fh.seek(0, os.SEEK_END)
            if fh.tell() > 0:
                fh.seek(-1, os.SEEK_END)
                if fh.read(1) != b"\n":
                    line = "\n" + line   # never glue onto a half-written line
            fh.write((line + "\n").encode())
    except OSError as exc:
        raise InjectError(f"{path}: cannot append ({exc.strerror or exc})") from None


def _stamp(node: str, now: float | None) -> str:
    """``2026-11-29T08:55:45+0000 node2 kernel:``, as journalctl -o short-iso prints."""
    when = time.localtime(time.time() if now is None else now)
    return f"{time.strftime('%Y-%m-%dT%H:%M:%S%z', when)} {node} kernel:"


def gpu_pci(lay: Layout, node: str, index: int) -> str:
    """The GPU's bus id in the kernel's short form (``0000:18:00``)."""
    gpu = _find_gpu(load_gpus(lay, node), node, index)
    bus_id = str(gpu.get("pci_bus_id", ""))
    parts = bus_id.split(".")[0].split(":")
    try:
        return normalize_pci(*parts)
    except (TypeError, ValueError):
        raise InjectError(f"{node} GPU {index}: bad pci_bus_id {bus_id!r}") from None


def inject_xid(lay: Layout, node: str, gpu: int, xid: int, message: str | None = None,
               pid: int | None = None, process: str = "python",
               now: float | None = None) -> str:
    """Append one driver-format XID line for the node's GPU; return the line."""
    pci = gpu_pci(lay, node, gpu)
    text = message or XID_MESSAGES.get(xid, DEFAULT_MESSAGE)
    pid = os.getpid() if pid is None else pid
    line = (f"{_stamp(node, now)} NVRM: Xid (PCI:{pci}): {xid}, pid={pid}, "
            f"name={process}, {text}")
    _append_line(lay, node, line)
    return line


def inject_sxid(lay: Layout, node: str, sxid: int, switch: int = 0,
                message: str | None = None, now: float | None = None) -> str:
    """Append one NVSwitch SXid line (fake switch ``switch``); return the line."""
    _check_node(lay, node)
    text = message or SXID_MESSAGES.get(sxid, f"Fatal, Link 0 {DEFAULT_MESSAGE}")
    pci = f"0000:{SWITCH_PCI_BASE + switch:02x}:00.0"
    line = f"{_stamp(node, now)} nvidia-nvswitch{switch}: SXid (PCI:{pci}): {sxid}, {text}"
    _append_line(lay, node, line)
    return line


def _convert(field: str, text: str, current: object) -> object:
    """``text`` as a value of ``current``'s type, or InjectError."""
    want = type(current).__name__
    if isinstance(current, bool):
        if text.lower() in _TRUE + _FALSE:
            return text.lower() in _TRUE
    elif isinstance(current, int):
        for base in (10, 0):   # 0 also takes 0x.. for bitmasks
            try:
                return int(text, base)
            except ValueError:
                pass
    elif isinstance(current, float):
        try:
            return float(text)
        except ValueError:
            pass
    elif isinstance(current, str):
        return text
    else:   # lists (nvlink_active) and anything else: JSON of the same shape
        want = f"JSON like {json.dumps(current)}"
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if type(value) is type(current) and _same_items(value, current):
            return value
    raise InjectError(f"{field}: expected {want}, got {text!r}")


def _same_items(value: object, current: object) -> bool:
    if not isinstance(value, list) or not isinstance(current, list) or not current:
        return True
    return all(type(v) is type(current[0]) for v in value)


def set_gpu(lay: Layout, node: str, gpu: int, changes: dict[str, str]) -> dict:
    """Change fields of one GPU in gpus.json (atomically); return the new GPU entry."""
    state = load_gpus(lay, node)
    entry = _find_gpu(state, node, gpu)
    for field, text in changes.items():
        if field not in entry:
            raise InjectError(f"unknown GPU field {field!r} "
                              f"(fields: {', '.join(sorted(entry))})")
        entry[field] = _convert(field, text, entry[field])
    _write_atomic(lay.gpu_state(node), json.dumps(state, indent=1) + "\n")
    return entry


def clear_node(lay: Layout, node: str) -> int:
    """Healthy GPUs again (same count) and an empty kernel log; return the GPU count."""
    _check_node(lay, node)
    try:
        count = len(load_gpus(lay, node)["gpus"])
    except InjectError:
        count = len(list((lay.node_dir(node) / "dev").glob("nvidia*")))
    _write_atomic(lay.gpu_state(node), json.dumps(fake_gpus(node, count), indent=1) + "\n")
    try:
        with open(lay.kernel_log(node), "w"):
            pass
    except OSError as exc:
        raise InjectError(f"{lay.kernel_log(node)}: cannot truncate "
                          f"({exc.strerror or exc})") from None
    return count


# -- CLI (registered in cli.py as `recovery-devcluster inject`) -------------------

def _layout(state_dir: Path | None) -> Layout:
    return Layout(Path(state_dir or default_state_dir()).absolute())


def _run(action, *args, **kwargs):
    try:
        return action(*args, **kwargs)
    except RecoveryError as exc:
        raise click.ClickException(str(exc)) from None


_STATE_DIR = click.option(
    "--state-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
    help="The dev cluster's state dir "
         "[default: $RECOVERY_DEVCLUSTER_DIR or /tmp/recovery-devcluster-UID].")
_NODE = click.option("--node", required=True, help="Node name, e.g. node2.")


@click.group()
def inject() -> None:
    """Inject GPU faults into a node's kernel log and fake-GPU state.

    Only files under the state dir change; the cluster need not be running.

    \b
    Example:
        recovery-devcluster inject xid --node node2 --gpu 1 --xid 79
        recovery-devcluster inject clear --node node2
    """


@inject.command("xid")
@_NODE
@click.option("--gpu", type=click.IntRange(0), required=True, help="GPU index on the node.")
@click.option("--xid", type=click.IntRange(1, 999999), required=True, help="XID code.")
@click.option("--message", default=None, help="Text after the code [default: per XID].")
@click.option("--pid", type=click.IntRange(0), default=None,
              help="pid= in the line [default: this process].")
@_STATE_DIR
def xid_cmd(node: str, gpu: int, xid: int, message: str | None, pid: int | None,
            state_dir: Path | None) -> None:
    """Append an NVRM Xid line for one GPU to the node's kernel log.

    \b
    Example:
        recovery-devcluster inject xid --node node2 --gpu 3 --xid 79
    """
    click.echo(_run(inject_xid, _layout(state_dir), node, gpu, xid, message, pid))


@inject.command("sxid")
@_NODE
@click.option("--sxid", type=click.IntRange(1, 999999), required=True, help="SXid code.")
@click.option("--switch", type=click.IntRange(0, 31), default=0, show_default=True,
              help="NVSwitch number.")
@click.option("--message", default=None, help="Text after the code [default: per SXid].")
@_STATE_DIR
def sxid_cmd(node: str, sxid: int, switch: int, message: str | None,
             state_dir: Path | None) -> None:
    """Append an NVSwitch SXid line to the node's kernel log.

    \b
    Example:
        recovery-devcluster inject sxid --node node1 --sxid 12028
    """
    click.echo(_run(inject_sxid, _layout(state_dir), node, sxid, switch, message))


@inject.command("gpu")
@_NODE
@click.option("--gpu", type=click.IntRange(0), required=True, help="GPU index on the node.")
@click.option("--set", "settings", multiple=True, required=True, metavar="FIELD=VALUE",
              help="A gpus.json field and its new value (repeatable).")
@_STATE_DIR
def gpu_cmd(node: str, gpu: int, settings: tuple[str, ...], state_dir: Path | None) -> None:
    """Change fields of one fake GPU (values must keep the field's type).

    \b
    Example:
        recovery-devcluster inject gpu --node node2 --gpu 1 --set missing=true \\
            --set temperature_c=95
    """
    changes = {}
    for item in settings:
        field, sep, value = item.partition("=")
        if not sep or not field:
            raise click.ClickException(f"--set expects FIELD=VALUE, got {item!r}")
        changes[field] = value
    entry = _run(set_gpu, _layout(state_dir), node, gpu, changes)
    click.echo(" ".join(f"{k}={json.dumps(entry[k])}" for k in changes))


@inject.command("clear")
@_NODE
@_STATE_DIR
def clear_cmd(node: str, state_dir: Path | None) -> None:
    """Make the node's GPUs healthy again and empty its kernel log.

    \b
    Example:
        recovery-devcluster inject clear --node node2
    """
    count = _run(clear_node, _layout(state_dir), node)
    click.echo(f"{node}: {count} healthy GPU(s), kernel log emptied")
