"""The straggler verdict: a running attempt whose step times lag is killed and
requeued, blaming the hosts the straggler detections name."""
from __future__ import annotations

from typing import Sequence

from .model import Detection, Verdict

__all__ = ["straggler_verdict"]


def straggler_verdict(found: Sequence[Detection], slow: Sequence[Detection]) -> Verdict:
    """The verdict on a running attempt whose step times lag: ``slow`` are the
    straggler detections just made (not empty), the last ``len(slow)`` of
    ``found``, the attempt's detections so far. The hosts they name are blamed
    (none named: unknown), and the attempt is killed and requeued."""
    hosts = tuple(d.host for d in slow if d.host)
    return Verdict(blame="node" if hosts else "unknown", category="straggler",
                   action="kill_requeue", confidence=0.6, nodes=hosts,
                   rests_on=tuple(range(len(found) - len(slow), len(found))),
                   reason=slow[0].detail)
