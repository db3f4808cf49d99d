"""``recovery-ctl report goodput``: the goodput ledger over a window (what
incidents cost, what recovery saved against plain Slurm; docs/goodput.md), and
the one-line job summary ``show job`` prints."""
from __future__ import annotations

import time

import click

from ..ledger import BY
from .client import Client, _config_option, _db_option, _url_option
from .output import _dump, _json_option, _parse_time, _when, listing_options

COLUMNS = [("group", "GROUP"), ("incidents", "INCIDENTS"), ("recovered", "RECOVERED"),
           ("stopped", "STOPPED"), ("given_up", "GIVEN_UP"), ("unknown", "UNKNOWN"),
           ("mttr_median", "MTTR_MEDIAN"), ("mttr_p95", "MTTR_P95"),
           ("gpu_hours_lost", "GPU_H_LOST"), ("gpu_hours_saved", "GPU_H_SAVED"),
           ("would_have_gpu_hours_saved", "WOULD_HAVE_GPU_H_SAVED"), ("ettr", "ETTR"),
           ("unknown_lost", "LOST_UNKNOWN"), ("unknown_saved", "SAVED_UNKNOWN")]
INCIDENT_COLUMNS = [("job_id", "JOB"), ("attempt", "ATTEMPT"), ("category", "CATEGORY"),
                    ("nodes_text", "NODES"), ("mode", "MODE"), ("outcome", "OUTCOME"),
                    ("failure_text", "FAILURE"), ("work_lost", "WORK_LOST"),
                    ("steps_lost", "STEPS_LOST"), ("downtime", "DOWNTIME"),
                    ("gpu_min_lost", "GPU_MIN_LOST"), ("saved", "SAVED"),
                    ("unknown_text", "UNKNOWN")]


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


def blame_line(blame: dict) -> str:
    """``node blame: 4 blamed (3 nodes): 2 confirmed, 1 cleared, 1 without
    evidence; precision 0.67``."""
    if not blame["blames"]:
        return "node blame: no node excluded or drained in the window"
    precision = blame["precision"]
    return (f"node blame: {blame['blames']} blamed ({blame['nodes']} node"
            f"{'' if blame['nodes'] == 1 else 's'}"
            + (f", {blame['would_have']} in monitor mode" if blame["would_have"] else "")
            + f"): {blame['confirmed']} confirmed, {blame['cleared']} cleared, "
            f"{blame['no_evidence']} without evidence; precision "
            + ("unknown" if precision is None else f"{precision:.2f}"))


def stops_line(stops: dict) -> str:
    """``stops: 3 (1 in monitor mode): 1 resubmitted unchanged and ran fine, ...``."""
    if not stops["stops"]:
        return "stops: none in the window"
    return (f"stops: {stops['stops']}"
            + (f" ({stops['would_have']} in monitor mode)" if stops["would_have"] else "")
            + f": {stops['ran_fine']} resubmitted unchanged and ran fine (false-stop "
            f"evidence), {stops['failed_again']} failed again, {stops['pending']} not "
            f"ended yet, {stops['not_resubmitted']} not resubmitted")


def _incident_row(inc: dict) -> dict:
    lost = inc["gpu_s_lost"]
    return {**inc, "nodes_text": ",".join(inc["nodes"]) or "-",
            "failure_text": _when(inc["failure"]) if inc["failure"] else "-",
            "work_lost": duration(inc["work_lost_s"]), "downtime": duration(inc["downtime_s"]),
            "gpu_min_lost": None if lost is None else f"{lost / 60:.1f}",
            "saved": duration(inc["saved_s"]) + (" (would have)" if inc["would_have"] and
                                                 inc["saved_s"] is not None else ""),
            "unknown_text": ",".join(sorted(inc["unknown"])) or "-"}


@click.command("goodput")
@click.option("--since", default="30d", show_default=True,
              help="ISO time, or a duration back (24h, 30d).")
@click.option("--until", default=None, help="ISO time, or a duration back [default: now].")
@click.option("--by", type=click.Choice(BY), default=None,
              help="One row per environment, user, failure category or node.")
@click.option("--incidents", "per_incident", is_flag=True,
              help="One row per incident (work and steps lost, downtime, saving) instead "
                   "of the groups.")
@_config_option
@_db_option
@_url_option
@_json_option
@listing_options
def goodput(since, until, by, per_incident, config_path, db_path, url, as_json,
            listing) -> None:
    """What recovery saved: incidents by outcome (recovered, stopped, given up,
    unknown), MTTR, GPU-hours lost, GPU-hours saved against plain Slurm (in
    monitor mode: what acting would have saved) and ETTR, over a window; the
    precision of node blame and the false-stop evidence. A figure the records
    cannot support counts as unknown. docs/goodput.md defines each one and the
    assumptions. Reads the store, or the agent's API (where a user sees only
    their own jobs).

    \b
    Example:
        recovery-ctl report goodput --since 30d
        recovery-ctl report goodput --since 7d --by category -P
        recovery-ctl report goodput --incidents -o job,outcome,steps_lost
        recovery-ctl report goodput --json | jq '.incidents[].outcome'
    """
    client = Client(config_path, db_path, url, readonly=True)
    start, end = _parse_time(since), _parse_time(until) or time.time()
    result = client.call("goodput", start, end, by)
    if as_json:
        _dump(result)
        return
    if per_incident:
        listing.print([_incident_row(i) for i in result["incidents"]], INCIDENT_COLUMNS)
        return
    rows = [{"group": key, **g, "mttr_median": duration(g["mttr_median_s"]),
             "mttr_p95": duration(g["mttr_p95_s"]),
             "ettr": None if g["ettr"] is None else f"{g['ettr']:.3f}"}
            for key, g in result["groups"].items()]
    if not listing.parsable:
        click.echo(f"window {_when(result['since'])} .. {_when(result['until'])}")
        click.echo(assumptions_line(result["assumptions"]))
    listing.print(rows, COLUMNS)
    if not listing.parsable:
        click.echo(blame_line(result["blame"]))
        click.echo(stops_line(result["false_stops"]))
