"""Join the shares of a resilience campaign run side by side (``make resilience
SHARDS=N``): each share's pytest wrote its rows as JSON (``--resilience-shard``);
this writes the one table of docs/resilience.md from them.

    python -m tests.resilience_merge --runs 20 --out docs/resilience.md a.json b.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tests.conftest import campaign_report, merge_campaigns


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.resilience_merge",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("parts", nargs="+", type=Path, metavar="SHARE.json",
                        help="the rows one share wrote")
    parser.add_argument("--runs", type=int, required=True,
                        help="the --resilience-runs the shares ran with")
    parser.add_argument("--out", type=Path, required=True, help="where the table goes")
    args = parser.parse_args(argv)
    parts, missing = [], []
    for path in args.parts:
        try:
            parts.append(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            missing.append(f"{path}: {exc}")
    if missing:   # a share that wrote nothing ran nothing: say so, write no partial table
        print("resilience_merge: a share left no rows:\n  " + "\n  ".join(missing),
              file=sys.stderr)
        return 1
    text = campaign_report(merge_campaigns(parts), args.runs, shares=len(parts))
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
