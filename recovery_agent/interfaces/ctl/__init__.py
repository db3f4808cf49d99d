"""``recovery-ctl``: the operator's command line for slurm-recovery.

Each command is a few lines over the library; library errors become
``click.ClickException`` here, at the edge. The commands live by role:
:mod:`.patterns` (packs over logs, offline), :mod:`.show` (what the agent
tracks), :mod:`.actions` (the operator's changes), :mod:`.audit` (the audit
trail and the monitor-mode report), :mod:`.host` (the watchdog and the
checks); :mod:`.client` reaches the store or the agent's API, :mod:`.output`
prints. This module assembles them into :func:`main`, the entry point.
"""
from __future__ import annotations

import click

from . import actions, audit, host, patterns, show


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--utc", is_flag=True,
              help="Print times in UTC (2026-12-01T20:16:50Z) instead of local time.")
@click.version_option(package_name="slurm-recovery", prog_name="recovery-ctl",
                      message="%(prog)s %(version)s")
def main(utc: bool) -> None:
    """Inspect and steer slurm-recovery: jobs, nodes, recommendations, modes,
    the audit trail, the watchdog, checks and reports, and pattern packs.

    \b
    Examples:
        recovery-ctl show jobs --state R
        recovery-ctl --utc audit --since 24h
        recovery-ctl check --sources
        recovery-ctl patterns test slurm-4410.out
    """


for _command in (patterns.patterns, show.show, actions.mode, actions.exclude,
                 actions.include, actions.ack, actions.complete, actions.cancel, audit.audit,
                 host.watchdog, host.check, audit.report):
    main.add_command(_command)
