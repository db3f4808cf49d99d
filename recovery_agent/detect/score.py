"""Scoring the classifier on labelled logs: what ``recovery-ctl patterns score``
prints, and what ``docs/accuracy.md`` is made from.

A labels file is JSON lines in the corpus format (``tests/fixtures/corpus/README.md``):
``id``, ``lines``, ``category``, ``expected_action``, ``node_attributable`` (and
``source``, ``xid``, ``notes``). Each row's lines go through the scanner and
attribution with the context the lines themselves give, as ``recovery-ctl
patterns test`` does, and the verdict is compared with the labels:

* **category**: the verdict's category (``benign``: no category at all);
* **action**: the verdict's coarse action (``kill_requeue`` is a requeue);
* **node named**: of the rows whose text names the node or GPU to blame, those
  whose verdict names one: to exclude (``nodes``, ``gpus``, ``links``), as a
  suspect, or as where the failure happened (``where``) (recall); and, of the
  rows whose text names none, those whose verdict names none;
* **benign fired**: benign rows on which any rule fired above ``info``, as
  attribution weighs the lines (its context may demote one: a task exit
  after a requeue notice).

A row that is not well formed is reported with its line number and field and
left out; the rest are scored. Pure: no I/O but what the caller hands in.
"""
from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from .attribution import attribute
from .context import context_from_lines
from .evidence import all_detections
from .model import CATEGORIES, Detection, Verdict

LABEL_CATEGORIES = (*CATEGORIES, "benign")
LABEL_ACTIONS = {"requeue_exclude_node": "requeue_exclude", "requeue": "requeue",
                 "stop": "stop", "none": "none"}
COARSE = {"kill_requeue": "requeue"}
MAX_LINES = 10_000          # lines of one row that are scored
ACTIONS = ("requeue_exclude", "requeue", "stop", "none")


@dataclass(frozen=True)
class Row:
    number: int          # line of the labels file, from 1
    id: str
    lines: tuple[str, ...]
    category: str
    action: str          # the product's name (requeue_exclude, requeue, stop, none)
    node_attributable: bool
    source: str = ""


@dataclass(frozen=True)
class Judged:
    row: Row
    verdict: Verdict
    detections: tuple[Detection, ...]

    @property
    def category(self) -> str:
        return self.verdict.category or "benign"

    @property
    def action(self) -> str:
        return COARSE.get(self.verdict.action, self.verdict.action)

    @property
    def named(self) -> bool:
        v = self.verdict
        return bool(v.nodes or v.gpus or v.links or v.suspects or v.where)

    @property
    def blamed(self) -> bool:
        """Named as a node to exclude or a suspect (not only where it happened)."""
        v = self.verdict
        return bool(v.nodes or v.gpus or v.links or v.suspects)

    @property
    def category_ok(self) -> bool:
        return self.category == self.row.category

    @property
    def action_ok(self) -> bool:
        return self.action == self.row.action

    @property
    def node_ok(self) -> bool:
        return self.named == self.row.node_attributable

    @property
    def fired(self) -> list[Detection]:
        return [d for d in self.detections if d.severity != "info"]

    @property
    def deciding(self) -> str:
        """The rule the verdict rests on first, or "-" when none."""
        used = [self.detections[i] for i in self.verdict.rests_on if i < len(self.detections)]
        return used[0].rule if used else "-"


def read_labels(text: str) -> tuple[list[Row], list[str]]:
    """Rows of a labels file, and one problem line per row left out (its line
    number and the field that is wrong)."""
    rows, problems, seen = [], [], set()
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            data = json.loads(raw)
        except ValueError as exc:
            problems.append(f"line {number}: not JSON ({exc})")
            continue
        try:
            row = _row(number, data)
        except ValueError as exc:
            problems.append(f"line {number}: {exc}")
            continue
        if row.id in seen:
            problems.append(f"line {number}: id {row.id!r} appears twice; the first is scored")
            continue
        seen.add(row.id)
        rows.append(row)
    return rows, problems


def _row(number: int, data: object) -> Row:
    if not isinstance(data, dict):
        raise ValueError("expected a JSON object")
    ident = data.get("id")
    if not isinstance(ident, str) or not ident:
        raise ValueError("field 'id': a non-empty string is required")
    lines = data.get("lines")
    if not isinstance(lines, list) or not lines or not all(isinstance(x, str) for x in lines):
        raise ValueError(f"{ident}: field 'lines': a non-empty list of strings is required")
    category = data.get("category")
    if category not in LABEL_CATEGORIES:
        raise ValueError(f"{ident}: field 'category': {category!r} is not one of "
                         f"{', '.join(LABEL_CATEGORIES)}")
    action = data.get("expected_action")
    if action not in LABEL_ACTIONS:
        raise ValueError(f"{ident}: field 'expected_action': {action!r} is not one of "
                         f"{', '.join(LABEL_ACTIONS)}")
    node = data.get("node_attributable")
    if not isinstance(node, bool):
        raise ValueError(f"{ident}: field 'node_attributable': true or false is required")
    source = data.get("source") or ""
    return Row(number, ident, tuple(_clean(x) for x in lines[:MAX_LINES]), category,
               LABEL_ACTIONS[action], node, source if isinstance(source, str) else "")


def _clean(line: str) -> str:
    """A line as the scanner sees lines from files: no NULs, no line breaks."""
    return line.replace("\x00", "").replace("\r", "").replace("\n", " ")


def judge(scanner, row: Row) -> Judged:
    detections = scanner.scan_lines(row.lines, source=row.id)
    context = context_from_lines(row.lines)
    verdict = attribute(detections, context)
    # what attribution weighed (``rests_on`` indexes it): a line its context
    # demoted to information (a task exit after a requeue) did not fire
    return Judged(row, verdict, tuple(all_detections(detections, context)))


@dataclass
class Score:
    judged: list[Judged]
    problems: list[str] = field(default_factory=list)

    def _share(self, rows: Sequence[Judged], test) -> float | None:
        return sum(1 for j in rows if test(j)) / len(rows) if rows else None

    @property
    def category(self) -> float | None:
        return self._share(self.judged, lambda j: j.category_ok)

    @property
    def action(self) -> float | None:
        return self._share(self.judged, lambda j: j.action_ok)

    @property
    def node_recall(self) -> float | None:
        """Of the rows whose text names the node, those where the verdict does."""
        return self._share([j for j in self.judged if j.row.node_attributable],
                           lambda j: j.named)

    @property
    def blame_recall(self) -> float | None:
        """Of the rows whose text names the node, those whose verdict excludes
        it or names it a suspect."""
        return self._share([j for j in self.judged if j.row.node_attributable],
                           lambda j: j.blamed)

    @property
    def node_agreement(self) -> float | None:
        return self._share(self.judged, lambda j: j.node_ok)

    @property
    def benign_fired(self) -> list[Judged]:
        return [j for j in self.judged if j.row.category == "benign" and j.fired]

    def by(self, key) -> dict[str, list[Judged]]:
        groups: dict[str, list[Judged]] = defaultdict(list)
        for j in self.judged:
            groups[key(j)].append(j)
        return dict(sorted(groups.items()))

    def confusion(self, which: str) -> tuple[list[str], dict[tuple[str, str], int]]:
        """(labels in order, counts by (labelled, predicted)) for "category" or "action"."""
        if which == "category":
            pairs = Counter((j.row.category, j.category) for j in self.judged)
            order = [c for c in LABEL_CATEGORIES if any(c in p for p in pairs)]
        else:
            pairs = Counter((j.row.action, j.action) for j in self.judged)
            order = [a for a in ACTIONS if any(a in p for p in pairs)]
        return order, dict(pairs)

    @property
    def misses(self) -> list[Judged]:
        return [j for j in self.judged if not (j.category_ok and j.action_ok and j.node_ok)]


def score(scanner, rows: Iterable[Row], problems: Sequence[str] = ()) -> Score:
    return Score([judge(scanner, row) for row in rows], list(problems))


# -- output ----------------------------------------------------------------------

def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def as_dict(result: Score) -> dict:
    def group(rows: list[Judged]) -> dict:
        part = Score(rows)
        return {"rows": len(rows), "category": part.category, "action": part.action,
                "node_recall": part.node_recall}
    cat_order, cat_pairs = result.confusion("category")
    act_order, act_pairs = result.confusion("action")
    return {
        "rows": len(result.judged), "problems": result.problems,
        "category": result.category, "action": result.action,
        "node_recall": result.node_recall, "blame_recall": result.blame_recall,
        "node_agreement": result.node_agreement,
        "by_category": {k: group(v) for k, v in result.by(lambda j: j.row.category).items()},
        "by_action": {k: group(v) for k, v in result.by(lambda j: j.row.action).items()},
        "confusion_category": {"labels": cat_order, "counts": [
            {"labelled": a, "predicted": b, "rows": n} for (a, b), n in cat_pairs.items()]},
        "confusion_action": {"labels": act_order, "counts": [
            {"labelled": a, "predicted": b, "rows": n} for (a, b), n in act_pairs.items()]},
        "benign_fired": [{"id": j.row.id, "rules": sorted({d.rule for d in j.fired})}
                         for j in result.benign_fired],
        "misses": [_miss(j) for j in result.misses],
    }


def _miss(j: Judged) -> dict:
    return {"id": j.row.id, "line": j.row.number, "source": j.row.source,
            "wrong": [k for k, ok in (("category", j.category_ok), ("action", j.action_ok),
                                      ("node", j.node_ok)) if not ok],
            "labelled": {"category": j.row.category, "action": j.row.action,
                         "node_attributable": j.row.node_attributable},
            "got": {"category": j.category, "action": j.action,
                    "nodes": _unique([*j.verdict.nodes, *j.verdict.gpus, *j.verdict.links,
                                      *j.verdict.suspects, *j.verdict.where])},
            "deciding_rule": j.deciding, "reason": j.verdict.reason}


def render(result: Score, title: str = "") -> str:
    """The score as markdown text: totals, per category and action, the two
    confusion matrices, benign lines fired, and every miss."""
    out = [f"## {title}", ""] if title else []
    out += [f"rows scored: {len(result.judged)}"
            + (f" ({len(result.problems)} left out, listed at the end)" if result.problems
               else ""), "",
            "| measure | value |", "|---|---:|",
            f"| category right | {_pct(result.category)} |",
            f"| coarse action right | {_pct(result.action)} |",
            f"| node named where the text names it (recall) | {_pct(result.node_recall)} |",
            f"| ... of those, named to exclude or as a suspect | {_pct(result.blame_recall)} |",
            f"| node named or not, as labelled | {_pct(result.node_agreement)} |",
            f"| benign rows where a rule fired | {len(result.benign_fired)} |", ""]
    for title_, key in (("by labelled category", lambda j: j.row.category),
                        ("by labelled action", lambda j: j.row.action)):
        out += [f"{title_}:", "", "| label | rows | category | action | node recall |",
                "|---|---:|---:|---:|---:|"]
        for name, rows in result.by(key).items():
            part = Score(rows)
            out.append(f"| {name} | {len(rows)} | {_pct(part.category)} | "
                       f"{_pct(part.action)} | {_pct(part.node_recall)} |")
        out.append("")
    for which in ("category", "action"):
        order, pairs = result.confusion(which)
        out += [f"{which} confusion (rows: labelled; columns: predicted):", "",
                "| | " + " | ".join(order) + " |", "|---|" + "---:|" * len(order)]
        for a in order:
            out.append(f"| {a} | " + " | ".join(str(pairs.get((a, b), 0) or "")
                                              for b in order) + " |")
        out.append("")
    out.append("benign rows where a rule fired:")
    out += [f"- {j.row.id}: {', '.join(sorted({d.rule for d in j.fired}))}"
            for j in result.benign_fired] or ["- none"]
    out += ["", "misses (labelled -> got, deciding rule):"]
    for j in result.misses:
        miss = _miss(j)
        out.append(f"- {j.row.id} [{', '.join(miss['wrong'])}]: "
                   f"{j.row.category}/{j.row.action}/"
                   f"{'node' if j.row.node_attributable else '-'} -> "
                   f"{j.category}/{j.action}/{','.join(miss['got']['nodes']) or '-'} "
                   f"({j.deciding})")
    if not result.misses:
        out.append("- none")
    if result.problems:
        out += ["", "left out:"] + [f"- {p}" for p in result.problems]
    return "\n".join(out) + "\n"


def _unique(values: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(values))
