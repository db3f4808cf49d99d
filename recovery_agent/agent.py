"""``recovery-agent``: the central service. Today it serves hook ingest; the
scheduler poller, detectors and actuator join it in later releases."""
from __future__ import annotations

import logging
import sys
import threading
import time

import click

from .config import Config, load
from .errors import RecoveryError
from .ingest import Ingest
from .scheduler import Job, Scheduler, select_scheduler
from .scheduler.runner import SlurmRunner
from .store import Store

log = logging.getLogger("recovery_agent")


class JobCache:
    """Job lookups for ingest, answered from one batched scheduler query that
    is reused for ``max_age`` seconds: a burst of reports from every node of a
    big job costs one ``squeue``, not one per report."""

    def __init__(self, scheduler: Scheduler, max_age: float = 2.0,
                 miss_refresh: float = 0.5) -> None:
        self.scheduler = scheduler
        self.max_age = max_age
        self.miss_refresh = miss_refresh
        self._jobs: dict[str, Job] = {}
        self._loaded = 0.0
        self._lock = threading.Lock()
        self.queries = 0

    def _refresh(self) -> None:
        jobs = self.scheduler.list_jobs()
        self.queries += 1
        index: dict[str, Job] = {}
        for job in jobs:
            index[job.job_id] = job
            index.setdefault(str(job.numeric_id), job)
        self._jobs, self._loaded = index, time.monotonic()

    def __call__(self, job_id: str) -> Job | None:
        with self._lock:
            age = time.monotonic() - self._loaded
            if age > self.max_age or (job_id not in self._jobs and age > self.miss_refresh):
                self._refresh()
            return self._jobs.get(job_id)


def job_lookup_for(cfg: Config) -> JobCache | None:
    """A cached job lookup, or None when no backend can run (ingest then
    works without the scheduler's submit times)."""
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
    app = create_app(cfg, Ingest(store, cfg.agent.cluster, job_lookup_for(cfg)))
    host, listen_port = bind or cfg.api.bind, port or cfg.api.port
    log.info("agent listening on %s:%s, store %s", host, listen_port, cfg.store_path)
    uvicorn.run(app, host=host, port=listen_port, log_level="warning", access_log=False)
    sys.exit(0)
