"""What ``recovery-ctl`` prints (tables, times, JSON) and the times it reads.

Times print as ISO 8601 with the date, to the second, in local time as Slurm
prints them (``2026-12-01T20:16:50``), or in UTC with a ``Z`` under the group's
``--utc``. Listings go through tabulate, or split by ``|`` with ``-P`` as
sacct and sinfo do; ``-o`` picks and orders their fields. JSON keeps the
store's values (epoch seconds for times) for scripts.
"""
from __future__ import annotations

import functools
import json
import time
from datetime import datetime, timezone

import click
from tabulate import tabulate

from ...config import parse_duration
from ...errors import RecoveryError

_json_option = click.option("--json", "as_json", is_flag=True, help="JSON for scripts.")


def _utc() -> bool:
    """Did the command line ask for UTC (``recovery-ctl --utc ...``)?"""
    ctx = click.get_current_context(silent=True)
    return bool(ctx and (ctx.find_root().params or {}).get("utc"))


def _when(ts: float | None) -> str:
    """A time as an operator reads it: ISO 8601 with the date, to the second."""
    if not ts:
        return "-"
    if _utc():
        return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%dT%H:%M:%S")


def _yes(value) -> str:
    """A flag in text: yes or no, never Python's True/False."""
    return "yes" if value else "no"


def _score(value) -> str:
    """A score in text: two decimals."""
    return "-" if value is None else f"{float(value):.2f}"


def _cell(value) -> str:
    if value in (None, "", []):
        return "-"
    if isinstance(value, bool):
        return _yes(value)
    if isinstance(value, float):
        return f"{value:.2f}"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


class Listing:
    """How one listing prints: ``-o`` fields, ``-P`` (``|``-separated), ``-n``."""

    def __init__(self, fields: str | None, parsable: bool, noheader: bool) -> None:
        self.fields, self.parsable, self.noheader = fields, parsable, noheader

    def columns(self, columns: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """The (key, header) columns ``-o`` asks for, in its order; an unknown
        field is refused with the valid ones."""
        if not self.fields:
            return columns
        by_name = {}
        for key, header in columns:
            by_name[header.lower()] = by_name[key.lower()] = (key, header)
        chosen = []
        for name in (f.strip().lower() for f in self.fields.split(",")):
            if not name:
                continue
            if name not in by_name:
                raise click.BadParameter(
                    f"unknown field {name!r}; valid fields: "
                    + ",".join(h for _, h in columns), param_hint="'-o/--format'")
            chosen.append(by_name[name])
        return chosen or columns

    def print(self, rows: list[dict], columns: list[tuple[str, str]]) -> None:
        columns = self.columns(columns)
        headers = [h for _, h in columns]
        cells = [[_cell(r.get(k)) for k, _ in columns] for r in rows]
        if self.parsable:
            if not self.noheader:
                click.echo("|".join(headers))
            for row in cells:
                click.echo("|".join(row))
            return
        if not cells and self.noheader:
            return
        text = tabulate(cells, headers=() if self.noheader else headers, tablefmt="plain",
                        disable_numparse=True)
        if text:
            click.echo("\n".join(line.rstrip() for line in text.splitlines()))


def listing_options(command):
    """``-o/--format``, ``-P/--parsable2`` and ``-n/--noheader`` for a listing;
    the command gets them as one ``listing`` argument."""
    @click.option("-o", "--format", "fields", default=None, metavar="FIELD,...",
                  help="Only these fields, in this order (the column headers, any case).")
    @click.option("-P", "--parsable2", "parsable", is_flag=True,
                  help="Fields split by '|', no padding (as sacct/sinfo -P).")
    @click.option("-n", "--noheader", is_flag=True, help="No header line.")
    @functools.wraps(command)
    def wrapper(*args, fields, parsable, noheader, **kwargs):
        return command(*args, listing=Listing(fields, parsable, noheader), **kwargs)
    return wrapper


def _table(rows: list[dict], columns: list[tuple[str, str]]) -> None:
    """Aligned columns (key, header), with a header line: a table inside a report."""
    Listing(None, False, False).print(rows, columns)


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


def node_health(row: dict) -> str:
    """A node's health as an operator reads it: the ``health_detail`` the agent
    gives, else the same words made here from the node's flags and score
    ("drained by recovery (...)", "excluded by operator", "suspect (score
    0.90)", "ok")."""
    if row.get("health_detail"):
        return str(row["health_detail"])
    if row.get("drained_by_us"):
        why = str(row.get("drain_reason") or "").removeprefix("recovery:").strip()
        return "drained by recovery" + (f" ({why})" if why else "")
    if row.get("excluded_by_operator"):
        why = str(row.get("exclude_reason") or "").strip()
        return "excluded by operator" + (f" ({why})" if why else "")
    if (row.get("suspect_score") or 0) > 0:
        return f"suspect (score {_score(row['suspect_score'])})"
    return "ok"
