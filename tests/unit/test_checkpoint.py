"""Checkpoint progress: which names under a ckpt= path count and which is the
newest (the files themselves: test_checkpoint_files.py), the save lines of
common trainers, and attempts that saved nothing new."""
from __future__ import annotations

import pytest

from recovery_agent.detect.checkpoint import (CheckpointFound, CheckpointRecord,
                                              CheckpointWatcher, attempts_without_progress,
                                              ignored_name, newest_found, parse_saved,
                                              step_from_path)

T0 = 1_760_000_000.0


# ----------------------------------------------- names and the newest entry

@pytest.mark.parametrize("name, ignored", [
    ("step-000100.json", False), (".metadata", False), ("global_step300", False),
    (".step-000150.json.4242.tmp", True), ("step-000150.json.tmp", True),
    ("model.safetensors.partial", True), ("tmp-checkpoint-150", True), (".hidden", True),
    ("latest~", True),
])
def test_ignored_names(name, ignored):
    assert ignored_name(name) is ignored


def test_newest_found_keeps_the_first_of_the_latest_mtime():
    a, b, c = (CheckpointFound("/ck/a", T0), CheckpointFound("/ck/b", T0 + 5),
               CheckpointFound("/ck/c", T0 + 5))
    assert newest_found([a, None, b, c]) == b
    assert newest_found(iter([None, a])) == a
    assert newest_found([]) is None and newest_found([None]) is None


# ---------------------------------------------------------- save lines

@pytest.mark.parametrize("line, wording, path, step", [
    # Megatron-LM
    ("[2026-03-02 09:30:12] successfully saved checkpoint from iteration    2000 to "
     "/lustre/proj/ckpt/gpt-8b [ t 1/4, p 1/2 ]", "megatron", "/lustre/proj/ckpt/gpt-8b", 2000),
    # Lightning ModelCheckpoint (as NeMo uses it)
    ("Epoch 4, global step 1250: 'val_loss' reached 1.87021 (best 1.87021), saving model to "
     "\"/scratch/run7/checkpoints/epoch=4-step=1250.ckpt\" as top 3", "lightning",
     "/scratch/run7/checkpoints/epoch=4-step=1250.ckpt", 1250),
    # NeMo asynchronous save
    ("[NeMo I 2026-03-02 09:30:12 nemo_logging:393] Async checkpoint save for step 1250 "
     "(/results/llama/checkpoints/llama--reduced_train_loss=1.92-step=1250.ckpt) finalized "
     "successfully.", "nemo", "/results/llama/checkpoints/llama--reduced_train_loss=1.92"
     "-step=1250.ckpt", 1250),
    ("[NeMo I 2026-03-02 09:30:10 nemo_logging:393] Saving checkpoint to /results/last.ckpt",
     "generic", "/results/last.ckpt", None),
    # DeepSpeed
    ("[2026-03-02 09:30:12,004] [INFO] [torch_checkpoint_engine.py:33:commit] [Torch] "
     "Checkpoint global_step3400 is ready now!", "deepspeed", "global_step3400", 3400),
    ("[2026-03-02 09:30:11,512] [INFO] [logging.py:128:log_dist] [Rank 0] Saving model "
     "checkpoint: /ckpt/ds-run/global_step3400/mp_rank_00_model_states.pt", "hf_or_deepspeed",
     "/ckpt/ds-run/global_step3400/mp_rank_00_model_states.pt", 3400),
    # Hugging Face Trainer
    ("[INFO|trainer.py:3812] 2026-03-02 09:30:12,004 >> Saving model checkpoint to "
     "./out/qwen-sft/checkpoint-1500", "hf_or_deepspeed", "./out/qwen-sft/checkpoint-1500", 1500),
    # torch.distributed.checkpoint driven by TorchTitan
    ("[rank0]:[titan] 2026-03-02 09:30:12,004 - root - INFO - Saving a full checkpoint at "
     "last step, step 6000.", "torchtitan", None, 6000),
    # generic, as examples/train.py prints it
    ("[2026-03-02T09:30:12.004Z] rank 0/2 node1 checkpoint saved: /shared/ckpt/run1/"
     "step-000150.json step=150", "generic", "/shared/ckpt/run1/step-000150.json", 150),
    ("INFO saved checkpoint to /data/ckpt/iter_0004000", "generic", "/data/ckpt/iter_0004000",
     4000),
])
def test_save_wordings(line, wording, path, step):
    assert parse_saved(line) == (wording, path, step)


@pytest.mark.parametrize("line", [
    "loading checkpoint from /lustre/proj/ckpt/gpt-8b at iteration 2000",
    "[2026-03-02T09:30:12.004Z] rank 1/2 node2 resuming from checkpoint "
    "/shared/ckpt/run1/step-000150.json at step 150 (restart 1)",
    "Epoch 4, global step 1250: 'val_loss' was not in top 3",
    "ERROR: failed to save checkpoint to /ckpt/run1: [Errno 28] No space left on device",
    "WARNING: could not find a checkpoint in /ckpt/run1, starting from scratch",
    "Restoring states from the checkpoint path at /scratch/run7/checkpoints/last.ckpt",
])
def test_lines_that_are_not_saves(line):
    assert parse_saved(line) is None


def test_step_from_path():
    assert step_from_path("/ckpt/ds/global_step3400/mp_rank_00_model_states.pt") == 3400
    assert step_from_path("/ckpt/epoch=4-step=1250.ckpt") == 1250
    assert step_from_path("/ckpt/run1/step-000150.json") == 150
    assert step_from_path("/ckpt/step_tuning/iter_0004000") == 4000
    assert step_from_path("/ckpt/last.ckpt") is None
    assert step_from_path(None) is None


def test_watcher_keeps_the_newest_per_attempt():
    w = CheckpointWatcher()
    assert w.feed(T0 + 1, "rank 0/2 node1 step 40/400 loss 2.2") is None
    w.feed(T0 + 10, "rank 0/2 node1 checkpoint saved: /ck/step-000050.json step=50")
    w.feed(T0 + 20, "rank 0/2 node1 checkpoint saved: /ck/step-000100.json step=100")
    assert w.newest == CheckpointRecord("/ck/step-000100.json", 100, T0 + 20, "log:generic")
    # A scan that finds an older file (from an earlier attempt) is not this attempt's.
    assert w.observe(CheckpointFound("/ck/step-000000.json", T0 - 50), started=T0) is None
    # A scan finding the newer file advances it, with the step read from the name.
    w.observe(CheckpointFound("/ck/step-000150.json", T0 + 31), started=T0)
    assert (w.newest.path, w.newest.step, w.newest.source) == ("/ck/step-000150.json", 150,
                                                               "ckpt")


def test_watcher_merges_a_scan_of_the_save_just_logged():
    w = CheckpointWatcher()
    w.feed(T0 + 10, "[Torch] Checkpoint global_step3400 is ready now!")
    w.feed(T0 + 9, "Saving model checkpoint: /ck/global_step3400/mp_rank_00_model_states.pt")
    assert w.newest.step == 3400


# ---------------------------------------------------- across attempts

def rec(step: int | None, time: float = T0, path: str | None = None) -> CheckpointRecord:
    return CheckpointRecord(path, step, time)


@pytest.mark.parametrize("attempts, expected", [
    ([], 0),
    ([None], 1),
    ([rec(100)], 0),
    ([rec(100), rec(200)], 0),
    ([rec(100), None], 1),
    ([rec(100), None, None], 2),
    ([rec(100), rec(100)], 1),               # resumed, saved the same step again
    ([rec(100), None, rec(100), None], 3),
    ([rec(100), None, rec(200)], 0),
    ([rec(300), rec(200)], 1),               # went backwards: no progress
    ([rec(None, T0), rec(None, T0 + 60)], 0),  # no steps known: by time
    ([rec(None, T0 + 60), rec(None, T0 + 60)], 1),
])
def test_attempts_without_progress(attempts, expected):
    assert attempts_without_progress(attempts) == expected
