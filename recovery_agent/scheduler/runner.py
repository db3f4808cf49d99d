"""The one place where slurm-recovery runs a Slurm command.

Every ``squeue``, ``sinfo``, ``scontrol``, ``sbatch`` and ``scancel`` goes
through :meth:`SlurmRunner.run`: an argv list (never a shell string), a timeout,
and a :class:`~recovery_agent.errors.SchedulerError` carrying argv, exit code and
stderr when anything goes wrong. Tests and benchmarks count calls here.
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ..errors import SchedulerError

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 30.0


@dataclass
class SlurmRunner:
    """Runs Slurm client commands.

    ``bin_dir`` prefixes bare command names (empty: search ``PATH``);
    ``slurm_conf`` sets ``SLURM_CONF`` for the child; ``timeout`` bounds each
    call. ``calls`` counts commands by name, for the scale benchmarks.
    """

    bin_dir: str = ""
    slurm_conf: str = ""
    timeout: float = DEFAULT_TIMEOUT
    extra_env: Mapping[str, str] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def resolve(self, command: str) -> str | None:
        """Full path of a Slurm command, or None when it is not installed."""
        if self.bin_dir:
            path = os.path.join(self.bin_dir, command)
            return path if os.access(path, os.X_OK) else None
        return shutil.which(command)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.extra_env)
        if self.slurm_conf:
            env["SLURM_CONF"] = self.slurm_conf
        return env

    def run(self, argv: Sequence[str], timeout: float | None = None,
            check: bool = True, binary: bool = False) -> subprocess.CompletedProcess:
        """Run ``argv`` and return the finished process: text mode, or with
        ``binary`` stdout left as bytes (a large listing is then never held twice,
        once raw and once decoded); stderr is always text.

        Raises SchedulerError when the command is missing, times out, or (with
        ``check``) exits non-zero.
        """
        if isinstance(argv, (str, bytes)):
            raise TypeError("SlurmRunner.run takes an argv list, not a string")
        argv = [str(a) for a in argv]
        exe = self.resolve(argv[0])
        if exe is None:
            raise SchedulerError(f"{argv[0]}: command not found (is Slurm installed?)",
                                 argv=argv, returncode=127)
        limit = self.timeout if timeout is None else timeout
        with self._lock:
            self.calls[argv[0]] = self.calls.get(argv[0], 0) + 1
        started = time.monotonic()
        try:
            if binary:
                proc = self._run_binary([exe, *argv[1:]], limit)
            else:
                proc = subprocess.run([exe, *argv[1:]], capture_output=True, text=True,
                                      errors="replace", timeout=limit, env=self.env(),
                                      stdin=subprocess.DEVNULL, check=False)
        except subprocess.TimeoutExpired as exc:
            stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) \
                else (exc.stderr or "")
            raise SchedulerError(f"{' '.join(argv)}: timed out after {limit:g}s",
                                 argv=argv, returncode=None, stderr=stderr) from None
        except OSError as exc:
            raise SchedulerError(f"{' '.join(argv)}: {exc.strerror}", argv=argv,
                                 returncode=None, stderr=str(exc)) from None
        log.debug("ran %s rc=%s in %.3fs", argv, proc.returncode, time.monotonic() - started)
        if check and proc.returncode != 0:
            raise SchedulerError(f"{' '.join(argv)}: exit {proc.returncode}", argv=argv,
                                 returncode=proc.returncode, stderr=proc.stderr)
        return proc

    def _run_binary(self, argv: list[str], limit: float) -> subprocess.CompletedProcess:
        """Run with stdout into an unlinked temporary file, read back in one
        allocation: a pipe is read in chunks and joined, which holds a 40 MB
        listing twice at the peak."""
        try:
            sink = tempfile.TemporaryFile(buffering=0)
        except OSError:   # no usable temp dir: a pipe still works
            proc = subprocess.run(argv, capture_output=True, timeout=limit, env=self.env(),
                                  stdin=subprocess.DEVNULL, check=False)
            proc.stderr = proc.stderr.decode(errors="replace")
            return proc
        with sink:
            proc = subprocess.run(argv, stdout=sink, stderr=subprocess.PIPE, timeout=limit,
                                  env=self.env(), stdin=subprocess.DEVNULL, check=False)
            sink.seek(0)
            proc.stdout = sink.readall()
        proc.stderr = proc.stderr.decode(errors="replace")
        return proc

    def total_calls(self) -> int:
        with self._lock:
            return sum(self.calls.values())
