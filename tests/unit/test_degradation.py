"""The degradation score on recorded counter series (recovery_agent.detect.degradation).

The series are built the way the agent would see them: hooks NVML snapshots
(the shape slurm_hooks.gpu.snapshot returns) at a node's health-check cadence,
turned into readings by readings_from_snapshot.
"""
from __future__ import annotations

import copy
from dataclasses import replace

import pytest

from recovery_agent.config.schema import ProactiveConfig
from recovery_agent.detect import degradation as dg
from recovery_devtools.devcluster.config import fake_gpus

CFG = ProactiveConfig()
T0 = 1_700_000_000.0
HOUR = 3600.0


def gpu_snapshot(**changes) -> dict:
    """A one-GPU snapshot as the hooks report it; ``changes`` override fields."""
    want = fake_gpus("gpu-a1", 1)["gpus"][0]
    gpu = {"index": 0, "uuid": want["uuid"], "name": want["name"], "lost": False,
           "pci_bus_id": want["pci_bus_id"], "pci_short": "0000:18:00",
           "ecc_volatile_corrected": 0, "ecc_aggregate_corrected": 0,
           "ecc_volatile_uncorrected": 0, "ecc_aggregate_uncorrected": 0,
           "remapped_rows_pending": False, "remapped_rows_failure": False,
           "remapped_rows_correctable": 0, "remapped_rows_uncorrectable": 0,
           "retired_pages_pending": False, "retired_pages_sbe": 0, "retired_pages_dbe": 0,
           "throttle_reasons": 0, "unsupported": [], "errors": {},
           "nvlink": [{"link": i, "active": True, "replay": 0, "recovery": 0,
                       "crc_flit": 0, "crc_data": 0, "ecc_data": 0} for i in range(4)]}
    links = changes.pop("links", {})
    gpu.update(changes)
    gpu["nvlink"] = copy.deepcopy(gpu["nvlink"])
    for (link, name), value in links.items():
        gpu["nvlink"][link][name] = value
    return {"ok": True, "error": None, "driver": "fake-555.42", "count": 1, "gpus": [gpu]}


def series(points, every=20 * 60.0, node="gpu-a1"):
    """Readings from a list of snapshot field overrides, one per ``every`` seconds."""
    out = []
    for i, changes in enumerate(points):
        out += dg.readings_from_snapshot(node, T0 + i * every, gpu_snapshot(**changes), [])
    return out


def test_healthy_series_scores_zero():
    score = dg.score_gpu(series([{}] * 10), CFG)
    assert score.score == 0 and score.level == "ok" and score.hits == ()
    assert score.readings == 10 and score.no_data == ()


def test_rising_sbe_fires_with_its_rate():
    # 0, 60, 120, ... corrected errors every 20 minutes: 180 per hour
    score = dg.score_gpu(series([{"ecc_volatile_corrected": 60 * i} for i in range(7)]), CFG)
    assert score.rules == ("sbe_rate",)
    hit = score.hits[0]
    assert hit.value == pytest.approx(180.0) and hit.threshold == 100.0
    assert score.level == "watch" and score.score == 0.5


def test_slow_sbe_stays_quiet():
    score = dg.score_gpu(series([{"ecc_volatile_corrected": 10 * i} for i in range(7)]), CFG)
    assert score.rules == ()          # 30 per hour, under 100


def test_a_high_but_flat_sbe_count_is_not_a_rate():
    """A GPU that collected many corrected errors long ago and none since."""
    score = dg.score_gpu(series([{"ecc_volatile_corrected": 50_000}] * 7), CFG)
    assert score.rules == ()


def test_two_close_readings_make_no_rate():
    rows = series([{"ecc_volatile_corrected": 0}, {"ecc_volatile_corrected": 500}], every=30.0)
    assert dg.score_gpu(rows, CFG).rules == ()        # 30 s apart: under min_span
    rows = series([{"ecc_volatile_corrected": 0}, {"ecc_volatile_corrected": 500}])
    assert dg.score_gpu(rows, CFG).rules == ("sbe_rate",)   # 20 minutes apart


def test_reset_in_the_middle_is_not_a_rate():
    """The volatile count falls to 0 on a GPU reset; only the rises count."""
    counts = [1000, 1005, 1010, 0, 5, 10, 15]          # 5 per 20 minutes either side
    rows = series([{"ecc_volatile_corrected": c} for c in counts])
    rise, span, resets = dg.counter_increase([(r.time, r.values["ecc_sbe"]) for r in rows])
    assert (rise, span, resets) == (25.0, 6 * 20 * 60.0, 1)
    assert dg.score_gpu(rows, CFG).rules == ()


def test_reset_then_real_rise_still_fires():
    counts = [4000, 4100, 0, 200, 400, 600]            # a reset, then 600 per hour
    score = dg.score_gpu(series([{"ecc_volatile_corrected": c} for c in counts]), CFG)
    assert score.rules == ("sbe_rate",)
    assert "counter reset 1 time" in score.hits[0].detail
    assert score.hits[0].value == pytest.approx(700 * 3600 / (5 * 20 * 60.0), rel=1e-3)


def test_pending_remap_fires_on_the_newest_reading():
    rows = series([{}] * 3 + [{"remapped_rows_pending": True}])
    score = dg.score_gpu(rows, CFG)
    assert score.rules == ("row_remap_pending",) and score.level == "degraded"
    # after the reset the flag is clear: the rule clears too
    cleared = dg.score_gpu(rows + dg.readings_from_snapshot(
        "gpu-a1", rows[-1].time + 600, gpu_snapshot()), CFG)
    assert cleared.rules == () and cleared.level == "ok"


def test_remap_failure_and_uncorrected_rise_cap_at_one():
    rows = series([{}, {"ecc_volatile_uncorrected": 2, "remapped_rows_failure": True}])
    score = dg.score_gpu(rows, CFG)
    assert set(score.rules) == {"row_remap_failure", "uncorrected_ecc_rising"}
    assert score.score == 1.0 and score.level == "degraded"


def test_retired_pages_near_limit():
    assert dg.score_gpu(series([{"retired_pages_sbe": 40, "retired_pages_dbe": 7}]),
                        CFG).rules == ()                      # 47 < 48
    score = dg.score_gpu(series([{"retired_pages_sbe": 40, "retired_pages_dbe": 8}]), CFG)
    assert score.rules == ("retired_pages_near_limit",) and score.hits[0].value == 48


def test_nvlink_replay_rising_names_the_link():
    rows = series([{"links": {(2, "replay"): 40 * i, (0, "replay"): i}} for i in range(6)])
    score = dg.score_gpu(rows, CFG)
    assert score.rules == ("nvlink_replay_rising",)
    assert score.hits[0].value == {"2": pytest.approx(120.0)}
    assert "link 2" in score.hits[0].detail and "link 0" not in score.hits[0].detail


def test_nvlink_crc_sums_flit_and_data():
    rows = series([{"links": {(1, "crc_flit"): 10 * i, (1, "crc_data"): 15 * i}}
                   for i in range(4)])
    assert dg.score_gpu(rows, CFG).rules == ("nvlink_crc_rising",)   # 75 per hour > 60


def test_slowdown_needs_a_trend_not_one_reading():
    one = series([{}] * 5 + [{"throttle_reasons": 0x40}])
    assert dg.score_gpu(one, CFG).rules == ()
    power_cap = series([{"throttle_reasons": 0x04}] * 6)       # SW power cap: normal
    assert dg.score_gpu(power_cap, CFG).rules == ()
    hot = series([{"throttle_reasons": 0x40 | 0x04}] * 3 + [{}] * 3)
    score = dg.score_gpu(hot, CFG)
    assert score.rules == ("thermal_power_slowdown",) and "0x40" in score.hits[0].detail


def test_missing_fields_do_not_fire_and_are_listed():
    """An older GPU: the precursor calls said NOT_SUPPORTED, the fields are None."""
    old = {"ecc_volatile_corrected": None, "ecc_aggregate_corrected": None,
           "ecc_volatile_uncorrected": None, "ecc_aggregate_uncorrected": None,
           "remapped_rows_pending": None, "remapped_rows_failure": None,
           "retired_pages_sbe": None, "retired_pages_dbe": None,
           "retired_pages_pending": None, "throttle_reasons": None, "nvlink": None}
    score = dg.score_gpu(series([old] * 6), CFG)
    assert score.score == 0 and score.rules == ()
    # the kernel log's Xids do not depend on the GPU's counters
    assert set(score.no_data) == set(dg.RULES) - {"xid_reset_soon"}


def test_aggregate_ecc_stands_in_for_volatile():
    rows = series([{"ecc_volatile_corrected": None, "ecc_aggregate_corrected": 300 * i}
                   for i in range(4)])
    assert dg.score_gpu(rows, CFG).rules == ("sbe_rate",)


def test_gap_in_a_counter_is_skipped_not_a_reset():
    counts = [0, 100, None, None, 400, 500]
    rows = series([{"ecc_volatile_corrected": c} for c in counts])
    rise, span, resets = dg.counter_increase([(r.time, r.values["ecc_sbe"]) for r in rows])
    assert (rise, resets) == (500.0, 0) and span == 5 * 20 * 60.0


def test_old_readings_leave_the_window():
    rising = [{"ecc_volatile_corrected": 300 * i} for i in range(4)]
    flat = [{"ecc_volatile_corrected": 900}] * 20      # 20 more readings, 20 minutes apart
    rows = series(rising + flat)
    assert dg.score_gpu(rows, CFG).rules == ()         # the rise is older than 6h
    assert dg.score_gpu(rows, replace(CFG, window=12 * HOUR)).rules == ("sbe_rate",)


def test_thresholds_come_from_the_config():
    rows = series([{"ecc_volatile_corrected": 10 * i} for i in range(7)])   # 30 per hour
    assert dg.score_gpu(rows, replace(CFG, sbe_per_hour=20.0)).rules == ("sbe_rate",)
    remap = series([{"remapped_rows_pending": True}])
    assert dg.score_gpu(remap, replace(CFG, degraded_score=1.0)).level == "degraded"
    slow = series([{"throttle_reasons": 0x40}] * 4)
    assert dg.score_gpu(slow, replace(CFG, degraded_score=0.25)).level == "degraded"
    assert dg.score_gpu(slow, replace(CFG, slowdown_reasons=0x08)).rules == ()


def test_lost_gpu_and_failed_snapshot_give_no_readings():
    snap = gpu_snapshot(lost=True)
    assert dg.readings_from_snapshot("n", T0, snap) == []
    assert dg.readings_from_snapshot("n", T0, {"ok": False, "gpus": []}) == []
    assert dg.readings_from_snapshot("n", T0, None) == []


def test_score_node_per_gpu_and_worst_level():
    two = gpu_snapshot()
    other = copy.deepcopy(two["gpus"][0])
    other.update(uuid="GPU-other", index=1, remapped_rows_pending=True)
    two["gpus"].append(other)
    rows = dg.readings_from_snapshot("n", T0, two) + dg.readings_from_snapshot(
        "n", T0 + 1200, two)
    scores = dg.score_node(rows, CFG)
    assert set(scores) == {two["gpus"][0]["uuid"], "GPU-other"}
    assert scores["GPU-other"].rules == ("row_remap_pending",)
    assert scores[two["gpus"][0]["uuid"]].rules == ()
    assert dg.node_level(scores) == (1.0, "degraded")
    assert dg.node_level({}) == (0.0, "ok")


def test_score_change_is_an_evidence_record_only_on_change():
    quiet = dg.score_gpu(series([{}] * 3), CFG)
    assert dg.score_change(None, quiet) is None                  # nothing to say
    rows = series([{"ecc_volatile_corrected": 100 * i} for i in range(4)])
    rising = dg.score_gpu(rows, CFG)
    record = dg.score_change(quiet, rising)
    assert record["kind"] == "degradation" and record["node"] == "gpu-a1"
    assert record["level"] == "watch" and record["previous_level"] == "ok"
    assert [r["rule"] for r in record["rules"]] == ["sbe_rate"]
    assert record["rules"][0]["threshold"] == 100.0 and record["cleared"] == []
    assert dg.score_change(rising, dg.score_gpu(rows, CFG)) is None   # same again
    calm = dg.score_gpu(rows + dg.readings_from_snapshot(
        "gpu-a1", rows[-1].time + 7 * HOUR, gpu_snapshot(ecc_volatile_corrected=300)), CFG)
    back = dg.score_change(rising, calm)
    assert back["level"] == "ok" and back["cleared"] == ["sbe_rate"]


# ---- xid_reset_soon: an Xid whose catalog bucket is RESET_GPU --------------------

# dev_failures.jsonl's GSP timeout rows (Xid 119: RESET_GPU), parsed as the hooks do
GSP_119 = ("NVRM: Xid (PCI:0000:18:00): 119, pid=4071838, name=python, Timeout after 45s of "
           "waiting for RPC response from GPU4 GSP! Expected function 76 (GSP_RM_CONTROL) "
           "(0x20801702 0x4).")


def xid_series(points, xids_at, every=20 * 60.0):
    """Readings where report ``i`` carries the parsed Xids ``xids_at.get(i, [])``."""
    from slurm_hooks.kmsg import parse_xid
    out = []
    for i, changes in enumerate(points):
        snap = gpu_snapshot(**changes)
        xids = [parse_xid(line) for line in xids_at.get(i, [])]
        out += dg.readings_from_snapshot("gpu-a1", T0 + i * every, snap, xids)
    return out


def test_a_reset_gpu_xid_on_a_running_gpu_degrades_it():
    score = dg.score_gpu(xid_series([{}] * 4, {2: [GSP_119]}), CFG)
    assert score.rules == ("xid_reset_soon",) and score.level == "degraded"
    assert score.hits[0].value == [119] and "Xid 119" in score.hits[0].detail


def test_xids_of_other_buckets_or_other_gpus_do_not_fire():
    # Xid 92 (high single-bit ECC rate) is IGNORE in the catalog; 13 is RESTART_APP
    ignore = GSP_119.replace("): 119,", "): 92,")
    app = GSP_119.replace("): 119,", "): 13,")
    other_gpu = GSP_119.replace("PCI:0000:18:00", "PCI:0000:3b:00")
    no_pci = GSP_119.replace("(PCI:0000:18:00)", "")
    score = dg.score_gpu(xid_series([{}] * 4, {1: [ignore, app], 2: [other_gpu, no_pci]}), CFG)
    assert score.rules == () and score.no_data == ()


def test_a_reset_seen_in_the_counters_clears_the_xid():
    # the volatile corrected count falls after the Xid: the GPU was reset
    points = [{"ecc_volatile_corrected": 40}] * 3 + [{"ecc_volatile_corrected": 0}] * 2
    assert dg.score_gpu(xid_series(points, {1: [GSP_119]}), CFG).rules == ()
    # without the fall it still counts at the end of the series
    assert dg.score_gpu(xid_series([{"ecc_volatile_corrected": 40}] * 5, {1: [GSP_119]}),
                        CFG).rules == ("xid_reset_soon",)


def test_readings_without_xid_information_list_the_rule_as_no_data():
    rows = [r for i in range(3)
            for r in dg.readings_from_snapshot("n", T0 + i * 1200, gpu_snapshot())]
    assert "xid_reset_soon" in dg.score_gpu(rows, CFG).no_data
