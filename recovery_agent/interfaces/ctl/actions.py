"""The operator's changes: an environment's mode, node exclusions, and the
claim, completion or withdrawal of a recommendation. Each one that changes
something is an audit record (who, when, before and after, why); a refused
one records nothing (the agent's log says who was refused)."""
from __future__ import annotations

import click

from .client import Client, _config_option, _db_option, _url_option
from .inputs import node_names
from .output import _dump, _json_option

# the outcomes a claimed recommendation ends with (Service.complete takes these)
OUTCOMES = ("done", "failed")


_reason_option = click.option("--reason", default="",
                              help="Why (recorded in the audit trail with who and when).")


@click.command()
@click.argument("env")
@click.argument("mode", required=False, type=click.Choice(["monitor", "action", "external"]))
@click.option("--clear", is_flag=True,
              help="Give ENV back the config file's mode (undo an earlier `mode ENV MODE`).")
@_reason_option
@_config_option
@_db_option
@_url_option
@_json_option
def mode(env, mode, clear, reason, config_path, db_path, url, as_json) -> None:
    """Switch an environment's mode (admin). It is stored, wins over the config
    file until `--clear`, and is audited with who did it, when and why
    (`recovery-ctl audit`; `show config` names who set it).

    \b
    Example:
        recovery-ctl mode prod action --reason "two weeks of monitor agreed with on-call"
        recovery-ctl mode prod --clear
    """
    if clear == bool(mode):
        raise click.UsageError("give either MODE or --clear")
    client = Client(config_path, db_path, url, writing=True)
    answer = (client.change("clear_mode", env, reason) if clear
              else client.change("set_mode", env, mode, reason))
    if as_json:
        _dump(answer)
        return
    if clear and not answer.get("cleared"):
        click.echo(f"environment {env}: {answer['mode']} (the config file's already; "
                   "nothing to clear)")
        return
    click.echo(f"environment {env}: {answer['before']} -> {answer['mode']}"
               + (" (the config file's)" if clear else ""))


@click.command()
@click.argument("nodes")
@click.option("--reason", required=True,
              help="Why (recorded in the audit trail with who and when).")
@click.option("--force", is_flag=True,
              help="Exclude even a node Slurm does not know, or when Slurm cannot be "
                   "asked (recorded as forced).")
@_config_option
@_db_option
@_url_option
@_json_option
def exclude(nodes, reason, force, config_path, db_path, url, as_json) -> None:
    """Exclude NODES (a name or a hostlist) from every tracked job's retries
    (admin). Each must be a node Slurm knows, unless --force. Drains stay ours:
    this never drains or resumes a node in Slurm.

    \b
    Example:
        recovery-ctl exclude node7 --reason "IB link flaps, ticket 4411"
        recovery-ctl exclude 'node[1-4,7]' --reason "rack 3 power work"
    """
    names = node_names(nodes)
    client = Client(config_path, db_path, url, writing=True)
    answers = []
    for name in names:          # each said as it is done: a refusal stops the rest
        answers.append(client.change("exclude", name, reason, force))
        forced = answers[-1].get("forced")
        if not as_json:
            click.echo(f"{name}: excluded from retries"
                       + (f" (forced: {forced})" if forced else ""))
    if as_json:
        _dump(answers[0] if len(names) == 1 else answers)


@click.command()
@click.argument("nodes")
@_reason_option
@_config_option
@_db_option
@_url_option
@_json_option
def include(nodes, reason, config_path, db_path, url, as_json) -> None:
    """Undo `exclude NODES` (admin; a name or a hostlist).

    \b
    Example:
        recovery-ctl include node7
        recovery-ctl include 'node[1-4,7]'
    """
    names = node_names(nodes)
    client = Client(config_path, db_path, url, writing=True)
    answers = []
    for name in names:
        answers.append(client.change("include", name, reason))
        if not as_json:
            click.echo(f"{name}: no longer excluded")
    if as_json:
        _dump(answers[0] if len(names) == 1 else answers)


@click.command()
@click.argument("rec_id", type=int)
@_reason_option
@_config_option
@_db_option
@_url_option
@_json_option
def ack(rec_id, reason, config_path, db_path, url, as_json) -> None:
    """Claim an external-mode recommendation (admin: as a site controller does,
    before it acts on Slurm and reports the outcome with `complete`).

    \b
    Example:
        recovery-ctl ack 17
    """
    answer = Client(config_path, db_path, url, writing=True).change("ack", rec_id, reason)
    if as_json:
        _dump(answer)
        return
    click.echo(f"#{rec_id}: claimed by {answer['claimed_by']}")


@click.command()
@click.argument("rec_id", type=int)
@click.option("--outcome", required=True, type=click.Choice(OUTCOMES),
              help="done: carried out on Slurm; failed: tried and it did not work.")
@click.option("--detail", default="",
              help="What was done, or what went wrong (recorded; the audit trail's reason).")
@_config_option
@_db_option
@_url_option
@_json_option
def complete(rec_id, outcome, detail, config_path, db_path, url, as_json) -> None:
    """Report the outcome of a claimed external recommendation (admin: after
    `ack` and acting on Slurm, as a site controller does).

    \b
    Example:
        recovery-ctl complete 17 --outcome done --detail "requeued by the site controller"
    """
    answer = Client(config_path, db_path, url, writing=True).change(
        "complete", rec_id, outcome, detail)
    if as_json:
        _dump(answer)
        return
    click.echo(f"#{rec_id}: {answer['status']}")


@click.command()
@click.argument("rec_id", type=int)
@_reason_option
@_config_option
@_db_option
@_url_option
@_json_option
def cancel(rec_id, reason, config_path, db_path, url, as_json) -> None:
    """Withdraw a recommendation that has not started on Slurm. A user may
    withdraw those for their own jobs; a node's drain or resume needs an admin.

    \b
    Example:
        recovery-ctl cancel 17 --reason "maintenance tonight, will requeue by hand"
    """
    answer = Client(config_path, db_path, url, writing=True).change("cancel", rec_id, reason)
    if as_json:
        _dump(answer)
        return
    click.echo(f"#{rec_id}: cancelled")
