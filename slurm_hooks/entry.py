"""Entry points for Slurm's Prolog, Epilog and HealthCheckProgram.

A job that did not opt in costs one environment lookup: this module imports
only ``os`` and ``sys`` before deciding. Everything after that is wrapped so
that a hook fails open (exit 0) whatever happens, except a deliberate
preflight verdict in ``enforce`` mode.
"""
from __future__ import annotations

import os
import sys

_SPANK_ENV = "SPANK__SLURM_SPANK_OPTION_slurm_recovery_recovery"


def opted_in(environ=os.environ) -> bool:
    """True when the job asked for recovery (SPANK option, or the comment form)."""
    if _SPANK_ENV in environ or "SLURM_RECOVERY" in environ:
        return True
    return "recovery=" in environ.get("SLURM_JOB_COMMENT", "")


def _run(hook: str) -> int:
    if hook != "health" and not opted_in():
        return 0
    try:
        from .report import run_hook
        return run_hook(hook, os.environ)
    except Exception as exc:  # noqa: BLE001 - a hook must never fail a job by accident
        try:
            sys.stderr.write(f"slurm-recovery {hook}: internal error, ignored: {exc!r}\n")
        except OSError:
            pass
        return 0


def prolog() -> int:
    return _end(_run("prolog"))


def epilog() -> int:
    return _end(_run("epilog"))


def healthcheck() -> int:
    return _end(_run("health"))


def _end(code: int) -> int:
    """End the hook's process now, with ``code``. Everything it wrote is on
    disk or sent by then (the report delivered or spooled); what is left is
    the interpreter's own teardown, which costs a hook tens of milliseconds
    (more with NVML loaded) on every job start and end. So the log handlers
    and the standard streams are flushed, and the process exits without it.
    A replayer the epilog started runs on in its own session."""
    logging = sys.modules.get("logging")
    try:
        if logging is not None:
            logging.shutdown()
    except Exception:  # noqa: BLE001 - the exit code matters more than a log line
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(code)
