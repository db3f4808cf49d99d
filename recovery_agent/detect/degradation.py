"""The degradation score of a GPU (and of its node) from a series of precursor
readings: the counters the node hooks' NVML snapshot carries (corrected and
uncorrected ECC, remapped rows, retired pages, per-link NVLink errors,
clock-event reasons), read at the prolog, the epilog and the health check.

Pure: the caller hands in the readings (from stored reports) and the
thresholds (``[proactive]``), and gets back a score, the rules that fired with
their evidence, and, when the score or the fired rules changed, the evidence
record to put on the node's timeline. Nothing here acts; docs/proactive.md
says what does not exist yet.

Rules (each named, with its weight toward the 0-1 score; a score is the sum
of the fired weights, capped at 1):

* ``row_remap_failure`` (1.0): the GPU could not remap a failing row (NVIDIA's
  row-remapping RMA criterion). A state flag: the newest reading decides.
* ``row_remap_pending`` (1.0): a remap waits for a GPU reset; until then the
  faulty row is still in use. State flag, newest reading.
* ``uncorrected_ecc_rising`` (1.0): the uncorrected ECC count rose inside the
  window (a rise between two readings, never a single value).
* ``retired_pages_pending`` (0.5): a retired page waits for a reset. State flag.
* ``retired_pages_near_limit`` (0.5): retired pages (single- plus double-bit)
  at ``retired_pages_near`` of ``retired_pages_limit`` or more. Newest reading.
* ``sbe_rate`` (0.5): corrected ECC errors per hour over the window above
  ``sbe_per_hour``.
* ``nvlink_replay_rising``, ``nvlink_crc_rising``, ``nvlink_recovery_rising``
  (0.5 each): per link, that counter's rate per hour over the window above its
  threshold; the evidence names the links.
* ``thermal_power_slowdown`` (0.25): at least ``slowdown_fraction`` of the
  window's readings (and two or more) show a ``slowdown_reasons`` bit.
* ``xid_reset_soon`` (1.0): the kernel log of a report named this GPU (by its
  PCI address) in an Xid whose catalog bucket is ``RESET_GPU``: the driver
  wants the GPU reset, and the job on it still runs. It counts until a later
  reading shows the GPU's counters set back (a reset, a driver reload).

A rate is the sum of the rises between consecutive readings of a counter over
the time from the first to the last reading that has the counter; it needs
``min_span`` of that time. A counter that goes down (a GPU reset or driver
reload clears the volatile counts) restarts its series there: the drop is not
a rise, and what follows counts from the new value. A reading without the
counter (NOT_SUPPORTED on that GPU or driver, or a failed read) is skipped;
a GPU that never had it is listed in the score's ``no_data``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from .patterns import XID_BUCKETS

__all__ = ["RULES", "Reading", "Score", "RuleHit", "readings_from_snapshot", "score_gpu",
           "score_node", "node_level", "score_change", "counter_increase"]

# rule name -> weight toward the 0-1 score
RULES: dict[str, float] = {
    "row_remap_failure": 1.0,
    "row_remap_pending": 1.0,
    "uncorrected_ecc_rising": 1.0,
    "retired_pages_pending": 0.5,
    "retired_pages_near_limit": 0.5,
    "sbe_rate": 0.5,
    "nvlink_replay_rising": 0.5,
    "nvlink_crc_rising": 0.5,
    "nvlink_recovery_rising": 0.5,
    "thermal_power_slowdown": 0.25,
    "xid_reset_soon": 1.0,
}

# the signals each rule reads, for ``no_data``
_SIGNALS = {
    "row_remap_failure": ("remap_failure",),
    "row_remap_pending": ("remap_pending",),
    "uncorrected_ecc_rising": ("ecc_dbe",),
    "retired_pages_pending": ("retired_pending",),
    "retired_pages_near_limit": ("retired_pages",),
    "sbe_rate": ("ecc_sbe",),
    "nvlink_replay_rising": ("nvlink",),
    "nvlink_crc_rising": ("nvlink",),
    "nvlink_recovery_rising": ("nvlink",),
    "thermal_power_slowdown": ("throttle_reasons",),
    "xid_reset_soon": ("reset_xids",),
}
# the volatile counters a GPU reset or a driver reload sets back to zero
_VOLATILE = ("ecc_sbe", "ecc_dbe")

_LINK_KINDS = {"nvlink_replay_rising": ("replay",), "nvlink_crc_rising": ("crc_flit", "crc_data"),
               "nvlink_recovery_rising": ("recovery",)}


@dataclass(frozen=True)
class Reading:
    """One GPU's counters at one time. ``values`` keys: ``ecc_sbe``,
    ``ecc_dbe`` (volatile counts) and ``ecc_sbe_aggregate``,
    ``ecc_dbe_aggregate`` (lifetime counts, read when a window has no
    volatile count at all: the two are never mixed in one series),
    ``remap_pending``, ``remap_failure``, ``retired_pending`` (bools),
    ``retired_pages`` (single- plus double-bit), ``throttle_reasons`` (bits),
    ``nvlink.<link>.<counter>`` and ``reset_xids`` (the codes of the report's
    RESET_GPU Xids on this GPU; empty: none); a missing key or None: no data."""

    time: float
    node: str
    gpu: str
    values: Mapping[str, Any]


@dataclass(frozen=True)
class RuleHit:
    rule: str
    weight: float
    detail: str
    value: Any = None
    threshold: Any = None

    def as_dict(self) -> dict:
        return {"rule": self.rule, "weight": self.weight, "detail": self.detail,
                "value": self.value, "threshold": self.threshold}


@dataclass(frozen=True)
class Score:
    node: str
    gpu: str
    time: float | None          # the newest reading's time (None: no readings)
    score: float
    level: str                  # ok, watch or degraded
    hits: tuple[RuleHit, ...] = ()
    readings: int = 0
    no_data: tuple[str, ...] = ()   # rules with nothing to read on this GPU

    @property
    def rules(self) -> tuple[str, ...]:
        return tuple(h.rule for h in self.hits)


def readings_from_snapshot(node: str, time: float, snapshot: Mapping[str, Any],
                           xids: Sequence[Mapping[str, Any]] | None = None) -> list[Reading]:
    """The readings of one hooks NVML snapshot (``report["gpus"]``): one per GPU
    that answered. A GPU is keyed by UUID (its index where the UUID is missing);
    a lost GPU gives no reading (its counters are gone, not zero). ``xids``:
    the same report's Xids (``report["xids"]``), matched to a GPU by its PCI
    address as the snapshot gives it; one with no address names no GPU."""
    out = []
    if not isinstance(snapshot, Mapping) or not snapshot.get("ok"):
        return out
    resets: dict[str, list[int]] = {}
    for xid in xids or ():
        if not isinstance(xid, Mapping):
            continue
        code, pci = xid.get("xid"), str(xid.get("pci") or "").lower()
        if (isinstance(code, int) and pci and xid.get("kind", "xid") == "xid"
                and XID_BUCKETS.get(code) == "RESET_GPU"):
            resets.setdefault(pci, []).append(code)
    for gpu in snapshot.get("gpus") or ():
        if not isinstance(gpu, Mapping) or gpu.get("lost"):
            continue
        key = gpu.get("uuid") or f"index:{gpu.get('index')}"
        sbe, dbe = _count(gpu.get("retired_pages_sbe")), _count(gpu.get("retired_pages_dbe"))
        values: dict[str, Any] = {
            "ecc_sbe": _count(gpu.get("ecc_volatile_corrected")),
            "ecc_sbe_aggregate": _count(gpu.get("ecc_aggregate_corrected")),
            "ecc_dbe": _count(gpu.get("ecc_volatile_uncorrected")),
            "ecc_dbe_aggregate": _count(gpu.get("ecc_aggregate_uncorrected")),
            "remap_pending": _flag(gpu.get("remapped_rows_pending")),
            "remap_failure": _flag(gpu.get("remapped_rows_failure")),
            "retired_pending": _flag(gpu.get("retired_pages_pending")),
            "retired_pages": None if sbe is None and dbe is None else (sbe or 0) + (dbe or 0),
            "throttle_reasons": _count(gpu.get("throttle_reasons")),
        }
        if xids is not None:
            pci = str(gpu.get("pci_short") or "").lower()
            values["reset_xids"] = tuple(sorted(set(resets.get(pci, ())))) if pci else None
        for link in gpu.get("nvlink") or ():
            if not isinstance(link, Mapping) or _count(link.get("link")) is None:
                continue
            for name in ("replay", "recovery", "crc_flit", "crc_data"):
                if _count(link.get(name)) is not None:
                    values[f"nvlink.{link['link']}.{name}"] = link[name]
        out.append(Reading(time=float(time), node=node, gpu=str(key), values=values))
    return out


def _count(value) -> int | None:
    """A counter as a report carries it: a non-negative int, else no data."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 \
        else None


def _flag(value) -> bool | None:
    return value if isinstance(value, bool) else None


def counter_increase(points: Sequence[tuple[float, Any]]) -> tuple[float, float, int]:
    """(rise, span seconds, resets) of one counter's (time, value) points in
    time order: rises between consecutive present values, a fall restarting
    the series (not counted), None values skipped."""
    rise = 0.0
    resets = 0
    prev = None
    first_t = last_t = None
    for t, v in points:
        if v is None or isinstance(v, bool):
            continue
        if first_t is None:
            first_t = t
        last_t = t
        if prev is not None:
            if v >= prev:
                rise += v - prev
            else:
                resets += 1   # reset: the new value starts a new series
        prev = v
    span = 0.0 if first_t is None else last_t - first_t
    return rise, span, resets


def _window(readings: Iterable[Reading], window: float, now: float | None) -> list[Reading]:
    rows = sorted(readings, key=lambda r: r.time)
    if not rows:
        return []
    end = rows[-1].time if now is None else now
    return [r for r in rows if end - window <= r.time <= end]


def _newest(rows: Sequence[Reading], key: str):
    for r in reversed(rows):
        v = r.values.get(key)
        if v is not None:
            return v, r.time
    return None, None


def _rate(rows, key, cfg) -> tuple[float | None, float, int]:
    """Per hour, or None when the span is too short or there is no data."""
    rise, span, resets = counter_increase([(r.time, r.values.get(key)) for r in rows])
    if span < max(cfg.min_span, 1.0):
        return None, rise, resets
    return rise * 3600.0 / span, rise, resets


def score_gpu(readings: Iterable[Reading], cfg, now: float | None = None) -> Score:
    """The score of one GPU's readings (one node, one GPU key) under ``cfg``
    (a ProactiveConfig or anything with its attributes). ``now`` ends the
    window (default: the newest reading)."""
    rows = _window(readings, cfg.window, now)
    if not rows:
        node = gpu = ""
        return Score(node, gpu, None, 0.0, "ok", (), 0, tuple(RULES))
    node, gpu = rows[-1].node, rows[-1].gpu
    hits: list[RuleHit] = []
    present = set()
    for r in rows:
        present.update(k.split(".")[0] for k, v in r.values.items() if v is not None)

    def hit(rule, detail, value=None, threshold=None):
        hits.append(RuleHit(rule, RULES[rule], detail, value, threshold))

    for rule, key, text in (("row_remap_failure", "remap_failure",
                             "row remapping failed (no spare row left)"),
                            ("row_remap_pending", "remap_pending",
                             "a row remap waits for a GPU reset"),
                            ("retired_pages_pending", "retired_pending",
                             "a retired page waits for a GPU reset")):
        value, _ = _newest(rows, key)
        if value is True:
            hit(rule, text, True)

    rise, _, _ = counter_increase([(r.time, r.values.get(_ecc_key(rows, "ecc_dbe")))
                                   for r in rows])
    if rise > 0:
        hit("uncorrected_ecc_rising", f"uncorrected ECC errors rose by {int(rise)} "
            f"within {_human(cfg.window)}", int(rise), 0)

    pages, _ = _newest(rows, "retired_pages")
    limit = cfg.retired_pages_limit * cfg.retired_pages_near
    if pages is not None and pages >= limit:
        hit("retired_pages_near_limit", f"{pages} retired pages of a lifetime "
            f"{cfg.retired_pages_limit}", pages, limit)

    rate, rise, resets = _rate(rows, _ecc_key(rows, "ecc_sbe"), cfg)
    if rate is not None and rate > cfg.sbe_per_hour:
        hit("sbe_rate", f"{rate:.0f} corrected ECC errors per hour over the window "
            f"({int(rise)} in all{_resets(resets)})", round(rate, 1), cfg.sbe_per_hour)

    link_keys = sorted({k for r in rows for k in r.values if k.startswith("nvlink.")})
    for rule, kinds in _LINK_KINDS.items():
        threshold = {"nvlink_replay_rising": cfg.nvlink_replay_per_hour,
                     "nvlink_crc_rising": cfg.nvlink_crc_per_hour,
                     "nvlink_recovery_rising": cfg.nvlink_recovery_per_hour}[rule]
        hot = {}
        for link in sorted({k.split(".")[1] for k in link_keys}, key=_link_order):
            total = None
            for kind in kinds:
                r, _, _ = _rate(rows, f"nvlink.{link}.{kind}", cfg)
                if r is not None:
                    total = (total or 0.0) + r
            if total is not None and total > threshold:
                hot[link] = round(total, 1)
        if hot:
            what = "/".join(kinds)
            hit(rule, "NVLink " + ", ".join(f"link {k}: {v:g} {what} per hour"
                                            for k, v in hot.items()), hot, threshold)

    reasons = [r.values.get("throttle_reasons") for r in rows]
    known = [v for v in reasons if isinstance(v, int) and not isinstance(v, bool)]
    slowed = [v for v in known if v & cfg.slowdown_reasons]
    if len(slowed) >= 2 and len(slowed) >= cfg.slowdown_fraction * len(known):
        bits = 0
        for v in slowed:
            bits |= v & cfg.slowdown_reasons
        hit("thermal_power_slowdown", f"{len(slowed)} of {len(known)} readings slowed down "
            f"(reasons 0x{bits:X})", len(slowed), cfg.slowdown_fraction)

    codes = _reset_xids(rows)
    if codes:
        hit("xid_reset_soon", f"Xid {', '.join(map(str, codes))} in the kernel log: the "
            "driver asks for a GPU reset (no reset seen since)", list(codes))

    no_data = tuple(rule for rule, signals in _SIGNALS.items()
                    if not any(s in present for s in signals))
    total = round(min(1.0, sum(h.weight for h in hits)), 3)
    level = "degraded" if total >= cfg.degraded_score else "watch" if total > 0 else "ok"
    return Score(node, gpu, rows[-1].time, total, level, tuple(hits), len(rows), no_data)


def _reset_xids(rows: Sequence[Reading]) -> tuple[int, ...]:
    """The newest RESET_GPU Xids of the window, unless a later reading shows a
    volatile counter set back (the reset); empty when none count."""
    for i in range(len(rows) - 1, -1, -1):
        codes = rows[i].values.get("reset_xids")
        if not codes:
            continue
        later = rows[i:]
        keys = set(_VOLATILE) | {k for r in later for k in r.values if k.startswith("nvlink.")}
        if any(counter_increase([(r.time, r.values.get(k)) for r in later])[2] for k in keys):
            return ()
        return tuple(codes)
    return ()


def score_node(readings: Iterable[Reading], cfg, now: float | None = None) -> dict[str, Score]:
    """Every GPU of the readings scored, by GPU key (the node's score is the
    highest of them: :func:`node_level`)."""
    by_gpu: dict[str, list[Reading]] = {}
    for r in readings:
        by_gpu.setdefault(r.gpu, []).append(r)
    return {gpu: score_gpu(rows, cfg, now) for gpu, rows in sorted(by_gpu.items())}


def node_level(scores: Mapping[str, Score]) -> tuple[float, str]:
    """The node's score and level: its worst GPU's."""
    worst = max(scores.values(), key=lambda s: s.score, default=None)
    return (worst.score, worst.level) if worst is not None else (0.0, "ok")


def score_change(previous: Score | Mapping[str, Any] | None, current: Score) -> dict | None:
    """The evidence record for the node's timeline when the score, the level or
    the fired rules changed since ``previous`` (a Score, the last record this
    returned, or None: never scored); None when nothing changed. Storing it is
    the caller's job."""
    if isinstance(previous, Mapping):
        before_rules = tuple(r.get("rule") for r in previous.get("rules") or ())
        before = (previous.get("score", 0.0), previous.get("level", "ok"))
    else:
        before_rules = previous.rules if previous else ()
        before = (previous.score, previous.level) if previous else (0.0, "ok")
    if previous is not None and (current.score, current.level, current.rules) == (
            *before, before_rules):
        return None
    if previous is None and current.score == 0:
        return None
    return {"kind": "degradation", "node": current.node, "gpu": current.gpu,
            "time": current.time, "score": current.score, "level": current.level,
            "previous_score": before[0], "previous_level": before[1],
            "rules": [h.as_dict() for h in current.hits],
            "cleared": [r for r in before_rules if r not in current.rules],
            "readings": current.readings, "no_data": list(current.no_data)}


def _ecc_key(rows: Sequence[Reading], key: str) -> str:
    """The volatile count where the window has one, else the aggregate."""
    if any(r.values.get(key) is not None for r in rows):
        return key
    return f"{key}_aggregate"


def _resets(n: int) -> str:
    return f", counter reset {n} time{'s' if n != 1 else ''} in the window" if n else ""


def _link_order(text: str):
    return (0, int(text)) if text.isdigit() else (1, text)


def _human(seconds: float) -> str:
    if seconds % 3600 == 0:
        return f"{int(seconds // 3600)}h"
    if seconds % 60 == 0:
        return f"{int(seconds // 60)}m"
    return f"{seconds:g}s"
