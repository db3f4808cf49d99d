"""What ``recovery-ctl`` reads from its arguments: hostlists and Slurm job
states, each refused with the forms it takes."""
from __future__ import annotations

import click
import hostlist

# Slurm's job states (squeue/sacct) by short code; either form is taken, in any case
JOB_STATES = {
    "BF": "BOOT_FAIL", "CA": "CANCELLED", "CD": "COMPLETED", "CF": "CONFIGURING",
    "CG": "COMPLETING", "DL": "DEADLINE", "F": "FAILED", "NF": "NODE_FAIL",
    "OOM": "OUT_OF_MEMORY", "PD": "PENDING", "PR": "PREEMPTED", "R": "RUNNING",
    "RD": "RESV_DEL_HOLD", "RF": "REQUEUE_FED", "RH": "REQUEUE_HOLD", "RQ": "REQUEUED",
    "RS": "RESIZING", "RV": "REVOKED", "SI": "SIGNALING", "SE": "SPECIAL_EXIT",
    "SO": "STAGE_OUT", "ST": "STOPPED", "S": "SUSPENDED", "TO": "TIMEOUT",
    "UNKNOWN": "UNKNOWN",
}
_NAMES = set(JOB_STATES.values())


def job_states(text: str | None) -> list[str]:
    """``--state``: Slurm state names or short codes, comma-separated, any case
    (``running``, ``R``, ``pd,cg``), as the names the store keeps."""
    if not text:
        return []
    out = []
    for word in (w.strip().upper() for w in text.split(",")):
        if not word:
            continue
        name = JOB_STATES.get(word, word)
        if name not in _NAMES:
            raise click.BadParameter(
                f"{word!r} is not a Slurm job state; use a name or its code: "
                + ", ".join(f"{n} ({c})" for c, n in sorted(JOB_STATES.items(),
                                                             key=lambda i: i[1])
                            if c != n), param_hint="'--state'")
        if name not in out:
            out.append(name)
    return out


def node_names(text: str) -> list[str]:
    """A node argument as a Slurm hostlist (``node[1-4,7]``, ``a1,b[2-3]``)."""
    try:
        names = hostlist.expand_hostlist(text)
    except hostlist.BadHostlist as exc:
        raise click.BadParameter(f"{text!r} is not a hostlist ({exc})") from None
    if not names:
        raise click.BadParameter(f"{text!r} names no node")
    return names
