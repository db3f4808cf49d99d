"""Checkpoint progress: the newest checkpoint each attempt of a job produced.

Two witnesses, both cheap:

* the job's ``ckpt=`` path (a directory or a glob):
  :func:`recovery_agent.inputs.checkpoints.newest_checkpoint` stats a bounded
  number of entries, with the job user's rights, and returns the newest
  finished file of theirs (a :class:`CheckpointFound`; which names count is
  :func:`ignored_name`, which entry is the newest :func:`newest_found`);
* the job's log: :class:`CheckpointWatcher` knows how common trainers announce
  a saved checkpoint (Megatron-LM, NeMo/Lightning, DeepSpeed, Hugging Face
  Trainer, TorchTitan and plain ``checkpoint saved: PATH step=N`` lines).

Each attempt keeps its newest :class:`CheckpointRecord`; policy asks
:func:`attempts_without_progress` how many recent attempts saved nothing newer,
for rules such as "stop after K attempts without a new checkpoint". Nothing
here touches the file system.
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field, replace
from typing import Iterable, NamedTuple, Sequence

from .stamps import line_time

__all__ = ["CheckpointFound", "CheckpointRecord", "CheckpointWatcher",
           "attempts_without_progress", "ignored_name", "newest_found", "parse_saved",
           "step_from_path"]

# Names a trainer writes while a save is under way, or leaves behind when one fails.
_TEMP_NAMES = ("*.tmp", "*.temp", "*.part", "*.partial", "*.incomplete", "*.lock",
               "*.swp", "*~", "tmp-*", "tmp_*", "tmp.*")
# Hidden files are skipped, except torch.distributed.checkpoint's ".metadata",
# which is written last and so marks a finished save.
_HIDDEN_KEPT = frozenset({".metadata"})


class CheckpointFound(NamedTuple):
    """The newest finished file under a ckpt path, and its modification time."""

    path: str
    mtime: float


def ignored_name(name: str) -> bool:
    """Whether a directory entry's ``name`` is skipped, with everything below it:
    a temporary name (a save under way or failed) or a hidden one."""
    if name.startswith("."):
        return name not in _HIDDEN_KEPT
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in _TEMP_NAMES)


def newest_found(candidates: Iterable[CheckpointFound | None]) -> CheckpointFound | None:
    """The newest of ``candidates`` by mtime (the first seen among equals);
    None entries (nothing found there) are passed over."""
    best: CheckpointFound | None = None
    for found in candidates:
        if found and (best is None or found.mtime > best.mtime):
            best = found
    return best


# ------------------------------------------------------------ log wordings

_STEP_IN_PATH = re.compile(r"(?:global_step|checkpoint-|iter_|iteration[-_]|step[-_=]?)(\d+)",
                           re.IGNORECASE)
_STEP_IN_LINE = re.compile(r"\b(?:global[_ ]step|step|iteration|iter)\b\s*[=:]?\s*(\d+)",
                           re.IGNORECASE)
_PATH = r"""['"]?(?P<path>/[^\s'",\]\[]+|[A-Za-z0-9_.-]+/[^\s'",\]\[]+)['"]?"""
_FAILED = re.compile(r"\b(?:fail(?:ed|ure)?|error|unable|could not|cannot|can't|not saved)\b",
                     re.IGNORECASE)

# (name, regex). Named groups: path, step. Checked in order; the first wins.
_SAVED = tuple((name, re.compile(rx, re.IGNORECASE)) for name, rx in (
    # Megatron-LM: "successfully saved checkpoint from iteration    2000 to /ckpt/gpt
    # [ t 1/2, p 1/1 ]"
    ("megatron", r"successfully saved checkpoint (?:from|at) iteration\s+(?P<step>\d+)\s+to\s+"
                 + _PATH),
    # Lightning ModelCheckpoint (NeMo too): "Epoch 2, global step 900: 'val_loss' reached
    # 1.23 (best 1.23), saving model to "/ckpt/epoch=2-step=900.ckpt" as top 1"
    ("lightning", r"\bEpoch \d+, global step (?P<step>\d+):.*?\bsaving model to\s+" + _PATH),
    # NeMo async save: "Async checkpoint save for step 900 (/ckpt/x.ckpt) finalized successfully."
    ("nemo", r"checkpoint save for step (?P<step>\d+) \((?P<path>[^)]+)\) finalized"),
    # DeepSpeed: "[Torch] Checkpoint global_step900 is ready now!"
    ("deepspeed", r"\bCheckpoint (?P<path>\S*?global_step(?P<step>\d+)\S*) is ready now"),
    # DeepSpeed: "Saving model checkpoint: /ckpt/global_step900/mp_rank_00_model_states.pt";
    # Hugging Face Trainer: "Saving model checkpoint to /out/checkpoint-900"
    ("hf_or_deepspeed", r"\bSaving model checkpoint(?: to|:)\s+" + _PATH),
    # TorchTitan: "Saving a full checkpoint at last step, step 900." / "Finished saving
    # the checkpoint (or staging if async is enabled)in 2.31 seconds."
    ("torchtitan", r"\bSaving (?:a |the )?(?:full |model[- ]weights[- ]only )?checkpoint "
                   r"at (?:last )?step,? step (?P<step>\d+)"),
    ("torchtitan", r"\bFinished saving the checkpoint\b"),
    # NeMo/Lightning and others: "Saving checkpoint to /ckpt/last.ckpt", "Saving checkpoint: PATH"
    ("generic", r"\bSaving (?:the |a |latest )?checkpoint(?: to|:)\s+" + _PATH),
    # generic, and examples/train.py: "checkpoint saved: /ckpt/step-000050.json step=50",
    # "saved checkpoint to PATH", "checkpoint written to PATH", "checkpoint saved"
    ("generic", r"\b(?:checkpoint (?:saved|written|stored)|(?:saved|wrote) (?:a |the )?"
                r"checkpoint)\b(?:\s*(?:to|at|in|:)\s*" + _PATH + ")?"),
))


@dataclass(frozen=True)
class CheckpointRecord:
    """A checkpoint an attempt produced: path and step when known, and when
    (the save line's own stamp, else the time the agent read it; or the file's
    mtime). ``source`` is ``log:<wording>`` or ``ckpt`` (found under the ckpt=
    path); ``clock`` says where ``time`` came from: ``line`` (the stamp),
    ``read`` (the agent's reading) or ``file`` (the mtime)."""

    path: str | None
    step: int | None
    time: float
    source: str = ""
    clock: str = field(default="", compare=False)

    def newer_than(self, other: "CheckpointRecord | None") -> bool:
        """Whether this checkpoint is progress over ``other``: a higher step
        when both steps are known, else a later time."""
        if other is None:
            return True
        if self.step is not None and other.step is not None:
            return self.step > other.step
        return self.time > other.time


def step_from_path(path: str | None) -> int | None:
    """The step a checkpoint's name carries (``global_step900``, ``checkpoint-900``,
    ``iter_0000900``, ``epoch=2-step=900.ckpt``, ``step-000900.json``), if any."""
    if not path:
        return None
    found = _STEP_IN_PATH.findall(path)
    return int(found[-1]) if found else None


def parse_saved(line: str) -> tuple[str, str | None, int | None] | None:
    """``(wording, path, step)`` when ``line`` says a checkpoint was saved."""
    low = line.lower()
    if "checkpoint" not in low and "saving model" not in low:
        return None
    if _FAILED.search(line):
        return None
    for name, pattern in _SAVED:
        match = pattern.search(line)
        if not match:
            continue
        groups = match.groupdict()
        path = (groups.get("path") or "").strip("'\"").rstrip(".") or None
        step = groups.get("step")
        if step is None:
            found = _STEP_IN_LINE.search(line[match.start():]) or _STEP_IN_LINE.search(line)
            step = found.group(1) if found else None
        return name, path, int(step) if step is not None else step_from_path(path)
    return None


class CheckpointWatcher:
    """The newest checkpoint one attempt has produced, from log lines and scans."""

    def __init__(self) -> None:
        self.newest: CheckpointRecord | None = None

    def _keep(self, record: CheckpointRecord) -> None:
        old = self.newest
        if old is not None and record.step is None and old.step is not None \
                and record.path and old.path and record.path.startswith(old.path):
            record = replace(record, step=old.step)  # a scan of the save just logged
        if old is None or record.newer_than(old) or (
                record.step is None and old.step is None and record.time >= old.time):
            self.newest = record

    def feed(self, time: float, line: str, started: float | None = None
             ) -> CheckpointRecord | None:
        """Take one log line read at ``time``; the record when it announced a
        save, dated by the line's own stamp where it carries one that fits
        (:func:`~recovery_agent.detect.stamps.line_time`, not before the
        attempt ``started``), else by ``time``."""
        saved = parse_saved(line)
        if saved is None:
            return None
        name, path, step = saved
        stamped = line_time(line, time, started)
        record = CheckpointRecord(path, step, time if stamped is None else stamped,
                                  f"log:{name}", "read" if stamped is None else "line")
        self._keep(record)
        return record

    def observe(self, found: CheckpointFound | None, started: float | None = None
                ) -> CheckpointRecord | None:
        """Take the result of
        :func:`~recovery_agent.inputs.checkpoints.newest_checkpoint`. Files older
        than the attempt's start (``started``) were written by an earlier attempt
        and are not this attempt's progress."""
        if found is None or (started is not None and found.mtime < started):
            return None
        record = CheckpointRecord(found.path, step_from_path(found.path), found.mtime, "ckpt",
                                  "file")
        self._keep(record)
        return record


def attempts_without_progress(attempt_ckpts: Sequence[CheckpointRecord | None]) -> int:
    """How many of the most recent attempts produced no checkpoint newer than
    every attempt before them. ``attempt_ckpts`` holds each attempt's newest
    checkpoint, oldest attempt first (None: it saved nothing).

    ``[a(step 100), b(step 200)]`` -> 0; ``[a(step 100), None, a(step 100)]`` -> 2;
    ``[None, None]`` -> 2.
    """
    best: CheckpointRecord | None = None
    streak = 0
    for record in attempt_ckpts:
        if record is not None and record.newer_than(best):
            best, streak = record, 0
        else:
            streak += 1
    return streak
