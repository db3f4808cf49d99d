"""The ``[hooks]`` section of recovery.toml, read the cheap way.

The hooks sit on every opted-in job's start path, and building the agent's
full config model costs more than the rest of a hook's imports together. So
they read their one section here, with the same defaults (a unit test compares
them with ``recovery_agent.config.HooksConfig``), and fail open: a value of the
wrong type is logged and replaced by its default, never fatal. The agent and
``recovery-ctl check`` validate the same file strictly.

``RECOVERY_HOOKS_<KEY>`` variables override the file by the rule the agent
applies too (:mod:`slurm_hooks.overrides`); one the rule cannot read is logged
and the file's value stays.
"""
from __future__ import annotations

import os

from . import overrides

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
    return overrides.duration_seconds(str(value))   # 90s, 500ms, 1h30m, 01:30:00, 2-00


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


def _kind(key: str) -> str:
    """The key's kind in the override rule (:mod:`slurm_hooks.overrides`)."""
    if key in DURATIONS:
        return "duration"
    return "int" if isinstance(DEFAULTS[key], int) else "str"


def _from_file(path: str, values: dict[str, object], problems: list[str]) -> None:
    """The file's ``[hooks]`` into ``values``; what is wrong into ``problems``."""
    try:
        import tomllib
        with open(path, "rb") as fh:
            section = tomllib.load(fh).get("hooks", {})
    except FileNotFoundError:
        problems.append(f"{path}: not found, using defaults")
        return
    except Exception as exc:  # noqa: BLE001 - unreadable or invalid TOML: fail open
        problems.append(f"{path}: unreadable ({exc}), using defaults")
        return
    if not isinstance(section, dict):
        problems.append(f"{path}: [hooks] is not a table")
        return
    for key, value in section.items():
        if key not in DEFAULTS:
            problems.append(f"hooks.{key}: unknown key, ignored")
            continue
        coerced = _coerce(key, value)
        if coerced is None:
            problems.append(f"hooks.{key}: bad value {value!r}, using {DEFAULTS[key]!r}")
        else:
            values[key] = coerced


def _from_environ(environ, values: dict[str, object], problems: list[str]) -> None:
    """``RECOVERY_HOOKS_<KEY>`` over the file's values, as the agent applies them."""
    for key, var, text in overrides.given("hooks", DEFAULTS, environ):
        try:
            value = overrides.parse(_kind(key), text)
        except ValueError as exc:
            problems.append(f"{var}: {exc}, got {text!r}; using {values[key]!r}")
            continue
        if key in CHOICES and value not in CHOICES[key]:
            problems.append(f"{var}: must be one of {', '.join(CHOICES[key])}, got {text!r}; "
                            f"using {values[key]!r}")
        else:
            values[key] = value


def load(environ=os.environ) -> Settings:
    path = environ.get("RECOVERY_CONFIG") or DEFAULT_PATH
    values, problems = dict(DEFAULTS), []
    _from_file(path, values, problems)
    _from_environ(environ, values, problems)
    return Settings(values, problems, path)
