"""Scale benchmark (issue 7): the agent's whole watch pipeline at 100, 1,000 and
10,000 tracked jobs.

    python -m tests.benchmarks.bench_scale [--sizes 100,1000,10000] [--cycles 5] [--out FILE]

Inputs are built from real output recorded from Slurm 22.05
(``tests/fixtures/slurm/22.05/squeue_all.json`` and ``sinfo.json``): one recorded
RUNNING job record is cloned N times, each opted in with ``--comment``, on 2
nodes of its own (20,000 nodes at N = 10,000), each writing its own output
file. The CLI backend parses that JSON through a runner that serves it instead
of forking squeue, so parsing is measured, and Slurm calls are counted.
``--active`` files (2,000 by default, all when N is smaller) grow at about one
line per second each, written by a separate process; one job in 500 fails per
cycle (a CUDA error line, then FAILED), so verdicts and decisions are part of
the load (judged 1 s after the end: no epilog reports come here).

Per size, each in a fresh process: CPU seconds and wall seconds per cycle
(median over ``--cycles`` after the warm-up: the first cycle registers every
job, and the cycles after the second last until the tailer has read the start
of every new file, at most ``MAX_CATCH_UP``; how many there were and their
median CPU are reported apart), the slowest measured cycle, peak RSS over the
measured cycles (VmHWM, reset after set-up, so it includes parsing each
squeue listing; the benchmark writes its listing a record at a time, so its
own text is not in it), store bytes per 1,000 job-attempts, and Slurm calls
per cycle. Growth exponents are fitted between sizes
(``log(ratio of figure) / log(ratio of jobs)``: 1 is linear).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import multiprocessing

import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "slurm" / "22.05"
CYCLE_S = 2.0
MAX_CATCH_UP = 15   # extra warm-up cycles, at most, while the tailer reads every file's start


class Listing:
    """The squeue document, printed as Slurm prints it (two-space indents), kept
    as one text per job so that failing a few jobs rewrites those few records
    (the benchmark's own work stays small)."""

    def __init__(self, doc: dict) -> None:
        jobs = doc.pop("jobs")
        head = json.dumps(doc, indent=2)
        self.head = head[:-2] + ',\n  "jobs": [\n'
        self.records = [self._render(j) for j in jobs]
        self.index = {j["job_id"]: i for i, j in enumerate(jobs)}

    @staticmethod
    def _render(record: dict) -> str:
        return "\n".join("    " + line for line in json.dumps(record, indent=2).split("\n"))

    def fail(self, ids: set[int]) -> None:
        for job_id in ids:
            i = self.index[job_id]
            record = json.loads(self.records[i])
            record.update(job_state="FAILED", exit_code=256)
            self.records[i] = self._render(record)

    def text(self) -> str:
        return self.head + ",\n".join(self.records) + "\n  ]\n}"

    def write(self, path: Path) -> None:
        """:meth:`text` into ``path`` a record at a time: the whole text (and
        its encoding) would add 75 MB at 10,000 jobs to the agent's measured
        peak, in this process but none of the agent's doing."""
        with open(path, "w") as fh:
            fh.write(self.head)
            for i, record in enumerate(self.records):
                fh.write(",\n" + record if i else record)
            fh.write("\n  ]\n}")


def build_inputs(n: int, logs: Path) -> tuple[Listing, str, list[str]]:
    """(squeue listing, sinfo JSON, output paths) for n running jobs on 2n nodes."""
    squeue = json.loads((FIXTURES / "squeue_all.json").read_text())
    sinfo = json.loads((FIXTURES / "sinfo.json").read_text())
    template = next(j for j in squeue["jobs"] if j["job_state"] == "RUNNING")
    node_tpl = sinfo["nodes"][0]
    jobs, nodes, paths = [], [], []
    now = int(time.time())
    for i in range(n):
        job = copy.deepcopy(template)
        job_id = 100000 + i
        path = str(logs / f"train-{job_id}.out")
        job.update({"job_id": job_id, "array_job_id": 0, "array_task_id": None,
                    "array_task_string": "", "name": f"train-{i}", "comment": "recovery=prod",
                    "nodes": f"gpu[{2 * i:05d}-{2 * i + 1:05d}]", "batch_host": f"gpu{2 * i:05d}",
                    "standard_output": path, "standard_error": path, "restart_cnt": 0,
                    "submit_time": now - 3600, "start_time": now - 3000, "end_time": now + 86400,
                    "job_state": "RUNNING", "node_count": 2})
        jobs.append(job)
        paths.append(path)
    for k in range(2 * n):
        node = copy.deepcopy(node_tpl)
        node.update({"name": f"gpu{k:05d}", "hostname": f"gpu{k:05d}", "state": "allocated",
                     "state_flags": [], "reason": "", "partitions": ["gpu"]})
        nodes.append(node)
    squeue["jobs"], sinfo["nodes"] = jobs, nodes
    return Listing(squeue), json.dumps(sinfo, indent=2), paths


def _rss_mb(field: str) -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def writer(paths: list[str], stop_at: float, seed: int) -> None:
    """About one line per second per file, in bursts, like training output."""
    rng = random.Random(seed)
    handles = {}
    step = 0
    while time.time() < stop_at:
        started = time.time()
        for path in paths:
            fh = handles.get(path) or handles.setdefault(path, open(path, "a"))
            step += 1
            fh.write(f"[rank0] iteration {step:>8d}/ 500000 | lm loss: "
                     f"{rng.uniform(1.8, 2.6):.6E} | elapsed time per iteration (ms): "
                     f"{rng.uniform(950, 1100):.1f}\n")
            fh.flush()
        time.sleep(max(0.0, 1.0 - (time.time() - started)))


def run_size(n: int, cycles: int, active: int, out: multiprocessing.Queue,
             profile: bool = False) -> None:
    from recovery_agent.config import from_mapping
    from recovery_agent.decide.decider import Decider
    from recovery_agent.detect.patterns import load_rules
    from recovery_agent.detect.scanner import Scanner
    from recovery_agent.inputs.logline import SqliteCursorStore
    from recovery_agent.inputs.tail import Tailer
    from recovery_agent.scheduler.cli_backend import CliScheduler
    from recovery_agent.scheduler.runner import SlurmRunner
    from recovery_agent.watch import verdicts as watch_verdicts
    from recovery_agent.store import Store
    from recovery_agent.watch import Watcher

    # no node hooks run here: a failed job is judged 1 s after it ends, not after
    # the 15 s wait for epilog reports, so its decision falls in the measured cycles
    watch_verdicts.EPILOG_GRACE = 1.0

    tmp = Path(tempfile.mkdtemp(prefix=f"recovery-scale-{n}-"))
    logs = tmp / "logs"
    logs.mkdir()
    listing, sinfo_text, paths = build_inputs(n, logs)
    for path in paths:
        Path(path).write_text("[rank0] iteration        1/ 500000 | lm loss: 2.5E+00\n")

    # squeue and sinfo are small scripts printing the built JSON: the agent forks
    # and reads them through its real argv seam, as it would the real commands
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    for name in ("squeue", "sinfo", "scontrol", "scancel"):
        script = bin_dir / name
        script.write_text(f"#!/bin/sh\nexec cat {tmp / (name + '.json')}\n")
        script.chmod(0o755)
    listing.write(tmp / "squeue.json")
    (tmp / "sinfo.json").write_text(sinfo_text)
    del sinfo_text
    runner = SlurmRunner(bin_dir=str(bin_dir))
    sched = CliScheduler(runner)
    cfg = from_mapping({"agent": {"cluster": "scale", "state_dir": str(tmp)},
                        "environments": {"prod": {"mode": "monitor"}}})
    store = Store(tmp / "recovery.db")
    watcher = Watcher(cfg, store, sched, Scanner(load_rules()), Tailer(SqliteCursorStore(store)),
                      decider=Decider(cfg, store, sched))
    stop_at = time.time() + (cycles + 3 + MAX_CATCH_UP) * CYCLE_S + 30
    proc = multiprocessing.Process(target=writer, args=(paths[:active], stop_at, n),
                                   daemon=True)
    proc.start()
    rng = random.Random(7)
    if profile:
        import cProfile
        prof = cProfile.Profile()
    cpu, wall, calls = [], [], []
    backlog = []   # files whose lines the tailer's budgets left unread, after each cycle
    catch_up = []  # CPU s of the warm-up cycles after the second (the tailer still behind)
    failed: set[int] = set()
    first = None   # the first measured cycle
    cycle = -1
    while first is None or cycle + 1 < first + cycles:
        cycle += 1
        # measured from the third cycle on, once the tailer has read every file's
        # first lines (registering N jobs gives it N new files at once; its time
        # budget spreads their first reads over several cycles), or at most
        # MAX_CATCH_UP cycles later
        if first is None and cycle >= 2 and (watcher.tailer.backlog == 0
                                             or cycle >= 2 + MAX_CATCH_UP):
            first = cycle
        measured = first is not None
        begun = time.monotonic()
        if cycle == first:   # peak RSS from here on: the agent's, not the set-up's
            import gc
            gc.collect()
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
        if measured:   # a few jobs fail: a CUDA error in the log, then FAILED in squeue
            pick = {100000 + rng.randrange(n) for _ in range(max(1, n // 500))} - failed
            for job_id in pick:
                with open(logs / f"train-{job_id}.out", "a") as fh:
                    fh.write("RuntimeError: CUDA error: an illegal memory access was "
                             "encountered\n")
            failed |= pick
            listing.fail(pick)
            tmp_text = tmp / "squeue.json.new"
            listing.write(tmp_text)
            tmp_text.replace(tmp / "squeue.json")
        before_calls = runner.total_calls()
        if profile and measured:
            prof.enable()
        c0, w0 = time.process_time(), time.monotonic()
        watcher.cycle()
        c1, w1 = time.process_time(), time.monotonic()
        if profile and measured:
            prof.disable()
        if not measured and cycle >= 2:
            catch_up.append(c1 - c0)
        if measured:
            backlog.append(watcher.tailer.backlog)
            cpu.append(c1 - c0)
            wall.append(w1 - w0)
            calls.append(runner.total_calls() - before_calls)
        time.sleep(max(0.0, CYCLE_S - (time.monotonic() - begun)))
    proc.terminate()
    if profile:
        import pstats
        if os.environ.get("BENCH_PSTATS"):   # for pstats' callers/callees afterwards
            prof.dump_stats(os.environ["BENCH_PSTATS"])
        pstats.Stats(prof, stream=sys.stderr).sort_stats(os.environ.get("BENCH_SORT", "tottime")).print_stats(int(os.environ.get("BENCH_TOP", "30")))
    attempts = store.db["attempts"].count
    store.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    size = (tmp / "recovery.db").stat().st_size
    out.put({"jobs": n, "active_files": min(active, n),
             "cpu_s": statistics.median(cpu), "cpu_per_cycle": [round(c, 3) for c in cpu],
             "tailer_backlog": backlog, "catch_up_cycles": len(catch_up),
             "catch_up_cpu_s": statistics.median(catch_up) if catch_up else 0.0,
             "wall_s": statistics.median(wall),
             "rss_mb": _rss_mb("VmHWM"), "rss_now_mb": _rss_mb("VmRSS"),
             "store_bytes_per_1000_attempts": size / max(attempts, 1) * 1000,
             "slurm_calls_per_cycle": statistics.median(calls),
             "decisions": store.db["events"].count_where("kind = 'verdict'"),
             "detections": store.db["detections"].count})


def exponent(a: dict, b: dict, key: str) -> float:
    if a[key] <= 0 or b[key] <= 0:
        return float("nan")
    return math.log(b[key] / a[key]) / math.log(b["jobs"] / a["jobs"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="100,1000,10000")
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--active", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--profile", action="store_true",
                        help="print where the measured cycles spend their time (cProfile; "
                             "the figures are then inflated)")
    args = parser.parse_args()
    results = []
    for n in (int(s) for s in args.sizes.split(",")):
        queue: multiprocessing.Queue = multiprocessing.Queue()
        proc = multiprocessing.Process(target=run_size, args=(n, args.cycles, args.active, queue,
                                                              args.profile))
        proc.start()
        result = queue.get()
        proc.join()
        print(f"{n} jobs: {json.dumps(result)}", file=sys.stderr, flush=True)
        results.append(result)
    lines = ["## Scale (issue 7): the watch pipeline at 100 → 10,000 jobs", "",
             f"Real 22.05 squeue/sinfo records cloned; {args.cycles} measured cycles of "
             f"{CYCLE_S:g} s per size; up to {args.active} output files growing at ~1 "
             "line/s each; 1 job in 500 fails per cycle. Catch-up cycles: warm-up cycles "
             "after the second while the tailer still had the start of new files to read "
             "(not measured).", "",
             "| jobs | CPU s / cycle | slowest cycle CPU s | wall s / cycle | RSS MB | "
             "store bytes / 1,000 attempts | Slurm calls / cycle | catch-up cycles "
             "(CPU s each) |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['jobs']} | {r['cpu_s']:.3f} | {max(r['cpu_per_cycle']):.3f} | "
                     f"{r['wall_s']:.3f} | "
                     f"{r['rss_mb']:.0f} | {r['store_bytes_per_1000_attempts']:.0f} | "
                     f"{r['slurm_calls_per_cycle']:.0f} | {r['catch_up_cycles']}"
                     + (f" ({r['catch_up_cpu_s']:.2f})" if r['catch_up_cycles'] else "")
                     + " |")
    if len(results) > 1:
        lines += ["", "Growth exponents (1 = linear):", ""]
        for a, b in zip(results, results[1:]):
            lines.append(f"* {a['jobs']} → {b['jobs']} jobs: CPU "
                         f"{exponent(a, b, 'cpu_s'):.2f}, RSS {exponent(a, b, 'rss_mb'):.2f}")
    last = results[-1]
    lines += ["", f"Targets at {last['jobs']} jobs: cycle ≤ 1 s CPU "
              f"({'met' if last['cpu_s'] <= 1 else 'missed'}: {last['cpu_s']:.2f} s), RSS ≤ "
              f"300 MB ({'met' if last['rss_mb'] <= 300 else 'missed'}: "
              f"{last['rss_mb']:.0f} MB)."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
