"""Recovery benchmark (issue 5): injected failures on a dev cluster, slurm-recovery
against plain Slurm (``--requeue`` plus ``RequeueExit``), in the same run.

    python -m tests.benchmarks.bench_recovery [--cases 20] [--baseline 3] [--out FILE]

It starts its own 4-node dev cluster (port $RECOVERY_BENCH_PORT or 37817,
``RequeueExit=75`` added to slurm.conf for the baseline) and its own agent.

Failure kinds, taken in turn, one single-node job per case:

* ``xid``: a training job; an XID 79 is written to its node's kernel log and
  its rank crashes with a CUDA error. Expected: requeue without the node, drain.
* ``nccl``: the job prints a NCCL watchdog timeout and exits 1. Expected: requeue.
* ``hang``: the job stops printing (``hang=5s``). Expected: kill and requeue.

For each case: *evidence -> detection* is the agent's decision time minus the
moment the evidence existed (the injection; for a hang, the job's last line,
its output file's mtime, plus the 5 s hang window, since silence only becomes
evidence then); *detection ->
action done* is the recommendation's completion minus its decision;
*failure -> running again* is the moment squeue (polled every 0.2 s) shows
the job RUNNING again minus the injection.

The baseline runs the same kinds with no agent: jobs exit 75 on failure so that
Slurm requeues them itself. A GPU fault persists, so the benchmark writes the
XID again whenever the baseline job starts on the bad node (each such start is
an attempt wasted on the bad node). Baseline cases run side by side (each waits
out Slurm's requeue delay) and are given up after ``--cap`` seconds.
Nothing here asserts a time; the figures go to stdout and ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from recovery_agent.errors import SchedulerError
from recovery_devtools.devcluster.cluster import DevCluster
from recovery_devtools.devcluster.config import local_spec
from recovery_devtools.devcluster.inject import clear_node, inject_xid

PORT = int(os.environ.get("RECOVERY_BENCH_PORT", "37817"))
REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "train.py"
KINDS = ("xid", "nccl", "hang")
HANG_S = 5
REQUEUE_EXIT = 75
NCCL_LINE = ("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, "
             "OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600012 "
             "milliseconds before timing out.")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Bench:
    def __init__(self, cluster: DevCluster) -> None:
        self.cluster = cluster
        self.runner = cluster.runner(timeout=30)
        self.sched = cluster.scheduler()
        self.lay = cluster.lay
        self.db = self.lay.root / "agent" / "bench.db"
        self.agent: subprocess.Popen | None = None

    # -- the agent ---------------------------------------------------------------
    def start_agent(self) -> None:
        env = dict(os.environ, RECOVERY_CONFIG=str(self.lay.agent_config),
                   RECOVERY_STORE_PATH=str(self.db),
                   # the same 4 nodes take every fault: no lemons, no budget in the way
                   RECOVERY_POLICY_LEMON_THRESHOLD="0",
                   RECOVERY_POLICY_MAX_DRAINS_PER_HOUR="1000",
                   RECOVERY_POLICY_MAX_DRAINED_PERCENT="100")
        out = open(self.lay.logs / "bench-agent.log", "ab")
        self.agent = subprocess.Popen([sys.executable, "-m", "recovery_agent"], env=env,
                                      stdout=out, stderr=out, stdin=subprocess.DEVNULL)
        port = int(next(l.split("=")[1] for l in self.lay.agent_config.read_text()
                        .splitlines() if l.startswith("port =")))
        import urllib.request
        for _ in range(120):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/health", timeout=1)
                return
            except OSError:
                time.sleep(0.25)
        raise SystemExit("the agent did not start; see " + str(self.lay.logs / "bench-agent.log"))

    def stop_agent(self) -> None:
        if self.agent and self.agent.poll() is None:
            self.agent.terminate()
            self.agent.wait(timeout=15)

    def rec(self, job_id: str) -> dict | None:
        with sqlite3.connect(self.db, timeout=10) as conn:
            conn.row_factory = sqlite3.Row
            rows = conn.execute("select * from recommendations where job_id = ? and "
                                "scope = 'job' order by id limit 1", (job_id,)).fetchall()
        return dict(rows[0]) if rows else None

    # -- jobs ----------------------------------------------------------------------
    def script(self, kind: str, baseline: bool, trigger: Path) -> str:
        fail = f"exit {REQUEUE_EXIT}" if baseline else "exit 1"
        if kind == "xid":
            xid_log = str(self.lay.kernel_log("NODE")).replace("NODE", "{node}")
            ckpt = self.lay.jobs / f"bench-ckpt-{trigger.name}"
            return (f"{sys.executable} {TRAIN} --ckpt-dir {ckpt} --steps 100000 "
                    f"--step-time 0.1 --ckpt-every 20 --xid-log {xid_log} || {fail}")
        after = f"echo '{NCCL_LINE}'; {fail}" if kind == "nccl" else "sleep 100000"
        return (f't={trigger}-${{SLURM_RESTART_COUNT:-0}}; i=0; while [ ! -e "$t" ]; do '
                f'i=$((i+1)); echo "step $i loss 1.0"; sleep 0.2; done; {after}')

    def submit(self, kind: str, baseline: bool, name: str) -> tuple[str, Path]:
        trigger = self.lay.jobs / f"trigger-{name}"
        args = ["sbatch", "--parsable", f"--chdir={self.lay.jobs}", "--mem=100", "-N1",
                "--requeue", "--open-mode=append", "-o", f"{name}-%j.out", "-J", name]
        if not baseline:
            args.append(f"--comment=recovery=act,hang={HANG_S}s")
        job_id = self.runner.run([*args, "--wrap",
                                  self.script(kind, baseline, trigger)]).stdout.strip()
        return job_id.split(";")[0], trigger

    def job(self, job_id: str):
        try:
            return self.sched.get_job(job_id)
        except SchedulerError:
            return None

    def wait(self, what: str, predicate, timeout: float, interval: float = 0.2):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = predicate()
            if found:
                return found
            time.sleep(interval)
        raise TimeoutError(what)

    def inject(self, kind: str, job, trigger: Path) -> float:
        if kind == "xid":
            inject_xid(self.lay, job.nodes[0], 0, 79)
        else:
            trigger.with_name(f"{trigger.name}-0").touch()
        return time.time()

    def cleanup(self, job_id: str, nodes) -> None:
        self.runner.run(["scancel", job_id], check=False)
        for node in nodes:
            clear_node(self.lay, node)
            try:
                if self.sched.get_node(node).drained:
                    self.sched.resume_node(node)
            except SchedulerError:
                pass
            with sqlite3.connect(self.db, timeout=10) as conn:
                conn.execute("update nodes set drained_by_us = 0 where name = ?", (node,))
        self.wait("nodes idle", lambda: all(n.available and n.state == "IDLE"
                                            for n in self.sched.list_nodes()), 60, 0.3)

    # -- one case with the agent -----------------------------------------------------
    def ours(self, index: int, kind: str) -> dict:
        job_id, trigger = self.submit(kind, False, f"ours{index}-{kind}")
        job = self.wait("running", lambda: (j := self.job(job_id)) and j.state == "RUNNING"
                        and j, 60)
        time.sleep(2.5)    # a little training first (and a checkpoint for xid)
        failed = self.inject(kind, job, trigger)
        evidence = failed
        if kind == "hang":
            # the silence began with the job's last line, up to one print
            # before the injection: the output file's mtime once it stopped
            time.sleep(1.0)
            out = self.lay.jobs / f"ours{index}-{kind}-{job_id}.out"
            evidence = os.stat(out).st_mtime + HANG_S
        result = {"kind": kind, "job": job_id, "node": job.nodes[0]}
        try:
            again = self.wait("running again", lambda: (j := self.job(job_id)) and
                              j.restart_count >= 1 and j.state == "RUNNING" and j, 90)
            running_at = time.time()
            rec = self.wait("recommendation done", lambda: (r := self.rec(job_id)) and
                            r["status"] in ("done", "failed", "expired") and r, 30)
            result.update(recovered=rec["status"] == "done", action=rec["action"],
                          detect_s=rec["detected_at"] - evidence,
                          action_s=(rec["done_at"] or float("nan")) - rec["detected_at"],
                          running_again_s=running_at - failed,
                          same_node=job.nodes[0] in again.nodes)
        except TimeoutError as exc:
            result.update(recovered=False, error=f"timed out waiting for {exc}")
        self.cleanup(job_id, [job.nodes[0]])
        return result

    # -- the baseline: plain Slurm ---------------------------------------------------
    def baseline(self, kinds: list[str], cap: float) -> list[dict]:
        cases = []
        for i, kind in enumerate(kinds):
            job_id, trigger = self.submit(kind, True, f"plain{i}-{kind}")
            cases.append({"kind": kind, "job": job_id, "trigger": trigger, "injected": None,
                          "bad": None, "starts": [], "running_again_s": None})
        deadline = time.monotonic() + cap + 60
        seen_start: dict[str, tuple[int, str]] = {}
        while time.monotonic() < deadline:
            live = {j.job_id: j for j in self.sched.list_jobs()}
            now = time.time()
            for case in cases:
                job = live.get(case["job"])
                if job is None or job.state != "RUNNING":
                    continue
                key = (job.restart_count, job.nodes[0])
                if seen_start.get(case["job"]) != key:
                    seen_start[case["job"]] = key
                    case["starts"].append({"restart": job.restart_count, "node": job.nodes[0],
                                           "at": now})
                    if case["injected"] is not None and job.restart_count >= 1 \
                            and case["running_again_s"] is None:
                        case["running_again_s"] = now - case["injected"]
                    if case["kind"] == "xid" and case["bad"] == job.nodes[0]:
                        inject_xid(self.lay, job.nodes[0], 0, 79)   # the GPU is still broken
                if case["injected"] is None and now - case["starts"][0]["at"] > 2.5:
                    case["injected"] = self.inject(case["kind"], job, case["trigger"])
                    case["bad"] = job.nodes[0]
            done = all(c["injected"] is not None and (
                c["running_again_s"] is not None and not (
                    c["kind"] == "xid" and c["starts"][-1]["node"] == c["bad"])
                or now - c["injected"] > cap) for c in cases)
            if done:
                break
            time.sleep(0.5)
        results = []
        for case in cases:
            # only a node fault makes a restart on the same node a wasted attempt
            wasted = sum(1 for s in case["starts"][1:] if s["node"] == case["bad"]) \
                if case["kind"] == "xid" else None
            recovered = case["running_again_s"] is not None and not (
                case["kind"] == "xid" and case["starts"][-1]["node"] == case["bad"])
            results.append({"kind": case["kind"], "job": case["job"], "recovered": recovered,
                            "running_again_s": case["running_again_s"],
                            "attempts": len(case["starts"]), "wasted_on_bad_node": wasted})
            self.runner.run(["scancel", case["job"]], check=False)
        for node in self.cluster.node_names():
            clear_node(self.lay, node)
        return results


def stats(values: list[float]) -> tuple[float, float]:
    values = sorted(v for v in values if v == v)
    if not values:
        return float("nan"), float("nan")
    p95 = values[min(len(values) - 1, round(0.95 * (len(values) - 1)))]
    return statistics.median(values), p95


# what the last part of "running again" is, after our release (read in 22.05's
# src/slurmctld/controller.c, _slurmctld_background)
SCHEDULER_NOTE = (
    "After the release the job waits for slurmctld's next scheduling pass. A pass that "
    "events ask for (a job's end, our requeue, the release) runs at most every "
    "`batch_sched_delay` seconds after the one before (`SchedulerParameters`, 3 by "
    "default), and the failed attempt's own end asks for one, so on a cluster with the "
    "default a restart is allocated about 3 s after that pass at the earliest, however "
    "soon the release comes. The benchmark's cluster keeps Slurm's default; the "
    "half-second poll that sees the job running adds up to 0.5 s.")

VERSIONS = REPO / "docs" / "benchmarks-recovery-versions.json"
SLURM_VERSIONS_NOTE = (
    "The same benchmark on each Slurm release the live matrix runs (`make bench-slurm`: "
    "22.05 on this host, 24.11 and 26.05 in their chroots, docs/slurm-versions.md), "
    "with no baseline; each row is its own run. Plain Slurm's own requeue waits "
    "`AuthInfo=cred_expire` + 1 s (121 s by default) on all three. No release here "
    "offers a faster requeue that keeps an exclusion: 25.11 added "
    "`SchedulerParameters=requeue_delay=N` (a site-wide change of that wait, which "
    "StartTime=now already skips) and `sbatch --requeue=expedited` with "
    "`SlurmctldParameters=enable_expedited_requeue` (set at submission; Slurm "
    "requeues the failed job itself at top priority on the nodes it had, the opposite "
    "of leaving a bad node out). So the path stays requeue-hold, exclude, StartTime=now, "
    "release on every version, and the start waits two whole seconds after the "
    "second its nodes were told to end the attempt: our requeue's for a running job, "
    "the attempt's own end for one that had ended (a slurmd refused a sooner relaunch on 24.11: "
    "docs/slurm-versions.md).")


def versions_section(path: Path = VERSIONS) -> list[str]:
    """The per-release table, from what ``--add-version`` recorded."""
    try:
        runs = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    lines = ["", "## Per Slurm release (issue 18)", "", SLURM_VERSIONS_NOTE, "",
             "| Slurm | cases | recovered | failure → running again median s (xid / nccl / "
             "hang) | detection → action done median s | measured |", "|---|---|---|---|---|---|"]
    for run in sorted(runs, key=lambda r: [int(p) for p in r["version"].split(".")]):
        lines.append(f"| {run['version']} | {run['cases']} | {run['recovered']} | "
                     f"{run['xid']:.2f} / {run['nccl']:.2f} / {run['hang']:.2f} | "
                     f"{run['action']:.2f} | {run['date']} |")
    return lines


def add_version(version: str, raw: Path, path: Path = VERSIONS) -> dict:
    """Record one release's run (a ``--json`` file) in the per-release table."""
    ours = json.loads(raw.read_text())["ours"]
    ok = [r for r in ours if r.get("recovered")]

    def med(kind: str, key: str = "running_again_s") -> float:
        return stats([r[key] for r in ok if kind == "all" or r["kind"] == kind])[0]

    run = {"version": version, "cases": len(ours), "recovered": len(ok), "xid": med("xid"),
           "nccl": med("nccl"), "hang": med("hang"), "action": med("all", "action_s"),
           "date": time.strftime("%Y-%m-%d", time.gmtime(raw.stat().st_mtime))}
    try:
        runs = [r for r in json.loads(path.read_text()) if r["version"] != version]
    except (OSError, ValueError):
        runs = []
    path.write_text(json.dumps(runs + [run], indent=1) + "\n")
    return run


def report(ours: list[dict], plain: list[dict], cap: float) -> str:
    lines = ["## Recovery (issue 5)", "",
             f"{len(ours)} injected failures on a 4-node dev cluster, one at a time, "
             f"kinds in turn ({', '.join(KINDS)}); agent poll interval 2 s; "
             f"hang window {HANG_S} s (counted as part of the failure, not of detection).", "",
             "| kind | cases | recovered | evidence → detection median / p95 s | "
             "detection → action done median / p95 s | failure → running again "
             "median / p95 s |", "|---|---|---|---|---|---|"]
    groups = [(k, [r for r in ours if r["kind"] == k]) for k in KINDS] + [("all", ours)]
    for kind, rows in groups:
        if not rows:
            continue
        ok = [r for r in rows if r.get("recovered")]
        d, a, g = (stats([r[key] for r in ok]) for key in ("detect_s", "action_s",
                                                           "running_again_s"))
        lines.append(f"| {kind} | {len(rows)} | {len(ok)} | {d[0]:.2f} / {d[1]:.2f} | "
                     f"{a[0]:.2f} / {a[1]:.2f} | {g[0]:.2f} / {g[1]:.2f} |")
    ok = [r for r in ours if r.get("recovered")]
    d, a, g = (stats([r[key] for r in ok]) for key in ("detect_s", "action_s",
                                                       "running_again_s"))
    lines += ["", "Targets: detection median ≤ 3 s "
              f"({'met' if d[0] <= 3 else 'missed'}), action done ≤ 5 s after detection "
              f"({'met' if a[1] <= 5 else 'missed'} at p95), running again ≤ 15 s "
              f"({'met' if g[1] <= 15 else 'missed'} at p95).", "", SCHEDULER_NOTE, ""]
    lines += [f"Baseline: plain Slurm, `--requeue` and `RequeueExit={REQUEUE_EXIT}`, the same "
              f"kinds, run side by side, given up after {cap:.0f} s. A GPU fault persists: "
              "a start on the bad node meets it again.", "",
              "| kind | recovered | failure → running again s | attempts | "
              "attempts wasted on the bad node | slurm-recovery median s | ratio |",
              "|---|---|---|---|---|---|---|"]
    for r in plain:
        mine = stats([o["running_again_s"] for o in ours
                      if o["kind"] == r["kind"] and o.get("recovered")])[0]
        again = r["running_again_s"]
        ratio = f"{again / mine:.1f}x" if again and mine == mine else "—"
        again_text = f"{again:.1f}" if again is not None else f"never (in {cap:.0f} s)"
        wasted = "—" if r["wasted_on_bad_node"] is None else r["wasted_on_bad_node"]
        lines.append(f"| {r['kind']} | {'yes' if r['recovered'] else 'no'} | {again_text} | "
                     f"{r['attempts']} | {wasted} | {mine:.2f} | {ratio} |")
    failed = [r for r in ours if not r.get("recovered")]
    if failed:
        lines += ["", "Cases slurm-recovery did not recover: "
                  + "; ".join(f"{r['kind']} job {r['job']}: {r.get('error', r.get('action'))}"
                              for r in failed)]
    lines += versions_section()
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=20, help="failures with the agent")
    parser.add_argument("--baseline", type=int, default=3,
                        help="plain-Slurm cases (kinds in turn, run side by side)")
    parser.add_argument("--cap", type=float, default=240.0,
                        help="give a baseline case up after this many seconds")
    parser.add_argument("--out", type=Path, default=None, help="also write Markdown here")
    parser.add_argument("--json", type=Path, default=None, help="raw per-case results")
    parser.add_argument("--add-version", nargs=2, metavar=("SLURM", "JSON"), default=None,
                        help="record a --json run made on Slurm SLURM in the per-release "
                        "table (docs/benchmarks-recovery-versions.json), then stop")
    parser.add_argument("--report-from", type=Path, default=None, metavar="JSON",
                        help="only print the report of an earlier run's --json file")
    args = parser.parse_args()
    if args.add_version:
        print(add_version(args.add_version[0], Path(args.add_version[1])))
        return
    if args.report_from:
        data = json.loads(args.report_from.read_text())
        text = report(data["ours"], data["plain"], args.cap)
        print(text)
        if args.out:
            args.out.write_text(text)
        return
    state = Path(tempfile.mkdtemp(prefix="recovery-bench-recovery-"))
    cluster = DevCluster(state, progress=log)
    spec = replace(local_spec(nodes=4, port=PORT), extra_conf=(f"RequeueExit={REQUEUE_EXIT}",))
    log(cluster.up(spec))
    bench = Bench(cluster)
    ours: list[dict] = []
    plain: list[dict] = []
    try:
        bench.start_agent()
        for i in range(args.cases):
            kind = KINDS[i % len(KINDS)]
            result = bench.ours(i, kind)
            ours.append(result)
            log(f"case {i + 1}/{args.cases} {kind}: " + (
                f"detect {result['detect_s']:.2f}s action {result['action_s']:.2f}s "
                f"running again {result['running_again_s']:.2f}s" if result.get("recovered")
                else f"NOT recovered ({result.get('error') or result.get('action')})"))
        bench.stop_agent()
        if args.baseline:
            log(f"baseline: {args.baseline} plain-Slurm case(s), up to {args.cap:.0f}s")
            plain = bench.baseline([KINDS[i % len(KINDS)] for i in range(args.baseline)],
                                   args.cap)
    finally:
        bench.stop_agent()
        cluster.down(quiet=True)
    text = report(ours, plain, args.cap)
    print(text)
    if args.out:
        args.out.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({"ours": ours, "plain": plain}, indent=1, default=str))


if __name__ == "__main__":
    main()
