"""Pattern packs: every shipped rule's examples, the loader's errors, site packs."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from recovery_agent.detect import model
from recovery_agent.detect.engines import hyperscan_probe, required_literals
from recovery_agent.detect.patterns import (QUIET_XIDS, REQUEUE_XIDS, STOP_XIDS, load_pack,
                                            load_rules, shipped_dir, xid_action)
from recovery_agent.detect.scanner import Scanner
from recovery_agent.errors import ConfigError
from slurm_hooks.kmsg import FATAL_XIDS

RULES = load_rules()
LINE_RULES = [r for r in RULES if r.scope == "line"]
SCANNER = Scanner(RULES, engine="re")
CATALOG = Path(__file__).resolve().parents[1] / "fixtures" / "corpus" / "xid_catalog.jsonl"


def _examples(kind: str):
    for rule in RULES:
        for line in getattr(rule, f"examples_{kind}"):
            yield pytest.param(rule, line, id=f"{rule.id}:{line[:40]}")


def test_shipped_packs_cover_every_category_and_area():
    assert {r.category for r in RULES} == set(model.CATEGORIES)
    files = {Path(r.source).stem for r in RULES}
    assert {"nccl", "cuda", "pytorch", "python", "kernel_gpu", "interconnect", "oom",
            "filesystem", "signals", "slurm"} <= files
    assert len({r.id for r in RULES}) == len(RULES)


@pytest.mark.parametrize("rule, line", _examples("match"))
def test_match_examples_fire_through_the_scanner(rule, line):
    assert rule.compiled.search(line)
    if rule.scope != "line":
        return
    hits = SCANNER.hits(line, range(len(SCANNER.line_rules)))
    ids = {r.id for r, _ in hits}
    # a more specific rule may claim the line; then it outranks this one
    assert rule.id in ids or max(r.priority for r, _ in hits) > rule.priority, ids


@pytest.mark.parametrize("rule, line", _examples("no_match"))
def test_no_match_examples_stay_quiet(rule, line):
    assert rule.compiled.search(line) is None


@pytest.mark.parametrize("rule", LINE_RULES, ids=lambda r: r.id)
def test_every_shipped_line_rule_is_documented_and_prefilterable(rule):
    assert rule.examples_match and rule.examples_no_match and rule.description
    assert required_literals(rule.regex) is not None, "no literal for the re prefilter"


@pytest.mark.skipif(hyperscan_probe() is not None, reason="hyperscan does not import")
@pytest.mark.parametrize("rule", LINE_RULES, ids=lambda r: r.id)
def test_every_line_rule_compiles_in_hyperscan(rule):
    import hyperscan
    db = hyperscan.Database(mode=hyperscan.HS_MODE_BLOCK)
    db.compile(expressions=[rule.regex.encode()], ids=[0], elements=1,
               flags=[hyperscan.HS_FLAG_MULTILINE])


@pytest.mark.parametrize("line, category", [
    ("[rank0]:[E1 ProcessGroupNCCL.cpp:1] [Rank 0] Watchdog caught collective operation "
     "timeout: WorkNCCL(SeqNum=3, OpType=ALLREDUCE, Timeout(ms)=600000) ran for 600001 "
     "milliseconds before timing out.", "nccl_timeout_hang"),
    ("n1:1:2 [0] transport/net_ib.cc:1 NCCL WARN NET/IB : Got completion from peer "
     "10.0.0.2<4000> with status=12 opcode=0 len=0 vendor err 129", "interconnect"),
    ("RuntimeError: NCCL error: unhandled system error, NCCL version 2.19.3", "interconnect"),
    ("ncclRemoteError: remote process exited or there was a network error", "interconnect"),
    ("RuntimeError: CUDA error: misaligned address", "cuda_error"),
    ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ", "application"),
    ("  exitcode  : -11 (pid: 9)", "segfault"),
    ("NVRM: Xid (PCI:0000:3b:00): 48, pid=1, name=python, An uncorrectable double bit "
     "error (DBE) has been detected on GPU", "gpu_hardware"),
    ("[1.2] mlx5_core 0000:5e:00.0 ibp94s0: Link down", "interconnect"),
    ("ibv_poll_cq: transport retry counter exceeded", "interconnect"),
    ("Memory cgroup out of memory: Killed process 12 (python)", "oom"),
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20 MiB", "oom"),
    ("OSError: [Errno 116] Stale file handle", "system_software"),
    ("LustreError: 11-0: fs-OST0001-osc: operation ost_read failed: rc = -107",
     "system_software"),
    ("OSError: [Errno 28] No space left on device", "system_software"),
    ("Segmentation fault (core dumped)", "segfault"),
    ("slurmstepd: error: *** JOB 1 ON n1 CANCELLED AT 2025-01-01T00:00:00 DUE TO TIME LIMIT ***",
     "system_software"),
])
def test_issue_families_are_covered(line, category):
    found = SCANNER.scan_lines([line])
    assert [d.category for d in found] == [category]


@pytest.mark.parametrize("line", [
    "node1:12:12 [0] NCCL INFO Channel 00/24 :    0   1   2   3   4   5   6   7",
    "node1:12:30 [0] net_fastsocket.cc:785 NCCL WARN Maximum retry reached for accept 3.",
    "[rank0]:[W101 00:00:00.0 ProcessGroupNCCL.cpp:1479] Warning: WARNING: "
    "destroy_process_group() was not called before program exit",
    "[INFO] [loss_scaler.py:183:update_scale] [deepspeed] OVERFLOW! Rank 0 Skipping step.",
    "slurmstepd: error: *** JOB 7 ON n2 CANCELLED AT 2025-01-01T00:00:00 DUE TO JOB REQUEUE ***",
    "/lib/python3.11/site-packages/torch/distributed/launch.py:208: FutureWarning: deprecated",
    "6,3973,227996636,-;nvidia-peermem nv_get_p2p_free_callback:127 ERROR detected invalid "
    "context, skipping further processing",
])
def test_benign_noise_does_not_fire(line):
    assert SCANNER.scan_lines([line]) == []


# -- the loader ------------------------------------------------------------------

GOOD = """
[[rule]]
id = "site.disk_smart"
category = "system_software"
action = "requeue_exclude"
regex = '''smartd\\[\\d+\\]: Device: (?P<host>\\S+) .*FAILED SMART'''
examples.match = ["smartd[77]: Device: gpu-x1 /dev/nvme0 FAILED SMART self-check"]
examples.no_match = ["smartd[77]: Device: gpu-x1 /dev/nvme0 passed"]
"""


def _pack(tmp_path: Path, body: str, name: str = "site.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


@pytest.mark.parametrize("change, message", [
    (("'''smartd", "'''(smartd"), "bad regex"),
    (('action = "requeue_exclude"', 'action = "requeue_exclude"\ncolour = "red"'), "colour"),
    (('category = "system_software"', 'category = "disk"'), "category 'disk'"),
    (('action = "requeue_exclude"', 'action = "reboot"'), "action 'reboot'"),
    (("FAILED SMART self-check", "failed smart self-check"), "example does not match"),
    (("/dev/nvme0 passed", "/dev/nvme0 FAILED SMART again"), "no_match example matches"),
    (("(?P<host>", "(?P<node>"), "unknown named group"),
    (("FAILED SMART'''", "FAILED(?= SMART)'''"), "not supported"),
    (('examples.match = [', 'examples.nope = [1]\nexamples.match = ['), "examples"),
])
def test_bad_rule_names_file_and_rule(tmp_path, change, message):
    path = _pack(tmp_path, GOOD.replace(*change))
    with pytest.raises(ConfigError) as err:
        load_pack(path)
    assert str(path) in str(err.value) and "'site.disk_smart'" in str(err.value)
    assert message in str(err.value)


def test_duplicate_ids_within_and_across_packs(tmp_path):
    with pytest.raises(ConfigError, match=r"site.toml: rule 'site.disk_smart': duplicate"):
        load_pack(_pack(tmp_path, GOOD + GOOD))
    other = tmp_path / "other"
    other.mkdir()
    _pack(tmp_path, GOOD)
    _pack(other, GOOD, "again.toml")
    with pytest.raises(ConfigError, match=r"again.toml: rule 'site.disk_smart': duplicate id"):
        load_rules([tmp_path, other], shipped=False)
    clash = GOOD.replace("site.disk_smart", "nccl.watchdog_timeout")
    with pytest.raises(ConfigError, match="duplicate id"):
        load_rules([_pack(other, clash, "again.toml").parent])


def test_unreadable_or_misshapen_pack(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_pack(_pack(tmp_path, "[[rule]\nid = 1"))
    with pytest.raises(ConfigError, match="unknown top-level"):
        load_pack(_pack(tmp_path, 'rules = ["x"]'))
    with pytest.raises(ConfigError, match="not found"):
        load_rules([tmp_path / "missing"], shipped=False)


def test_site_pack_dir_adds_rules_to_the_scanner(tmp_path):
    _pack(tmp_path, GOOD)
    rules = load_rules([tmp_path])
    assert rules[-1].id == "site.disk_smart" and len(rules) == len(RULES) + 1
    found = Scanner(rules).scan_lines(["smartd[9]: Device: gpu-x7 /dev/nvme1 FAILED SMART"])
    assert [(d.rule, d.host, d.action_hint) for d in found] == [
        ("site.disk_smart", "gpu-x7", "requeue_exclude")]


def test_shipped_dir_is_the_repository_packs():
    assert shipped_dir() == Path(__file__).resolve().parents[2] / "etc" / "patterns"


# -- XID actions ------------------------------------------------------------------

@pytest.mark.skipif(not CATALOG.exists(), reason="shared corpus not present")
def test_xid_buckets_follow_the_catalog():
    buckets: dict = {}
    for line in CATALOG.read_text().splitlines():
        row = json.loads(line)
        buckets.setdefault(row["job_recovery_action"], set()).add(row["xid"])
    assert buckets["requeue_exclude_node"] == set(FATAL_XIDS)
    assert buckets["requeue"] == set(REQUEUE_XIDS)
    assert buckets["stop"] == set(STOP_XIDS)
    assert buckets["none"] == set(QUIET_XIDS)


@pytest.mark.parametrize("xid, message, kind, action", [
    (79, "GPU has fallen off the bus.", "xid", "requeue_exclude"),
    (145, "RLW_RXPIPE Nonfatal XC0 i0 Link 13", "xid", "none"),
    (154, "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)", "xid",
     "requeue_exclude"),
    (154, "GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)", "xid",
     "none"),
    (13, "Graphics SM Warp Exception", "xid", "stop"),
    (94, "Contained ECC error", "xid", "requeue"),
    (63, "Row Remapper", "xid", "none"),
    (20034, "Fatal, Link 48 LTSSM Fault Up", "sxid", "requeue_exclude"),
    (12028, "Non-fatal, Link 4", "sxid", "none"),
])
def test_xid_action(xid, message, kind, action):
    assert xid_action(xid, message, kind) == action
