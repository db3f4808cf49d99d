"""Durations as Slurm sites write them, for the directive, the config and the CLI.

Accepted (whole seconds; every number at most 8 digits):

    90            a bare number: SECONDS (see below)
    90s 20m 2h 1d one unit
    1h30m 2d4h    several units, largest first, each at most once (d, h, m, s)
    MM:SS         Slurm's --time forms (src/common/parse_time.c, time_str2secs):
    HH:MM:SS        no field is range-checked, so 90:00 is ninety minutes and
    D-HH            0:90 is ninety seconds, as Slurm reads them
    D-HH:MM
    D-HH:MM:SS

A bare number is seconds here, unlike Slurm's ``--time`` where it is minutes:
the directive (``hang=45``) and the config have always read it as seconds, and
reading it as minutes now would silently stretch every such setting sixtyfold.
Write ``45m`` or ``45:00`` for minutes. Slurm's loose readings of empty fields
(``1-``, ``12:``) and its ``-1``/``INFINITE``/``UNLIMITED`` are refused: a
duration here is always a finite number someone typed in full.

The SPANK plugin (spank/slurm_recovery.c, ``parse_duration``) implements the
same rules in C; ``tests/fixtures/spec_cases.json`` holds the cases both must
agree on. Standard library only: the hooks import this.
"""
from __future__ import annotations

import re

_CLOCK = re.compile(r"(?:([0-9]{1,8})-)?([0-9]{1,8})(?::([0-9]{1,8}))?(?::([0-9]{1,8}))?")
_UNITS = (("d", 86400), ("h", 3600), ("m", 60), ("s", 1))
_COMPOUND = re.compile("".join(rf"(?:([0-9]{{1,8}}){u})?" for u, _ in _UNITS))
FORMS = "90s, 20m, 1h30m, 2d4h, MM:SS, HH:MM:SS, D-HH, D-HH:MM[:SS]"


def seconds(text: str) -> int | None:
    """Whole seconds from ``text`` in one of the forms above, or None when it
    is none of them. No whitespace is allowed; zero is a valid result."""
    clock = _CLOCK.fullmatch(text)
    if clock:
        days, *fields = clock.groups()
        given = [int(f) for f in fields if f is not None]
        if days is not None:          # D-HH[:MM[:SS]]
            weights = (3600, 60, 1)
            total = int(days) * 86400
        else:                         # SS, MM:SS, HH:MM:SS
            weights = ((1,), (60, 1), (3600, 60, 1))[len(given) - 1]
            total = 0
        return total + sum(n * w for n, w in zip(given, weights))
    compound = _COMPOUND.fullmatch(text)
    if compound and any(compound.groups()):
        return sum(int(n) * w for n, (_u, w) in zip(compound.groups(), _UNITS) if n)
    return None
