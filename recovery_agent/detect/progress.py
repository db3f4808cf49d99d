"""Hangs and stragglers, judged from a job's log lines alone.

Pure logic: the caller feeds ``(time, line)`` events from the log sources and
asks ``check(now, ...)``; nothing here reads files or clocks, so every decision
can be replayed in a test with explicit times.

* :class:`HangDetector` (one per job attempt): a RUNNING job that shows no
  progress for its hang duration is hung. Category ``nccl_timeout_hang``: a
  training job that goes silent is, far more often than not, blocked in a
  collective whose peer died or stalled.
* :class:`StragglerDetector`: per-rank step times from common log shapes; a rank
  whose median step time exceeds the median of the other ranks by a factor is a
  straggler. Category ``interconnect``: the job is healthy, one node is slow, and
  a slow rank in a synchronous job most often means a degraded link (an IB port
  running at reduced width or rate, NVLink lanes down, PCIe fallback); a
  throttled or faulty GPU shows up in the node reports, which attribution weighs
  alongside. Severity ``warning`` and action hint ``none``: a straggler costs
  throughput, not the job, so acting on it is the policy's call.
* :func:`rank_host_map`: which host each rank ran on, learned from the log or
  laid out the way Slurm distributes tasks by default.
"""
from __future__ import annotations

import re
import statistics
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

from ..config import DEFAULT_PROGRESS_PATTERN
from .model import Detection, Evidence

if TYPE_CHECKING:
    from slurm_hooks.spec import RecoverySpec

    from ..config import EnvironmentConfig

__all__ = ["DEFAULT_PROGRESS_PATTERN", "HangDetector", "StepSample", "StragglerDetector",
           "hang_seconds", "parse_step_time", "rank_host_map", "rank_of", "host_of"]

EVIDENCE_CHARS = 500   # evidence keeps the head of a line; megabyte lines stay out


def _clip(line: str) -> str:
    line = line.rstrip("\r\n")
    return line if len(line) <= EVIDENCE_CHARS else line[:EVIDENCE_CHARS] + "..."


def _span(seconds: float) -> str:
    """``3725`` -> ``1h02m05s``: durations as people read them in a detail."""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


# --------------------------------------------------------------------- hangs

def hang_seconds(spec: "RecoverySpec | None", env: "EnvironmentConfig") -> float:
    """The job's hang duration: its own ``hang=``, else its environment's (0 = off)."""
    if spec is not None and spec.hang is not None:
        return float(spec.hang)
    return float(env.hang)


class HangDetector:
    """Decides when one attempt of a job has stopped making progress.

    The clock starts at the attempt's start, so a job silent from the outset is
    hung once the window passes, and never before. Progress is any output when
    ``progress_pattern`` is empty. With a pattern, output counts as progress
    until the first matching line; from then on only matching lines do, so a job
    that stops advancing but keeps printing warnings is still caught, while a job
    whose progress lines the pattern does not know is judged by its output
    (``require_match=True`` counts only matching lines from the start).

    The clock also restarts whenever the job is seen not running (suspended,
    requeued, completing): only RUNNING time counts. One silence gives one
    detection; the next needs progress first.
    """

    def __init__(self, hang: float, started: float, progress_pattern: str = "",
                 source: str = "", require_match: bool = False) -> None:
        self.hang = float(hang)
        self.started = float(started)
        self.source = source
        self.require_match = require_match
        self._pattern = re.compile(progress_pattern) if progress_pattern else None
        self._matched = False           # has the pattern matched any line yet?
        self._clock = self.started      # silence is measured from here
        self._last: Evidence | None = None         # the last progress line
        self._last_output: Evidence | None = None  # the last line of any kind
        self._fired = False

    @classmethod
    def for_attempt(cls, spec: "RecoverySpec | None", env: "EnvironmentConfig",
                    started: float, source: str = "") -> "HangDetector":
        """A detector set up from the job's directive and its environment."""
        return cls(hang_seconds(spec, env), started, env.progress_pattern, source)

    @property
    def enabled(self) -> bool:
        return self.hang > 0

    def is_progress(self, line: str) -> bool:
        """Whether ``line`` counts as progress (and learn that the pattern fits)."""
        if self._pattern is None:
            return True
        if self._pattern.search(line):
            self._matched = True
            return True
        return not (self._matched or self.require_match)

    def feed(self, time: float, line: str, source: str = "",
             lineno: int | None = None) -> bool:
        """Take one log line; True when it counted as progress."""
        seen = Evidence(_clip(line), source or self.source, lineno, time)
        self._last_output = seen
        if not self.is_progress(line):
            return False
        self._last = seen
        if time > self._clock:
            self._clock = time
            self._fired = False
        return True

    def due(self) -> float | None:
        """When the present silence fills the window (the clock's time), so a
        check then finds the hang; None when none can fire (off, or this
        silence has had its detection)."""
        if not self.enabled or self._fired:
            return None
        return self._clock + self.hang

    def check(self, now: float, running: bool) -> Detection | None:
        """A ``hang`` detection when the job has been RUNNING and silent for the
        whole window; None otherwise, and None again for the same silence."""
        if not running:
            self._clock = max(self._clock, now)
            return None
        if not self.enabled or self._fired:
            return None
        silent = now - self._clock
        if silent < self.hang:
            return None
        self._fired = True
        return self._detection(now, silent)

    def _detection(self, now: float, silent: float) -> Detection:
        evidence = tuple(e for e in (self._last,) if e is not None)
        out = self._last_output
        if out is not None and out is not self._last:
            evidence += (out,)
        if self._last is None:
            since = "no progress since the attempt started"
        else:
            since = f"last progress {_span(now - (self._last.time or now))} ago"
        kind = "progress" if self._pattern is not None else "output"
        detail = (f"no {kind} for {_span(silent)} while running (hang={_span(self.hang)}); "
                  f"{since}")
        return Detection(rule="hang", category="nccl_timeout_hang", severity="error",
                         action_hint="kill_requeue", evidence=evidence, detail=detail)


# ------------------------------------------------------------ ranks and hosts

# "[rank3]", "rank=3", "Rank 3:", "global_rank 11", "RANK=3", "SLURM_PROCID=3";
# local_rank/group_rank never match (no word boundary before "rank").
_RANK = re.compile(
    r"\[\s*rank\s*(\d+)\s*\]"
    r"|\b(?:global[_ ]rank|rank|SLURM_PROCID|OMPI_COMM_WORLD_RANK|PMIX_RANK|PMI_RANK)\b"
    r"\s*[=:]?\s*(\d+)", re.IGNORECASE)
# srun --label puts the task id first: "  3: ...".
_SRUN_LABEL = re.compile(r"^\s*(\d{1,6}): ")
# "host gpu07", "hostname=gpu07", "node: gpu07", "SLURMD_NODENAME=gpu07".
_HOST = re.compile(
    r"\b(?:host(?:name)?|node(?:name)?|SLURMD_NODENAME|SLURM_TOPOLOGY_ADDR)\b"
    r"\s*[=:]?\s*[\"']?([A-Za-z][A-Za-z0-9._-]*)", re.IGNORECASE)
# "rank 3/16 gpu07": rank, world size and host in a row (examples/train.py's prefix).
_RANK_WORLD_HOST = re.compile(r"\brank\s+(\d+)\s*/\s*(\d+)(?:\s+([A-Za-z][A-Za-z0-9._-]*))?",
                              re.IGNORECASE)
_WORLD = re.compile(r"\b(?:world[_ ]size|SLURM_NTASKS|SLURM_NPROCS)\b\s*[=:]?\s*(\d+)",
                    re.IGNORECASE)


def _folded(line: str) -> str:
    """``line`` case-folded for a cheap test before a case-blind regex: a
    line the regex can match holds the regex's literal words in this form.
    (``re.IGNORECASE`` also takes the dotted and the dotless capital and small
    I for ``i``, which folding leaves apart: they become ``i`` here.)"""
    low = line.casefold()
    if not low.isascii():
        low = low.replace("i\u0307", "i").replace("\u0131", "i")
    return low


def rank_of(line: str) -> int | None:
    """The global rank a line names, else the srun task label it starts with."""
    match = _RANK.search(line)
    if match:
        return int(match.group(1) or match.group(2))
    match = _SRUN_LABEL.match(line)
    return int(match.group(1)) if match else None


def _known_host(name: str, nodes: Iterable[str]) -> str | None:
    name = name.rstrip(".-_")
    known = set(nodes)
    if name in known:
        return name
    short = name.split(".", 1)[0]
    if short in known:
        return short
    # Unknown names must look like hosts (a digit), so "node index" is no host.
    return name if any(ch.isdigit() for ch in name) else None


def host_of(line: str, nodes: Iterable[str] = ()) -> str | None:
    """The host a line names, if any. ``nodes`` (the job's node list) lets
    digitless names through and maps ``gpu07.cluster`` to ``gpu07``."""
    nodes = tuple(nodes)
    low = _folded(line)
    # _HOST's words all hold "host", "node" or "topology_addr"; _RANK_WORLD_HOST's "rank"
    if "host" in low or "node" in low or "topology_addr" in low:
        for match in _HOST.finditer(line):
            host = _known_host(match.group(1), nodes)
            if host:
                return host
    if "rank" not in low:
        return None
    match = _RANK_WORLD_HOST.search(line)
    if match and match.group(3):
        return _known_host(match.group(3), nodes)
    return None


def _block_layout(ntasks: int, nodes: Sequence[str]) -> dict[int, str]:
    """Slurm's default block distribution: as even as possible, the first
    nodes taking one extra task each while the remainder lasts."""
    if not nodes or ntasks <= 0:
        return {}
    base, extra = divmod(ntasks, len(nodes))
    out, rank = {}, 0
    for index, node in enumerate(nodes):
        for _ in range(base + (1 if index < extra else 0)):
            out[rank] = node
            rank += 1
    return out


def _cyclic_layout(ntasks: int, nodes: Sequence[str]) -> dict[int, str]:
    return {rank: nodes[rank % len(nodes)] for rank in range(ntasks)} if nodes else {}


class _TorchrunBlock:
    """torchrun's "Rank assignment" block: ``group_rank=G`` and, a few lines on,
    ``global_ranks=[...]``. Group G is taken as the job's G-th node (one torchrun
    per node started by srun with ``--node_rank=$SLURM_NODEID``)."""

    _GROUP = re.compile(r"\bgroup_rank\s*[=:]\s*(\d+)")
    _RANKS = re.compile(r"\bglobal_ranks\s*[=:]\s*\[([\d,\s]*)\]")

    def __init__(self) -> None:
        self.group: int | None = None

    def feed(self, line: str, nodes: Sequence[str]) -> dict[int, str]:
        match = self._GROUP.search(line)
        if match:
            self.group = int(match.group(1))
        match = self._RANKS.search(line)
        if not match or self.group is None or self.group >= len(nodes):
            return {}
        ranks = [int(r) for r in match.group(1).replace(",", " ").split()]
        host, self.group = nodes[self.group], None
        return {rank: host for rank in ranks}


def rank_host_map(lines: Iterable[str], nodes: Sequence[str],
                  ntasks: int | None = None) -> dict[int, str]:
    """rank -> host for a job, from its log lines and its (expanded) node list.

    Learned from lines naming both a rank and a host (``[rank3]: ... host gpu07``,
    ``SLURM_PROCID=3 SLURMD_NODENAME=gpu07``, ``rank 3/16 gpu07``) and from
    torchrun's rank-assignment blocks. Ranks left over are placed the way Slurm
    lays out tasks by default (block; cyclic when the learned pairs say so) over
    ``ntasks`` tasks: given, else the world size the log names, else one per node.
    Left unmapped when the learned pairs fit neither layout.
    """
    nodes = tuple(nodes)
    learned: dict[int, str] = {}
    world = 0
    torchrun = _TorchrunBlock()
    for line in lines:
        learned.update(torchrun.feed(line, nodes))
        match = _WORLD.search(line)
        if match:
            world = max(world, int(match.group(1)))
        match = _RANK_WORLD_HOST.search(line)
        if match:
            world = max(world, int(match.group(2)))
        rank, host = rank_of(line), host_of(line, nodes)
        if rank is not None and host is not None:
            learned[rank] = host
    ntasks = ntasks or world or max([len(nodes) - 1, *learned]) + 1
    for layout in (_block_layout(ntasks, nodes), _cyclic_layout(ntasks, nodes)):
        if all(layout.get(rank, host) == host for rank, host in learned.items()):
            return {**layout, **learned}
    return learned


# ----------------------------------------------------------------- stragglers

@dataclass(slots=True)
class StepSample:
    """One step time read from a line: whose (rank and/or host) and how long."""

    rank: int | None
    host: str | None
    seconds: float
    time: float = 0.0
    line: str = ""


_NUM = r"(\d+(?:\.\d+)?)"
# (regex, how to turn its number into seconds per step). Rates become their
# inverse: only the ratio between ranks matters, and every rank of a job logs
# the same shape.
_STEP_TIMES: tuple[tuple[re.Pattern[str], object, str, bool], ...] = (
    # (each with a literal its matches hold, and whether to look for it case-blind)
    # Megatron-LM: "elapsed time per iteration (ms): 812.3"
    (re.compile(r"elapsed time per iteration \(ms\):\s*" + _NUM), lambda v: v / 1000.0,
     "elapsed time per iteration (ms):", False),
    # NeMo: "train_step_timing in s=0.512"
    (re.compile(r"\bstep_timing(?: in s)?\s*[=:]\s*" + _NUM), lambda v: v, "step_timing", False),
    # generic: "step_time=0.52s", "iter time: 520 ms", "time/step 0.5", "step time 0.4s"
    (re.compile(r"\b(?:(?:step|iter(?:ation)?)[ _-]?time|time[ _/-]?per[ _-]?(?:step|iter)"
                r"|time/(?:step|iter))\b\s*(?:\(s\))?\s*[=:]?\s*" + _NUM + r"\s*(ms|s)?\b",
                re.IGNORECASE), None, "time", True),
    # tqdm / Lightning progress bars: "0.52s/it", "3.32it/s"
    (re.compile(_NUM + r"\s*s/it\b"), lambda v: v, "s/it", False),
    (re.compile(_NUM + r"\s*it/s\b"), lambda v: 1.0 / v if v > 0 else None, "it/s", False),
    # DeepSpeed throughput: "CurrSamplesPerSec=118.2"
    (re.compile(r"\bCurrSamplesPerSec\s*=\s*" + _NUM), lambda v: 1.0 / v if v > 0 else None,
     "CurrSamplesPerSec", False),
)


def parse_step_time(line: str, nodes: Iterable[str] = ()) -> StepSample | None:
    """The step time a line reports, with the rank and host it names; None when
    the line carries no step time or names neither a rank nor a host."""
    low = None
    for pattern, convert, literal, blind in _STEP_TIMES:
        if blind:
            low = _folded(line) if low is None else low
            if literal not in low:
                continue
        elif literal not in line:
            continue
        match = pattern.search(line)
        if not match:
            continue
        value = float(match.group(1))
        if convert is None:  # the generic shape carries its own unit
            seconds = value / 1000.0 if match.group(2) == "ms" else value
        else:
            seconds = convert(value)  # type: ignore[operator]
        if seconds is None or seconds <= 0:
            return None
        rank, host = rank_of(line), host_of(line, nodes)
        if rank is None and host is None:
            return None
        return StepSample(rank, host, seconds, line=_clip(line))
    return None


class StragglerDetector:
    """Flags ranks that are consistently slower than the rest of the job.

    Samples are kept per rank (per host when a line names only a host) for
    ``window`` seconds. A rank is compared once it and at least one other rank
    have ``min_samples`` samples in the window: it is a straggler when its median
    exceeds ``factor`` times the median of the other ranks' medians. Medians keep
    one slow step (a checkpoint save, a GC pause) from counting. A flagged rank is
    reported once, and again only after it has caught up in between.
    """

    def __init__(self, factor: float = 1.5, window: float = 600.0, min_samples: int = 5,
                 rank_hosts: Mapping[int, str] | None = None, nodes: Sequence[str] = (),
                 source: str = "") -> None:
        if factor <= 1.0:
            raise ValueError("factor must be above 1")
        self.factor, self.window, self.min_samples = factor, window, min_samples
        self.rank_hosts = dict(rank_hosts or {})
        self.nodes = tuple(nodes)
        self.source = source
        self._samples: dict[tuple, deque[StepSample]] = {}
        self._flagged: set[tuple] = set()

    @classmethod
    def for_environment(cls, env: "EnvironmentConfig", **kw) -> "StragglerDetector":
        return cls(factor=env.straggler_factor, window=env.straggler_window, **kw)

    def feed(self, time: float, line: str) -> StepSample | None:
        """Take one log line; the step sample it carried, if any."""
        sample = parse_step_time(line, self.nodes)
        if sample is None:
            return None
        sample.time = time
        key = ("rank", sample.rank) if sample.rank is not None else ("host", sample.host)
        self._samples.setdefault(key, deque()).append(sample)
        return sample

    def _prune(self, now: float) -> None:
        horizon = now - self.window
        for key, samples in list(self._samples.items()):
            while samples and samples[0].time < horizon:
                samples.popleft()
            if not samples:
                del self._samples[key]

    def medians(self, now: float) -> dict[tuple, float]:
        """Median step time per rank key, for keys with enough samples."""
        self._prune(now)
        return {key: statistics.median(s.seconds for s in samples)
                for key, samples in self._samples.items() if len(samples) >= self.min_samples}

    def check(self, now: float) -> list[Detection]:
        """New straggler detections (usually none)."""
        if not self._samples:
            return []
        medians = self.medians(now)
        found = []
        for key, mine in medians.items():
            others = [m for k, m in medians.items() if k != key]
            typical = statistics.median(others) if others else 0.0
            slow = bool(others) and typical > 0 and mine > self.factor * typical
            if not slow:
                self._flagged.discard(key)
            elif key not in self._flagged:
                self._flagged.add(key)
                found.append(self._detection(key, mine, typical, len(others)))
        return found

    def _detection(self, key: tuple, mine: float, typical: float, peers: int) -> Detection:
        samples = self._samples[key]
        last = samples[-1]
        rank = last.rank
        host = next((s.host for s in reversed(samples) if s.host), None)
        if host is None and rank is not None:
            host = self.rank_hosts.get(rank)
        who = f"rank {rank}" if rank is not None else "a rank"
        detail = (f"{who} on {host or 'an unknown host'}: median step {mine:.3g}s over "
                  f"{len(samples)} steps vs {typical:.3g}s for the other {peers} rank(s) "
                  f"(x{mine / typical:.2f}, limit x{self.factor:g}); a slow link or GPU on "
                  f"that node is likely")
        evidence = (Evidence(last.line, self.source, None, last.time),)
        return Detection(rule="straggler", category="interconnect", severity="warning",
                         action_hint="none", evidence=evidence, host=host, rank=rank,
                         detail=detail)
