"""``docs/accuracy.md``: the shipped packs scored on the held-out split.

The public corpus (``tests/fixtures/corpus/public_*.jsonl``) is real log text
from public reports, split by source before any rule was written for it: the
tune half may shape rules, the held-out half only measures them. This page
reports the held-out half alone, as ``recovery-ctl patterns score`` prints it.

    python -m recovery_devtools.accuracy > docs/accuracy.md
    python -m recovery_devtools.accuracy --coverage   # rewrites docs/coverage.md's index
    python -m recovery_devtools.accuracy --skip-list  # the held-out sources, one a line

``docs/coverage.md`` is written by hand (emitter, message family, formats)
down to :data:`INDEX_MARK`; below it, the index of every shipped rule is made
from the packs, so the page cannot name a rule that does not exist or leave
one out.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Iterable

from recovery_agent.detect.patterns import load_rules
from recovery_agent.detect.scanner import Scanner
from recovery_agent.detect.score import LABEL_ACTIONS, read_labels, render, score

ROOT = Path(__file__).resolve().parents[2]   # the checkout (tools/recovery_devtools/)
CORPUS = ROOT / "tests" / "fixtures" / "corpus"
HELDOUT = CORPUS / "public_heldout.jsonl"
READING = CORPUS / "provenance" / "text-only-reading.jsonl"   # lines-only labels of tune rows
# where rule authors write what they read: the packs (comments and examples),
# the coverage table, and the unit tests' example lines
AUTHORED = ("etc/patterns/*.toml", "docs/coverage.md", "tests/unit/test_*.py")
_THREAD = re.compile(r"github\.com/([^/\s]+)/([^/\s]+)/(?:issues|pull|discussions)/(\d+)")
COVERAGE = ROOT / "docs" / "coverage.md"
INDEX_MARK = "<!-- every rule: made by python -m recovery_devtools.accuracy --coverage -->"
_NCCL_PID = re.compile(r"^\s*([A-Za-z][\w.-]*:\d{3,}):\d{3,} ")

HEADER = """# Accuracy on real failures the rules were not tuned on

Made by `python -m recovery_devtools.accuracy > docs/accuracy.md`; a test fails when
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


def seen_by_authors(rows: Iterable, authored: str, known: str) -> dict[str, str]:
    """Held-out rows a rule author has seen, by id, with why: the row's source
    thread is cited in what authors wrote, or a line of the row (or an NCCL
    ``host:pid`` of it) is quoted there and is not also in the tune or dev
    rows (``known``). Such rows are left out of the score, not re-labelled:
    their source may have shaped a rule."""
    quoted = {line.strip() for line in re.findall(r'"((?:[^"\\]|\\.){20,})"', authored)}
    quoted |= {line.strip() for line in re.findall(r"'([^'\n]{20,})'", authored)}
    pids = {m.group(1) for q in quoted if (m := _NCCL_PID.match(q))}
    out: dict[str, str] = {}
    for row in rows:
        thread = _THREAD.search(row.source or "")
        if thread:
            owner, repo, number = thread.groups()
            cite = re.compile(rf"\b{re.escape(repo)}(?:#|/issues/|/pull/){number}\b", re.I)
            if cite.search(authored):
                out[row.id] = f"its thread ({owner}/{repo}#{number}) is cited by a rule"
                continue
        for line in row.lines:
            text = line.strip()
            pid = _NCCL_PID.match(line)
            if len(text) >= 20 and text in quoted and text not in known:
                out[row.id] = f"a rule quotes its line {text[:60]!r}"
                break
            if pid and pid.group(1) in pids and pid.group(1) not in known:
                out[row.id] = f"a rule quotes a line of its process {pid.group(1)}"
                break
    return out


def report(path: Path = HELDOUT) -> str:
    rows, problems = read_labels(path.read_text(encoding="utf-8"))
    authored = "\n".join(f.read_text(encoding="utf-8", errors="replace")
                         for pattern in AUTHORED for f in sorted(ROOT.glob(pattern)))
    known = "\n".join(line for name in ("public_tune.jsonl", "dev_failures.jsonl")
                      for row in read_labels((CORPUS / name).read_text(encoding="utf-8"))[0]
                      for line in row.lines)
    seen = seen_by_authors(rows, authored, known)
    result = score(Scanner(load_rules(), engine="re"),
                   [r for r in rows if r.id not in seen], problems)
    out = HEADER + render(result, title=f"held-out split ({path.name})") + text_only_reading()
    if seen:
        out += ("\n## Rows left out: seen by a rule author\n\n"
                f"{len(seen)} of {len(rows)} held-out rows are not scored, because "
                "the text rule authors wrote (packs, coverage table, unit tests) cites "
                "their thread or quotes their lines, so they may have shaped a rule:\n\n"
                + "".join(f"- {rid}: {why}\n" for rid, why in sorted(seen.items())))
    return out


def text_only_reading(path: Path = READING) -> str:
    """How often a reviewer who saw only the lines agrees with the corpus
    labels (tests/fixtures/corpus/provenance/text-only-reading.md): what the
    text alone supports, the yardstick for the figures above."""
    if not path.exists():
        return ""
    labels = {row.id: row for row in read_labels((CORPUS / "public_tune.jsonl")
                                                  .read_text(encoding="utf-8"))[0]}
    counts: dict[str, list[int]] = {"all": [0, 0, 0], "high": [0, 0, 0], "low": [0, 0, 0]}
    for line in path.read_text(encoding="utf-8").splitlines():
        read = json.loads(line)
        row = labels[read["id"]]
        for part in ("all", read["confidence"]):
            counts[part][0] += 1
            counts[part][1] += read["category"] == row.category
            counts[part][2] += LABEL_ACTIONS[read["expected_action"]] == row.action
    lines = ["", "## How far the text alone goes", "",
             f"A reviewer labelled {counts['all'][0]} tune rows from their lines alone (no "
             "thread, no source, no rule; `tests/fixtures/corpus/provenance/"
             "text-only-reading.md`). The corpus labels are read with hindsight from the "
             "threads; this is how many of them the text an automatic system sees gives "
             "back to a careful reader: how much of the score above the text can "
             "support at all, on rows like these:", "",
             "| rows the reviewer was | rows | category as labelled | action as labelled |",
             "|---|---:|---:|---:|"]
    for part, name in (("all", "all"), ("high", "sure of"), ("low", "guessing")):
        n, cat, act = counts[part]
        if n:
            lines.append(f"| {name} | {n} | {cat / n:.1%} | {act / n:.1%} |")
    return "\n".join(lines) + "\n"


def rule_index() -> str:
    """Every shipped rule, pack by pack: id, category, role, action, who may
    print it (``system``: only a node's kernel, drivers or daemons) and what it
    means."""
    out = [INDEX_MARK, "", "## Every rule", "",
           "Made from the packs; `role` and `action` as above, `printed by`: `system` "
           "rules count as node evidence only from a node's own report or log feed.", ""]
    pack = None
    for rule in load_rules():
        name = Path(rule.source).name
        if name != pack:
            pack = name
            out += ["", f"### `{name}`", "",
                    "| rule | category | role | action | printed by | what it means |",
                    "|---|---|---|---|---|---|"]
        action = "by XID" if rule.action_by_xid else rule.action
        what = " ".join(rule.description.split()).replace("|", "\\|")
        out.append(f"| `{rule.id}` | {rule.category} | {rule.role} | {action} | "
                   f"{rule.emitter} | {what} |")
    return "\n".join(out) + "\n"


def coverage_page(current: str) -> str:
    """``current`` (docs/coverage.md) with its index made anew."""
    head = current.split(INDEX_MARK, 1)[0].rstrip("\n")
    return head + "\n\n" + rule_index()


def heldout_sources(path: Path = HELDOUT) -> list[str]:
    """Every source (a thread's or page's URL) the held-out split has a row
    from, once each, sorted: what a rule author or a research helper skips
    while looking for real lines (no row's lines or labels are shown)."""
    found = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            source = json.loads(line).get("source")
            if source:
                found.add(source.strip())
    return sorted(found)


USAGE = ("usage: python -m recovery_devtools.accuracy [--coverage | --skip-list]\n"
         "  (no option)  print docs/accuracy.md (the held-out split scored)\n"
         "  --coverage   rewrite the rule index of docs/coverage.md\n"
         "  --skip-list  print the held-out split's sources, one a line: the threads\n"
         "               to skip when looking for lines to write rules from\n")


def main(argv: list[str]) -> int:
    if argv == ["--coverage"]:
        COVERAGE.write_text(coverage_page(COVERAGE.read_text(encoding="utf-8")),
                            encoding="utf-8")
    elif argv == ["--skip-list"]:
        sys.stdout.write("".join(f"{source}\n" for source in heldout_sources()))
    elif not argv:
        sys.stdout.write(report())
    elif argv in (["-h"], ["--help"]):
        sys.stdout.write(USAGE)
    else:
        sys.stderr.write(f"unknown arguments: {' '.join(argv)}\n{USAGE}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
