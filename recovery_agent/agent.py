"""``recovery-agent``: the central service. Today it serves hook ingest; the
scheduler poller, detectors and actuator join it in later releases."""
from __future__ import annotations

import logging
import sys

import click

from .config import Config, load
from .errors import RecoveryError
from .ingest import Ingest
from .jobcache import JobCache
from .scheduler import select_scheduler
from .scheduler.runner import SlurmRunner
from .store import Store

log = logging.getLogger("recovery_agent")


def job_cache_for(cfg: Config) -> JobCache | None:
    """The scheduler's job listing for ingest, or None when no backend can run
    (ingest then works without the scheduler's submit times)."""
    runner = SlurmRunner(bin_dir=cfg.scheduler.bin_dir, slurm_conf=cfg.scheduler.slurm_conf,
                         timeout=cfg.scheduler.command_timeout)
    try:
        sched = select_scheduler(cfg.scheduler.backend, runner)
    except RecoveryError as exc:
        log.warning("no scheduler backend (%s); hook reports are stored without the "
                    "scheduler's submit time", exc)
        return None
    return JobCache(sched)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-c", "--config", "config_path", type=click.Path(dir_okay=False),
              default=None, help="Config file [default: $RECOVERY_CONFIG or "
                                 "/etc/slurm-recovery/recovery.toml].")
@click.option("--bind", default=None, help="Listen address (overrides api.bind).")
@click.option("--port", type=int, default=None, help="Listen port (overrides api.port).")
def main(config_path: str | None, bind: str | None, port: int | None) -> None:
    """Run the slurm-recovery agent: receive node hook reports and store them.

    \b
    Example:
        RECOVERY_CONFIG=/etc/slurm-recovery/recovery.toml recovery-agent --port 8787
    """
    try:
        cfg = load(config_path)
    except RecoveryError as exc:
        raise click.ClickException(str(exc)) from None
    logging.basicConfig(level=cfg.agent.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        store = Store(cfg.store_path)
    except RecoveryError as exc:
        raise click.ClickException(str(exc)) from None
    import uvicorn

    from .api import create_app
    app = create_app(cfg, Ingest(store, cfg.agent.cluster, job_cache_for(cfg)))
    host, listen_port = bind or cfg.api.bind, port or cfg.api.port
    log.info("agent listening on %s:%s, store %s", host, listen_port, cfg.store_path)
    uvicorn.run(app, host=host, port=listen_port, log_level="warning", access_log=False)
    sys.exit(0)
