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
    return _run("prolog")


def epilog() -> int:
    return _run("epilog")


def healthcheck() -> int:
    return _run("health")
