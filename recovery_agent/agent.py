"""``recovery-agent``: the central service. Hook ingest (HTTP), the watch loop
(poll, tail, detect, decide) and the actuator (act on Slurm, watchdog), one
process per store: a second agent on the same store refuses to start."""
from __future__ import annotations

import logging
import sys
import threading

import click
import uvicorn

from .act.actuator import Actuator
from .interfaces.api import create_app
from .config import Config, load
from .decide.decider import Decider
from .detect.patterns import load_rules
from .inputs.provider import from_config as attribution_provider
from .detect.scanner import Scanner
from .errors import RecoveryError
from .inputs.ingest import Ingest
from .inputs.jobcache import JobCache
from .inputs.logline import SqliteCursorStore
from .inputs.tail import Tailer
from .scheduler import Scheduler, scheduler_for
from .inputs.sources import SourcePoller, build_sources
from .store import Store, StoreLock, files
from .watch import Watcher

log = logging.getLogger("recovery_agent")


def load_scanner(cfg: Config):
    """The scanner with the shipped and the site's packs (a bad pack is an error now)."""
    site = [cfg.agent.patterns_dir] if cfg.agent.patterns_dir else []
    return Scanner(load_rules(site))


def source_poller(cfg: Config, scanner):
    """A poller over the external sources the config names (GPU metrics, log
    stores), or None when it names none. Raises ConfigError for an unreadable
    credentials file."""
    sources = build_sources(cfg, scanner.rules)
    if not sources:
        return None
    log.info("asking external sources every %.0fs: %s", cfg.sources.query_interval,
             ", ".join(f"{s.name} ({s.endpoint.label})" for s in sources))
    return SourcePoller(sources)


def start_watch(cfg: Config, store: Store, sched: Scheduler, ingest: Ingest,
                scanner=None, stop: threading.Event | None = None,
                sources=None, fence=None, on_step=None) -> threading.Event:
    """The watch loop and the actuator in background threads; set the returned
    event to stop them. ``sources``: a SourcePoller (see :func:`source_poller`);
    ``fence``: says why this agent may no longer act (see :func:`fence_for`);
    ``on_step``: the actuator's step seam (tests only)."""
    scanner = scanner or load_scanner(cfg)
    actuator = Actuator(cfg, store, sched, fence=fence, on_step=on_step)
    decider = Decider(cfg, store, sched)
    decider.on_new_work.append(actuator.wake.set)
    tailer = Tailer(SqliteCursorStore(store), allowed_roots=cfg.allowed_log_roots,
                    max_backlog=cfg.agent.log_max_backlog_mb << 20,
                    keep_tail=cfg.agent.log_keep_mb << 20,
                    time_budget=cfg.agent.poll_interval / 2)
    watcher = Watcher(cfg, store, sched, scanner, tailer, decider=decider, sources=sources,
                      provider=attribution_provider(cfg))
    ingest.log_listeners.append(watcher.report_lines)
    ingest.evidence_listeners.append(watcher.nudge)
    if ingest.jobs is not None:
        watcher.on_listing.append(ingest.jobs.offer)
    stop = stop or threading.Event()
    threading.Thread(target=watcher.run_forever, args=(stop,), name="watch",
                     daemon=True).start()
    threading.Thread(target=actuator.run_forever, args=(stop,), name="actuator",
                     daemon=True).start()
    log.info("watching jobs every %.1fs with %d rules (%s engine)", cfg.agent.poll_interval,
             len(scanner.rules), scanner.engine_name)
    return stop


def watch_when_ready(cfg: Config, store: Store, ingest: Ingest, scanner,
                     stop: threading.Event, retry: float = 5.0, sources=None,
                     fence=None, on_step=None) -> None:
    """Slurm was unreachable at start: keep trying, then start watching (an agent
    restarted during a slurmctld outage must not stay deaf once it is back)."""
    def loop() -> None:
        while not stop.wait(retry):
            sched = scheduler_for(cfg)
            if sched is not None:
                ingest.attach_jobs(JobCache(sched))
                start_watch(cfg, store, sched, ingest, scanner, stop, sources, fence, on_step)
                return
    threading.Thread(target=loop, name="wait-for-slurm", daemon=True).start()


def open_store(cfg: Config, lock: StoreLock) -> Store:
    """The store, locked for this agent (``lock``), private (0600: it holds
    every user's jobs; a looser one is tightened before it is opened, so that
    SQLite makes its -wal and -shm private too) and checked: an empty or
    damaged store is refused with what to do."""
    try:
        files.make_directory(cfg.store_path)
        lock.acquire()
        for line in files.tighten(cfg.store_path):
            log.warning("the store holds every user's jobs: made it private: %s", line)
        return Store(cfg.store_path, check=True)
    except (RecoveryError, OSError) as exc:
        raise click.ClickException(str(exc)) from None


def fence_for(cfg: Config, store: Store, lock: StoreLock):
    """Claim the store for this agent and return its fence: a callable saying
    why this agent may no longer act on Slurm ("" while it may). Another agent
    that reached the same store by another path, or took it over since, stops
    this one before its next Slurm call: two agents never act on one store."""
    try:
        token = store.claim(fresh_within=max(30.0, 10 * cfg.agent.poll_interval))
    except RecoveryError as exc:
        raise click.ClickException(str(exc)) from None

    def fence() -> str:
        lost = lock.lost()
        if lost:
            return lost
        try:
            return "" if store.claimed_by(token) else (
                "another recovery-agent has claimed the store since this one started")
        except Exception as exc:  # noqa: BLE001 - an unreadable claim fences too
            return f"cannot read the store's claim: {exc}"
    return fence


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-c", "--config", "config_path", type=click.Path(dir_okay=False),
              default=None, help="Config file [default: $RECOVERY_CONFIG or "
                                 "/etc/slurm-recovery/recovery.toml].")
@click.option("--bind", default=None, help="Listen address (overrides api.bind).")
@click.option("--port", type=int, default=None, help="Listen port (overrides api.port).")
@click.option("--no-watch", is_flag=True,
              help="Only serve hook ingest; do not follow jobs' logs.")
@click.pass_context
def main(ctx: click.Context, config_path: str | None, bind: str | None, port: int | None,
         no_watch: bool) -> None:
    """Run the slurm-recovery agent: receive node hook reports and store them.

    \b
    Example:
        RECOVERY_CONFIG=/etc/slurm-recovery/recovery.toml recovery-agent --port 8787
    """
    # a caller's seams, e.g. the actuator's on_step (tests/step_faults.py): none in service
    on_step = (ctx.obj or {}).get("on_step")
    try:
        cfg = load(config_path)
    except RecoveryError as exc:
        raise click.ClickException(str(exc)) from None
    logging.basicConfig(level=cfg.agent.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    lock = StoreLock(cfg.store_path)
    store = open_store(cfg, lock)
    fence = fence_for(cfg, store, lock)
    sched = scheduler_for(cfg)
    ingest = Ingest(store, cfg.agent.cluster, JobCache(sched) if sched is not None else None,
                    proactive=cfg.proactive)
    app = create_app(cfg, ingest)
    stop = threading.Event()
    if not no_watch:
        try:
            scanner = load_scanner(cfg)
            sources = source_poller(cfg, scanner)
            attribution_provider(cfg)   # a missing entry point or token file: say so now
        except (RecoveryError, ValueError, OSError) as exc:
            raise click.ClickException(str(exc)) from None
        if sched is not None:
            start_watch(cfg, store, sched, ingest, scanner, stop, sources, fence, on_step)
        else:
            log.warning("not watching jobs until Slurm answers (retrying every 5s)")
            watch_when_ready(cfg, store, ingest, scanner, stop, sources=sources, fence=fence,
                             on_step=on_step)
    host, listen_port = bind or cfg.api.bind, port or cfg.api.port
    if host not in ("127.0.0.1", "localhost", "::1") and not cfg.api.read_token_file:
        log.warning("the API listens on %s without api.read_token_file: anyone who can "
                    "reach port %s can read every job's recovery history (changes still "
                    "need munge); set a read token or firewall the port", host, listen_port)
    log.info("agent listening on %s:%s, store %s", host, listen_port, cfg.store_path)
    try:
        # proxy_headers off: X-Forwarded-For must not change who a caller is
        uvicorn.run(app, host=host, port=listen_port, log_level="warning", access_log=False,
                    proxy_headers=False)
    finally:
        stop.set()
    sys.exit(0)
