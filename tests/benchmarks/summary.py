"""Gather the benchmark reports under docs/ into docs/benchmarks.md.

    python -m tests.benchmarks.summary [--docs docs] > docs/benchmarks.md

Each benchmark writes its own file (``make bench`` runs them all); this puts
them on one page, in a fixed order, naming the files that are missing.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ORDER = [
    ("benchmarks-scale.md", "tests.benchmarks.bench_scale"),
    ("benchmarks-burst.md", "tests.benchmarks.bench_burst"),
    ("benchmarks-recovery.md", "tests.benchmarks.bench_recovery"),
    ("benchmarks-hooks.md", "tests.benchmarks.bench_hooks"),
    ("benchmarks-scanner.md", "tests.benchmarks.bench_scanner"),
    ("benchmarks-tail.md", "tests.benchmarks.bench_tail"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--docs", type=Path, default=Path("docs"))
    args = parser.parse_args()
    out = ["# Benchmarks", "",
           "Made by `make bench` on the machine named in each section's own notes. Every "
           "figure is measured in the same run as its baseline; see each module's "
           "docstring for how (`python -m <module> --help`).", ""]
    for name, module in ORDER:
        path = args.docs / name
        out.append(f"<!-- {name}: python -m {module} -->")
        if path.exists():
            out += [path.read_text().rstrip("\n").replace("\n## ", "\n### ")
                    .replace("\n# ", "\n## "), ""]
        else:
            out += [f"*{name} is missing: run `python -m {module} --out docs/{name}`.*", ""]
            print(f"missing: {path}", file=sys.stderr)
    print("\n".join(out))


if __name__ == "__main__":
    main()
