"""``RECOVERY_<SECTION>_<KEY>`` environment overrides: the one rule that the
agent and ``recovery-ctl`` (:func:`recovery_agent.config.loading.apply_env`)
and the node hooks (:func:`slurm_hooks.settings.load`) both apply, so that
``recovery-ctl show config`` run with a hook's environment shows what that hook
does.

* **Name**: ``RECOVERY_`` + section + ``_`` + key, upper case:
  ``hooks.agent_url`` is ``RECOVERY_HOOKS_AGENT_URL``.
* **Value**: the text is read as the same key's value in the file would be, by
  the key's kind: ``str`` as it is; ``int`` an optional minus and digits;
  ``float`` any number Python reads; ``bool`` ``1/true/yes/on`` or
  ``0/false/no/off`` (any case); ``duration`` a number with a unit (``500ms``,
  ``90s``, ``1.5h``), whole units largest first (``1h30m``) or Slurm's clock
  forms (``01:30:00``, ``2-00``), a bare number being seconds.
* **Order**: the file, then the variable. A value the rule cannot read is an
  error naming the variable in the agent; the hooks fail open instead (the
  file's value stays, and the hook log names the variable).

Standard library only: the hooks import this on a job's start path.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from . import durations

PREFIX = "RECOVERY_"
KINDS = ("str", "int", "float", "bool", "duration")
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_NUMBER_UNIT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}


def variable(section: str, key: str) -> str:
    """The environment variable that overrides ``section.key``."""
    return f"{PREFIX}{section}_{key}".upper()


def duration_seconds(text: str) -> float | None:
    """Seconds from a duration as text (see the module's rule), or None."""
    match = _NUMBER_UNIT.match(text)
    if match:
        return float(match.group(1)) * _UNITS[match.group(2)]
    whole = durations.seconds(text.strip())
    return None if whole is None else float(whole)


def parse(kind: str, text: str) -> object:
    """``text`` read as a value of ``kind``; ValueError says what was expected."""
    if kind == "str":
        return text
    if kind == "bool":
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
    elif kind == "int":
        if text.strip().lstrip("-").isdigit():
            return int(text)
    elif kind == "float":
        try:
            return float(text)
        except ValueError:
            pass
    elif kind == "duration":
        seconds = duration_seconds(text)
        if seconds is not None:
            return seconds
        raise ValueError("expected a duration such as 90s, 20m, 1h30m or 01:30:00")
    else:
        raise ValueError(f"unknown kind {kind!r}")
    raise ValueError(f"expected {kind}")


def given(section: str, keys: Iterable[str], environ: Mapping[str, str]
          ) -> list[tuple[str, str, str]]:
    """(key, variable, text) for each of ``section``'s ``keys`` set in ``environ``."""
    found = []
    for key in keys:
        var = variable(section, key)
        if var in environ:
            found.append((key, var, environ[var]))
    return found
