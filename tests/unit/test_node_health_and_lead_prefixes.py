"""Two families read from what prints them (issue 15): the LBNL Node Health
Check's failures (mej/nhc: die() logs "ERROR:  nhc:  Health check failed:
<check>: ...", its drain sets the Slurm reason "NHC: <check>: ..."), and a
traceback whose every line repeats the prefix its header line has (a logger
that prefixes each line of a message, a tool transcript's "[stderr] "), and
the kernel OOM killer's header read as the kill it announces.

Every log line is a real one, quoted in the public text named above it (the
same ones the rules in etc/patterns/slurm.toml cite); none is built from a
format.
"""
from __future__ import annotations

import json
from pathlib import Path

from recovery_agent.detect.attribution import attribute
from recovery_agent.detect.context import AttributionContext
from recovery_agent.detect.patterns import load_rules
from tests.unit.packs import fired_rules, scanner, scored_verdict  # noqa: F401 (scanner: a fixture)
from tests.unit.test_evidence_boundary import scan

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "corpus"

# an NHC exporter's tests (find_string id 51943633573)
NHC_GPU_COUNT = ["ERROR:  nhc:  Health check failed:  check_gpu_count:  Invalid number of AMD GPUs present."]
NHC_SERVICE = ["ERROR:  nhc:  Health check failed:  check_ps_service:  Service chronyd (process chronyd) owned by chrony not running; start in progress"]
# a cluster health report in public docs (find_string id 36146247394)
NHC_IB = ["monument-273 | ERROR: nhc: Health check failed: check_hw_ib: No IB port mlx5_ib7:1 is ACTIVE (LinkUp 400 Gb/sec)."]
# an scontrol show node in a public repository (find_string id 24738526160)
NHC_REASON = ["        Reason=NHC: check_ps_service:  Service sshd (process sshd) owned by root not running [root@2024-08-20T16:32:47]"]
# a passing check and a check about to run (find_string ids 63150932199, 51943633573)
NHC_PASSED = ["SUCCESS:  nhc:  Health check passed:  check_gpu_count: Expected 8 and found 8",
              'Running check:  "check_gpu_count 3"']


def test_a_failed_health_check_takes_the_node_out_by_what_it_checked(scanner):
    v = scored_verdict(scanner, NHC_GPU_COUNT)
    assert (v.category, v.action) == ("gpu_hardware", "requeue_exclude")
    v = scored_verdict(scanner, NHC_IB)
    assert (v.category, v.action) == ("interconnect", "requeue_exclude")
    for lines in (NHC_SERVICE, NHC_REASON):
        v = scored_verdict(scanner, lines)
        assert (v.category, v.action) == ("system_software", "requeue_exclude")


def test_a_passed_or_starting_check_is_not_a_failure(scanner):
    assert fired_rules(scanner, NHC_PASSED) == []
    assert scored_verdict(scanner, NHC_PASSED).action == "none"


def test_a_health_check_line_the_job_printed_blames_no_node():
    # NHC's and slurmctld's words: a job that prints them proves nothing
    rules = {r.id: r for r in load_rules() if r.id.startswith("nhc.")}
    assert set(rules) == {"nhc.gpu_check_failed", "nhc.fabric_check_failed", "nhc.check_failed"}
    assert all(r.emitter == "system" and r.role == "root" for r in rules.values())
    job = attribute(scan(NHC_GPU_COUNT, "job"), AttributionContext(nodes=("node1",)))
    assert job.blame != "node" and job.nodes == () and job.action != "requeue_exclude"
    node = attribute(scan(NHC_GPU_COUNT, "system"), AttributionContext(nodes=("node1",)))
    assert (node.blame, node.action, node.nodes) == ("node", "requeue_exclude", ("node1",))


# a tool transcript's stderr (find_string id 71647673219)
STDERR_TRACEBACK = ["[stderr] Traceback (most recent call last):",
                    '[stderr]   File "<string>", line 1, in <module>',
                    "[stderr]     import acme; print(acme)",
                    "[stderr]     ^^^^^^^^^^^",
                    "[stderr] ModuleNotFoundError: No module named 'acme'"]


def _corpus_row(name, row_id):
    for line in (CORPUS / name).read_text().splitlines():
        row = json.loads(line)
        if row["id"] == row_id:
            return row["lines"]
    raise AssertionError(row_id)


def test_a_traceback_behind_its_headers_own_prefix_is_read_to_its_exception(scanner):
    found = scanner.scan_lines(STDERR_TRACEBACK)
    assert [d.rule for d in found] == ["python.import_error"]
    assert found[0].detail.startswith("traceback ending ModuleNotFoundError")
    assert STDERR_TRACEBACK[0] in [e.text for e in found[0].evidence]
    # Metaflow's per-line prefix, its clock in it (databrickslabs/dolly#139)
    lines = _corpus_row("public_tune.jsonl", "ho-dolly139-metaflow-prefixed-errno28-torch-save")
    found = scanner.scan_lines(lines)
    assert [d.rule for d in found] == ["fs.no_space"]
    assert found[0].detail.startswith("traceback ending OSError")
    v = scored_verdict(scanner, lines)
    assert (v.category, v.action) == ("system_software", "stop")


def test_a_line_without_the_headers_prefix_is_not_part_of_its_traceback(scanner):
    # the header's prefix differs from the next lines' (a level word, not
    # digits): those lines are not frames, and the traceback stays unfinished
    lines = ["[2026-06-07T21:05:05.705689Z] [ERROR] [cycle] Traceback (most recent call last):",
             "[2026-06-07T21:05:05.721658Z] [INFO] [cycle] Cycle error outbox written: /home/fiste/Noema/symnozein/body/bridge/outbox/messages/2026-06-07T210505Z_rpi5_cycle-error-unknown.md"]
    assert fired_rules(scanner, lines) == ["python.traceback_unfinished"]


# mm/oom_kill.c dump_header(), printed once a victim is chosen: a log cut after
# it still shows an OOM kill (tensorflow/tensorflow#9419, tune row)
OOM_HEADER_ONLY = ["[  687.293876] python invoked oom-killer: gfp_mask=0x24280ca, order=0, oom_score_adj=0",
                   "[  687.293881] python cpuset=/ mems_allowed=0"]


def test_the_oom_killers_header_alone_is_an_oom_kill(scanner):
    assert fired_rules(scanner, OOM_HEADER_ONLY) == ["oom.kernel_killer_invoked"]
    v = scored_verdict(scanner, OOM_HEADER_ONLY)
    assert (v.category, v.action) == ("oom", "stop")
    rule = next(r for r in load_rules() if r.id == "oom.kernel_killer_invoked")
    assert rule.emitter == "system"
