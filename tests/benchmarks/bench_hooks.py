"""Hook and ingest benchmarks (issue 3). One command: `make bench`.

Figures are printed as medians and p95, and as ratios against a baseline
measured in the same run on the same machine: a bare `python -c pass` start
(the floor any Python hook pays). Nothing here asserts a time; the targets
are printed beside the figures for a person to judge.

* prolog wall time: a job that did not opt in, an opted-in job with the agent
  up, and one with the agent down (the report is spooled);
* ingest throughput: signed reports per second into /v1/hooks/epilog with 1,
  4 and 16 concurrent senders.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

from recovery_devtools.devcluster.cluster import DevCluster
from recovery_devtools.devcluster.config import local_spec
from slurm_hooks.delivery import Deliverer

PORT = int(os.environ.get("RECOVERY_BENCH_PORT", "36817"))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def timed_runs(argv: list[str], env: dict, runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=False)
        times.append((time.perf_counter() - started) * 1000)
    return times


def hook_env(cluster: DevCluster, opted_in: bool, n: int) -> dict:
    env = {"SLURMD_NODENAME": "node1", "SLURM_JOB_ID": str(900000 + n),
           "SLURM_CLUSTER_NAME": "devcluster", "SLURM_JOB_USER": "root",
           "SLURM_JOB_RESTART_COUNT": "0", "SLURM_SCRIPT_CONTEXT": "prolog_slurmd"}
    if opted_in:
        env["SPANK__SLURM_SPANK_OPTION_slurm_recovery_recovery"] = "bench:monitor"
    return env


class Agent:
    def __init__(self, cluster: DevCluster) -> None:
        self.cluster = cluster
        self.proc = None
        self.port = local_spec(port=PORT).agent_port

    def start(self) -> None:
        env = dict(os.environ, RECOVERY_CONFIG=str(self.cluster.lay.agent_config))
        self.proc = subprocess.Popen([sys.executable, "-m", "recovery_agent"], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/health", timeout=1)
                return
            except OSError:
                time.sleep(0.2)
        raise SystemExit("agent did not start")

    def stop(self) -> None:
        if self.proc:
            self.proc.terminate()
            self.proc.wait(timeout=15)
            self.proc = None


def bench_prolog(cluster: DevCluster, agent: Agent, runs: int) -> list[dict]:
    wrapper = str(cluster.lay.hook_wrapper("prolog"))
    baseline = timed_runs([sys.executable, "-c", "pass"], dict(os.environ), runs)
    rows = [("python -c pass (baseline)", baseline, None)]
    rows.append(("prolog, job not opted in", timed_runs([wrapper], hook_env(cluster, False, 0),
                                                        runs), 30))
    agent.start()
    rows.append(("prolog, opted in, agent up",
                 [timed_runs([wrapper], hook_env(cluster, True, i), 1)[0] for i in range(runs)],
                 200))
    agent.stop()
    rows.append(("prolog, opted in, agent down (spooled)",
                 [timed_runs([wrapper], hook_env(cluster, True, i), 1)[0] for i in range(runs)],
                 700))
    base = statistics.median(baseline)
    return [{"case": name, "median_ms": statistics.median(t), "p95_ms": percentile(t, 0.95),
             "ratio_to_baseline": statistics.median(t) / base, "target_ms": target}
            for name, t, target in rows]


def bench_ingest(cluster: DevCluster, agent: Agent, total: int) -> list[dict]:
    socket_path = str(cluster.lay.munge_socket)
    agent.start()
    results = []
    try:
        for senders in (1, 4, 16):
            bodies = []
            for i in range(total):
                report = {"version": 1, "hook": "epilog", "report_id": uuid.uuid4().hex,
                          "created": time.time(), "cluster": "devcluster", "node": "node1",
                          "job": {"job_id": str(700000 + i), "attempt": 0, "spec": "bench"},
                          "gpus": {"ok": True, "count": 1, "gpus": [{"index": 0}]},
                          "xids": [], "exit": {"code": 0, "signal": None}}
                bodies.append(json.dumps(report).encode())
            deliverer = Deliverer(f"http://127.0.0.1:{agent.port}", 5.0,
                                  tempfile.mkdtemp(), socket_path)
            started = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(senders) as pool:
                outcomes = list(pool.map(lambda b: deliverer.send("epilog", b), bodies))
            elapsed = time.perf_counter() - started
            results.append({"senders": senders, "reports": total,
                            "stored": outcomes.count("sent"),
                            "reports_per_s": total / elapsed})
    finally:
        agent.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=30, help="hook runs per case")
    parser.add_argument("--reports", type=int, default=300, help="reports per ingest round")
    parser.add_argument("--out", type=Path, default=None, help="also write Markdown here")
    args = parser.parse_args()
    state = Path(tempfile.mkdtemp(prefix="recovery-bench-"))
    cluster = DevCluster(state, progress=lambda m: print(m, file=sys.stderr))
    print(cluster.up(local_spec(nodes=1, port=PORT)), file=sys.stderr)
    try:
        prolog = bench_prolog(cluster, Agent(cluster), args.runs)
        ingest = bench_ingest(cluster, Agent(cluster), args.reports)
    finally:
        cluster.down(quiet=True)
    lines = ["## Hooks and ingest (issue 3)", "",
             f"{args.runs} runs per case; baseline: `python -c pass` on the same machine.", "",
             "| case | median ms | p95 ms | median / baseline | target |",
             "|---|---|---|---|---|"]
    for r in prolog:
        target = f"≤ {r['target_ms']} ms" if r["target_ms"] else "—"
        lines.append(f"| {r['case']} | {r['median_ms']:.1f} | {r['p95_ms']:.1f} | "
                     f"{r['ratio_to_baseline']:.2f}x | {target} |")
    lines += ["", "| concurrent senders | reports | stored | reports/s |", "|---|---|---|---|"]
    for r in ingest:
        lines.append(f"| {r['senders']} | {r['reports']} | {r['stored']} | "
                     f"{r['reports_per_s']:.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
