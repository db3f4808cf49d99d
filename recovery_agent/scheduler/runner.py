"""The one place where slurm-recovery runs a Slurm command.

Every ``squeue``, ``sinfo``, ``scontrol``, ``sbatch`` and ``scancel`` goes
through :meth:`SlurmRunner.run`: an argv list (never a shell string), a timeout,
and a :class:`~recovery_agent.errors.SchedulerError` carrying argv, exit code and
stderr when anything goes wrong. Tests and benchmarks count calls here.

In SSH mode (``ssh_host``) the same argv runs on a login or controller host
through ``ssh``, with the same timeout. ssh hands the remote side one command
string for its shell, so every word is quoted there: names and paths with
shell metacharacters still arrive as single arguments.
"""
from __future__ import annotations

import logging
import os
import shlex
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
    ssh_host: str = ""                 # run commands there through ssh
    ssh_options: tuple[str, ...] = ()  # extra ssh arguments (-i key, -p port, -o ...)
    calls: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def from_config(cls, scheduler_cfg, timeout: float | None = None) -> "SlurmRunner":
        """The runner a ``[scheduler]`` config section describes."""
        return cls(bin_dir=scheduler_cfg.bin_dir, slurm_conf=scheduler_cfg.slurm_conf,
                   timeout=scheduler_cfg.command_timeout if timeout is None else timeout,
                   ssh_host=scheduler_cfg.ssh_host,
                   ssh_options=tuple(shlex.split(scheduler_cfg.ssh_options)))

    def resolve(self, command: str) -> str | None:
        """Full path of a Slurm command, or None when it is not installed. In
        SSH mode the remote host is asked only when a command runs: here the
        name (under ``bin_dir``) is returned when ssh itself is installed."""
        if self.ssh_host:
            if shutil.which("ssh") is None:
                return None
            return os.path.join(self.bin_dir, command) if self.bin_dir else command
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
        command = [exe, *argv[1:]]
        if self.ssh_host:
            command = self._over_ssh(command, limit)
        try:
            if binary:
                proc = self._run_binary(command, limit)
            else:
                proc = subprocess.run(command, capture_output=True, text=True,
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
        if self.ssh_host and proc.returncode == 255:
            # ssh's own failure (host down, refused key): never the command's
            raise SchedulerError(f"{' '.join(argv)}: ssh to {self.ssh_host} failed: "
                                 f"{proc.stderr.strip()[-300:]}", argv=argv,
                                 returncode=255, stderr=proc.stderr)
        if check and proc.returncode != 0:
            raise SchedulerError(f"{' '.join(argv)}: exit {proc.returncode}", argv=argv,
                                 returncode=proc.returncode, stderr=proc.stderr)
        return proc

    def _over_ssh(self, command: list[str], limit: float) -> list[str]:
        """The argv that runs ``command`` on ``ssh_host``: no terminal, no
        password prompt, a connect timeout within the call's, and SLURM_CONF
        set there when configured (ssh passes no environment)."""
        remote = (["env", f"SLURM_CONF={self.slurm_conf}"] if self.slurm_conf else []) + command
        return ["ssh", "-T", "-o", "BatchMode=yes",
                "-o", f"ConnectTimeout={max(1, int(min(limit, 15)))}",
                "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=2",
                *self.ssh_options, "--", self.ssh_host, shlex.join(remote)]

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
