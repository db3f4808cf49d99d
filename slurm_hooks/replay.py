"""Replaying a node's spool soon after an epilog had to spool its report.

An epilog report carries the node's evidence about how a job ended (its XIDs),
and the agent's verdict on the job waits for it only so long
(``agent.node_report_wait``). Left to the next hook run, a spooled epilog report
reaches the agent when the node next starts a job, ends one or runs its health
check: often later than that. So an epilog whose report went to the spool
starts one detached replayer: a short-lived process in a session of its own
(Slurm does not wait for it), with no standard streams (nothing holds slurmd's
pipes), which replays the spool after 1, 2, 4, 8 and then every 15 seconds,
for at most :data:`WINDOW` seconds, and ends as soon as the spool is empty.
At most one runs per node (an advisory lock held for its whole life); an
epilog that finds one running starts none. Any failure here only means the
next hook run replays the spool, as before.
"""
from __future__ import annotations

import fcntl
import logging
import os
import sys
import time
from pathlib import Path

log = logging.getLogger("slurm_hooks")
WINDOW = 60.0
PAUSES = (1.0, 2.0, 4.0, 8.0, 15.0, 15.0, 15.0)   # together WINDOW
LOCK_NAME = ".replayer.lock"
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])


def _hold_lock(spool: Path):
    """The open lock file when this process now holds the replayer lock, else
    None (also for a spool that must not be used: see delivery.untrusted)."""
    from .delivery import open_lock, untrusted
    if untrusted(spool):
        return None
    try:
        fh = os.fdopen(open_lock(spool / LOCK_NAME), "w")
    except OSError:
        return None
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        fh.close()
        return None
    return fh


def start(spool: Path, environ) -> bool:
    """Start the detached replayer for ``spool`` unless one runs already.
    True when one was started. Never raises."""
    probe = _hold_lock(spool)
    if probe is None:
        return False     # one is running (or the spool cannot even be opened)
    probe.close()        # the replayer takes it for itself
    env = {k: environ[k] for k in ("RECOVERY_CONFIG", "SLURMD_NODENAME", "PATH")
           if environ.get(k)}
    # -I: no PYTHON* variables, no user site, no current directory on the path;
    # the package is found where this hook found it
    code = (f"import sys; sys.path.insert(0, {_PACKAGE_ROOT!r}); "
            "from slurm_hooks.replay import main; sys.exit(main())")
    try:
        import subprocess
        subprocess.Popen([sys.executable, "-I", "-c", code], env=env, cwd="/",
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    except (OSError, ValueError) as exc:
        log.warning("cannot start the spool replayer (%s): the next hook run replays", exc)
        return False
    return True


def run(deliverer, sleep=time.sleep, pauses: tuple[float, ...] = PAUSES) -> bool:
    """Replay ``deliverer``'s spool after each pause until it is empty; True
    when it was emptied. The caller holds the replayer lock."""
    for pause in pauses:
        sleep(pause)
        if not deliverer.pending():
            return True
        done, agent_ok = deliverer.replay(by="replayer")
        if done:
            log.info("replayer: %d spooled report(s) delivered", done)
        if agent_ok and not deliverer.pending():
            return True
    return not deliverer.pending()


def main(environ=os.environ) -> int:
    """The detached replayer (started by :func:`start`)."""
    try:
        from . import node as where
        from . import settings
        from .delivery import Deliverer
        cfg = settings.load(environ)
        node = where.node_name(environ)
        where.setup_logging(cfg, node)
        spool = Path(where.node_path(cfg.spool_dir, node))
        lock = _hold_lock(spool)
        if lock is None:
            return 0
        with lock:
            deliverer = Deliverer(cfg.agent_url, cfg.timeout, spool, cfg.munge_socket)
            if not run(deliverer):
                log.warning("replayer: the agent did not take the spool within %.0fs; "
                            "the next hook run replays it", WINDOW)
    except Exception as exc:  # noqa: BLE001 - a helper of a hook: never loud
        log.warning("replayer failed, the next hook run replays: %r", exc)
    return 0
