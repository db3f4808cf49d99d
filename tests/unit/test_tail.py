"""The log tailer on real files in a temp dir: every awkward case a job's
output can present, handle limits, budgets and restarts."""
from __future__ import annotations

import logging
import os
import tracemalloc

import pytest

from recovery_agent.inputs import (LogLine, MemoryCursorStore, SqliteCursorStore, Tailer,
                                   lines_from_report)
from recovery_agent.inputs import tail as tail_mod
from recovery_agent.inputs import tailfds, tailread
from recovery_agent.store import Store


def write(path, data: bytes | str, mode: str = "ab") -> None:
    with open(path, mode) as f:
        f.write(data.encode() if isinstance(data, str) else data)


def texts(lines: list[LogLine]) -> list[str]:
    return [line.text for line in lines]


def drain(tailer: Tailer, limit: int = 1000) -> list[LogLine]:
    """Poll until nothing is left unread."""
    out: list[LogLine] = []
    for _ in range(limit):
        got = tailer.poll()
        out += got
        if not got and not tailer.backlog:
            return out
    raise AssertionError("tailer never caught up")


def test_missing_file_is_watched_until_created(tmp_path):
    path = tmp_path / "slurm-1.out"
    t = Tailer()
    t.add(path, "1")
    assert t.poll() == [] and t.errors == {} and t.open_count == 0
    write(path, "hello\nworld\n")
    lines = t.poll()
    assert [(l.key, l.path, l.lineno, l.text, l.offset) for l in lines] == \
        [("1", str(path), 1, "hello", 0), ("1", str(path), 2, "world", 6)]


def test_partial_lines_are_held_until_newline_or_flush(tmp_path):
    path = tmp_path / "out"
    t = Tailer()
    t.add(path, "j")
    write(path, "iter")
    assert t.poll() == []
    write(path, "ation 1 loss 2.5\niteration 2")
    lines = t.poll()
    assert texts(lines) == ["iteration 1 loss 2.5"] and lines[0].offset == 0
    write(path, " loss 2.4\nTraceback (most")
    lines = t.poll()
    assert [(l.lineno, l.text, l.offset) for l in lines] == [(2, "iteration 2 loss 2.4", 21)]
    assert t.poll() == []
    final = t.flush_partial(path)
    assert [(l.lineno, l.text, l.offset) for l in final] == [(3, "Traceback (most", 42)]
    assert t.flush_partial(path) == []


def test_crlf_and_empty_lines(tmp_path):
    path = tmp_path / "out"
    write(path, b"one\r\ntwo\r\n\r\n\nthree\r")
    t = Tailer()
    t.add(path, "j")
    assert texts(t.poll()) == ["one", "two", "", ""]
    write(path, b"\n")
    assert texts(t.poll()) == ["three"]


def test_invalid_utf8_and_binary_junk_are_replaced(tmp_path):
    path = tmp_path / "out"
    write(path, b"caf\xc3\xa9 ok\nbad \xff\xfe bytes\n\x00\x00\x00NCCL WARN x\x00\n"
                b"\x1b[31mred\x1b[0m\n")
    t = Tailer()
    t.add(path, "j")
    assert texts(t.poll()) == ["café ok", "bad \ufffd\ufffd bytes", "NCCL WARN x",
                               "\x1b[31mred\x1b[0m"]


def test_huge_line_is_capped_without_buffering_it(tmp_path):
    path = tmp_path / "out"
    with open(path, "wb") as f:
        f.write(b"before\n")
        for _ in range(80):  # 5 MiB on one line
            f.write(b"x" * 65536)
        f.write(b"\nafter\n")
    t = Tailer(max_line=4096, file_budget=1 << 20)
    t.add(path, "j")
    tracemalloc.start()
    try:
        lines = drain(t)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [(l.lineno, len(l.text), l.capped) for l in lines] == \
        [(1, 6, False), (2, 4096, True), (3, 5, False)]
    assert lines[2].text == "after" and lines[2].offset == 7 + 80 * 65536 + 1
    assert peak < 3 * 1024 * 1024, f"peak {peak} bytes"


def test_huge_line_written_in_pieces_is_capped(tmp_path):
    path = tmp_path / "out"
    t = Tailer(max_line=100)
    t.add(path, "j")
    for _ in range(5):
        write(path, "y" * 70)
        assert t.poll() == []
    write(path, "\nnext\n")
    lines = t.poll()
    assert [(len(l.text), l.capped) for l in lines] == [(100, True), (4, False)]


@pytest.mark.resilience("log file deleted, truncated or swapped for a symlink while tailed",
                        "a truncated log is read again from its start, logged")
def test_truncation_restarts_from_zero(tmp_path, caplog):
    path = tmp_path / "out"
    write(path, "a\nb\nc\n")
    t = Tailer()
    t.add(path, "j")
    assert texts(t.poll()) == ["a", "b", "c"]
    write(path, "new\n", mode="wb")
    with caplog.at_level(logging.WARNING, logger="recovery_agent.inputs.tail"):
        lines = t.poll()
    assert [(l.lineno, l.text, l.offset) for l in lines] == [(1, "new", 0)]
    assert "truncated" in caplog.text


def test_rotation_finishes_the_old_file_then_reads_the_new(tmp_path):
    path = tmp_path / "out"
    write(path, "old 1\n")
    t = Tailer()
    t.add(path, "j")
    assert texts(t.poll()) == ["old 1"]
    write(path, "old 2\nold partial")
    os.rename(path, tmp_path / "out.1")
    write(path, "new 1\n")
    lines = t.poll()
    assert [(l.lineno, l.text) for l in lines] == \
        [(2, "old 2"), (3, "old partial"), (1, "new 1")]
    write(path, "new 2\n")
    assert [(l.lineno, l.text) for l in t.poll()] == [(2, "new 2")]


def test_rotation_while_the_descriptor_was_closed(tmp_path):
    path, other = tmp_path / "out", tmp_path / "other"
    write(path, "old 1\n")
    write(other, "x\n")
    t = Tailer(max_open=1)
    t.add(other, "k")  # keeps the one descriptor: "out" is read and closed
    t.add(path, "j")
    assert texts(t.poll()) == ["x", "old 1"] and t.open_count == 1
    write(path, "old 2\n")
    os.rename(path, tmp_path / "out.1")  # found again by its inode
    write(path, "new 1\n")
    assert [(l.lineno, l.text) for l in t.poll()] == [(2, "old 2"), (1, "new 1")]


def test_replacement_by_a_new_file_of_the_same_name(tmp_path):
    path = tmp_path / "out"
    write(path, "a\n")
    t = Tailer()
    t.add(path, "j")
    t.poll()
    os.unlink(path)
    assert t.poll() == []
    write(path, "b\n")
    assert [(l.lineno, l.text) for l in t.poll()] == [(1, "b")]


def test_replacement_unseen_between_polls_with_the_descriptor_closed(tmp_path):
    path, other = tmp_path / "out", tmp_path / "other"
    write(path, "line one\n")
    t = Tailer(max_open=1)
    t.add(path, "j")
    t.add(other, "k")
    assert texts(t.poll()) == ["line one"]
    assert t.poll() == []
    write(other, "x\n")  # "out" has been idle: its descriptor goes to "other"
    assert texts(t.poll()) == ["x"] and t.open_count == 1
    os.unlink(path)  # tmpfs and ext4 hand the same inode number to the next file
    write(path, "x\nsomething longer\n")
    assert [(l.lineno, l.text) for l in t.poll()] == [(1, "x"), (2, "something longer")]


def test_600_files_with_64_handles_deliver_in_order(tmp_path):
    paths = [tmp_path / f"slurm-100_{i}.out" for i in range(600)]
    fds_before = len(os.listdir("/proc/self/fd"))
    t = Tailer(max_open=64)
    for i, path in enumerate(paths):
        t.add(path, f"100_{i}")
    got: dict[str, list[str]] = {}
    for rnd in range(4):
        for i, path in enumerate(paths):
            write(path, f"r{rnd} a\nr{rnd} b\nr{rnd} c-")  # ends inside a line
        for line in drain(t):
            got.setdefault(line.path, []).append(line.text)
        assert t.open_count <= 64
        assert len(os.listdir("/proc/self/fd")) - fds_before <= 64
    want = ["r0 a", "r0 b"] + [x for r in (1, 2, 3) for x in (f"r{r - 1} c-r{r} a", f"r{r} b")]
    assert all(got[str(path)] == want for path in paths)


def test_unchanged_files_are_not_read(tmp_path, monkeypatch):
    for i in range(20):
        write(tmp_path / f"f{i}", "line\n")
    t = Tailer()
    for i in range(20):
        t.add(tmp_path / f"f{i}", str(i))
    assert len(t.poll()) == 20
    reads = []
    real = os.pread
    monkeypatch.setattr(tailread.os, "pread", lambda *a: reads.append(a) or real(*a))
    assert t.poll() == [] and reads == []
    write(tmp_path / "f3", "more\n")
    assert texts(t.poll()) == ["more"] and len(reads) == 1


def test_read_budget_keeps_a_huge_file_from_starving_others(tmp_path):
    big, small = tmp_path / "big", tmp_path / "small"
    write(big, ("z" * 99 + "\n") * 40_000)  # 4 MB
    t = Tailer(file_budget=256 * 1024, read_budget=300 * 1024)
    t.add(big, "big")
    t.add(small, "small")
    first = t.poll()
    assert 2000 < len(first) < 3000 and t.backlog == 1
    write(small, "urgent\n")
    second = t.poll()
    assert "urgent" in texts(second)
    rest = drain(t)
    numbers = [l.lineno for l in first + second + rest if l.key == "big"]
    assert numbers == list(range(1, 40_001))


def test_restart_resumes_from_saved_offsets(tmp_path):
    path, other = tmp_path / "out", tmp_path / "other"
    write(path, "1\n2\n3")
    write(other, "a\n")
    with Store(tmp_path / "r.db") as store:
        with Tailer(SqliteCursorStore(store)) as t:
            t.add(path, "j")
            t.add(other, "k")
            assert texts(t.poll()) == ["1", "2", "a"]
        assert store.log_cursors()[str(path)] == (os.stat(path).st_ino, 4, 2)
    write(path, " done\n4\n")
    os.unlink(other)  # replaced while the agent was down (the inode may come back)
    write(other, "bb\n")
    with Store(tmp_path / "r.db") as store:
        t = Tailer(SqliteCursorStore(store))
        t.add(path, "j")
        t.add(other, "k")
        lines = t.poll()
        t.close()
    assert [(l.key, l.lineno, l.text) for l in lines] == \
        [("j", 3, "3 done"), ("j", 4, "4"), ("k", 1, "bb")]


def test_a_flushed_partial_line_comes_again_once_after_a_restart(tmp_path):
    path = tmp_path / "out"
    write(path, "done\nlast words")
    cursors = MemoryCursorStore()
    with Tailer(cursors) as t:
        t.add(path, "j")
        assert texts(t.poll()) == ["done"]
        assert [(l.lineno, l.text) for l in t.flush_partial(path)] == [(2, "last words")]
    write(path, " and more\n")  # the cursor stayed after the last newline
    with Tailer(cursors) as t:
        t.add(path, "j")
        assert [(l.lineno, l.text) for l in t.poll()] == [(2, "last words and more")]


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_cursors_are_saved_on_interval_and_forgotten_on_request(tmp_path, kind):
    path = tmp_path / "out"
    write(path, "x\n")
    store = Store(tmp_path / "r.db") if kind == "sqlite" else None
    cursors = SqliteCursorStore(store) if store else MemoryCursorStore()
    t = Tailer(cursors, save_interval=0)
    t.add(path, "j")
    t.poll()
    assert cursors.load_all()[str(path)][1:] == (2, 1)
    t.remove(path, forget=True)
    assert cursors.load_all() == {} and t.paths == []
    if store:
        assert "003_log_cursors" in store.applied_migrations()
        store.close()


def test_a_file_truncated_and_rewritten_past_the_offset_is_read_again(tmp_path):
    path = tmp_path / "out"
    write(path, "attempt 0 line\n")
    t = Tailer()
    t.add(path, "j")
    assert texts(t.poll()) == ["attempt 0 line"]
    write(path, "requeued: attempt 1, a longer first line\n", mode="wb")  # same inode
    assert [(l.lineno, l.text) for l in t.poll()] == \
        [(1, "requeued: attempt 1, a longer first line")]


def test_unreadable_paths_are_recorded_not_raised(tmp_path, monkeypatch):
    folder, denied, good = tmp_path / "a-dir", tmp_path / "denied", tmp_path / "good"
    folder.mkdir()
    write(denied, "secret\n")
    write(good, "fine\n")
    real_open = os.open

    def fake_open(path, *args, **kw):
        if str(path) == str(denied):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kw)

    monkeypatch.setattr(tailfds.os, "open", fake_open)
    t = Tailer()
    for path in (folder, denied, good):
        t.add(path, "j")
    assert texts(t.poll()) == ["fine"]
    assert t.poll() == []
    assert set(t.errors) == {str(folder), str(denied)}
    assert "PermissionError" in t.errors[str(denied)]
    monkeypatch.setattr(tailfds.os, "open", real_open)
    assert texts(t.poll()) == ["secret"] and set(t.errors) == {str(folder)}


def test_lines_from_report():
    report = {"hook": "epilog", "node": "gpu7", "job": {"job_id": "55_3"},
              "log_lines": [{"text": "NCCL WARN net\r", "source": "stderr"},
                            {"text": "a\nb\x00"}, "junk", {"source": "x"},
                            {"text": "y" * 30}]}
    lines = lines_from_report(report, max_line=20)
    assert [(l.key, l.path, l.lineno, l.text, l.capped) for l in lines] == [
        ("55_3", "hook:gpu7/epilog:stderr", 1, "NCCL WARN net", False),
        ("55_3", "hook:gpu7/epilog", 1, "a", False),
        ("55_3", "hook:gpu7/epilog", 2, "b", False),
        ("55_3", "hook:gpu7/epilog", 3, "y" * 20, True)]
    assert lines_from_report({"node": "n"}) == []
    assert lines_from_report({"log_lines": "nope"}) == []


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        Tailer(max_open=0)


def test_a_rotation_that_uses_up_the_budget_reads_the_new_file_next_poll(tmp_path):
    path = tmp_path / "out"
    write(path, "a\n")
    t = Tailer(file_budget=8)
    t.add(path, "j")
    assert texts(t.poll()) == ["a"]
    write(path, "0123456\n")  # exactly the budget
    os.rename(path, tmp_path / "out.1")
    write(path, "new\n")
    assert texts(t.poll()) == ["0123456"] and t.backlog == 1
    assert [(l.lineno, l.text) for l in t.poll()] == [(1, "new")]


@pytest.mark.resilience("log file deleted, truncated or swapped for a symlink while tailed",
                        "a log swapped for a symlink to a secret is never read; the refusal is recorded")
def test_log_swapped_for_a_symlink_is_not_read(tmp_path):
    secret = tmp_path / "shadow"
    secret.write_text("root:$6$secret:19000:0:99999:7:::\n")
    log = tmp_path / "job.out"
    log.write_text("step 1\n")
    tailer = Tailer(MemoryCursorStore())
    tailer.add(log, "k")
    assert [l.text for l in tailer.poll()] == ["step 1"]
    log.unlink()
    log.symlink_to(secret)
    lines = tailer.poll() + tailer.poll()
    assert all("secret" not in l.text for l in lines)
    assert "symbolic link" in tailer.errors[str(log)]


@pytest.mark.resilience("log file deleted, truncated or swapped for a symlink while tailed",
                        "paths and links leading outside agent.log_roots are refused")
def test_paths_outside_the_allowed_roots_are_not_followed(tmp_path):
    inside, outside = tmp_path / "scratch", tmp_path / "etc"
    inside.mkdir()
    outside.mkdir()
    (outside / "passwd").write_text("root:x:0:0\n")
    (inside / "ok.out").write_text("step 1\n")
    (inside / "sneaky.out").symlink_to(outside / "passwd")    # a link out of the root
    tailer = Tailer(MemoryCursorStore(), allowed_roots=(str(inside),))
    tailer.add(inside / "ok.out", "a")
    tailer.add(inside / "sneaky.out", "b")
    tailer.add(outside / "passwd", "c")
    assert [(l.key, l.text) for l in tailer.poll()] == [("a", "step 1")]
    assert set(tailer.refused) == {str(inside / "sneaky.out"), str(outside / "passwd")}


@pytest.mark.resilience("log file deleted, truncated or swapped for a symlink while tailed",
                        "no crash; lines before the change delivered once; a new file of "
                        "the same name is read from its start; links never followed")
def test_log_deleted_while_tailed_then_recreated(tmp_path):
    log = tmp_path / "job.out"
    write(log, "step 1\nstep 2\n")
    tailer = Tailer(MemoryCursorStore())
    tailer.add(log, "k")
    assert texts(drain(tailer)) == ["step 1", "step 2"]
    write(log, "step 3\n")
    log.unlink()                       # deleted with an unread line in it
    got = texts(drain(tailer))
    assert got in ([], ["step 3"])     # read before the unlink was noticed, or lost with it
    write(log, "fresh 1\n", "wb")      # the job (or a rerun) creates it again
    assert texts(drain(tailer)) == ["fresh 1"]


# -- floods (issue 14, finding 12) --------------------------------------------

def numbered(first: int, count: int, width: int = 100) -> bytes:
    """Lines 'line N ...' padded to ``width`` bytes each, newline included."""
    return b"".join(f"line {n} ".encode().ljust(width - 1, b"x") + b"\n"
                    for n in range(first, first + count))


def test_a_file_far_ahead_is_skipped_to_its_tail_with_line_numbers_kept(tmp_path):
    path = tmp_path / "flood.out"
    write(path, "step 1\npartial")              # a held partial line before the flood
    t = Tailer(max_backlog=1 << 20, keep_tail=64 * 1024)
    t.add(path, "j")
    assert texts(t.poll()) == ["step 1"]
    write(path, b" end\n" + numbered(3, 40_000))   # 4 MB: far past the backlog bound
    lines = drain(t)
    assert lines[0].lineno == 2 and lines[0].text == "partial"   # delivered, not lost
    kept = lines[1:]
    assert 0 < len(kept) * 100 <= 64 * 1024 + 100
    # the kept lines start at a line start and carry their true numbers
    assert all(l.text.startswith(f"line {l.lineno} ") for l in kept)
    assert kept[-1].lineno == 40_002
    (notice,) = t.notices
    assert notice.kind == "skipped" and notice.key == "j" and notice.path == str(path)
    assert notice.skipped == t.skipped_bytes > 3_900_000
    assert "skipped 3.9 MB of output" in notice.message
    write(path, "after the flood\n")            # back to normal: read as usual
    assert [(l.lineno, l.text) for l in t.poll()] == [(40_003, "after the flood")]


def test_later_skips_of_one_file_are_reported_together(tmp_path, monkeypatch):
    path = tmp_path / "flood.out"
    t = Tailer(max_backlog=1 << 20, keep_tail=64 * 1024)
    t.add(path, "j")
    for first in (1, 30_001, 60_001):
        write(path, numbered(first, 30_000))
        drain(t)
    assert len(t.notices) == 1                  # the first at once, the others wait
    t.remove(path)                              # ...until the file is let go
    assert [n.kind for n in t.notices] == ["skipped", "skipped"]
    assert sum(n.skipped for n in t.notices) == t.skipped_bytes


def test_the_time_budget_shares_one_poll_between_flooded_files(tmp_path):
    a, b = tmp_path / "a.out", tmp_path / "b.out"
    write(a, numbered(1, 30_000))               # 3 MB each, three steps each
    write(b, numbered(1, 30_000))
    t = Tailer(time_budget=0, max_backlog=0)    # no time: one step of one file a poll
    t.add(a, "a")
    t.add(b, "b")
    keys = [{l.key for l in t.poll()} for _ in range(4)]
    assert keys == [{"a"}, {"b"}, {"a"}, {"b"}]
    assert t.backlog == 2


def test_poll_iter_yields_lines_a_step_at_a_time(tmp_path):
    path = tmp_path / "big.out"
    write(path, numbered(1, 50_000))            # 5 MB
    t = Tailer(max_backlog=0)
    t.add(path, "j")
    sizes, run = [], 0
    last = None
    for line in t.poll_iter():
        if last is not None and line.offset // tailread.STEP != last // tailread.STEP:
            sizes.append(run)
            run = 0
        run += 1
        last = line.offset
    assert len(sizes) >= 4 and max(sizes) * 100 <= tailread.STEP + 100


def test_a_huge_flood_is_flushed_with_bounded_memory_and_the_skip_is_reported(tmp_path):
    """A job that wrote 320 MB in its last moments: the old flush read it all
    into one list (RSS 86 MB -> 1.2 GB, the loop stalled for 65 s)."""
    path = tmp_path / "flood.out"
    write(path, "step 1\n")
    t = Tailer()
    t.add(path, "j")
    assert texts(t.poll()) == ["step 1"]
    block = numbered(0, 10_486)                 # ~1 MiB of lines
    with open(path, "ab") as fh:
        for _ in range(320):
            fh.write(block)
        fh.write(b"RuntimeError: CUDA error: an illegal memory access was encountered")
    total = os.path.getsize(path)
    tracemalloc.start()
    try:
        count, last = 0, None
        for line in t.flush_iter(path):         # consumed as it comes, as the watcher does
            count += 1
            last = line
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 48 << 20, f"flush peaked at {peak >> 20} MiB"
    assert last.text.startswith("RuntimeError: CUDA error") and last.lineno == 320 * 10_486 + 2
    assert count * 100 < tail_mod.KEEP_TAIL + 200   # only the tail was read, line by line
    (notice,) = t.notices
    assert notice.kind == "skipped" and notice.skipped == t.skipped_bytes
    start = len("step 1\n")                   # skipped from there to a line start
    assert 0 <= notice.skipped - (total - tail_mod.KEEP_TAIL - start) < 100
