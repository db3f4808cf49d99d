"""The goodput page's charts, laid out on the server: plain numbers in,
shapes out (rectangles, ticks, labels in SVG units) that the template draws
as inline SVG. No script and no chart library: the page is complete as
served, and a screenshot or a text browser shows what a browser does.

* :func:`lost_over_time`: GPU-hours lost per day (per week past 45 days),
  stacked by failure category, with the incidents whose loss is unknown
  counted under each bar;
* :func:`bars`: one horizontal bar per row (ETTR per environment, MTTR per
  category, GPU-hours lost per node), a value of None drawn as "unknown".
"""
from __future__ import annotations

import math
import time

# one colour per failure category, stable across pages (others take the grey)
COLOURS = {"gpu_hardware": "#d9482b", "interconnect": "#3b82c4",
           "nccl_timeout_hang": "#7d4cc2", "cuda_error": "#d9822b", "oom": "#c2a14c",
           "system_software": "#1f9d55", "application": "#6b7a90", "segfault": "#a33b7a",
           "hang": "#7d4cc2", "unknown": "#9aa7bb"}
OTHER = "#b8c1cf"
WIDTH, HEIGHT, LEFT, BOTTOM, TOP = 900, 230, 56, 34, 22
DAY = 86400.0


def colour(category: str) -> str:
    return COLOURS.get(category, OTHER)


def _nice(top: float) -> float:
    """A round axis top at or above ``top`` (1, 2 or 5 times a power of ten)."""
    if top <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(top))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= top)


def _label(seconds: float, step: float) -> str:
    return time.strftime("%m-%d" if step >= DAY else "%m-%d %H:%M", time.localtime(seconds))


def lost_over_time(incidents: list[dict], since: float, until: float) -> dict:
    """Stacked bars of GPU-hours lost per bucket and category (by failure
    time), the categories in the legend, the y-axis ticks, and per bucket how
    many incidents had a loss the ledger could not tell."""
    step = DAY if until - since <= 45 * DAY else 7 * DAY
    start = math.floor(since / step) * step
    count = max(1, math.ceil((until - start) / step))
    hours: list[dict[str, float]] = [{} for _ in range(count)]
    unknown = [0] * count
    for inc in incidents:
        if inc.get("failure") is None:
            continue
        i = min(count - 1, max(0, int((inc["failure"] - start) // step)))
        if inc.get("gpu_s_lost") is None:
            unknown[i] += 1
            continue
        cat = inc.get("category") or "unknown"
        hours[i][cat] = hours[i].get(cat, 0.0) + inc["gpu_s_lost"] / 3600
    top = _nice(max((sum(h.values()) for h in hours), default=0.0))
    plot_w, plot_h = WIDTH - LEFT - 10, HEIGHT - BOTTOM - TOP
    slot = plot_w / count
    bars, labels = [], []
    categories = sorted({c for h in hours for c in h})
    for i, h in enumerate(hours):
        x = LEFT + i * slot + slot * 0.12
        y = TOP + plot_h
        for cat in categories:
            value = h.get(cat, 0.0)
            if value <= 0:
                continue
            height = value / top * plot_h
            y -= height
            bars.append({"x": round(x, 1), "y": round(y, 1), "w": round(slot * 0.76, 1),
                         "h": round(max(height, 0.5), 1), "fill": colour(cat),
                         "category": cat, "value": value,
                         "title": f"{_label(start + i * step, step)}: {value:.2f} GPU-h "
                                  f"lost to {cat}"})
        every = max(1, math.ceil(count / 12))
        if i % every == 0:
            labels.append({"x": round(LEFT + i * slot + slot / 2, 1),
                           "text": _label(start + i * step, step)})
    ticks = [{"y": round(TOP + plot_h - f * plot_h, 1), "text": f"{top * f:g}"}
             for f in (0, 0.25, 0.5, 0.75, 1)]
    marks = [{"x": round(LEFT + i * slot + slot / 2, 1), "n": n}
             for i, n in enumerate(unknown) if n]
    return {"width": WIDTH, "height": HEIGHT, "left": LEFT, "top": TOP,
            "plot_w": plot_w, "plot_h": plot_h, "bars": bars, "labels": labels,
            "ticks": ticks, "unknown": marks, "unknown_total": sum(unknown),
            "legend": [{"category": c, "fill": colour(c)} for c in categories],
            "step": "day" if step == DAY else "week",
            "total": sum(sum(h.values()) for h in hours)}


def bars(rows: list[tuple[str, float | None, str]], top: float | None = None,
         width: int = 900, label_w: int = 150, text_w: int = 330, row_h: int = 22) -> dict:
    """Horizontal bars: each row (label, value or None, the text shown beside
    it). ``top``: the value of a full bar (default: the largest, rounded up)."""
    known = [v for _, v, _ in rows if v is not None]
    full = top if top is not None else _nice(max(known, default=0.0))
    plot_w = width - label_w - text_w
    out = []
    for i, (label, value, text) in enumerate(rows):
        y = 4 + i * row_h
        w = 0.0 if value is None or full <= 0 else max(0.0, min(1.0, value / full)) * plot_w
        out.append({"label": label, "y": y, "w": round(max(w, 1.0 if value else 0.0), 1),
                    "text": text, "known": value is not None, "value": value})
    return {"width": width, "height": 8 + row_h * max(1, len(rows)), "label_w": label_w,
            "plot_w": plot_w, "rows": out, "row_h": row_h}
