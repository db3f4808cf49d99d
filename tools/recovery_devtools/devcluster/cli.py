"""``recovery-devcluster``: a real Slurm cluster on this machine, in seconds."""
from __future__ import annotations

import json
import logging
import shlex
import sys
from pathlib import Path

import click

from recovery_agent.errors import RecoveryError
from .cluster import DevCluster, default_state_dir
from .config import DEFAULT_GPUS, DEFAULT_NODES, DEFAULT_PORT, local_spec
from .inject import inject

STATE_DIR = click.option(
    "--state-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
    help="Where config, logs, sockets and per-node fault files live "
         "[default: $RECOVERY_DEVCLUSTER_DIR or /tmp/recovery-devcluster-UID].")


def _cluster(state_dir: Path | None) -> DevCluster:
    return DevCluster(state_dir or default_state_dir(),
                      progress=lambda msg: click.echo(msg, err=True))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Log what is being run.")
def main(verbose: bool) -> None:
    """Run a real Slurm cluster (munge, slurmctld, N slurmd) on this one machine.

    It uses the distribution's Slurm on non-default ports, so it never meets a
    real cluster. Each node gets a kernel-log file and a fake-GPU state file
    under the state dir, for fault injection.

    \b
    Example:
        recovery-devcluster up --nodes 4
        eval "$(recovery-devcluster env)"
        sbatch -N2 --wrap 'srun hostname'
        recovery-devcluster down
    """
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")


@main.command()
@click.option("--nodes", type=click.IntRange(1, 64), default=DEFAULT_NODES, show_default=True,
              help="Number of slurmd to start (node1..nodeN).")
@click.option("--gpus-per-node", type=click.IntRange(0, 16), default=DEFAULT_GPUS,
              show_default=True, help="GPUs (gres/gpu) each node reports.")
@click.option("--port", type=click.IntRange(1024, 65000), default=DEFAULT_PORT,
              show_default=True,
              help="slurmctld's port; slurmd K listens on PORT+1+K.")
@click.option("--rest/--no-rest", default=None,
              help="Also run slurmrestd (auth/jwt on PORT+80, local auth on a socket in "
                   "the state dir) [default: $RECOVERY_DEVCLUSTER_REST, else off].")
@STATE_DIR
def up(nodes: int, gpus_per_node: int, port: int, rest: bool | None,
       state_dir: Path | None) -> None:
    """Start the cluster and wait until every node is idle (60 s at most).

    A healthy cluster of the same shape is reused; a stale one left by a
    crash is cleaned first. The SPANK plugin and the node hooks are wired in
    when they are built/installed.

    \b
    Example:
        recovery-devcluster up --nodes 2 --gpus-per-node 8 --state-dir /tmp/dc
    """
    spec = local_spec(nodes=nodes, gpus_per_node=gpus_per_node, port=port, rest=rest)
    cluster = _cluster(state_dir)
    try:
        click.echo(cluster.up(spec))
    except RecoveryError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"export SLURM_CONF={shlex.quote(str(cluster.slurm_conf))}", err=True)


@main.command()
@STATE_DIR
def down(state_dir: Path | None) -> None:
    """Cancel all jobs and stop every process `up` started.

    The state dir (logs, config) is kept for inspection.

    \b
    Example:
        recovery-devcluster down
    """
    cluster = _cluster(state_dir)
    stopped = cluster.down(quiet=True)
    click.echo(f"stopped {len(stopped)} daemon(s)" if stopped else "nothing was running")


@main.command()
@STATE_DIR
def env(state_dir: Path | None) -> None:
    """Print the line a shell needs to talk to the cluster.

    \b
    Example:
        eval "$(recovery-devcluster env)"
    """
    cluster = _cluster(state_dir)
    if not cluster.slurm_conf.exists():
        raise click.ClickException(f"no dev cluster in {cluster.lay.root}; "
                                   "run `recovery-devcluster up` first")
    click.echo(f"export SLURM_CONF={shlex.quote(str(cluster.slurm_conf))}")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@STATE_DIR
def status(as_json: bool, state_dir: Path | None) -> None:
    """Show the daemons and the node states. Exits 1 when the cluster is not fully up.

    \b
    Example:
        recovery-devcluster status --json
    """
    info = _cluster(state_dir).status()
    healthy = bool(info["daemons"]) and all(d["alive"] for d in info["daemons"])
    if as_json:
        click.echo(json.dumps(dict(info, healthy=healthy), indent=2))
    else:
        click.echo(f"state dir: {info['state_dir']}")
        if not info["daemons"]:
            click.echo("daemons:   none running")
        for d in info["daemons"]:
            click.echo(f"  {d['name']:<16} pid {d['pid']:<8} "
                       f"{'running' if d['alive'] else 'DEAD'}")
        if info["nodes"]:
            click.echo(f"{'NODE':<10} {'STATE':<18} REASON")
            for n in info["nodes"]:
                click.echo(f"{n['name']:<10} {n['state']:<18} {n['reason']}")
    sys.exit(0 if healthy else 1)


main.add_command(inject)
