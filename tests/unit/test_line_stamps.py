"""Output lines are stamped, for the hang detector, with their file's mtime
(when the bytes read were last written) rather than with the time the poll
read them: a silence is measured from the last output, so a hang is found at
its window, not up to a poll later. The mtime is the storage's clock, so it is
believed only between the tailer's last look and now."""
from __future__ import annotations

import os
import time

from recovery_agent.config import from_mapping
from recovery_agent.detect.progress import HangDetector, StragglerDetector
from recovery_agent.inputs.logline import MemoryCursorStore
from recovery_agent.inputs.tail import MTIME_SLACK, Tailer, written_at
from recovery_agent.store import Store
from recovery_agent.watch.attempt import AttemptWatch
from slurm_hooks import spec as specs
from tests.unit.scripted import Script, scripted_watcher


def test_written_at_believes_an_mtime_only_between_the_last_look_and_now():
    assert written_at(1_000.5, looked=1_000.0, now=1_002.0) == 1_000.5
    assert written_at(999.5, looked=1_000.0, now=1_002.0) == 999.5   # within the slack
    assert written_at(1_000.0 - MTIME_SLACK - 0.1, looked=1_000.0, now=1_002.0) is None
    assert written_at(1_003.0, looked=1_000.0, now=1_002.0) is None    # storage clock ahead
    assert written_at(1_000.5, looked=None, now=1_002.0) is None       # a first look


def test_the_tailer_gives_the_mtime_of_what_it_read(tmp_path):
    log = tmp_path / "train.out"
    log.write_text("step 1\n")
    tailer = Tailer(MemoryCursorStore())
    tailer.add(str(log), "k")
    assert [line.text for line in tailer.poll()] == ["step 1"]
    assert tailer.written(str(log)) is None          # first look: no lower bound
    with open(log, "a") as fh:
        fh.write("step 2\n")
    written = time.time() - 0.2
    os.utime(log, (written, written))
    assert [line.text for line in tailer.poll()] == ["step 2"]
    assert abs(tailer.written(str(log)) - written) < 1e-3
    with open(log, "a") as fh:
        fh.write("step 3\n")
    os.utime(log, (written - 3600, written - 3600))  # a file server an hour behind
    assert [line.text for line in tailer.poll()] == ["step 3"]
    assert tailer.written(str(log)) is None
    assert tailer.written(str(tmp_path / "not-followed")) is None


def test_the_hang_clock_starts_at_the_last_write_not_at_the_read(tmp_path):
    cfg = from_mapping({"agent": {"cluster": "c1"}})
    store = Store(tmp_path / "r.db")
    watcher = scripted_watcher(cfg, store, Script())     # the wall clock
    assert watcher.mtime_stamps
    log = tmp_path / "train.out"
    log.write_text("")
    watcher.tailer.add(str(log), "1:0")
    watcher.tailer.poll()                                # the first look
    started = time.time() - 100
    watch = AttemptWatch(1, "5", 0, specs.parse("prod"), started, {str(log)},
                         HangDetector(hang=30, started=started),
                         StragglerDetector.for_environment(cfg.environment("prod")))
    with open(log, "a") as fh:
        fh.write("step 7\n")
    written = time.time() - 0.5
    os.utime(log, (written, written))
    run = watcher.tailer.poll()
    now = time.time()
    watcher._feed(watch, str(log), run, now)
    assert abs(watch.hang.due() - (written + 30)) < 1e-3
    # a loop on a test clock keeps the time of reading
    watcher.mtime_stamps = False
    with open(log, "a") as fh:
        fh.write("step 8\n")
    os.utime(log, (written + 0.1, written + 0.1))
    later = time.time()
    watcher._feed(watch, str(log), watcher.tailer.poll(), later)
    assert watch.hang.due() == later + 30
    store.close()
