"""The crash and pause points of the fault tests, as the actuator's ``on_step``
seam (production code reads no test switch).

``StepFaults(crash_after="exclude")`` SIGKILLs this process right after that
Slurm step took effect; ``StepFaults(pause_before="release", pause_file=P)``
writes P before that step and holds still (once, up to ``pause_limit``) until
the test removes it, so the test can break something first.

``python -m tests.step_faults [agent options]`` runs the real agent with the
faults its environment names (``STEP_FAULTS_CRASH_AFTER``,
``STEP_FAULTS_PAUSE_BEFORE``, ``STEP_FAULTS_PAUSE_FILE``): the live tests start
it in place of ``python -m recovery_agent`` (tests/integration/conftest.py
AgentProcess)."""
from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

log = logging.getLogger("tests.step_faults")
ENV = ("STEP_FAULTS_CRASH_AFTER", "STEP_FAULTS_PAUSE_BEFORE", "STEP_FAULTS_PAUSE_FILE")


@dataclass
class StepFaults:
    crash_after: str = ""
    pause_before: str = ""
    pause_file: str = ""
    pause_limit: float = 120.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "StepFaults":
        crash, pause, path = (environ.get(k, "") for k in ENV)
        return cls(crash_after=crash, pause_before=pause, pause_file=path)

    def __call__(self, when: str, step: str) -> None:
        if when == "before" and step == self.pause_before and self.pause_file:
            self.pause_before = ""   # once per process
            path = Path(self.pause_file)
            path.write_text(f"{os.getpid()} before {step}\n")
            log.warning("step fault: paused before step %s until %s is removed", step, path)
            deadline = time.monotonic() + self.pause_limit
            while path.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        elif when == "ok" and step == self.crash_after:
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    from recovery_agent.agent import main
    main(obj={"on_step": StepFaults.from_env()})
