"""``recovery-ctl report goodput``: the goodput ledger over a window (what
incidents cost, what recovery saved against plain Slurm; docs/goodput.md), and
the one-line job summary ``show job`` prints."""
from __future__ import annotations

import time

import click

from ..ledger import BY
from .client import Client, _config_option, _db_option
from .output import _dump, _json_option, _parse_time, _when, listing_options

COLUMNS = [("group", "GROUP"), ("incidents", "INCIDENTS"), ("recovered", "RECOVERED"),
           ("stopped", "STOPPED"), ("given_up", "GIVEN_UP"), ("unknown", "UNKNOWN"),
           ("mttr_median", "MTTR_MEDIAN"), ("mttr_p95", "MTTR_P95"),
           ("gpu_hours_lost", "GPU_H_LOST"), ("gpu_hours_saved", "GPU_H_SAVED"),
           ("would_have_gpu_hours_saved", "WOULD_HAVE_GPU_H_SAVED"), ("ettr", "ETTR"),
           ("unknown_lost", "LOST_UNKNOWN"), ("unknown_saved", "SAVED_UNKNOWN")]


def duration(seconds: float | None) -> str:
    """Seconds in words: ``45 s``, ``12 min``, ``2 h 05 min`` (``-`` unknown)."""
    if seconds is None:
        return "-"
    sign, seconds = ("-" if seconds < 0 else ""), abs(seconds)
    if seconds < 60:
        return f"{sign}{seconds:.0f} s"
    minutes = round(seconds / 60)
    if minutes < 60:
        return f"{sign}{minutes} min"
    return f"{sign}{minutes // 60} h {minutes % 60:02d} min"


def assumptions_line(assume: dict) -> str:
    hang = assume["hang_noticed_after_s"]
    return (f"assumptions: plain Slurm requeue delay {duration(assume['requeue_delay_s'])}; "
            + ("one more lost attempt when the fault stays with a node nothing excluded; "
               if assume["repeat_on_node"] else "")
            + f"monitor mode: running again {duration(assume['restart_after_decision_s'])} "
            "after our decision; plain Slurm ends a hang "
            + (f"after {duration(hang)}" if hang else "after an unknown time (not set)"))


def summary_line(led: dict) -> str:
    """``3 incidents, 41 GPU-min lost, 2 h 05 min saved vs plain Slurm``."""
    n = led["incidents"]
    text = f"{n} incident{'' if n == 1 else 's'}"
    if not n:
        return text
    lost = led["gpu_s_lost"]
    text += ", " + (f"{lost / 60:.0f} GPU-min lost" if lost is not None else "GPU time lost "
                    "unknown")
    if led["unknown_lost"] and lost is not None:
        text += f" ({led['unknown_lost']} unknown)"
    saved = led["saved_s"]
    verb = "would have saved" if led["would_have"] else "saved"
    text += ", " + (f"{duration(saved)} {verb} vs plain Slurm" if saved is not None
                    else f"time {verb} unknown")
    if led["unknown_saved"] and saved is not None:
        text += f" ({led['unknown_saved']} unknown)"
    return text


@click.command("goodput")
@click.option("--since", default="30d", show_default=True,
              help="ISO time, or a duration back (24h, 30d).")
@click.option("--until", default=None, help="ISO time, or a duration back [default: now].")
@click.option("--by", type=click.Choice(BY), default=None,
              help="One row per environment, user, failure category or node.")
@_config_option
@_db_option
@_json_option
@listing_options
def goodput(since, until, by, config_path, db_path, as_json, listing) -> None:
    """What recovery saved: incidents by outcome (recovered, stopped, given up,
    unknown), MTTR, GPU-hours lost, GPU-hours saved against plain Slurm (in
    monitor mode: what acting would have saved) and ETTR, over a window. A
    figure the records cannot support counts as unknown. docs/goodput.md
    defines each one and the assumptions.

    \b
    Example:
        recovery-ctl report goodput --since 30d
        recovery-ctl report goodput --since 7d --by category -P
        recovery-ctl report goodput --json | jq '.incidents[].outcome'
    """
    client = Client(config_path, db_path, None, readonly=True)
    if client.service is None:
        raise click.ClickException(f"report goodput: cannot read the store "
                                   f"{client.cfg.store_path} here (run it on the agent's "
                                   "host, or name it with --db)")
    start, end = _parse_time(since), _parse_time(until) or time.time()
    result = client.call("goodput", start, end, by)
    if as_json:
        _dump(result)
        return
    rows = [{"group": key, **g, "mttr_median": duration(g["mttr_median_s"]),
             "mttr_p95": duration(g["mttr_p95_s"]),
             "ettr": None if g["ettr"] is None else f"{g['ettr']:.3f}"}
            for key, g in result["groups"].items()]
    if not listing.parsable:
        click.echo(f"window {_when(start)} .. {_when(end)}")
        click.echo(assumptions_line(result["assumptions"]))
    listing.print(rows, COLUMNS)
