"""Node-software and infrastructure formats added for the system_software family.

Each line is a real line from a public log (the comment above the rule in
etc/patterns/*.toml names where); the tests check what the line means for the
job through the scanner and attribution, not only that a regex matches.
"""
from __future__ import annotations

import pytest

from recovery_agent.detect.attribution import attribute
from recovery_agent.detect.context import context_from_lines
from recovery_agent.detect.patterns import load_rules
from recovery_agent.detect.scanner import Scanner

SCANNER = Scanner(load_rules(), engine="re")


def _verdict(lines):
    return attribute(SCANNER.scan_lines(lines), context_from_lines(lines))


@pytest.mark.parametrize("line, rule, action", [
    # slurmctld's drain reason after processes outlived the kill
    ("Kill task failed     root      2025-06-02T22:09:38 kla-ac-cpu-[04,16]",
     "slurm.node_drained_kill_task_failed", "requeue_exclude"),
    # LNet under Lustre: a transfer to a server NID timed out
    ("[Mon Oct 16 09:54:43 2017] LNet: 2431:0:(o2iblnd_cb.c:3174:kiblnd_check_conns()) "
     "Timed out tx for 172.31.126.87@o2ib: 403055 seconds", "fs.lnet_timeout", "requeue"),
    # libnvidia-container: the driver service (node) and the nvcgo helper (load)
    ("nvidia-container-cli: initialization error: driver rpc error: timed out",
     "container.nvidia_runtime_failed", "requeue_exclude"),
    ("nvidia-container-cli: initialization error: driver rpc error: failed to process "
     "request: unknown.", "container.nvidia_runtime_failed", "requeue_exclude"),
    ("nvidia-container-cli: initialization error: nvcgo rpc error: timed out",
     "container.nvcgo_rpc_timeout", "requeue"),
])
def test_formats_classify(line, rule, action):
    found = SCANNER.scan_lines([line])
    assert [(d.rule, d.category, d.action_hint) for d in found] == \
        [(rule, "system_software", action)]


@pytest.mark.parametrize("line", [
    "srun: error: Application launch failed: Kill task failed",
    "[Mon Oct 16 09:54:43 2017] LNet: 2431:0:(o2iblnd_cb.c:3174:kiblnd_check_conns()) "
    "Skipped 24 previous similar messages",
])
def test_neighbours_are_not_taken(line):
    rules = {d.rule for d in SCANNER.scan_lines([line])}
    assert not rules & {"slurm.node_drained_kill_task_failed", "fs.lnet_timeout"}


def test_scontrols_reason_line_names_no_node_and_fires_nothing():
    """A health script logging `scontrol show node` for every node would
    otherwise blame the host that printed the line, not the drained node."""
    lines = ["   Reason=Kill task failed [root@2024-08-08T19:12:57]"]
    assert "slurm.node_drained_kill_task_failed" not in {
        d.rule for d in SCANNER.scan_lines(lines)}


def test_a_kill_task_drain_names_the_nodes_sinfo_lists():
    verdict = _verdict(["Kill task failed     root      2025-06-02T22:09:38 kla-ac-cpu-[04,16]"])
    assert (verdict.category, verdict.action) == ("system_software", "requeue_exclude")
    assert set(verdict.nodes) == {"kla-ac-cpu-04", "kla-ac-cpu-16"}


def test_an_lnet_timeout_alone_is_a_retry_without_a_node():
    verdict = _verdict(["[Mon Oct 16 09:54:43 2017] LNet: 2431:0:(o2iblnd_cb.c:3174:"
                        "kiblnd_check_conns()) Timed out tx for 172.31.126.87@o2ib: "
                        "403055 seconds"])
    assert (verdict.category, verdict.action) == ("system_software", "requeue")
    assert verdict.nodes == ()
