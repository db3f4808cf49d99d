"""A job's timeline laid out for the Console: which lane each event runs in,
the attempt it belongs to, where it sits on the time axis, and the evidence
line of each detection: its own, through the detection the event names
(``events.detection``), never another detection's of the same rule.

Pure: events, detections and attempts in, plain dicts out (the template draws
them)."""
from __future__ import annotations

import bisect

LANES = (("slurm", "Slurm / agent"), ("hooks", "Node hooks"), ("detected", "Detections"),
         ("decision", "Decisions"), ("step", "Slurm steps"))
LANE_NAMES = tuple(name for name, _ in LANES)
WIDTH, LEFT, LANE_H, TOP = 1000, 130, 28, 26     # the axis drawing's geometry (SVG units)
DECISIONS = ("verdict", "recommendation", "blocked_by_budget", "policy")
EVIDENCE_CHARS = 400


def lane_of(kind: str) -> str:
    """The lane an event of this kind runs in."""
    if kind == "step":
        return "step"
    if kind.startswith("hook_"):
        return "hooks"
    if kind in ("detected", "xid"):
        return "detected"
    if kind in DECISIONS or kind.startswith("rec_"):
        return "decision"
    return "slurm"


def evidence_of(event: dict, detections: dict[int, dict]) -> dict | None:
    """The line that shows why: a detection event's own detection's first
    evidence line, an XID's raw kernel line; None for other events and for a
    detection event that names no detection."""
    if event["kind"] == "xid":
        raw = (event.get("data") or {}).get("raw")
        return {"text": raw[:EVIDENCE_CHARS], "where": event.get("source") or ""} if raw else None
    if event["kind"] != "detected" or event.get("detection") not in detections:
        return None
    found = detections[event["detection"]]
    lines = (found.get("evidence") or {}).get("lines") or []
    if not lines or not lines[0].get("text"):
        return None
    first = lines[0]
    where = first.get("source") or found.get("source") or ""
    if first.get("line"):
        where = f"{where}:{first['line']}"
    return {"text": first["text"][:EVIDENCE_CHARS], "where": where}


def _starts(events: list[dict], attempts: list[dict]) -> list[tuple[float, int]]:
    """(start time, number) of each attempt, in time order: Slurm's start time,
    else its first event's."""
    first: dict[int, float] = {}
    for e in events:
        if e["attempt"] is not None:
            first[e["attempt"]] = min(first.get(e["attempt"], e["ts"]), e["ts"])
    numbers = sorted({a["attempt"] for a in attempts} | set(first))
    starts = {n: first.get(n) for n in numbers}
    for a in attempts:
        if a.get("start_time"):
            starts[a["attempt"]] = float(a["start_time"])
    return sorted((ts, n) for n, ts in starts.items() if ts is not None)


def _attempt_for(event: dict, starts: list[tuple[float, int]]) -> int | None:
    """An event's attempt: its own, else the one running at its time (the
    first, for an event before any started)."""
    if event["attempt"] is not None:
        return event["attempt"]
    if not starts:
        return None
    i = bisect.bisect_right([ts for ts, _ in starts], event["ts"]) - 1
    return starts[max(i, 0)][1]


def layout(events: list[dict], detections: list[dict], attempts: list[dict]) -> dict:
    """Everything the timeline template draws: ``lanes`` (label, y), the
    attempts' ``bands`` on the axis, one ``mark`` per event, and ``groups``:
    the events of each attempt in time order, each with its lane, text and
    evidence line."""
    events = sorted(events, key=lambda e: (e["ts"], e.get("id") or 0))
    by_id = {d["id"]: d for d in detections}
    lanes = [{"name": name, "label": label, "y": TOP + i * LANE_H}
             for i, (name, label) in enumerate(LANES)]
    height = TOP + LANE_H * len(LANES) + 10
    out = {"lanes": lanes, "bands": [], "marks": [], "groups": [], "width": WIDTH,
           "left": LEFT, "height": height, "start": None, "span": 0.0}
    if not events:
        return out
    starts = _starts(events, attempts)
    begin = min([events[0]["ts"], *(ts for ts, _ in starts)])
    end = max(events[-1]["ts"], begin)
    span = max(end - begin, 1.0)
    out.update(start=begin, span=end - begin)

    def x(ts: float) -> float:
        return round(LEFT + (min(max(ts, begin), end) - begin) / span * WIDTH, 1)

    for i, (ts, number) in enumerate(starts):
        right = x(starts[i + 1][0]) if i + 1 < len(starts) else LEFT + WIDTH
        out["bands"].append({"attempt": number, "x": x(ts), "w": round(right - x(ts), 1),
                             "shade": i % 2})
    nodes = {a["attempt"]: a.get("nodes") or [] for a in attempts}
    groups: dict[int | None, list[dict]] = {}
    for n, event in enumerate(events, 1):
        lane = lane_of(event["kind"])
        row = {"n": n, "ts": event["ts"], "lane": lane, "column": LANE_NAMES.index(lane),
               "kind": event["kind"], "message": event["message"] or "",
               "source": event.get("source") or "", "detection": event.get("detection"),
               "evidence": evidence_of(event, by_id)}
        groups.setdefault(_attempt_for(event, starts), []).append(row)
        out["marks"].append({"n": n, "x": x(event["ts"]), "y": lanes[row["column"]]["y"],
                             "lane": lane, "kind": event["kind"], "ts": event["ts"],
                             "message": row["message"]})
    order = sorted(groups, key=lambda a: (a is not None, a if a is not None else 0))
    out["groups"] = [{"attempt": a, "nodes": nodes.get(a, []), "rows": groups[a]}
                     for a in order]
    return out
