#!/usr/bin/env python3
"""A stand-in for a multi-node training job: steps, loss lines, checkpoints, resume.

Launched by ``srun`` (one task per node, see train.sbatch); needs only the Python
standard library. Ranks share nothing but the checkpoint directory, which must be
on a file system every node sees. Rank 0 writes ``step-NNNNNN.json`` there every
``--ckpt-every`` steps; on start every rank resumes from the newest one. A
checkpoint signal (``--ckpt-signal``, SIGUSR1 by default) asks for one more: rank 0
saves at the end of the step it arrives in, the same way, and training goes on.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

EPILOG = """\
environment (set by Slurm; defaults suit a run without Slurm):
  SLURM_PROCID, SLURM_NTASKS, SLURM_NODEID   this task's rank, the world size, its node index
  SLURMD_NODENAME, SLURM_JOB_ID              shown in the log lines
  SLURM_RESTART_COUNT                        how often Slurm requeued the job (unset = 0)
  TRAIN_CKPT_SIGNAL                          the default of --ckpt-signal (USR1, USR2, none)

examples:
  srun python3 train.py --ckpt-dir /shared/ckpt/run1
  srun python3 train.py --ckpt-dir /shared/ckpt/run1 --fail-at-step 120 --fail-rank 1
  scancel --signal=USR1 JOBID      # every rank: rank 0 saves a checkpoint at its next step

exit status: 0 when training finished, 1 on a (simulated) crash, 143 on SIGTERM.
"""
CKPT_SIGNALS = {"USR1": signal.SIGUSR1, "USR2": signal.SIGUSR2, "none": None}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt-dir", required=True, type=Path,
                   help="checkpoint directory shared by all ranks (created if missing)")
    p.add_argument("--steps", type=int, default=400, help="total steps (default: %(default)s)")
    p.add_argument("--step-time", type=float, default=0.05,
                   help="seconds one step takes (default: %(default)s)")
    p.add_argument("--ckpt-every", type=int, default=50,
                   help="rank 0 saves a checkpoint every N steps (default: %(default)s)")
    p.add_argument("--ckpt-signal", type=_signal_name,
                   default=os.environ.get("TRAIN_CKPT_SIGNAL") or "USR1",
                   help="the signal that asks for a checkpoint now: USR1, USR2 or none "
                        "(default: $TRAIN_CKPT_SIGNAL, else USR1); SIGTERM still exits")
    p.add_argument("--log-every", type=int, default=10,
                   help="print a step line every N steps (default: %(default)s)")
    p.add_argument("--fail-at-step", type=int, metavar="K",
                   help="simulate a crash at step K, on the first attempt only "
                        "(SLURM_RESTART_COUNT unset or 0)")
    p.add_argument("--fail-rank", type=int, default=0, metavar="R",
                   help="the rank that crashes with --fail-at-step (default: %(default)s)")
    p.add_argument("--xid-log", metavar="PATH",
                   help="crash like a CUDA program does when this node's kernel log "
                        "gains an NVRM Xid line ({node} is replaced by the node name); "
                        "how the dev cluster's injected GPU faults reach the job")
    args = p.parse_args(argv)
    for name in ("steps", "ckpt_every", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.step_time < 0:
        p.error("--step-time must not be negative")
    return args


def _signal_name(text: str) -> str:
    name = text.strip().upper().removeprefix("SIG")
    name = "none" if name == "NONE" else name
    if name not in CKPT_SIGNALS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected one of {', '.join(CKPT_SIGNALS)}")
    return name


def _env_int(name: str, default: int = 0) -> int:
    value = os.environ.get(name, "").strip()
    return int(value) if value else default


class Task:
    """Who this process is, as Slurm told it."""

    def __init__(self) -> None:
        self.rank = _env_int("SLURM_PROCID")
        self.world = _env_int("SLURM_NTASKS", 1)
        self.node_id = _env_int("SLURM_NODEID")
        self.node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        self.job_id = os.environ.get("SLURM_JOB_ID", "-")
        self.restart = _env_int("SLURM_RESTART_COUNT")


def log(msg: str) -> None:
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    print(f"[{stamp}] {msg}", flush=True)


def checkpoint_path(ckpt_dir: Path, step: int) -> Path:
    return ckpt_dir / f"step-{step:06d}.json"


def newest_checkpoint(ckpt_dir: Path) -> tuple[Path, dict] | None:
    """The highest-step checkpoint that parses; half-written temp files never match."""
    found = []
    for path in ckpt_dir.glob("step-*.json"):
        try:
            found.append((int(path.stem.split("-", 1)[1]), path))
        except ValueError:
            continue
    for _, path in sorted(found, reverse=True):
        try:
            state = json.loads(path.read_text())
            int(state["step"])
            return path, state
        except (OSError, ValueError, KeyError, TypeError):
            continue  # vanished or unreadable: fall back to an older one
    return None


def save_checkpoint(ckpt_dir: Path, state: dict) -> Path:
    """Write to a temp file in the same dir, fsync, then rename: readers see all or nothing."""
    final = checkpoint_path(ckpt_dir, state["step"])
    tmp = ckpt_dir / f".{final.name}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        json.dump(state, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    return final


def loss_at(step: int, rank: int) -> float:
    """A plausible, deterministic falling loss curve with a little per-rank wobble."""
    return 2.5 * math.exp(-step / 150.0) + 0.1 + 0.02 * math.sin(step * 0.7 + rank)


class XidWatch:
    """Notices NVRM Xid lines added to a kernel log after the job started: the
    GPU this rank uses has failed, and the next CUDA call would fail."""

    def __init__(self, template: str, node: str) -> None:
        self.path = Path(template.replace("{node}", node))
        try:
            self.offset = self.path.stat().st_size
        except OSError:
            self.offset = 0

    def new_fault(self) -> bool:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                added = fh.read()
        except OSError:
            return False
        self.offset += len(added)
        return b"NVRM: Xid" in added


def exit_on_sigterm(who: str) -> None:
    """Slurm sends SIGTERM on scancel, requeue and time limit: say so, exit 128+15."""
    def handler(signum: int, frame: object) -> None:
        log(f"{who} received SIGTERM: exiting 143 (the newest checkpoint stays on disk)")
        sys.exit(143)
    signal.signal(signal.SIGTERM, handler)


class CheckpointRequest:
    """A checkpoint signal sets a flag; the training loop takes it at the end of
    the step, never inside the handler (a save half done when the signal came
    must not be started again)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.pending = False
        signum = CKPT_SIGNALS[name]
        if signum is not None:
            signal.signal(signum, self._handler)

    def _handler(self, signum: int, frame: object) -> None:
        self.pending = True

    def take(self) -> bool:
        """Whether a request came since the last take (and clear it)."""
        pending, self.pending = self.pending, False
        return pending


def train(args: argparse.Namespace, task: Task,
          request: CheckpointRequest | None = None) -> int:
    who = f"rank {task.rank}/{task.world} {task.node}"
    args.ckpt_dir.mkdir(parents=True, exist_ok=True)
    log(f"{who} job {task.job_id} node index {task.node_id} started (restart {task.restart})")
    start = 0
    latest = newest_checkpoint(args.ckpt_dir)
    if latest:
        path, state = latest
        start = min(int(state["step"]), args.steps)
        log(f"{who} resuming from checkpoint {path} at step {start} (restart {task.restart})")
    else:
        log(f"{who} starting fresh (restart {task.restart})")
    saved = start
    xids = XidWatch(args.xid_log, task.node) if args.xid_log else None
    for step in range(start + 1, args.steps + 1):
        time.sleep(args.step_time)
        if xids is not None and xids.new_fault():
            log(f"{who} step {step}: CUDA error on this node's GPU")
            raise RuntimeError("CUDA error: unspecified launch failure\n"
                               "CUDA kernel errors might be asynchronously reported at some "
                               "other API call")
        if (args.fail_at_step == step and task.rank == args.fail_rank
                and task.restart == 0):
            raise RuntimeError(f"simulated crash on rank {task.rank} at step {step} "
                               "(--fail-at-step; first attempt only)")
        loss = loss_at(step, task.rank)
        if step % args.log_every == 0 or step == args.steps:
            log(f"{who} step {step}/{args.steps} loss {loss:.4f} (restart {task.restart})")
        asked = request is not None and request.take()
        if asked:
            log(f"{who} step {step}: SIG{request.name} asks for a checkpoint"
                + (" now" if task.rank == 0 else " (rank 0 saves it)"))
        if task.rank == 0 and (asked or step % args.ckpt_every == 0 or step == args.steps):
            path = save_checkpoint(args.ckpt_dir, {
                "step": step, "loss": round(loss, 6), "world": task.world,
                "job_id": task.job_id, "restart": task.restart,
                "saved_at": datetime.now(timezone.utc).isoformat()})
            saved = step
            log(f"{who} checkpoint saved: {path} step={step}")
    log(f"{who} training finished at step {args.steps}"
        + (f" (last checkpoint step={saved})" if task.rank == 0 else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    task = Task()
    exit_on_sigterm(f"rank {task.rank}/{task.world} {task.node}")
    request = CheckpointRequest(args.ckpt_signal)
    return train(args, task, request)


if __name__ == "__main__":
    sys.exit(main())
