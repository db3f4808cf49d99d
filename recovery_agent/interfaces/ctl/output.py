"""What ``recovery-ctl`` prints (tables, times, JSON) and the times it reads."""
from __future__ import annotations

import json
import time
from datetime import datetime

import click

from ...config import parse_duration
from ...errors import RecoveryError

_json_option = click.option("--json", "as_json", is_flag=True, help="JSON for scripts.")


def _when(ts: float | None) -> str:
    if not ts:
        return "-"
    return time.strftime("%H:%M:%S", time.localtime(ts)) + f".{int(ts % 1 * 1000):03d}"


def _table(rows: list[dict], columns: list[tuple[str, str]]) -> None:
    """Aligned columns, scontrol/squeue style; ``columns`` are (key, header)."""
    cells = [[h for _, h in columns]] + [
        ["-" if r.get(k) in (None, "", []) else
         (",".join(map(str, r[k])) if isinstance(r[k], list) else str(r[k]))
         for k, _ in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    for row in cells:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())


def _dump(value) -> None:
    click.echo(json.dumps(value, default=str))


def _parse_time(text: str | None) -> float | None:
    """``--since``: an ISO date/time, or a duration back from now (30m, 2h, 7d)."""
    if not text:
        return None
    if ":" in text and not any(c in text for c in "-T "):
        # 09:30 is a time of day to sacct, a duration (MM:SS) to parse_duration
        raise click.BadParameter(f"{text!r} could be a time of day or a duration: write "
                                 "2026-11-29T09:30, or a duration such as 30m or 0-09:30")
    try:
        return time.time() - parse_duration(text, "--since/--until")
    except RecoveryError:
        pass
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise click.BadParameter(f"{text!r}: use an ISO time (2026-11-29T10:00) or a "
                                 "duration back from now (30m, 2h, 7d)") from None
