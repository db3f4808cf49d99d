"""The ``[hooks]`` section of recovery.toml, read the cheap way.

The hooks sit on every opted-in job's start path, and building the agent's
full config model costs more than the rest of a hook's imports together. So
they read their one section here, with the same defaults (a unit test compares
them with ``recovery_agent.config.HooksConfig``), and fail open: a value of the
wrong type is logged and replaced by its default, never fatal. The agent and
``recovery-ctl check`` validate the same file strictly.
"""
from __future__ import annotations

import os
import re

from . import durations

DEFAULT_PATH = "/etc/slurm-recovery/recovery.toml"
DEFAULTS: dict[str, object] = {
    "agent_url": "http://127.0.0.1:8787",
    "timeout": 0.5,
    "spool_dir": "/var/spool/slurm-recovery",
    "log_file": "/var/log/slurm-recovery/hooks.log",
    "kernel_log": "journal",
    "xid_window": 600.0,
    "nvml_library": "",
    "gpu_state_file": "",
    "expected_gpus": 0,
    "preflight": "report",
    "munge_socket": "",
}
DURATIONS = frozenset({"timeout", "xid_window"})
CHOICES = {"preflight": ("off", "report", "enforce")}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}


class Settings:
    """Attribute access to the hooks' settings; ``problems`` lists what was
    wrong in the file (each already replaced by its default)."""

    def __init__(self, values: dict[str, object], problems: list[str], source: str) -> None:
        self.__dict__.update(values)
        self.problems = problems
        self.source = source


def _duration(value: object) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value) if value >= 0 else None
    match = _DURATION.match(str(value))
    if match:
        return float(match.group(1)) * _UNITS[match.group(2)]
    whole = durations.seconds(str(value).strip())   # 1h30m, 01:30:00, 2-00
    return None if whole is None else float(whole)


def _coerce(key: str, value: object) -> object | None:
    """The value as the default's type, or None when it cannot be."""
    if key in DURATIONS:
        return _duration(value)
    default = DEFAULTS[key]
    if isinstance(default, int) and not isinstance(default, bool):
        return value if isinstance(value, int) and not isinstance(value, bool) else None
    if isinstance(value, str) and (key not in CHOICES or value in CHOICES[key]):
        return value
    return None


def load(environ=os.environ) -> Settings:
    path = environ.get("RECOVERY_CONFIG") or DEFAULT_PATH
    values, problems = dict(DEFAULTS), []
    try:
        import tomllib
        with open(path, "rb") as fh:
            section = tomllib.load(fh).get("hooks", {})
    except FileNotFoundError:
        return Settings(values, [f"{path}: not found, using defaults"], path)
    except Exception as exc:  # noqa: BLE001 - unreadable or invalid TOML: fail open
        return Settings(values, [f"{path}: unreadable ({exc}), using defaults"], path)
    if not isinstance(section, dict):
        return Settings(values, [f"{path}: [hooks] is not a table"], path)
    for key, value in section.items():
        if key not in DEFAULTS:
            problems.append(f"hooks.{key}: unknown key, ignored")
            continue
        coerced = _coerce(key, value)
        if coerced is None:
            problems.append(f"hooks.{key}: bad value {value!r}, using {DEFAULTS[key]!r}")
        else:
            values[key] = coerced
    return Settings(values, problems, path)
