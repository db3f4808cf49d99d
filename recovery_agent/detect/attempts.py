"""The reading across attempts: a verdict read together with the job's
earlier attempts (:func:`across_attempts`), where each ran and what was
decided (:class:`PriorAttempt`). Pure: attribution calls it with the
context's history, policy with the store's."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Sequence

from .model import Verdict

__all__ = ["PriorAttempt", "across_attempts"]


@dataclass(frozen=True)
class PriorAttempt:
    """An earlier attempt of the same job: where it ran and what was decided."""

    nodes: tuple[str, ...] = ()
    verdict: Verdict | None = None
    attempt: int | None = None         # its number (Slurm's restart count), when known



def across_attempts(verdict: Verdict, nodes: Sequence[str],
                    previous: Sequence[PriorAttempt]) -> Verdict:
    """The verdict read together with the job's earlier attempts (``nodes``:
    where this one ran). Pure: policy calls it with the store's history.

    * A collective timeout at the same point of the run (the same
      operation, sequence number and size) as an earlier attempt's is a hang
      the run reaches every time: ``stop``. At the first collective only when
      the attempts shared no node (there a bad node or link hangs it too).
    * A CUDA error or a segfault (``signature``) that follows the job onto
      nodes none of whose earlier occurrences ran on is the code: ``stop``.
      One that stays with one node is that node: exclude it.
    * An I/O failure without a full disk, a second time: ``stop``.
    * DataLoader workers killed by a bus error in shared memory, a second
      time: ``stop`` (/dev/shm is too small for the job's batches and workers).
    * A host named as a suspect (a peer, a store host) that an earlier
      attempt's failure named too: exclude it.
    * A failure naming no node (with evidence: not one with none at all),
      repeated over attempts that share exactly one node, blames that node.
    """
    if not previous or verdict.action == "stop" or verdict.signature == "done":
        return verdict
    family = verdict.signature.partition(":")[0]
    if family == "hang":
        reread = _same_hang(verdict, nodes, previous)
        if reread is not None:
            return reread
    # not when node-level evidence blames the GPU, nor for uncorrectable ECC
    # (memory the code cannot corrupt: two bad GPUs are two bad GPUs)
    if (family in ("cuda", "segfault") and verdict.category != "gpu_hardware"
            and verdict.signature != "cuda:ecc"):
        reread = _recurring(verdict, family, nodes, previous)
        if reread is not None:
            return reread
    if family == "io":
        again = [p for p in previous if p.verdict and p.verdict.signature.startswith("io")]
        if again:
            return replace(verdict, action="stop", blame="unknown",
                           reason=f"{verdict.reason}; the same I/O failure ended "
                                  f"{_attempts(again)} too: a full disk, a quota or a "
                                  "filesystem fault that a retry does not clear")
    if family == "shm":
        again = [p for p in previous if p.verdict and p.verdict.signature == "shm"]
        if again:
            return replace(verdict, action="stop", blame="unknown", nodes=(), gpus=(),
                           links=(), unexplained=False,
                           reason=f"{verdict.reason}; the DataLoader workers ran out of "
                                  f"shared memory in {_attempts(again)} too: /dev/shm is "
                                  "too small for the job's batches and workers (raise it, "
                                  "or fewer workers or a smaller prefetch)")
    if verdict.blame != "node" and verdict.suspects:
        named = [s for s in verdict.suspects if (not nodes or s in nodes) and any(
            p.verdict and (s in p.verdict.suspects or s in p.verdict.nodes) for p in previous)]
        if named:
            again = [p for p in previous if p.verdict and set(named) & set(
                p.verdict.suspects + p.verdict.nodes)]
            return replace(verdict, blame="node", action="requeue_exclude",
                           nodes=tuple(named), unexplained=False, confidence=0.7,
                           reason=f"{verdict.reason}; {', '.join(named)} named by the "
                                  f"failure of {_attempts(again)} too: excluded")
    if verdict.blame != "application" and not verdict.nodes and verdict.action != "none":
        return _repeated(verdict, nodes, previous) or verdict
    return verdict


def _recurring(verdict: Verdict, family: str, nodes: Sequence[str],
               previous: Sequence[PriorAttempt]) -> Verdict | None:
    same = [p for p in previous if p.verdict and p.nodes
            and p.verdict.signature.partition(":")[0] == family]
    if not same or not nodes:
        return None
    what = "CUDA error" if family == "cuda" else "segfault"
    fresh = [p for p in same if not set(p.nodes) & set(nodes)]
    if fresh:
        return replace(verdict, blame="application", action="stop", nodes=(), gpus=(),
                       links=(), unexplained=False, confidence=0.8,
                       reason=f"{verdict.reason}; the same {what} ended "
                              f"{_attempts(fresh)} on {', '.join(fresh[0].nodes)} and now "
                              f"this one on other nodes ({', '.join(nodes)}): it follows the "
                              "job, so it is the code or its setup, not a node")
    common = set(nodes).intersection(*(set(p.nodes) for p in same))
    if len(common) > 1:
        pointed = set(verdict.suspects).intersection(*(set(p.verdict.suspects) for p in same))
        common &= pointed
    if len(common) != 1:
        return None
    node = common.pop()
    return replace(verdict, blame="node", action="requeue_exclude", nodes=(node,),
                   unexplained=False, confidence=0.7,
                   reason=f"{verdict.reason}; the same {what} ended {_attempts(same)} on "
                          f"{node} too: it stays with that node")


def _same_hang(verdict: Verdict, nodes: Sequence[str],
               previous: Sequence[PriorAttempt]) -> Verdict | None:
    """Stop a hang that an earlier attempt had at the very same collective.

    A fault (a GPU, a link, a node) stalls a collective wherever the run is
    when it strikes, so two attempts hanging at the same sequence number,
    operation and size is the run itself: a rank busy elsewhere (validation,
    a save, data loading on one rank) longer than the timeout, or ranks that
    disagree on the collectives they call. The sequence numbers count from
    each process's start; the first collectives of a run are also where a
    bad node or link first shows, so those count only across attempts that
    shared no node."""
    same = [p for p in previous if p.verdict and p.verdict.signature == verdict.signature]
    if not same:
        return None
    _, op, seq = verdict.signature.split(":")[:3]
    if int(seq) <= 1 and (not nodes or any(set(p.nodes) & set(nodes) or not p.nodes
                                           for p in same)):
        return None
    return replace(verdict, blame="application", action="stop", nodes=(), gpus=(), links=(),
                   unexplained=False, confidence=0.75,
                   reason=f"{verdict.reason}; {_attempts(same)} timed out at the same "
                          f"collective ({op} number {seq}): a hang the run reaches every "
                          "time is the code or its setup (one rank busy longer than the "
                          "timeout, or ranks calling different collectives), not a node")


def _attempts(previous: Sequence[PriorAttempt]) -> str:
    numbers = [str(p.attempt) for p in previous if p.attempt is not None]
    if not numbers:
        return "an earlier attempt" if len(previous) == 1 else f"{len(previous)} earlier attempts"
    return ("attempt " if len(numbers) == 1 else "attempts ") + ", ".join(numbers)


def _repeated(verdict: Verdict, nodes: Sequence[str],
              previous: Sequence[PriorAttempt]) -> Verdict | None:
    """Blame the one node common to this failure and earlier failed attempts."""
    failed = [p for p in previous
              if p.nodes and (p.verdict is None or p.verdict.blame != "application")]
    if not failed or not nodes:
        return None
    common = set(nodes).intersection(*(set(p.nodes) for p in failed))
    named = Counter(n for p in failed if p.verdict for n in p.verdict.nodes if n in nodes)
    if len(common) == 1:
        node = common.pop()
    elif named:
        node = named.most_common(1)[0][0]
    else:
        return None
    return replace(verdict, blame="node", nodes=(node,), action="requeue_exclude",
                   unexplained=False, confidence=0.6 if len(failed) == 1 else 0.7,
                   reason=f"{verdict.reason}; {node} is common to {len(failed) + 1} "
                          "failed attempts")
