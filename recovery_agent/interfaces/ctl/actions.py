"""The operator's changes: an environment's mode, node exclusions, and the
claim or withdrawal of a recommendation."""
from __future__ import annotations

import click

from .client import Client, _config_option, _db_option, _url_option
from .output import _dump, _json_option


@click.command()
@click.argument("env")
@click.argument("mode", type=click.Choice(["monitor", "action", "external"]))
@_config_option
@_db_option
@_url_option
@_json_option
def mode(env, mode, config_path, db_path, url, as_json) -> None:
    """Switch an environment's mode (admin): persisted, and audited with who did it.

    \b
    Example:
        recovery-ctl mode prod action
    """
    answer = Client(config_path, db_path, url, writing=True).change("set_mode", env, mode)
    if as_json:
        _dump(answer)
        return
    click.echo(f"environment {env}: {answer['before']} -> {answer['mode']}")


@click.command()
@click.argument("node")
@click.option("--reason", required=True, help="Why (recorded in the audit trail).")
@_config_option
@_db_option
@_url_option
def exclude(node, reason, config_path, db_path, url) -> None:
    """Exclude NODE from every tracked job's retries (admin). Drains stay ours:
    this never drains or resumes a node in Slurm.

    \b
    Example:
        recovery-ctl exclude node7 --reason "IB link flaps, ticket 4411"
    """
    Client(config_path, db_path, url, writing=True).change("exclude", node, reason)
    click.echo(f"{node}: excluded from retries")


@click.command()
@click.argument("node")
@_config_option
@_db_option
@_url_option
def include(node, config_path, db_path, url) -> None:
    """Undo `exclude NODE` (admin).

    \b
    Example:
        recovery-ctl include node7
    """
    Client(config_path, db_path, url, writing=True).change("include", node)
    click.echo(f"{node}: no longer excluded")


@click.command()
@click.argument("rec_id", type=int)
@_config_option
@_db_option
@_url_option
def ack(rec_id, config_path, db_path, url) -> None:
    """Claim an external-mode recommendation (admin: as a site controller does,
    before it acts on Slurm and reports the outcome).

    \b
    Example:
        recovery-ctl ack 17
    """
    answer = Client(config_path, db_path, url, writing=True).change("ack", rec_id)
    click.echo(f"#{rec_id}: claimed by {answer['claimed_by']}")


@click.command()
@click.argument("rec_id", type=int)
@click.option("--reason", default="", help="Why (recorded).")
@_config_option
@_db_option
@_url_option
def cancel(rec_id, reason, config_path, db_path, url) -> None:
    """Withdraw a recommendation that has not started on Slurm. A user may
    withdraw those for their own jobs; a node's drain or resume needs an admin.

    \b
    Example:
        recovery-ctl cancel 17 --reason "maintenance tonight, will requeue by hand"
    """
    Client(config_path, db_path, url, writing=True).change("cancel", rec_id, reason)
    click.echo(f"#{rec_id}: cancelled")
