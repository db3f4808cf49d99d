"""The time a log line says it was written, from the date-time stamp at its
head (pure: the caller passes when it read the line).

A trainer's save line is read by the agent a moment after it was written
(the tailer's poll, up to about a second on the dev cluster); the line's own
stamp is the better time for the goodput ledger, which sets checkpoints
against Slurm's end time (docs/goodput.md). Only a stamp near the start of
the line counts (a logging prefix, not a date inside a message or a path),
and only one that falls where the line can have been written: not after it
was read (beyond a small clock skew), not before the attempt started.

The shapes, each as the emitting software writes it:

* an ISO 8601 time with a zone (``[2026-12-02T10:00:00.123Z]``: the demo
  trainer's ``log()`` in examples/train.py);
* Python logging's default ``asctime``, ``2025-04-01 00:25:59,616`` (CPython
  Lib/logging/__init__.py, ``default_time_format`` and ``default_msec_format``),
  as TorchTitan (pytorch/torchtitan torchtitan/tools/logging.py: ``[titan]
  %(asctime)s - ...``) and DeepSpeed (``[2024-08-15 21:12:21,408] [INFO] ...``)
  print it;
* NeMo's formatter, ``[NeMo I 2025-06-18 22:03:05 nemo_logging:393]``
  (NVIDIA/NeMo nemo/utils/formatters/base.py, date format ``%Y-%m-%d
  %H:%M:%S``), and Megatron-LM's iteration line, `` [2024-07-15 15:26:21]
  iteration ...`` (NVIDIA/Megatron-LM megatron/training/training.py,
  ``training_log``): whole seconds, local time.

A stamp without a zone is read in the agent host's zone (``zone``): the nodes
and the control host of one site keep one zone. A stamp that lands outside
the bounds (another zone, a clock far off) is not used; the caller then keeps
the time it read the line.
"""
from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone, tzinfo

__all__ = ["HEAD", "SKEW", "line_time"]

HEAD = 120     # characters of a line a logging prefix fits in
SKEW = 5.0     # seconds a node's clock may run ahead of the agent's
_STAMP = re.compile(r"(?<!\d)(\d{4})-(\d\d)-(\d\d)[T ](\d\d):(\d\d):(\d\d)(?:[.,](\d{1,9}))?"
                    r"(?: ?(Z|UTC|[+-]\d\d:?\d\d))?(?![\d:])")


def _zone(text: str | None) -> tzinfo | None:
    if not text:
        return None
    if text in ("Z", "UTC"):
        return timezone.utc
    sign = 1 if text[0] == "+" else -1
    digits = text[1:].replace(":", "")
    return timezone(sign * timedelta(hours=int(digits[:2]), minutes=int(digits[2:])))


def line_time(text: str, read_at: float, earliest: float | None = None,
              zone: tzinfo | None = None) -> float | None:
    """When ``text`` says it was written (Unix seconds), or None: no stamp at
    its head, or one after ``read_at`` + :data:`SKEW` or before ``earliest``
    − :data:`SKEW` (the attempt's start). A stamp without a zone is read in
    ``zone`` (None: this host's)."""
    # a stamp holds both: most lines are settled here, before the regex
    if text.find("-", 0, HEAD) < 0 or text.find(":", 0, HEAD) < 0:
        return None
    match = _STAMP.search(text, 0, HEAD)
    if match is None:
        return None
    year, month, day, hour, minute, second, fraction, given = match.groups()
    try:
        when = datetime(int(year), int(month), int(day), int(hour), int(minute), int(second),
                        int((fraction or "0")[:6].ljust(6, "0")))
        found = _zone(given) or zone
        stamp = (when.replace(tzinfo=found) if found else when).timestamp()
    except (ValueError, OverflowError, OSError):
        return None
    if stamp > read_at + SKEW or (earliest is not None and stamp < earliest - SKEW):
        return None
    return stamp
