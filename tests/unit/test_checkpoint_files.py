"""The newest checkpoint file under a ckpt= path (recovery_agent.inputs.checkpoints),
as the agent sees it; with a job user's rights: test_security_userfs.py."""
from __future__ import annotations

import os

from recovery_agent.detect.checkpoint import CheckpointFound
from recovery_agent.inputs.checkpoints import newest_checkpoint

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
