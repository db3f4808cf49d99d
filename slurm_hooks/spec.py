"""The ``--recovery`` directive: one parser for the hooks, the agent and the
``--comment=recovery=...`` fallback. The SPANK plugin (spank/) applies the same
rules in C; ``tests/fixtures/spec_cases.json`` holds the cases both must agree on.

Grammar::

    SPEC  := [HEAD] ("," KEY "=" VALUE)*      at most 512 characters
    HEAD  := ENV [":" MODE] | ":" MODE
    ENV   := [A-Za-z0-9_-]{1,64}
    MODE  := monitor | action
    KEY   := max-restarts (0-1000) | hang (a duration: durations.py; a bare number is
           seconds) | ckpt (absolute path or glob)
           | notify (none, mail, http(s) URL)
           | ckpt-signal ([B:]USR1, [B:]USR2, [B:]TERM or none) | proactive (yes, no)

A spec whose first part holds "=" has no head (``max-restarts=3``). Empty parts,
unknown or repeated keys, and characters outside each part's alphabet are refused
with a message naming the bad part. Standard library only: this sits on the
start path of every job.
"""
from __future__ import annotations

import re

from . import durations

MAX_LENGTH = 512
DEFAULT_ENV = "default"
MODES = ("monitor", "action")
MAX_HANG = 365 * 86400   # so the canonical seconds always parse again
KEYS = ("max-restarts", "hang", "ckpt", "notify", "ckpt-signal", "proactive")
# The signals a job may name as its checkpoint convention; "B:" sends it to the
# batch shell only, as Slurm's own --signal=B:SIG does (scancel --batch).
CKPT_SIGNALS = ("USR1", "USR2", "TERM")
SPANK_ENV = "SPANK__SLURM_SPANK_OPTION_slurm_recovery_recovery"
JOB_ENV = "SLURM_RECOVERY"

_ENV = re.compile(r"[A-Za-z0-9_-]{1,64}")
_RESTARTS = re.compile(r"[0-9]{1,4}")
_CKPT = re.compile(r"/[A-Za-z0-9_./@+*?{}\[\]-]{0,255}")
_URL = re.compile(r"https?://[A-Za-z0-9._~:/?#@!*+=%-]{1,400}")
_CKPT_SIGNAL = re.compile(r"(?:B:)?(?:USR1|USR2|TERM)|none")
_COMMENT = re.compile(r"(?:^|[\s;])recovery=(\S*)")


class SpecError(ValueError):
    """The directive is invalid; the message names the bad part."""


class RecoverySpec:
    """A parsed directive. ``mode`` is None when the job did not choose one
    (the environment's mode then applies); ``hang`` is in seconds. A plain
    class, not a dataclass: importing dataclasses costs a hook ~15 ms."""

    __slots__ = ("env", "mode", "max_restarts", "hang", "ckpt", "notify", "ckpt_signal",
                 "proactive")

    def __init__(self, env: str = DEFAULT_ENV, mode: str | None = None,
                 max_restarts: int | None = None, hang: int | None = None,
                 ckpt: str | None = None, notify: str | None = None,
                 ckpt_signal: str | None = None, proactive: bool | None = None) -> None:
        self.env, self.mode, self.max_restarts = env, mode, max_restarts
        self.hang, self.ckpt, self.notify = hang, ckpt, notify
        # ckpt_signal: None (not given: the job's own --signal applies), "none",
        # or "USR1"/"B:USR1"...; proactive: None (not given), True or False
        self.ckpt_signal, self.proactive = ckpt_signal, proactive

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RecoverySpec) and self.as_dict() == other.as_dict()

    def __hash__(self) -> int:
        return hash(tuple(self.as_dict().values()))

    def __repr__(self) -> str:
        return f"RecoverySpec({self.canonical()!r})"

    def canonical(self) -> str:
        """The spec in its one normal form, as stored and exported."""
        head = self.env + (f":{self.mode}" if self.mode else "")
        parts = [head]
        if self.max_restarts is not None:
            parts.append(f"max-restarts={self.max_restarts}")
        if self.hang is not None:
            parts.append(f"hang={self.hang}s")
        if self.ckpt is not None:
            parts.append(f"ckpt={self.ckpt}")
        if self.notify is not None:
            parts.append(f"notify={self.notify}")
        if self.ckpt_signal is not None:
            parts.append(f"ckpt-signal={self.ckpt_signal}")
        if self.proactive is not None:
            parts.append(f"proactive={'yes' if self.proactive else 'no'}")
        return ",".join(parts)

    def as_dict(self) -> dict:
        return {"env": self.env, "mode": self.mode, "max_restarts": self.max_restarts,
                "hang": self.hang, "ckpt": self.ckpt, "notify": self.notify,
                "ckpt_signal": self.ckpt_signal, "proactive": self.proactive}


def _show(text: str) -> str:
    """A bad part, quoted and cut short so an error stays one line."""
    shown = text if len(text) <= 40 else text[:37] + "..."
    return repr(shown)


def parse(text: str | None, default_env: str = DEFAULT_ENV,
          default_mode: str | None = None) -> RecoverySpec:
    """Parse a directive; raise SpecError naming the bad part."""
    text = "" if text in (None, "(null)") else text
    if len(text) > MAX_LENGTH:
        raise SpecError(f"spec is {len(text)} characters long (at most {MAX_LENGTH})")
    for ch in text:
        if not (" " < ch <= "~"):
            raise SpecError(f"invalid character {ch!r} in spec")
    if not text:
        return RecoverySpec(env=default_env, mode=default_mode)
    parts = text.split(",")
    if any(p == "" for p in parts):
        raise SpecError("empty part in spec (check for doubled or trailing commas)")
    head, rest = ("", parts) if "=" in parts[0] else (parts[0], parts[1:])
    env, mode = _parse_head(head, default_env, default_mode)
    values: dict[str, object] = {}
    for part in rest:
        key, sep, value = part.partition("=")
        if not sep:
            raise SpecError(f"expected key=value, got {_show(part)}")
        if key not in KEYS:
            raise SpecError(f"unknown key {_show(key)} (known: {', '.join(KEYS)})")
        if key in values:
            raise SpecError(f"key {key!r} given twice")
        values[key] = _parse_value(key, value)
    return RecoverySpec(env=env, mode=mode, max_restarts=values.get("max-restarts"),
                        hang=values.get("hang"), ckpt=values.get("ckpt"),
                        notify=values.get("notify"), ckpt_signal=values.get("ckpt-signal"),
                        proactive=values.get("proactive"))


def _parse_head(head: str, default_env: str, default_mode: str | None) -> tuple[str, str | None]:
    env, sep, mode = head.partition(":")
    if sep and not mode:
        raise SpecError("empty mode after ':' (expected monitor or action)")
    if env and not _ENV.fullmatch(env):
        raise SpecError(f"invalid environment {_show(env)} (letters, digits, _ and -, "
                        f"at most 64)")
    if sep and mode not in MODES:
        raise SpecError(f"invalid mode {_show(mode)} (expected monitor or action)")
    return env or default_env, (mode if sep else default_mode)


def _parse_value(key: str, value: str) -> object:
    if value == "":
        raise SpecError(f"empty value for {key}")
    if key == "max-restarts":
        if not _RESTARTS.fullmatch(value) or int(value) > 1000:
            raise SpecError(f"invalid max-restarts {_show(value)} (an integer 0-1000)")
        return int(value)
    if key == "hang":
        hang = durations.seconds(value)
        if not hang or hang > MAX_HANG:
            raise SpecError(f"invalid hang {_show(value)} (a duration such as 90s, 20m, "
                            f"1h30m, 01:30:00; at most 365d)")
        return hang
    if key == "ckpt":
        if not value.startswith("/"):
            raise SpecError(f"invalid ckpt {_show(value)} (an absolute path)")
        if not _CKPT.fullmatch(value):
            raise SpecError(f"invalid ckpt {_show(value)} (path has a character outside "
                            f"letters, digits and _ . / @ + * ? {{ }} [ ] -)")
        return value
    if key == "ckpt-signal":
        if not _CKPT_SIGNAL.fullmatch(value):
            raise SpecError(f"invalid ckpt-signal {_show(value)} (USR1, USR2, TERM, each "
                            f"optionally B: for the batch shell only, or none)")
        return value
    if key == "proactive":
        if value not in ("yes", "no"):
            raise SpecError(f"invalid proactive {_show(value)} (yes or no)")
        return value == "yes"
    if value in ("none", "mail") or _URL.fullmatch(value):
        return value
    raise SpecError(f"invalid notify {_show(value)} (none, mail, or an http(s) URL)")


def from_comment(comment: str | None) -> str | None:
    """The spec inside a ``--comment`` (``recovery=prod:action,...``), or None."""
    if not comment:
        return None
    match = _COMMENT.search(comment)
    return match.group(1) if match else None


def from_environ(environ) -> tuple[str | None, str]:
    """(raw spec, where it came from) for a hook or job environment; (None, "")
    when the job did not opt in. The SPANK option wins over the comment."""
    for var in (SPANK_ENV, JOB_ENV):
        if var in environ:
            return environ[var], var
    spec = from_comment(environ.get("SLURM_JOB_COMMENT"))
    if spec is not None:
        return spec, "SLURM_JOB_COMMENT"
    return None, ""
