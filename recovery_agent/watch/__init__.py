"""The agent's watch loop: follow every opted-in job and turn its output into
detections.

One cycle: one batched scheduler query; register jobs that opted in through
``--comment`` (hook-registered jobs are already in the store); follow each
tracked attempt's stdout/stderr; scan new lines; ask the external sources
(GPU metrics, log stores; see :mod:`recovery_agent.watch.feed`), when
configured; run the hang, straggler and checkpoint detectors; store what was
found. A bad cycle is logged and the next one runs (the loop never dies of one
job's oddity).

The parts, by role (one :class:`Watcher` made of them):

- :mod:`.loop`: the cycle, ``--comment`` registration, job sync (state
  changes, a job gone, an id reused), running the loop;
- :mod:`.attempt`: one attempt's watch (:class:`AttemptWatch`), tailing and
  scanning its lines, the store of its detections;
- :mod:`.running`: the hang, straggler and checkpoint detectors on a running
  attempt, and the external sources while it runs;
- :mod:`.verdicts`: an ended attempt's verdict and decision, the node
  evidence it waits for, late evidence, the queues of refused writes;
- :mod:`.feed`: the external sources' findings as detections.

The constants are re-exported here for reading; a test that changes one sets
it in the module that uses it (``recovery_agent.watch.verdicts.EPILOG_GRACE``).
"""
from .attempt import RUN_LINES, AttemptWatch
from .feed import SourceFeed
from .loop import ENDED_STATES, GONE_AFTER, SEEN_FLUSH_EVERY, Watcher
from .running import CKPT_SCAN_INTERVAL, STRAGGLER_CHECK_EVERY
from .verdicts import EPILOG_GRACE, MAX_PENDING_VERDICTS, NO_WAIT_STATES, NODE_MAP_TTL, XID_SLACK

__all__ = [
    "AttemptWatch", "CKPT_SCAN_INTERVAL", "ENDED_STATES", "EPILOG_GRACE", "GONE_AFTER",
    "MAX_PENDING_VERDICTS", "NODE_MAP_TTL", "NO_WAIT_STATES", "RUN_LINES", "SEEN_FLUSH_EVERY",
    "STRAGGLER_CHECK_EVERY", "SourceFeed", "Watcher", "XID_SLACK",
]
