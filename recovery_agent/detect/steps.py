"""The training step a job's log last reported (pure), for the goodput
ledger's *steps lost*: the last step printed before the failure minus the
step of the checkpoint the job resumes from (docs/goodput.md).

Only lines that report a step as done count: a trainer prints them after the
step (its loss, its time), so the number is a step completed. A line naming
the step under way when something broke (the demo's ``step 57: CUDA error``)
is not one of them. Each rule below is the shape its trainer prints:
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .stamps import line_time

__all__ = ["StepCounter", "parse_step"]

_STEP_LINES = tuple(re.compile(rx) for rx in (
    # NeMo (Megatron strategy) progress line, whose "iteration" counts within the
    # epoch while global_step counts the run: "Training epoch 0, iteration 4/9 | lr:
    # 8e-05 | global_batch_size: 1 | global_step: 4 | reduced_train_loss: 1.257 | ..."
    # (haydenjohnson94/HuangSeedFund_Evo2 Train_Evo2_Mortierellaceae.md, a NeMo run's
    # output); checked before the Megatron shape it contains
    r"\| global_step: (\d+) \|",
    # Megatron-LM training_log (NVIDIA/Megatron-LM megatron/training/training.py:
    # ' iteration {:8d}/{:8d} |'): " [2024-07-15 15:26:21] iteration       10/    1000 |
    # consumed samples: 80 | ..." and, older, without the stamp (epfLLM/Megatron-LLM
    # issue 11); NeMo's "Validation: iteration 1/20" has no "|" and is not a step
    r"\biteration\s+(\d+)\s*/\s*\d+\s*\|",
    # DeepSpeed's engine (microsoft/DeepSpeed deepspeed/runtime/engine.py,
    # _report_progress: log_dist(f"step={step}, skipped=..."): "[2024-08-15
    # 21:12:21,408] [INFO] [logging.py:96:log_dist] [Rank 0] step=600, skipped=0, ..."
    r"\] step=(\d+), skipped=\d+",
    # TorchTitan's metrics line (pytorch/torchtitan torchtitan/components/metrics.py,
    # f"{color.red}step: {step:2}  {color.green}loss: ..."): "[rank0]:[titan] 2025-06-04
    # 08:51:48,074 - root - INFO - step:  1  loss: 12.2254  memory: ..." (its colour
    # escapes are taken out first); "validate step: N" is an evaluation, not a step
    r"(?<!validate )\bstep:\s*(\d+)\s+loss:",
    # examples/train.py, the demo trainer: "rank 0/2 node1 step 40/200 loss 0.1234
    # (restart 0)"
    r"\bstep (\d+)/\d+ loss \d",
))


_COLOUR = re.compile(r"\x1b\[[\d;]*m")   # a terminal colour escape


def parse_step(line: str) -> int | None:
    """The step a line reports as done, or None."""
    if "step" not in line and "iteration" not in line:
        return None
    if "\x1b" in line:
        line = _COLOUR.sub("", line)
    for pattern in _STEP_LINES:
        found = pattern.search(line)
        if found:
            return int(found.group(1))
    return None


@dataclass
class StepCounter:
    """The last step one attempt's log reported, and when (the line's own
    stamp where it has one, else when it was read). The last, not the
    highest: a trainer that restarts inside the attempt counts again from its
    checkpoint, and what it last said is its progress."""

    last: int | None = None
    time: float | None = None

    def feed(self, time: float, line: str, started: float | None = None) -> int | None:
        step = parse_step(line)
        if step is not None:
            stamped = line_time(line, time, started)
            self.last, self.time = step, time if stamped is None else stamped
        return step
