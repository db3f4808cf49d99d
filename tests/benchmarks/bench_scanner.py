"""Scanner throughput on a large generated training log, against ``grep -E -f``.

    python -m tests.benchmarks.bench_scanner [--lines 500000] [--seed 7]

The log is mostly what a healthy multi-node run prints (Megatron-style
iteration lines, tqdm bars, DeepSpeed and NCCL INFO chatter, warnings,
checkpoint saves), with rare real failures, a few long and non-UTF-8 lines.
Each engine scans the whole file end to end (read, decode, split, scan,
tracebacks folded); grep gets the same rules translated to POSIX ERE
(``LC_ALL=C``, GNU extensions ``\\w \\s \\b``) and counts matching lines.
Rules that cannot be written in ERE are listed. Prints a Markdown table;
no assertion on times.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from recovery_agent.detect.patterns import load_rules
from recovery_agent.detect.scanner import Scanner

HOSTS = [f"gpu-a{n:02d}" for n in range(1, 17)]
FAILURES = [
    ["[rank9]:[E1102 04:10:55.120117 ProcessGroupNCCL.cpp:616] [Rank 9] Watchdog caught "
     "collective operation timeout: WorkNCCL(SeqNum=9120, OpType=ALLREDUCE, NumelIn=1048576, "
     "NumelOut=1048576, Timeout(ms)=600000) ran for 600113 milliseconds before timing out."],
    ["Traceback (most recent call last):", '  File "/work/train.py", line 88, in <module>',
     "    loss = model(batch)", "torch.OutOfMemoryError: CUDA out of memory. Tried to "
     "allocate 2.00 GiB. GPU 3 has a total capacity of 79.11 GiB of which 1.10 GiB is free."],
    ["Jul 14 02:11:09 gpu-a07 kernel: [88123.1] NVRM: Xid (PCI:0000:b7:00): 79, "
     "pid='<unknown>', name=<unknown>, GPU has fallen off the bus."],
    ["gpu-a03:3110:3311 [2] transport/net_ib.cc:1690 NCCL WARN NET/IB : Got completion from "
     "peer 10.12.3.41<52114> with status=12 opcode=1 len=0 vendor err 129 (Send)"],
    ["RuntimeError: CUDA error: an illegal memory access was encountered"],
    ["srun: error: gpu-a05: task 3: Segmentation fault (core dumped)"],
    ["OSError: [Errno 28] No space left on device"],
]


def _benign(rng: random.Random, step: int) -> str:
    host = rng.choice(HOSTS)
    kind = rng.random()
    if kind < 0.45:
        return (f" iteration {step:>8}/ 3000000 | consumed samples: {step * 1024:>12} | "
                f"elapsed time per iteration (ms): {rng.uniform(800, 950):.1f} | learning "
                f"rate: {rng.uniform(1e-5, 3e-4):.3E} | global batch size:  1024 | lm loss: "
                f"{rng.uniform(1.8, 2.6):.6E} | loss scale: 1.0 | grad norm: "
                f"{rng.uniform(0.1, 2):.3f} | number of skipped iterations:   0 | "
                f"number of nan iterations:   0 |")
    if kind < 0.65:
        return (f"{host}:{rng.randint(1000, 99999)}:{rng.randint(1000, 99999)} "
                f"[{rng.randint(0, 7)}] NCCL INFO Channel {rng.randint(0, 31):02d}/0 : "
                f"{rng.randint(0, 63)}[{rng.randint(0, 7)}] -> {rng.randint(0, 63)}"
                f"[{rng.randint(0, 7)}] [send] via NET/IB/{rng.randint(0, 7)}/GDRDMA")
    if kind < 0.80:
        pct = rng.randint(0, 100)
        return (f"Epoch 3:  {pct}%|{'#' * (pct // 10)}{' ' * (10 - pct // 10)}| "
                f"{pct * 50}/5000 [12:{rng.randint(10, 59)}<31:02, 2.61it/s, loss=2.11]")
    if kind < 0.90:
        return (f"[2025-01-0{rng.randint(1, 9)} 10:00:00,{rng.randint(100, 999)}] [INFO] "
                f"[logging.py:128:log_dist] [Rank 0] step={step}, skipped=0, "
                f"lr=[0.0003], mom=[(0.9, 0.95)]")
    if kind < 0.95:
        return ("/venv/lib/python3.11/site-packages/torch/utils/checkpoint.py:91: UserWarning:"
                " None of the inputs have requires_grad=True. Gradients will be None")
    if kind < 0.98:
        return (f"{host}:881:881 [1] NCCL INFO NCCL_IB_HCA set to mlx5_0,mlx5_1,mlx5_2,"
                "mlx5_3 ; NCCL_SOCKET_IFNAME set by environment to ib0")
    return (f"[rank{rng.randint(0, 63)}]:[W{step % 1000} ProcessGroupNCCL.cpp:1250] Warning:"
            " TORCH_NCCL_AVOID_RECORD_STREAMS is the default now, this env var is deprecated")


def generate_log(lines: int, seed: int = 7, failure_every: int = 25000) -> list[str]:
    """A training log of about ``lines`` lines: benign output, rare failures,
    a few lines that are very long, binary or not UTF-8."""
    rng = random.Random(seed)
    out: list[str] = []
    step = 0
    while len(out) < lines:
        step += 1
        if step % failure_every == 0:
            out.extend(rng.choice(FAILURES))
        elif step % 9973 == 0:
            out.append("x" * 200_000 if rng.random() < 0.5 else "\x00\x01\xfe junk \ufffd\x7f")
        else:
            out.append(_benign(rng, step))
    return out


_ERE_SPECIAL = set(".[]()*+?{}|^$\\")
_OUTSIDE = {"d": "[0-9]", "D": "[^0-9]", "w": "\\w", "W": "\\W", "s": "\\s", "S": "\\S",
            "b": "\\b"}
_INSIDE = {"d": "0-9", "w": "[:alnum:]_", "s": "[:space:]"}


def to_ere(regex: str) -> str | None:
    """The rule's regex in POSIX ERE with GNU escapes, or None when it has no
    faithful translation (caseless flag, negated classes inside brackets...)."""
    out: list[str] = []
    i, bracket, quantified = 0, None, False
    while i < len(regex):
        c = regex[i]
        if bracket is not None:                      # inside [...]: copied, escapes resolved
            if c == "\\":
                nxt = regex[i + 1]
                if nxt in _INSIDE:
                    bracket.append(_INSIDE[nxt])
                elif nxt == "-" and regex[i + 2] == "]":
                    bracket.append("-")
                elif nxt.isalnum() or nxt in "]-\\^":
                    return None
                else:
                    bracket.append(nxt)
                i += 2
                continue
            if c == "]" and bracket not in ([], ["^"]):
                out.append("[" + "".join(bracket) + "]")
                bracket, quantified = None, False
            else:
                bracket.append(c)
            i += 1
            continue
        if c == "[":
            bracket, i = [], i + 1
            if regex[i] == "^":
                bracket.append("^")
                i += 1
            continue
        if c == "\\":
            nxt = regex[i + 1]
            if nxt in _OUTSIDE:
                out.append(_OUTSIDE[nxt])
            elif nxt.isalnum():
                return None
            else:
                out.append("\\" + nxt if nxt in _ERE_SPECIAL else nxt)
            i, quantified = i + 2, False
            continue
        if regex.startswith("(?:", i) or regex.startswith("(?P<", i):
            i = regex.index(">", i) + 1 if regex[i + 2] == "P" else i + 3
            out.append("(")
            quantified = False
            continue
        if regex.startswith("(?", i):
            return None
        if c == "?" and quantified:                  # lazy quantifier: same lines match
            i += 1
            continue
        out.append(c)
        quantified = c in "*+?}"
        i += 1
    return "".join(out)


def _best(run, repeat: int) -> tuple[float, int]:
    """The fastest of ``repeat`` runs (the machine may be shared) and its hit count."""
    results = [run() for _ in range(repeat)]
    return min(results)


def _scan_file(path: Path, engine: str, repeat: int) -> tuple[float, int]:
    scanner = Scanner(load_rules(), engine=engine)

    def once() -> tuple[float, int]:
        start = time.perf_counter()
        found = scanner.scan_bytes(path.read_bytes())
        return time.perf_counter() - start, len(found)
    return _best(once, repeat)


def _raw_hyperscan(path: Path, repeat: int) -> tuple[float, int]:
    """Hyperscan's own block scan of the scanner's database over the same
    bytes, counting match events and nothing else: the engine's floor."""
    database = Scanner(load_rules(), engine="hyperscan").engine.database

    def once() -> tuple[float, int]:
        events = [0]

        def on_match(*_args) -> None:
            events[0] += 1
        start = time.perf_counter()
        database.scan(path.read_bytes(), match_event_handler=on_match)
        return time.perf_counter() - start, events[0]
    return _best(once, repeat)


def _grep(path: Path, ere_file: Path, repeat: int) -> tuple[float, int] | None:
    if shutil.which("grep") is None:
        return None

    def once() -> tuple[float, int]:
        start = time.perf_counter()
        done = subprocess.run(["grep", "-E", "-c", "-f", str(ere_file), str(path)],
                              capture_output=True, text=True,
                              env={**os.environ, "LC_ALL": "C"})
        return time.perf_counter() - start, int(done.stdout.strip() or 0)
    return _best(once, repeat)


def run(lines: int, seed: int, repeat: int = 3) -> None:
    rules = [r for r in load_rules() if r.scope == "line"]
    translated, skipped = [], []
    for rule in rules:
        ere = to_ere(rule.regex)
        (translated.append(ere) if ere else skipped.append(rule.id))
    with tempfile.TemporaryDirectory() as tmp:
        path, ere_file = Path(tmp) / "train.log", Path(tmp) / "rules.ere"
        path.write_text("\n".join(generate_log(lines, seed)) + "\n", errors="surrogatepass")
        ere_file.write_text("\n".join(translated) + "\n")
        size = path.stat().st_size
        rows = [("grep -E -f (LC_ALL=C)", _grep(path, ere_file, repeat))]
        for engine in ("re", "hyperscan"):
            try:
                rows.append((f"scanner engine={engine}", _scan_file(path, engine, repeat)))
            except Exception as exc:   # hyperscan missing: say so in the table
                print(f"engine {engine}: {exc}")
        try:
            rows.append(("hyperscan raw block scan (same database, events only)",
                         _raw_hyperscan(path, repeat)))
        except Exception as exc:
            print(f"raw hyperscan: {exc}")
    grep_time = rows[0][1][0] if rows[0][1] else None
    raw = dict(rows).get("hyperscan raw block scan (same database, events only)")
    scanner_hs = dict(rows).get("scanner engine=hyperscan")
    print(f"\n{lines} lines, {size / 1e6:.1f} MB, {len(rules)} line rules "
          f"({len(translated)} in ERE for grep); best of {repeat} runs each\n")
    print("| matcher | seconds | MB/s | lines/s | hits | time vs grep |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, result in rows:
        if result is None:
            print(f"| {name} | - | - | - | - | - |")
            continue
        secs, hits = result
        ratio = f"{secs / grep_time:.2f}x" if grep_time else "-"
        print(f"| {name} | {secs:.2f} | {size / 1e6 / secs:.1f} | {lines / secs:,.0f} "
              f"| {hits} | {ratio} |")
    if grep_time and scanner_hs:
        print(f"\nscanner (hyperscan) speed: {grep_time / scanner_hs[0]:.2f}x grep's"
              + (f", {raw[0] / scanner_hs[0]:.2f}x hyperscan's raw block scan" if raw else ""))
    print("\nhits: grep counts matching lines; the scanner counts detections "
          "(a traceback is one); the raw scan counts match events.")
    print("rules not translated to ERE: " + (", ".join(skipped) or "none"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=500_000)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    run(args.lines, args.seed, args.repeat)


if __name__ == "__main__":
    main()
