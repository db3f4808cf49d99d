"""Tailer benchmark (issue 4): agent CPU per wall second while tailing 2,000 active logs;
and (issue 14) the cost of reading with the job user's rights, and log floods.

    python -m tests.benchmarks.bench_tail [--files 2000] [--seconds 20] [--intervals 1,0.25]
        [--no-flood | --flood [--baseline REV] [--burst-lines 300000] [--end-mb 330]]

A writer process appends training-like output to every file: on average one
line per second per file (2,000 lines/s in all), with bursts (NCCL INFO blocks,
tracebacks) and lines written in two pieces. The readers follow the same files
at the same time, each in a process of its own, so that they meet the same
machine load and each figure is its reader's own: CPU is ``time.process_time``
spent in ``poll()``, divided by wall seconds; RSS and open descriptors are read
from /proc at the end. Readers:

* the Tailer with the default 256 descriptors (most files are reopened each poll),
* the same, each file added with its user's rights (``tailer-256-user``: walked
  from ``/`` with those rights, looked at by ``fstatat`` in its kept directory),
* the Tailer allowed a descriptor per file,
* the baseline: a loop that stats every file and reads new bytes with
  ``open``/``seek``/``read``, splitting lines, nothing more.

Lag is the time from the writer stamping a line (``ts=`` at its end) to the
poll that returned it. Nothing here asserts a time.

``--flood`` runs the whole watch loop (Watcher, scanner, detectors; a script
stands in for squeue) on one job whose output floods, once with the code of
``--baseline`` (a git revision, extracted with ``git archive``) and once with this
checkout, one after the other in fresh processes, and prints both with their
ratio: the delay from an error line written right after a burst of
``--burst-lines`` lines at ``--burst-rate`` lines/s to its detection; then, for a
job that ends after writing ``--end-mb`` MB at once, the longest watch cycle (the
read of its last output) and the reader's peak RSS.
"""
from __future__ import annotations

import argparse
import heapq
import json
import multiprocessing
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

BURST_P = 0.05     # share of writes that are a burst of lines
SPLIT_P = 0.05     # share of lines written in two pieces
BURST_LINES = (10, 40)
MEAN_LINES = (1 - BURST_P) + BURST_P * sum(BURST_LINES) / 2


def training_line(rng: random.Random, task: int, step: int) -> str:
    kind = rng.random()
    if kind < 0.7:
        return (f"[2025-03-01 12:{step % 60:02d}:07,431] [INFO] [rank{task % 8}] iteration "
                f"{step:>8d}/  500000 | consumed samples: {step * 512:>10d} | elapsed time per "
                f"iteration (ms): {rng.uniform(950, 1100):.1f} | learning rate: 2.991E-04 | "
                f"lm loss: {rng.uniform(1.8, 2.6):.6E} | loss scale: 65536.0 | grad norm: "
                f"{rng.uniform(0.5, 1.2):.3f} |")
    if kind < 0.85:
        return (f"Epoch 3:  45%|████▌     | {step}/10000 [12:34<15:20,  5.98it/s, "
                f"loss={rng.uniform(1.8, 2.6):.3f}, v_num=7]")
    if kind < 0.95:
        return (f"gpu-node-{task % 64:03d}:{4000 + task}:{4100 + task} [{task % 8}] NCCL INFO "
                f"Channel {step % 32:02d}/0 : {task % 8}[{task % 8}] -> {(task + 1) % 8}"
                f"[{(task + 1) % 8}] via P2P/IPC/read")
    return "torch/distributed/elastic: [WARNING] step time above the 5-minute median"


def burst(rng: random.Random, task: int) -> list[str]:
    if rng.random() < 0.5:
        return [f"gpu-node-{task % 64:03d}:{task}:{task} [{i % 8}] NCCL INFO comm 0x55d1 rank "
                f"{i} nRanks 64 nNodes 8 localRanks 8 localRank {i % 8} MNNVL 0"
                for i in range(rng.randint(*BURST_LINES))]
    frames = ["Traceback (most recent call last):"]
    for i in range(rng.randint(*BURST_LINES) // 2):
        frames += [f'  File "/opt/conda/lib/python3.11/site-packages/torch/nn/modules/'
                   f'module.py", line {1500 + i}, in _call_impl',
                   "    return forward_call(*args, **kwargs)"]
    return frames + ["torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate "
                     "2.00 GiB"]


def raise_fd_limit(nfiles: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, nfiles + 64)), hard))


def write_logs(folder: str, nfiles: int, start: float, seconds: float, seed: int,
               result) -> None:
    """From wall time ``start``, append ~1 line/s to every file for ``seconds``."""
    raise_fd_limit(nfiles)
    rng = random.Random(seed)
    files = [open(os.path.join(folder, f"slurm-7000_{i}.out"), "ab", buffering=0)
             for i in range(nfiles)]
    rate = 1.0 / MEAN_LINES  # writes per second per file
    time.sleep(max(0.0, start - time.time()))
    queue = [(start + rng.expovariate(rate), i, None) for i in range(nfiles)]
    heapq.heapify(queue)
    steps = [0] * nfiles
    written = 0
    while queue:
        due, i, rest = heapq.heappop(queue)
        if rest is None and due - start >= seconds:
            continue
        now = time.time()
        if due > now:
            time.sleep(due - now)
        if rest is not None:  # the second piece of a split line
            files[i].write(f"{rest} ts={time.time():.6f}\n".encode())
            written += 1
            continue
        steps[i] += 1
        if rng.random() < BURST_P:
            stamp = f" ts={time.time():.6f}\n"
            block = burst(rng, i)
            files[i].write("".join(line + stamp for line in block).encode())
            written += len(block)
        else:
            line = training_line(rng, i, steps[i])
            if rng.random() < SPLIT_P:
                cut = rng.randint(1, len(line) - 1)
                files[i].write(line[:cut].encode())
                heapq.heappush(queue, (time.time() + rng.uniform(0.2, 0.8), i, line[cut:]))
            else:
                files[i].write(f"{line} ts={time.time():.6f}\n".encode())
                written += 1
        heapq.heappush(queue, (due + rng.expovariate(rate), i, None))
    for f in files:
        f.close()
    result.send(written)


class NaiveReader:
    """The baseline: stat every file, open/seek/read what is new, split lines."""

    def __init__(self, paths: list[str]) -> None:
        self.offsets = {path: 0 for path in paths}
        self.partial = {path: b"" for path in paths}

    def poll(self) -> list[tuple[str, str]]:
        out = []
        for path, offset in self.offsets.items():
            try:
                if os.stat(path).st_size <= offset:
                    continue
                with open(path, "rb") as f:
                    f.seek(offset)
                    data = f.read()
            except OSError:
                continue
            self.offsets[path] = offset + len(data)
            *lines, self.partial[path] = (self.partial[path] + data).split(b"\n")
            out += [(path, line.decode("utf-8", "replace")) for line in lines]
        return out

    @property
    def open_count(self) -> int:
        return 0


def line_text(item) -> str:
    return item[1] if isinstance(item, tuple) and len(item) == 2 else item.text


def read_logs(reader_name: str, folder: str, nfiles: int, start: float, seconds: float,
              interval: float, result) -> None:
    """From wall time ``start``, poll every ``interval`` seconds for ``seconds``;
    send the figures back."""
    raise_fd_limit(nfiles)
    from recovery_agent.inputs import Rights, Tailer
    paths = [os.path.join(folder, f"slurm-7000_{i}.out") for i in range(nfiles)]
    if reader_name == "naive":
        reader = NaiveReader(paths)
    else:
        reader = Tailer(max_open=nfiles + 16 if reader_name == "tailer-all" else 256)
        rights = Rights.of(os.getuid(), os.getgid()) if reader_name.endswith("-user") else None
        for i, path in enumerate(paths):
            reader.add(path, f"7000_{i}", rights=rights)
    cpu = 0.0
    polls = delivered = 0
    lags: list[float] = []
    time.sleep(max(0.0, start - time.time()))
    started = time.monotonic()
    next_poll = started
    while next_poll - started < seconds:
        time.sleep(max(0.0, next_poll - time.monotonic()))
        before = time.process_time()
        got = reader.poll()
        cpu += time.process_time() - before
        now = time.time()
        polls += 1
        delivered += len(got)
        for item in got:  # outside the measured part
            text = line_text(item)
            mark = text.rfind(" ts=")
            if mark >= 0:
                lags.append(now - float(text[mark + 4:]))
        next_poll += interval
    wall = time.monotonic() - started
    rss_kib = next(int(line.split()[1]) for line in open("/proc/self/status")
                   if line.startswith("VmRSS:"))
    lags.sort()
    result.send({
        "reader": reader_name, "interval": interval, "cpu_per_s": cpu / wall, "polls": polls,
        "ms_per_poll": 1000 * cpu / max(polls, 1), "lines_per_s": delivered / wall,
        "delivered": delivered,
        "lag_p50": statistics.median(lags) if lags else float("nan"),
        "lag_max": lags[-1] if lags else float("nan"),
        "open_handles": reader.open_count, "fds": len(os.listdir("/proc/self/fd")),
        "rss_mib": rss_kib / 1024,
    })


READERS = ("naive", "tailer-256", "tailer-256-user", "tailer-all")


def run_interval(ctx, nfiles: int, seconds: float, interval: float, seed: int) -> list[dict]:
    """One writer and every reader on the same files at the same time."""
    folder = tempfile.mkdtemp(prefix="recovery-bench-tail-")
    try:
        for i in range(nfiles):
            open(os.path.join(folder, f"slurm-7000_{i}.out"), "wb").close()
        start = time.time() + 3.0  # after every process has started and imported
        w_recv, w_send = ctx.Pipe(duplex=False)
        procs = [ctx.Process(target=write_logs,
                             args=(folder, nfiles, start, seconds + 1, seed, w_send))]
        pipes = []
        for name in READERS:
            recv, send = ctx.Pipe(duplex=False)
            pipes.append(recv)
            procs.append(ctx.Process(target=read_logs, args=(name, folder, nfiles, start,
                                                             seconds, interval, send)))
        for proc in procs:
            proc.start()
        rows = [recv.recv() for recv in pipes]
        written = w_recv.recv()
        for proc in procs:
            proc.join()
        for row in rows:
            row["written"] = written
        return rows
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# -- floods (issue 14) ---------------------------------------------------------

FLOOD_LINE = ("gpu-a03:3110:3311 [2] NCCL INFO Channel 07/0 : 12[2] -> 13[3] [send] via "
              "NET/IB/3/GDRDMA comm 0x55d1")
BURST_END = "RuntimeError: CUDA error: an illegal memory access was encountered"
FLOOD_END = "srun: error: gpu-a05: task 3: Segmentation fault (core dumped)"
CYCLE_S = 2.0


def _hwm_mib() -> float:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:")) / 1024


def _flood_writer(path: str, lines: int, rate: float, conn) -> None:
    """``lines`` flood lines at ``rate`` lines/s (1,000 a write), then the error
    line; sends the time the error line was written."""
    block = ("".join(f"{FLOOD_LINE} seq={i}\n" for i in range(1000))).encode()
    with open(path, "ab", buffering=0) as fh:
        start = time.monotonic()
        for k in range(lines // 1000):
            time.sleep(max(0.0, start + k * 1000 / rate - time.monotonic()))
            fh.write(block)
        fh.write(f"{BURST_END}\n".encode())
        conn.send(time.time())


def flood_reader(opts: dict) -> dict:
    """The watch loop of whatever recovery_agent is importable, on one flooded job."""
    from recovery_agent.config import from_mapping
    from recovery_agent.detect.patterns import load_rules
    from recovery_agent.detect.scanner import Scanner
    from recovery_agent.inputs.logline import MemoryCursorStore
    from recovery_agent.inputs.tail import Tailer
    from recovery_agent.scheduler.base import Job
    from recovery_agent.store import Store
    from recovery_agent.watch import Watcher

    from tests.unit.scripted import Script as Listing

    tmp = Path(tempfile.mkdtemp(prefix="recovery-bench-flood-"))
    try:
        out = tmp / "flood.out"
        out.write_text("step 1 loss 2.0\n")
        job = dict(job_id="9", numeric_id=9, submit_time=int(time.time()) - 60,
                   start_time=int(time.time()) - 50, nodes=("gpu-a05",), comment="recovery=prod",
                   stdout=str(out), stderr=str(out), user_id=os.getuid(), group_id=os.getgid())
        listing = Listing()
        listing.jobs = [Job(state="RUNNING", **job)]
        store = Store(tmp / "r.db")
        watcher = Watcher(from_mapping({"agent": {"cluster": "b"}}), store, listing,
                          Scanner(load_rules()), Tailer(MemoryCursorStore()))
        watcher.cycle()

        def found(text: str) -> bool:
            return any(text in e.text for w in watcher.watches.values() for d in w.found
                       for e in d.evidence) or any(
                text in e.text for w, _, _ in watcher.closing for d in w.found
                for e in d.evidence)

        # a burst, then an error line: how long until it is detected
        recv, send = multiprocessing.Pipe(duplex=False)
        writer = multiprocessing.Process(target=_flood_writer, args=(
            str(out), opts["burst_lines"], opts["burst_rate"], send))
        writer.start()
        written, delay = None, None
        deadline = time.monotonic() + opts["max_wait"]
        while time.monotonic() < deadline:
            begun = time.monotonic()
            watcher.cycle()
            if written is None and recv.poll():
                written = recv.recv()
            if written is not None and found(BURST_END):
                delay = time.time() - written
                break
            time.sleep(max(0.0, CYCLE_S - (time.monotonic() - begun)))
        writer.join()
        burst_hwm = _hwm_mib()
        # a job that writes a flood at once and ends: its last cycle reads it
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        with open(out, "ab") as fh:
            block = ("".join(f"{FLOOD_LINE} end={i}\n" for i in range(10_000))).encode()
            for _ in range(int(opts["end_mb"] * 1e6) // len(block)):
                fh.write(block)
            fh.write(f"{FLOOD_END}\n".encode())
        rss_before = _hwm_mib()
        listing.jobs = [Job(state="FAILED", exit_code=1, end_time=int(time.time()), **job)]
        begun = time.monotonic()
        watcher.cycle()
        stall = time.monotonic() - begun
        return {"delay_s": delay, "burst_hwm_mib": burst_hwm, "end_stall_s": stall,
                "end_rss_before_mib": rss_before, "end_hwm_mib": _hwm_mib(),
                "end_found": found(FLOOD_END),
                "skipped_mb": store.health.get("log_bytes_skipped", 0) / 1e6}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _code_of(rev: str, into: Path) -> Path:
    """The agent's code at git revision ``rev``, extracted under ``into``."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "recovery_agent",
                              "slurm_hooks", "etc"], capture_output=True, check=True,
                             timeout=120).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True, timeout=120)
    return into


def run_flood(args) -> str:
    rows = {}
    with tempfile.TemporaryDirectory(prefix="recovery-bench-base-") as base:
        for name, code in (("before", _code_of(args.baseline, Path(base))), ("after", REPO)):
            print(f"flood, {name} ({code}) ...", file=sys.stderr)
            opts = {"burst_lines": args.burst_lines, "burst_rate": args.burst_rate,
                    "end_mb": args.end_mb, "max_wait": args.max_wait}
            proc = subprocess.run(
                [sys.executable, "-m", "tests.benchmarks.bench_tail", "--flood-reader",
                 json.dumps(opts)], capture_output=True, text=True, check=True, cwd=code,
                env=dict(os.environ, PYTHONPATH=f"{code}:{REPO}"), timeout=3600)
            rows[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    before, after = rows["before"], rows["after"]

    def show(value, unit="") -> str:
        return f">{args.max_wait:.0f} s" if value is None else f"{value:.1f}{unit}"

    def ratio(key: str) -> str:
        b, a = before[key], after[key]
        if not b or not a:
            return "n/a"
        return f"{a / b:.2f}x" if a / b >= 0.1 else f"{a / b:.3f}x"
    lines = ["## Log floods (issue 14)", "",
             f"One job, the whole watch loop (poll every {CYCLE_S:g} s). Burst: "
             f"{args.burst_lines:,} lines ({args.burst_lines * 105 / 1e6:.0f} MB) at "
             f"{args.burst_rate:,.0f} lines/s, then an error line. End: {args.end_mb:g} MB "
             f"written at once, then the job ends. before: `{args.baseline}`; after: this "
             f"checkout; one after the other, os.cpu_count() = {os.cpu_count()}.", "",
             "| figure | before | after | after / before |", "|---|---|---|---|",
             f"| error line after the burst detected in | {show(before['delay_s'], ' s')} | "
             f"{show(after['delay_s'], ' s')} | {ratio('delay_s')} |",
             f"| peak RSS during the burst | {before['burst_hwm_mib']:.0f} MiB | "
             f"{after['burst_hwm_mib']:.0f} MiB | {ratio('burst_hwm_mib')} |",
             f"| the job's last cycle (reads its end) | {before['end_stall_s']:.1f} s | "
             f"{after['end_stall_s']:.1f} s | {ratio('end_stall_s')} |",
             f"| peak RSS in that cycle | {before['end_hwm_mib']:.0f} MiB | "
             f"{after['end_hwm_mib']:.0f} MiB | {ratio('end_hwm_mib')} |",
             f"| its last line detected | {before['end_found']} | {after['end_found']} | |",
             f"| MB skipped (on the timeline) | {before['skipped_mb']:.0f} | "
             f"{after['skipped_mb']:.0f} | |"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=20.0, help="per reader and interval")
    parser.add_argument("--intervals", default="1,0.25", help="poll intervals in seconds")
    parser.add_argument("--out", type=Path, default=None, help="also write Markdown here")
    parser.add_argument("--flood", action="store_true", help="only the flood benchmark")
    parser.add_argument("--no-flood", action="store_true", help="only the tailing readers")
    parser.add_argument("--baseline", default="ab1d87c",
                        help="git revision the flood figures are compared with")
    parser.add_argument("--burst-lines", type=int, default=300_000)
    parser.add_argument("--burst-rate", type=float, default=100_000.0)
    parser.add_argument("--end-mb", type=float, default=330.0)
    parser.add_argument("--max-wait", type=float, default=180.0,
                        help="give up waiting for the burst's error line after this")
    parser.add_argument("--flood-reader", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.flood_reader:
        print(json.dumps(flood_reader(json.loads(args.flood_reader))))
        return
    if args.flood:
        text = run_flood(args)
        print(text)
        if args.out:
            args.out.write_text(text)
        return
    ctx = multiprocessing.get_context("spawn")
    rows = []
    for interval in [float(x) for x in args.intervals.split(",")]:
        print(f"polling every {interval} s for {args.seconds} s ...", file=sys.stderr)
        rows += run_interval(ctx, args.files, args.seconds, interval, seed=4)
    lines = ["## Log tailing (issue 4)", "",
             f"{args.files} files, ~{args.files} lines/s written with bursts and split lines, "
             f"{args.seconds:.0f} s per interval, all readers at once; CPU is each reader "
             f"process's own, in `poll()`. Written: {rows[0]['written'] / (args.seconds + 1):.0f} "
             f"lines/s. os.cpu_count() = {os.cpu_count()}.", "",
             "| reader | poll every | CPU s per s | vs naive | ms per poll | lines/s | "
             "lag p50 | lag max | open handles | RSS MiB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        naive = next(r for r in rows if r["interval"] == row["interval"]
                     and r["reader"] == "naive")
        lines.append(
            f"| {row['reader']} | {row['interval']:g} s | {row['cpu_per_s']:.4f} | "
            f"{row['cpu_per_s'] / naive['cpu_per_s']:.2f}x | {row['ms_per_poll']:.1f} | "
            f"{row['lines_per_s']:.0f} | {row['lag_p50']:.2f} s | {row['lag_max']:.2f} s | "
            f"{row['open_handles']} | {row['rss_mib']:.0f} |")
    for interval in sorted({row["interval"] for row in rows}, reverse=True):
        plain, user = (next(r for r in rows if r["interval"] == interval and r["reader"] == n)
                       for n in ("tailer-256", "tailer-256-user"))
        lines.append("")
        lines.append(f"Every {interval:g} s, reading with the user's rights costs "
                     f"{user['cpu_per_s'] / plain['cpu_per_s']:.2f}x the CPU of reading "
                     "as the agent (tailer-256-user / tailer-256).")
    lines += ["", "naive: stat + open/seek/read per changed file each poll; tailer-256: the "
              "default descriptor limit; tailer-256-user: the same, each file read with "
              "its user's rights; tailer-all: one descriptor per file."]
    text = "\n".join(lines) + "\n"
    if not args.no_flood:
        text += "\n" + run_flood(args)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
