"""The error hierarchy.

Library code raises these; the edges (click commands, the daemon loop, the
hooks) translate them into exit codes, log lines or HTTP responses.
"""
from __future__ import annotations

from typing import Sequence


class RecoveryError(Exception):
    """Base class for every error slurm-recovery raises on purpose."""


class ConfigError(RecoveryError):
    """The configuration file or an override is invalid. The message names the key."""


class StoreError(RecoveryError):
    """The SQLite store could not be opened, migrated or written."""


class SchedulerUnavailable(RecoveryError):
    """No scheduler backend can run here; the message says why for each one."""


class SchedulerError(RecoveryError):
    """A Slurm command or API call failed.

    Carries the argv that ran (or the API call, rendered as argv-like words), its
    exit code (``None`` when it never finished, e.g. on a timeout) and stderr.
    """

    def __init__(self, message: str, argv: Sequence[str] = (), returncode: int | None = None,
                 stderr: str = "") -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr
        super().__init__(message)

    def __str__(self) -> str:
        text = self.args[0] if self.args else "scheduler error"
        detail = self.stderr.strip().splitlines()
        if detail and detail[-1] not in text:
            text = f"{text}: {detail[-1]}"
        return text


class JobNotFound(SchedulerError):
    """The scheduler does not know the job (never existed, or aged out)."""


class NodeNotFound(SchedulerError):
    """The scheduler does not know the node."""
