"""slurm_hooks.gpu.snapshot through pynvml's real code against the fake NVML.

The fake libnvidia-ml.so.1 (tests/fake_nvml) is built once per module. A
process can hold only one libnvidia-ml.so.1 and NVML's state is global to it,
so every reading runs in a fresh interpreter; that also shows the preload by
absolute path takes effect in a clean process.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from recovery_devtools.devcluster.config import fake_gpus

REPO = Path(__file__).resolve().parents[2]
FAKE_DIR = REPO / "tests" / "fake_nvml"
FAKE_LIB = FAKE_DIR / "libnvidia-ml.so.1"

# Runs in the child: one or more snapshots, then proof of which library pynvml used.
CHILD = r"""
import ctypes, json, sys
from slurm_hooks.gpu import snapshot
args = json.loads(sys.argv[1])
if args.get("preload_first"):
    ctypes.CDLL(args["library"], mode=ctypes.RTLD_GLOBAL)   # before the state is named
results = [snapshot(args["library"], state) for state in args["states"]]
import pynvml
lib = pynvml.nvmlLib
maps = [line.split()[-1] for line in open("/proc/self/maps") if "libnvidia-ml" in line]
out = {"results": results, "mapped": sorted(set(maps)),
       "pynvml_handle_is_fake": lib is not None
           and lib._handle == ctypes.CDLL(args["library"])._handle,
       "error_string_9": pynvml.nvmlErrorString(9) if lib is not None else None}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def fake_lib() -> Path:
    build = subprocess.run(["make", "-C", str(FAKE_DIR), f"PYTHON={sys.executable}"],
                           capture_output=True, text=True, timeout=300)
    if build.returncode != 0 or not FAKE_LIB.is_file():
        pytest.fail(f"cannot build the fake NVML:\n{build.stdout}\n{build.stderr}")
    return FAKE_LIB


def run_child(library: Path | str, states: list[str], preload_first: bool = False) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RECOVERY_FAKE_NVML_STATE"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    args = {"library": str(library), "states": states, "preload_first": preload_first}
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stderr}"
    return json.loads(proc.stdout)


def snap(library: Path | str, state: str) -> dict:
    return run_child(library, [state])["results"][0]


def write_state(tmp_path: Path, state: dict | str, name: str = "gpus.json") -> str:
    path = tmp_path / name
    path.write_text(state if isinstance(state, str) else json.dumps(state, indent=1) + "\n")
    return str(path)


def healthy(count: int = 2) -> dict:
    return fake_gpus("node1", count)


def assert_matches(gpu: dict, want: dict) -> None:
    for field in ("index", "uuid", "name", "pci_bus_id", "temperature_c",
                  "ecc_volatile_uncorrected", "ecc_aggregate_uncorrected",
                  "retired_pages_pending", "remapped_rows_pending", "remapped_rows_failure",
                  "throttle_reasons", "ecc_volatile_corrected", "ecc_aggregate_corrected",
                  "remapped_rows_correctable", "remapped_rows_uncorrectable",
                  "retired_pages_sbe", "retired_pages_dbe"):
        assert gpu[field] == want.get(field, 0), field
    links = []
    for i, active in enumerate(want["nvlink_active"]):
        link = {"link": i, "active": active}
        for name in LINK_COUNTERS:
            values = want.get(f"nvlink_{name}") or []
            link[name] = values[i] if i < len(values) else 0
        links.append(link)
    assert gpu["nvlink"] == links
    assert gpu["lost"] is False and gpu["errors"] == {} and gpu["unsupported"] == []


LINK_COUNTERS = ("replay", "recovery", "crc_flit", "crc_data", "ecc_data")


def test_healthy_two_gpus(fake_lib, tmp_path):
    state = healthy(2)
    out = run_child(fake_lib, [write_state(tmp_path, state)])
    result = out["results"][0]
    assert result["ok"] is True and result["error"] is None
    assert result["count"] == 2 and len(result["gpus"]) == 2
    for gpu, want in zip(result["gpus"], state["gpus"]):
        assert_matches(gpu, want)
        assert gpu["memory_total_bytes"] == 80 << 30
    assert [g["pci_short"] for g in result["gpus"]] == ["0000:18:00", "0000:28:00"]


def test_pynvml_really_called_the_fake(fake_lib, tmp_path):
    out = run_child(fake_lib, [write_state(tmp_path, healthy(1))])
    assert out["results"][0]["driver"] == "fake-555.42"
    assert out["pynvml_handle_is_fake"] is True
    assert out["mapped"] == [str(fake_lib)]          # no other libnvidia-ml in the process
    assert out["error_string_9"] == "Driver Not Loaded"   # answered by the fake's C code


def test_state_is_read_at_init_not_at_load(fake_lib, tmp_path):
    out = run_child(fake_lib, [write_state(tmp_path, healthy(3))], preload_first=True)
    assert out["results"][0]["ok"] is True and out["results"][0]["count"] == 3


def test_faults_on_one_gpu(fake_lib, tmp_path):
    state = healthy(2)
    bad = state["gpus"][1]
    bad.update(ecc_volatile_uncorrected=3, ecc_aggregate_uncorrected=12,
               remapped_rows_pending=True, remapped_rows_failure=True,
               retired_pages_pending=True, throttle_reasons=0x48, temperature_c=91,
               nvlink_active=[True, False, True, False], pci_bus_id="00000000:3B:00.0")
    result = snap(fake_lib, write_state(tmp_path, state))
    assert result["ok"] is True
    assert_matches(result["gpus"][0], state["gpus"][0])
    assert_matches(result["gpus"][1], bad)
    assert result["gpus"][1]["pci_short"] == "0000:3b:00"


def test_pci_bus_id_is_normalized(fake_lib, tmp_path):
    state = healthy(1)
    state["gpus"][0]["pci_bus_id"] = "0000:af:00.0"    # short, lowercase in the state
    gpu = snap(fake_lib, write_state(tmp_path, state))["gpus"][0]
    assert gpu["pci_bus_id"] == "00000000:AF:00.0" and gpu["pci_short"] == "0000:af:00"


def test_no_nvlink_is_none(fake_lib, tmp_path):
    state = healthy(2)
    state["gpus"][0]["nvlink_active"] = []
    state["gpus"][1]["nvlink_active"] = None
    result = snap(fake_lib, write_state(tmp_path, state))
    assert [g["nvlink"] for g in result["gpus"]] == [None, None]
    assert all(g["errors"] == {} for g in result["gpus"])


def test_missing_gpu_is_lost_others_intact(fake_lib, tmp_path):
    state = healthy(3)
    state["gpus"][1]["missing"] = True
    result = snap(fake_lib, write_state(tmp_path, state))
    assert result["ok"] is True and result["count"] == 3
    lost = result["gpus"][1]
    assert lost["lost"] is True and lost["index"] == 1
    assert lost["uuid"] is None and lost["temperature_c"] is None
    assert lost["errors"]["uuid"] == "GPU is lost"
    assert set(lost["errors"]) >= {"uuid", "name", "pci_bus_id", "temperature_c",
                                   "ecc_volatile_uncorrected", "remapped_rows_failure",
                                   "throttle_reasons", "nvlink"}
    for i in (0, 2):
        assert_matches(result["gpus"][i], state["gpus"][i])


def test_unknown_keys_and_nesting_are_tolerated(fake_lib, tmp_path):
    state = healthy(1)
    state["extra"] = {"a": [1, -2.5e3, {"b": None, "c": [True, False, []]}], "s": "x\u00e9\"\\/y"}
    state["gpus"][0]["vendor_note"] = {"deep": [[[{}]]], "emoji": "\U0001F600"}
    state["gpus"][0]["a_rather_long_unknown_key_" + "x" * 100] = 7
    state["nvml_error"] = None
    result = snap(fake_lib, write_state(tmp_path, state))
    assert result["ok"] is True
    assert_matches(result["gpus"][0], state["gpus"][0])


def test_driver_not_loaded(fake_lib, tmp_path):
    state = healthy(2)
    state["nvml_error"] = "driver_not_loaded"
    out = run_child(fake_lib, [write_state(tmp_path, state)])
    result = out["results"][0]
    assert result == {"ok": False, "error": "Driver Not Loaded", "driver": "", "count": 0,
                      "gpus": []}
    assert result["error"] == out["error_string_9"]   # the same text the fake's NVML gives


@pytest.mark.parametrize("name, text", [
    ("uninitialized", "Uninitialized"),
    ("lib_rm_version_mismatch", "RM has detected an NVML/RM version mismatch."),
    ("no_such_error_name", "Unknown Error"),
])
def test_other_init_errors(fake_lib, tmp_path, name, text):
    state = healthy(1)
    state["nvml_error"] = name
    result = snap(fake_lib, write_state(tmp_path, state))
    assert result["ok"] is False and result["error"] == text and result["count"] == 0


def test_state_file_absent_is_driver_not_loaded(fake_lib, tmp_path):
    result = snap(fake_lib, str(tmp_path / "nope.json"))
    assert result["ok"] is False and result["error"] == "Driver Not Loaded"


@pytest.mark.parametrize("text", [
    "", "not json", "{", "[]", '{"gpus": [}', '{"gpus": [{"index": "zero"}]}',
    '{"gpus": [{"temperature_c": -4}]}', '{"gpus": [{"missing": "yes"}]}',
    '{"gpus": [{"pci_bus_id": "nonsense"}]}', '{"gpus": [{"uuid": "' + "u" * 200 + '"}]}',
    '{"gpus": [{"nvlink_active": [' + ",".join(["true"] * 37) + "]}]}",
    '{"gpus": []} trailing', '{"gpus": [{"name": "bad \\q escape"}]}',
    '{"gpus": [{"name": "nul \\u0000"}]}', '{"gpus": [{"name": "lone \\ud800"}]}',
    '{"a": ' + "[" * 500 + "]" * 500 + ', "gpus": []}', '{"gpus": [{"index": 01}]}',
    '{"gpus": [' + ",".join(["{}"] * 65) + "]}",
])
def test_garbled_state(fake_lib, tmp_path, text):
    result = snap(fake_lib, write_state(tmp_path, text))
    assert result["ok"] is False and result["count"] == 0
    assert result["error"] == "Unknown Error"


def test_every_truncation_fails_cleanly(fake_lib, tmp_path):
    text = json.dumps(healthy(2))
    states = []
    for cut in range(0, len(text), 7):
        states.append(write_state(tmp_path, text[:cut], f"cut{cut}.json"))
    states.append(write_state(tmp_path, text, "whole.json"))
    results = run_child(fake_lib, states)["results"]
    assert all(r["ok"] is False and r["error"] == "Unknown Error" for r in results[:-1])
    assert results[-1]["ok"] is True and results[-1]["count"] == 2   # NVML usable again


def test_binary_garbage(fake_lib, tmp_path):
    path = tmp_path / "garbage.json"
    path.write_bytes(bytes(range(256)) * 4)
    result = snap(fake_lib, str(path))
    assert result["ok"] is False and result["error"] == "Unknown Error"


def test_library_that_does_not_exist(fake_lib, tmp_path):
    missing = tmp_path / "no" / "libnvidia-ml.so.1"
    result = snap(missing, write_state(tmp_path, healthy(1)))
    assert result["ok"] is False and result["count"] == 0 and result["gpus"] == []
    assert str(missing) in result["error"]


def test_repeated_snapshots_reread_the_state(fake_lib, tmp_path):
    first = healthy(2)
    second = copy.deepcopy(first)
    second["gpus"][0]["temperature_c"] = 77
    out = run_child(fake_lib, [write_state(tmp_path, first, "a.json"),
                               write_state(tmp_path, second, "b.json")])
    assert [r["gpus"][0]["temperature_c"] for r in out["results"]] == [35, 77]


# ---- precursor counters (issue 20): pynvml's own wrappers read the fake's new fields

def test_precursor_counters_are_read(fake_lib, tmp_path):
    state = healthy(2)
    worn = state["gpus"][1]
    worn.update(ecc_volatile_corrected=41, ecc_aggregate_corrected=907,
                remapped_rows_correctable=3, remapped_rows_uncorrectable=1,
                remapped_rows_pending=True, retired_pages_sbe=7, retired_pages_dbe=2,
                nvlink_replay=[0, 12], nvlink_recovery=[0, 0, 1],
                nvlink_crc_flit=[5, 0, 0, 9], nvlink_crc_data=[0, 3],
                nvlink_ecc_data=[1, 1, 1, 1], throttle_reasons=0x40)
    result = snap(fake_lib, write_state(tmp_path, state))
    assert result["ok"] is True
    assert_matches(result["gpus"][0], state["gpus"][0])
    assert_matches(result["gpus"][1], worn)
    gpu = result["gpus"][1]
    assert gpu["nvlink"][1]["replay"] == 12 and gpu["nvlink"][3]["crc_flit"] == 9
    assert gpu["nvlink"][3]["replay"] == 0      # past the end of a shorter array: 0
    assert (gpu["retired_pages_sbe"], gpu["retired_pages_dbe"]) == (7, 2)


def test_retired_page_lists_through_pynvml(fake_lib, tmp_path):
    """pynvml sizes the buffer with a first call (count 0, no buffer), then
    fills it; both the plain and the _v2 (timestamps) wrapper must work."""
    state = healthy(1)
    state["gpus"][0].update(retired_pages_sbe=3, retired_pages_dbe=0)
    child = r"""
import ctypes, json, sys
ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
import pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
sbe = n.nvmlDeviceGetRetiredPages(h, n.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
dbe = n.nvmlDeviceGetRetiredPages(h, n.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
v2 = n.nvmlDeviceGetRetiredPages_v2(h, n.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
try:
    n.nvmlDeviceGetNvLinkErrorCounter(h, 0, n.NVML_NVLINK_ERROR_COUNT)
    bad = None
except n.NVMLError as e:
    bad = e.value
print(json.dumps({"sbe": sbe, "dbe": dbe, "v2": v2, "bad_counter": bad}))
"""
    env = dict(os.environ, RECOVERY_FAKE_NVML_STATE=write_state(tmp_path, state))
    proc = subprocess.run([sys.executable, "-c", child, str(fake_lib)], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert len(out["sbe"]) == 3 and len(set(out["sbe"])) == 3 and out["dbe"] == []
    assert [p["address"] for p in out["v2"]] == out["sbe"]
    assert all(p["timestamp"] > 0 for p in out["v2"])
    assert out["bad_counter"] == 2          # NVML_ERROR_INVALID_ARGUMENT


def test_unsupported_features_are_none_not_errors(fake_lib, tmp_path):
    """An older GPU or driver: every precursor call answers NOT_SUPPORTED."""
    state = healthy(2)
    old = state["gpus"][0]
    old.update(not_supported=["ecc", "remapped_rows", "retired_pages", "nvlink_errors",
                              "clock_reasons"], ecc_volatile_corrected=5)
    result = snap(fake_lib, write_state(tmp_path, state))
    assert result["ok"] is True
    gpu = result["gpus"][0]
    assert gpu["errors"] == {} and gpu["lost"] is False
    for field in ("ecc_volatile_uncorrected", "ecc_aggregate_uncorrected",
                  "ecc_volatile_corrected", "ecc_aggregate_corrected", "retired_pages_sbe",
                  "retired_pages_dbe", "retired_pages_pending", "remapped_rows_pending",
                  "remapped_rows_failure", "remapped_rows_correctable",
                  "remapped_rows_uncorrectable", "throttle_reasons"):
        assert gpu[field] is None, field
        assert field in gpu["unsupported"], field
    assert gpu["nvlink"][0] == {"link": 0, "active": True, "replay": None, "recovery": None,
                                "crc_flit": None, "crc_data": None, "ecc_data": None}
    assert {"nvlink_replay", "nvlink_crc_data"} <= set(gpu["unsupported"])
    assert len(gpu["unsupported"]) == len(set(gpu["unsupported"]))   # once per field
    assert gpu["temperature_c"] == 35                                 # the rest still read
    assert_matches(result["gpus"][1], state["gpus"][1])


@pytest.mark.parametrize("text", [
    '{"gpus": [{"not_supported": ["warp_drive"]}]}',
    '{"gpus": [{"not_supported": "ecc"}]}',
    '{"gpus": [{"nvlink_replay": [1, -1]}]}',
    '{"gpus": [{"nvlink_crc_flit": [' + ",".join(["0"] * 37) + "]}]}",
    '{"gpus": [{"retired_pages_sbe": 5000}]}',
    '{"gpus": [{"ecc_volatile_corrected": true}]}',
])
def test_garbled_precursor_state(fake_lib, tmp_path, text):
    result = snap(fake_lib, write_state(tmp_path, text))
    assert result["ok"] is False and result["error"] == "Unknown Error"


def test_fake_counters_through_pynvml_score_as_degraded(fake_lib, tmp_path):
    """End to end: the fake's counters rise between snapshots, pynvml reads
    them, and the degradation score sees the SBE rate and the pending remap;
    the second GPU (an older one, NOT_SUPPORTED everywhere) scores 0."""
    from recovery_agent.config.schema import ProactiveConfig
    from recovery_agent.detect import degradation as dg

    states = []
    for step in range(4):
        state = healthy(2)
        state["gpus"][0].update(ecc_volatile_corrected=200 * step,
                                remapped_rows_pending=step == 3)
        state["gpus"][1]["not_supported"] = ["ecc", "remapped_rows", "retired_pages",
                                             "nvlink_errors", "clock_reasons"]
        states.append(write_state(tmp_path, state, f"s{step}.json"))
    results = run_child(fake_lib, states)["results"]
    assert all(r["ok"] for r in results)
    readings = []
    for step, result in enumerate(results):
        readings += dg.readings_from_snapshot("node1", 1_700_000_000 + step * 1800.0, result)
    scores = dg.score_node(readings, ProactiveConfig())
    worn = scores[results[0]["gpus"][0]["uuid"]]
    old = scores[results[0]["gpus"][1]["uuid"]]
    assert set(worn.rules) == {"sbe_rate", "row_remap_pending"}
    assert worn.level == "degraded"
    assert old.score == 0 and "row_remap_pending" in old.no_data
