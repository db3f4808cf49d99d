"""Hang and straggler detection over recorded-looking log lines, with explicit
times: no clocks, no sleeps, no files."""
from __future__ import annotations

import random
import re

import pytest

from recovery_agent.config import DEFAULT_PROGRESS_PATTERN, EnvironmentConfig
from recovery_agent.detect.model import CATEGORIES, Detection
from recovery_agent.detect.progress import (HangDetector, StragglerDetector, hang_seconds,
                                            host_of, parse_step_time, rank_host_map, rank_of)
from slurm_hooks.spec import parse

T0 = 1_760_000_000.0  # the attempt's start

STEP = "[2026-03-02T09:14:{s:02d}.120Z] rank 0/2 gpu-a01 step {n}/5000 loss 2.3141 (restart 0)"
WARN = ("/opt/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py:617: "
        "UserWarning: This DataLoader will create 16 worker processes in total.")
NCCL_INFO = "gpu-a01:48213:48391 [0] NCCL INFO Channel 02/0 : 0[0] -> 1[0] [send] via NET/IB/0"


# ------------------------------------------------------------------ hang

def test_hang_fires_once_after_the_window():
    det = HangDetector(hang=600, started=T0)
    assert det.feed(T0 + 30, STEP.format(s=30, n=10))
    assert det.check(T0 + 600, running=True) is None   # 570 s of silence: not yet
    found = det.check(T0 + 631, running=True)
    assert isinstance(found, Detection)
    assert (found.rule, found.category) == ("hang", "nccl_timeout_hang")
    assert found.category in CATEGORIES
    assert found.action_hint == "kill_requeue"
    assert "step 10/5000" in found.evidence[0].text
    assert found.evidence[0].time == T0 + 30
    assert "10m01s" in found.detail  # the silent duration
    # The same silence is reported once.
    assert det.check(T0 + 700, running=True) is None
    assert det.check(T0 + 5000, running=True) is None
    # Progress, then a new silence: a new detection.
    det.feed(T0 + 5100, STEP.format(s=5, n=20))
    assert det.check(T0 + 5600, running=True) is None
    again = det.check(T0 + 5701, running=True)
    assert again is not None and "step 20/5000" in again.evidence[0].text


def test_silent_from_the_start_is_hung_after_the_window_and_not_before():
    det = HangDetector(hang=300, started=T0)
    assert det.check(T0 + 1, running=True) is None
    assert det.check(T0 + 299, running=True) is None
    found = det.check(T0 + 300, running=True)
    assert found is not None
    assert found.evidence == ()
    assert "since the attempt started" in found.detail


def test_no_hang_before_the_job_starts_or_while_not_running():
    det = HangDetector(hang=300, started=T0)
    # Pending/suspended: no detection, and the time does not count.
    assert det.check(T0 + 1000, running=False) is None
    assert det.check(T0 + 1200, running=True) is None
    assert det.check(T0 + 1301, running=True) is not None


def test_zero_disables():
    det = HangDetector(hang=0, started=T0)
    assert not det.enabled
    assert det.check(T0 + 10 * 86400, running=True) is None


def test_any_output_is_progress_without_a_pattern():
    det = HangDetector(hang=600, started=T0, progress_pattern="")
    det.feed(T0 + 10, STEP.format(s=10, n=10))
    for t in range(100, 2000, 100):
        assert det.feed(T0 + t, WARN)
        assert det.check(T0 + t + 50, running=True) is None


def test_warning_spam_after_progress_stopped_is_still_a_hang():
    det = HangDetector(hang=600, started=T0, progress_pattern=DEFAULT_PROGRESS_PATTERN)
    assert det.feed(T0 + 10, STEP.format(s=10, n=10))
    for t in range(60, 700, 60):
        assert not det.feed(T0 + t, WARN)
        assert not det.feed(T0 + t + 1, NCCL_INFO)
    found = det.check(T0 + 611, running=True)
    assert found is not None
    assert "step 10/5000" in found.evidence[0].text  # the last progress line
    assert "NCCL INFO" in found.evidence[-1].text   # and the last output
    assert "no progress for 10m01s" in found.detail


def test_output_counts_until_the_pattern_first_matches():
    """A job whose progress lines the pattern does not know is judged by its
    output; require_match judges it by the pattern alone."""
    lenient = HangDetector(hang=600, started=T0, progress_pattern=DEFAULT_PROGRESS_PATTERN)
    strict = HangDetector(hang=600, started=T0, progress_pattern=DEFAULT_PROGRESS_PATTERN,
                          require_match=True)
    for t in range(60, 900, 60):
        lenient.feed(T0 + t, WARN)
        strict.feed(T0 + t, WARN)
    assert lenient.check(T0 + 900, running=True) is None
    assert strict.check(T0 + 900, running=True) is not None


@pytest.mark.parametrize("line", [
    "[rank0]: step 120 | loss 1.93 | 0.52s/it",
    " iteration      120/   10000 | consumed samples:        15360 | elapsed time per "
    "iteration (ms): 812.3 | learning rate: 2.998E-04 | lm loss: 4.213E+00 |",
    "Epoch 3:  45%|████▌     | 450/1000 [02:15<02:45,  3.32it/s, v_num=0, loss=2.31]",
    "{'loss': 1.8734, 'grad_norm': 0.91, 'learning_rate': 4.9e-05, 'epoch': 0.37}",
    "[2026-03-02 09:14:02,113] [INFO] [logging.py:128:log_dist] [Rank 0] step=2400, "
    "skipped=0, lr=[0.0001], mom=[(0.9, 0.95)]",
    "global_step=7 train/loss=3.02",
    "[Step 1200] tokens/s 51234",
])
def test_default_pattern_knows_common_progress_lines(line):
    assert re.search(DEFAULT_PROGRESS_PATTERN, line)


@pytest.mark.parametrize("line", [
    WARN, NCCL_INFO,
    "Detected call of `lr_scheduler.step()` before `optimizer.step()`.",
    "[rank3]:[E302 09:24:11.402] [PG 0 Rank 3] Watchdog caught collective operation "
    "timeout: WorkNCCL(SeqNum=4410, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, "
    "Timeout(ms)=600000) ran for 600043 milliseconds before timing out.",
    "batch_size=32 micro_batch_size=4",
])
def test_default_pattern_ignores_noise(line):
    assert not re.search(DEFAULT_PROGRESS_PATTERN, line)


def test_hang_duration_from_spec_else_environment():
    env = EnvironmentConfig(hang=1800.0)
    assert hang_seconds(parse("prod:action,hang=20m"), env) == 1200
    assert hang_seconds(parse("prod:action"), env) == 1800
    assert hang_seconds(None, EnvironmentConfig()) == 0
    det = HangDetector.for_attempt(parse("hang=90s"), env, started=T0)
    assert det.hang == 90 and det.check(T0 + 90, running=True) is not None


# ------------------------------------------------------------- stragglers

def _feed_ranks(det: StragglerDetector, times: dict[int, float], steps: int,
                jitter: float = 0.0, seed: int = 7, t0: float = T0) -> None:
    rng = random.Random(seed)
    for step in range(steps):
        for rank, base in times.items():
            secs = base * (1 + rng.uniform(-jitter, jitter))
            det.feed(t0 + step * 2.0,
                     f"[rank{rank}]: step {100 + step} | loss 2.07 | {secs:.3f}s/it")


def test_straggler_flagged_with_its_host_once():
    hosts = rank_host_map([], ["gpu-a01", "gpu-a02", "gpu-a03", "gpu-a04"], ntasks=8)
    det = StragglerDetector(factor=1.5, window=600, min_samples=5, rank_hosts=hosts)
    times = {r: 0.50 for r in range(8)}
    times[5] = 0.95
    _feed_ranks(det, times, steps=12, jitter=0.05)
    found = det.check(T0 + 30)
    assert len(found) == 1
    d = found[0]
    assert (d.rule, d.category, d.rank, d.host) == ("straggler", "interconnect", 5, "gpu-a03")
    assert d.category in CATEGORIES and d.severity == "warning"
    assert "rank 5 on gpu-a03" in d.detail and "[rank5]" in d.evidence[0].text
    assert det.check(T0 + 31) == []  # reported once


def test_noise_is_not_a_straggler():
    det = StragglerDetector(factor=1.5, window=600, min_samples=5)
    _feed_ranks(det, {r: 0.50 for r in range(8)}, steps=40, jitter=0.25, seed=3)
    # One rank with a few very slow steps (a checkpoint save, a GC pause).
    for i in range(3):
        det.feed(T0 + 100 + i, f"[rank2]: step {900 + i} | loss 2.0 | 4.100s/it")
    assert det.check(T0 + 110) == []


def test_too_few_samples_is_not_a_straggler():
    det = StragglerDetector(factor=1.5, window=600, min_samples=5)
    _feed_ranks(det, {0: 0.5, 1: 0.5, 2: 0.5, 3: 2.0}, steps=4)
    assert det.check(T0 + 10) == []


def test_window_forgets_old_slowness():
    det = StragglerDetector(factor=1.5, window=60, min_samples=5)
    _feed_ranks(det, {0: 0.5, 1: 0.5, 2: 1.5}, steps=10)          # t0 .. t0+18
    _feed_ranks(det, {0: 0.5, 1: 0.5, 2: 0.5}, steps=10, t0=T0 + 200)
    assert det.check(T0 + 230) == []


def test_host_only_lines_and_megatron_shape():
    det = StragglerDetector(factor=1.5, window=600, min_samples=3)
    for i in range(5):
        for host, ms in (("gpu-b11", 812.0), ("gpu-b12", 820.5), ("gpu-b13", 1710.2)):
            det.feed(T0 + i, f"host={host} iteration {i + 10}/1000 | elapsed time per "
                             f"iteration (ms): {ms} | lm loss: 3.9E+00")
    found = det.check(T0 + 10)
    assert [(d.host, d.rank) for d in found] == [("gpu-b13", None)]


@pytest.mark.parametrize("line, rank, host, seconds", [
    ("[rank3]: step 120 loss 2.01 0.52s/it", 3, None, 0.52),
    ("  7:  iteration      120/   10000 | consumed samples: 1920 | elapsed time per "
     "iteration (ms): 812.3 | learning rate: 3.0E-04", 7, None, 0.8123),
    ("node gpu07 | Epoch 1:  12%|█▏        | 120/1000 [00:36<04:24,  3.33it/s, v_num=3]",
     None, "gpu07", 1 / 3.33),
    ("global_rank=11 hostname=dgx-h100-017 step_time=0.41s", 11, "dgx-h100-017", 0.41),
    ("RANK=2 iter time: 520 ms", 2, None, 0.52),
    ("[Rank 1] epoch=0/micro_step=40/global_step=40, RunningAvgSamplesPerSec=98.1, "
     "CurrSamplesPerSec=100.0, MemAllocated=21.3GB", 1, None, 0.01),
])
def test_step_time_shapes(line, rank, host, seconds):
    sample = parse_step_time(line)
    assert sample is not None
    assert (sample.rank, sample.host) == (rank, host)
    assert sample.seconds == pytest.approx(seconds, rel=1e-3)


@pytest.mark.parametrize("line", [
    "step 120 loss 2.01 0.52s/it",                 # whose? no rank, no host
    "[rank3]: NCCL INFO comm 0x5581 rank 3 nranks 8 cudaDev 3 busId 3a000 - Init COMPLETE",
    "[rank0]: local_rank=1 step 4 tokens 4096",
])
def test_lines_without_an_attributable_step_time(line):
    assert parse_step_time(line) is None


# ------------------------------------------------------------ rank -> host

def test_rank_and_host_readers():
    assert rank_of("[rank12]:[W302 09:14:02.113] ProcessGroupNCCL.cpp:1250 warning") == 12
    assert rank_of("local_rank=3 group_rank=1") is None
    assert rank_of("  4: step 10") == 4                      # srun --label
    assert host_of("rank 1/2 node2 step 10/400 loss 2.3", ["node1", "node2"]) == "node2"
    assert host_of("node index 0 started") is None
    assert host_of("SLURMD_NODENAME=login", ["login"]) == "login"
    assert host_of("host gpu07.cluster.example.org up", ["gpu07"]) == "gpu07"


def test_rank_host_map_learned_from_lines():
    nodes = ["gpu-c01", "gpu-c02"]
    lines = [
        "[rank0]: starting on host gpu-c02",     # not where block layout would put it
        "[rank1]: starting on host gpu-c01",
        "SLURM_PROCID=2 SLURMD_NODENAME=gpu-c02 SLURM_NTASKS=4",
        "some unrelated line",
    ]
    got = rank_host_map(lines, nodes)
    assert got[0] == "gpu-c02" and got[1] == "gpu-c01" and got[2] == "gpu-c02"
    assert 3 not in got  # fits neither block nor cyclic layout: not guessed


def test_rank_host_map_from_train_example_lines():
    lines = ["[2026-03-02T09:00:00.001Z] rank 0/4 node1 job 4242 node index 0 started",
             "[2026-03-02T09:00:00.002Z] rank 3/4 node2 job 4242 node index 1 started"]
    assert rank_host_map(lines, ["node1", "node2"]) == {0: "node1", 1: "node1",
                                                       2: "node2", 3: "node2"}


def test_rank_host_map_from_torchrun_rank_assignment():
    head = "I0302 09:00:01.331000 140 torch/distributed/elastic/agent/server/api.py:525] "
    block = [head + text for text in (
        "[default] Rank assignment:", "  restart_count=0", "  master_addr=gpu-d01",
        "  group_rank=1", "  group_world_size=2", "  local_ranks=[0, 1, 2, 3]",
        "  global_ranks=[4, 5, 6, 7]", "  global_world_sizes=[8, 8, 8, 8]")]
    got = rank_host_map(block, ["gpu-d01", "gpu-d02"], ntasks=8)
    assert {r: got[r] for r in (4, 5, 6, 7)} == dict.fromkeys((4, 5, 6, 7), "gpu-d02")
    assert got[0] == "gpu-d01"  # the rest by block layout, which agrees


def test_rank_host_map_fallback_is_slurm_block_layout():
    assert rank_host_map([], ["n1", "n2", "n3"], ntasks=8) == {
        0: "n1", 1: "n1", 2: "n1", 3: "n2", 4: "n2", 5: "n2", 6: "n3", 7: "n3"}
    assert rank_host_map([], ["n1", "n2"]) == {0: "n1", 1: "n2"}  # one task per node
    assert rank_host_map(["[rank0]: host n1"], []) == {0: "n1"}


def test_environment_settings_reach_the_detector():
    env = EnvironmentConfig(straggler_factor=2.0, straggler_window=120.0)
    det = StragglerDetector.for_environment(env, min_samples=3)
    assert (det.factor, det.window) == (2.0, 120.0)
    with pytest.raises(ValueError):
        StragglerDetector(factor=1.0)


@pytest.mark.parametrize("text, key", [
    ("progress_pattern = 'step (\\\\d+'", "environments.prod.progress_pattern"),
    ("straggler_factor = 1.0", "environments.prod.straggler_factor"),
    ("straggler_window = 'soon'", "environments.prod.straggler_window"),
])
def test_bad_environment_settings_name_the_key(text, key):
    import tomllib

    from recovery_agent.config import from_mapping
    from recovery_agent.errors import ConfigError
    with pytest.raises(ConfigError, match=re.escape(key)):
        from_mapping(tomllib.loads(f"[environments.prod]\n{text}\n"))
    good = from_mapping(tomllib.loads("[environments.prod]\nprogress_pattern = ''\n"
                                      "straggler_factor = 2\nstraggler_window = '5m'\n"))
    assert good.environment("prod").straggler_window == 300.0
