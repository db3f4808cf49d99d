"""Checkpoint progress: the newest checkpoint under a ckpt= path, the save
lines of common trainers, and attempts that saved nothing new."""
from __future__ import annotations

import os

import pytest

from recovery_agent.detect.checkpoint import (CheckpointFound, CheckpointRecord,
                                              CheckpointWatcher, attempts_without_progress,
                                              newest_checkpoint, parse_saved, step_from_path)

T0 = 1_760_000_000.0


def touch(path, mtime: float, text: str = "x"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    os.utime(path, (mtime, mtime))
    return path


# --------------------------------------------------------- the ckpt= path

def test_newest_in_a_directory_ignores_temp_and_hidden_files(tmp_path):
    touch(tmp_path / "step-000050.json", T0 + 50)
    touch(tmp_path / "step-000100.json", T0 + 100)
    touch(tmp_path / ".step-000150.json.4242.tmp", T0 + 150)   # a save under way
    touch(tmp_path / "step-000150.json.tmp", T0 + 151)
    touch(tmp_path / "model.safetensors.partial", T0 + 152)
    touch(tmp_path / "tmp-checkpoint-150" / "model.safetensors", T0 + 153)
    found = newest_checkpoint(str(tmp_path))
    assert found == CheckpointFound(str(tmp_path / "step-000100.json"), T0 + 100)
    path, mtime = found  # a plain (path, mtime) pair too
    assert mtime == T0 + 100


def test_newest_recurses_into_step_directories_up_to_a_depth(tmp_path):
    touch(tmp_path / "global_step200" / "mp_rank_00_model_states.pt", T0 + 200)
    touch(tmp_path / "global_step300" / "mp_rank_00_model_states.pt", T0 + 300)
    touch(tmp_path / "global_step300" / ".metadata", T0 + 301)  # DCP's commit file counts
    touch(tmp_path / "a" / "b" / "c" / "d" / "e" / "deep.pt", T0 + 999)  # below max_depth
    found = newest_checkpoint(str(tmp_path))
    assert found == (str(tmp_path / "global_step300" / ".metadata"), T0 + 301)
    assert newest_checkpoint(str(tmp_path), max_depth=5).path.endswith("deep.pt")


def test_newest_by_glob(tmp_path):
    touch(tmp_path / "run1" / "epoch=1-step=400.ckpt", T0 + 400)
    touch(tmp_path / "run1" / "epoch=2-step=800.ckpt", T0 + 800)
    touch(tmp_path / "run1" / "epoch=3-step=1200.ckpt.tmp", T0 + 1200)
    touch(tmp_path / "run2" / "epoch=9-step=9000.ckpt", T0 + 9000)
    touch(tmp_path / "run1" / "notes.txt", T0 + 5000)
    found = newest_checkpoint(str(tmp_path / "run1" / "*.ckpt*"))
    assert found == (str(tmp_path / "run1" / "epoch=2-step=800.ckpt"), T0 + 800)
    across = newest_checkpoint(str(tmp_path / "run*" / "epoch=*.ckpt"))
    assert across.path.endswith("run2/epoch=9-step=9000.ckpt")


def test_missing_empty_and_plain_file(tmp_path):
    assert newest_checkpoint(str(tmp_path / "absent")) is None
    assert newest_checkpoint(str(tmp_path / "absent" / "*.pt")) is None
    assert newest_checkpoint("") is None
    (tmp_path / "empty").mkdir()
    assert newest_checkpoint(str(tmp_path / "empty")) is None
    one = touch(tmp_path / "final.pt", T0)
    assert newest_checkpoint(str(one)) == (str(one), T0)


def test_work_is_bounded(tmp_path):
    for i in range(60):
        touch(tmp_path / f"shard-{i:03d}.pt", T0 + i)
    found = newest_checkpoint(str(tmp_path), max_entries=10)
    assert found is not None  # the newest among the 10 entries read
    assert newest_checkpoint(str(tmp_path / "*.pt"), max_entries=10) is not None
    assert newest_checkpoint(str(tmp_path)).mtime == T0 + 59


def test_symlinked_dirs_are_not_entered(tmp_path):
    touch(tmp_path / "ckpt" / "step-1.pt", T0)
    os.symlink(tmp_path / "ckpt", tmp_path / "ckpt" / "loop")
    assert newest_checkpoint(str(tmp_path / "ckpt")) == (str(tmp_path / "ckpt" / "step-1.pt"),
                                                          T0)


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
