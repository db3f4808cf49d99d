"""Scheduler backends and how one is chosen.

Selection follows one rule: an explicit choice (config ``scheduler.backend`` or
``RECOVERY_SCHEDULER_BACKEND``) wins; ``auto`` takes the first viable backend in
:data:`ORDER`; when none is viable, :class:`SchedulerUnavailable` says why for
each one.

The order: ``rest`` first, because it is viable only when a site has named its
slurmrestd (``scheduler.rest_url``), which says what the site wants; then
pyslurm, which avoids a fork per query where its build matches the running
Slurm; then the CLI, which runs wherever the Slurm commands do.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

from ..errors import RecoveryError, SchedulerUnavailable
from .base import Job, Node, Probe, Scheduler
from .cli_backend import CliScheduler
from .rest_client import RestSettings
from .runner import SlurmRunner

if TYPE_CHECKING:
    from ..config import Config

__all__ = ["Job", "Node", "Probe", "Scheduler", "CliScheduler", "SlurmRunner", "RestSettings",
           "ORDER", "select_scheduler", "scheduler_for", "probe_all"]
log = logging.getLogger(__name__)

ORDER = ("rest", "pyslurm", "cli")


def _factories(runner: SlurmRunner,
               rest: RestSettings | None) -> dict[str, Callable[[], Scheduler]]:
    def pyslurm_factory() -> Scheduler:
        from .pyslurm_backend import PyslurmScheduler
        return PyslurmScheduler()

    def rest_factory() -> Scheduler:
        from .rest_backend import RestScheduler
        return RestScheduler(rest or RestSettings(timeout=runner.timeout), runner)

    return {"rest": rest_factory, "pyslurm": pyslurm_factory,
            "cli": lambda: CliScheduler(runner)}


def probe_all(runner: SlurmRunner | None = None,
              rest: RestSettings | None = None) -> list[Probe]:
    """The viability of every backend, in selection order (for ``recovery-ctl check``)."""
    factories = _factories(runner or SlurmRunner(), rest)
    return [factories[name]().probe() for name in ORDER]


def scheduler_for(cfg: Config) -> Scheduler | None:
    """The backend the config chooses (``scheduler.backend``, its runner
    settings), or None, with the reason logged, when none can run here."""
    runner = SlurmRunner.from_config(cfg.scheduler)
    try:
        return select_scheduler(cfg.scheduler.backend, runner,
                                RestSettings.from_config(cfg.scheduler))
    except RecoveryError as exc:
        log.warning("no scheduler backend: %s", exc)
        return None


def select_scheduler(backend: str = "auto", runner: SlurmRunner | None = None,
                     rest: RestSettings | None = None) -> Scheduler:
    """The backend to use: ``backend`` when named, else the first viable one."""
    factories = _factories(runner or SlurmRunner(), rest)
    if backend != "auto":
        if backend not in factories:
            raise SchedulerUnavailable(
                f"unknown scheduler backend {backend!r}; choose one of: auto, "
                + ", ".join(ORDER))
        chosen = factories[backend]()
        probe = chosen.probe()
        if not probe.viable:
            raise SchedulerUnavailable(f"scheduler backend {backend!r} cannot run: "
                                       f"{probe.reason}")
        return chosen
    reasons = []
    for name in ORDER:
        candidate = factories[name]()
        probe = candidate.probe()
        if probe.viable:
            return candidate
        reasons.append(f"{name}: {probe.reason}")
    raise SchedulerUnavailable("no scheduler backend can run here; " + "; ".join(reasons))
