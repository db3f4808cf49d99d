"""``docs/accuracy.md``: the shipped packs scored on the held-out split.

The public corpus (``tests/fixtures/corpus/public_*.jsonl``) is real log text
from public reports, split by source before any rule was written for it: the
tune half may shape rules, the held-out half only measures them. This page
reports the held-out half alone, as ``recovery-ctl patterns score`` prints it.

    python -m recovery_agent.accuracy > docs/accuracy.md
"""
from __future__ import annotations

import sys
from pathlib import Path

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "corpus"
HELDOUT = CORPUS / "public_heldout.jsonl"

HEADER = """# Accuracy on real failures the rules were not tuned on

Made by `python -m recovery_agent.accuracy > docs/accuracy.md`; a test fails when
this page no longer matches the code.

**What is scored.** `tests/fixtures/corpus/public_heldout.jsonl`: real log text
from public bug reports and discussions (each row names its `source`; no line is
ours), labelled by the rules of `tests/fixtures/corpus/README.md`. The public
rows were split in two by a hash of their source *before* any rule was written
for them: rules may be tuned on `public_tune.jsonl`, never on this half. The
development corpus (`dev_failures.jsonl`), on which the rules were first written,
is a regression set and is not reported here.

**How.** Each row's lines go through the shipped packs and attribution exactly as
`recovery-ctl patterns score` (and `patterns test`) judge a log: the verdict's
category, its coarse action (`kill_requeue` counts as a requeue) and whether it
names a node or GPU, against the labels. Run the same on your own labelled
incidents before you switch an environment to action mode.

"""


def report(path: Path = HELDOUT) -> str:
    from .detect.patterns import load_rules
    from .detect.scanner import Scanner
    from .detect.score import read_labels, render, score
    rows, problems = read_labels(path.read_text(encoding="utf-8"))
    result = score(Scanner(load_rules(), engine="re"), rows, problems)
    return HEADER + render(result, title=f"held-out split ({path.name})")


if __name__ == "__main__":
    sys.stdout.write(report())
