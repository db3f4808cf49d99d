"""`recovery-devcluster inject`: files only, on a state dir laid out in tmp_path."""
from __future__ import annotations

import json
import time

import pytest
from click.testing import CliRunner

from recovery_devtools.devcluster.cli import main
from recovery_devtools.devcluster.config import ClusterSpec, Layout, write_files
from recovery_devtools.devcluster.inject import XID_MESSAGES
from slurm_hooks import kmsg


@pytest.fixture
def lay(tmp_path):
    layout = Layout(tmp_path / "dc")
    write_files(ClusterSpec(nodes=2, gpus_per_node=4), layout)
    return layout


def run(lay: Layout, *args: str):
    return CliRunner().invoke(main, ["inject", *args, "--state-dir", str(lay.root)])


def gpus(lay: Layout, node: str) -> list[dict]:
    return json.loads(lay.gpu_state(node).read_text())["gpus"]


def test_xid_line_is_real_format_and_parses(lay):
    before = time.time()
    result = run(lay, "xid", "--node", "node2", "--gpu", "3", "--xid", "79")
    assert result.exit_code == 0, result.output
    text = lay.kernel_log("node2").read_text()
    assert text.count("\n") == 1 and lay.kernel_log("node1").read_text() == ""
    line = text.rstrip("\n")
    assert result.output.strip() == line
    assert " node2 kernel: NVRM: Xid (PCI:0000:48:00): 79, pid=" in line
    assert line.endswith(", name=python, GPU has fallen off the bus.")
    pci = gpus(lay, "node2")[3]["pci_bus_id"]          # 00000000:48:00.0
    event = kmsg.parse_xid(line)
    assert event["xid"] == 79 and event["pci"] == kmsg.normalize_pci(*pci[:-2].split(":"))
    assert event["process"] == "python" and isinstance(event["pid"], int)
    stamp = kmsg.parse_time(line)
    assert int(before) <= stamp <= time.time()
    events = kmsg.read_xids(f"file:{lay.kernel_log('node2')}", since=before)
    assert [e["xid"] for e in events] == [79]


def test_xid_message_pid_and_default_text(lay):
    assert run(lay, "xid", "--node", "node1", "--gpu", "0", "--xid", "48").exit_code == 0
    assert run(lay, "xid", "--node", "node1", "--gpu", "1", "--xid", "31337",
               "--message", "custom words", "--pid", "7").exit_code == 0
    events = kmsg.read_xids(f"file:{lay.kernel_log('node1')}", since=None)
    assert [(e["xid"], e["pci"], e["pid"]) for e in events] == [
        (48, "0000:18:00", events[0]["pid"]), (31337, "0000:28:00", 7)]
    assert events[0]["message"] == XID_MESSAGES[48]
    assert events[1]["message"] == "custom words"


def test_xid_appends_after_a_partial_line(lay):
    lay.kernel_log("node1").write_text("half a line without newline")
    assert run(lay, "xid", "--node", "node1", "--gpu", "0", "--xid", "79").exit_code == 0
    lines = lay.kernel_log("node1").read_text().splitlines()
    assert lines[0] == "half a line without newline" and kmsg.parse_xid(lines[1])


def test_sxid(lay):
    result = run(lay, "sxid", "--node", "node2", "--sxid", "12028")
    assert result.exit_code == 0, result.output
    event = kmsg.parse_xid(lay.kernel_log("node2").read_text())
    assert (event["kind"], event["xid"], event["pci"]) == ("sxid", 12028, "0000:c3:00")
    assert event["message"].startswith("Non-fatal") and not kmsg.is_fatal(event)
    assert run(lay, "sxid", "--node", "node2", "--sxid", "20034", "--switch", "2").exit_code == 0
    last = kmsg.parse_xid(lay.kernel_log("node2").read_text().splitlines()[-1])
    assert "nvidia-nvswitch2:" in last["raw"] and kmsg.is_fatal(last)


def test_gpu_set_is_typed_and_atomic(lay):
    result = run(lay, "gpu", "--node", "node2", "--gpu", "1", "--set", "missing=true",
                 "--set", "temperature_c=95", "--set", "nvlink_active=[true,false,true,true]",
                 "--set", "throttle_reasons=0x8")
    assert result.exit_code == 0, result.output
    gpu = gpus(lay, "node2")[1]
    assert gpu["missing"] is True and gpu["temperature_c"] == 95
    assert gpu["nvlink_active"] == [True, False, True, True] and gpu["throttle_reasons"] == 8
    assert gpus(lay, "node2")[0]["missing"] is False
    assert sorted(p.name for p in lay.node_dir("node2").iterdir()) == ["dev", "gpus.json",
                                                                       "kern.log"]


@pytest.mark.parametrize("setting, fragment", [
    ("temperature_c=hot", "temperature_c: expected int"),
    ("missing=maybe", "missing: expected bool"),
    ("nvlink_active=[1,2]", "nvlink_active: expected JSON like"),
    ("nvlink_active=true", "nvlink_active: expected JSON like"),
    ("fan_speed=3", "unknown GPU field 'fan_speed'"),
    ("missing", "--set expects FIELD=VALUE"),
])
def test_gpu_set_bad_values(lay, setting, fragment):
    before = lay.gpu_state("node2").read_text()
    result = run(lay, "gpu", "--node", "node2", "--gpu", "1", "--set", setting)
    assert result.exit_code != 0
    assert fragment in result.output and len(result.output.strip().splitlines()) == 1
    assert lay.gpu_state("node2").read_text() == before


@pytest.mark.parametrize("args, fragment", [
    (["xid", "--node", "node9", "--gpu", "0", "--xid", "79"], "unknown node 'node9' "
                                                                "(known: node1, node2)"),
    (["xid", "--node", "node1", "--gpu", "4", "--xid", "79"], "node1 has no GPU 4"),
    (["gpu", "--node", "node1", "--gpu", "7", "--set", "missing=true"], "node1 has no GPU 7"),
    (["sxid", "--node", "nodeX", "--sxid", "12028"], "unknown node 'nodeX'"),
    (["clear", "--node", "node3"], "unknown node 'node3'"),
])
def test_bad_targets(lay, args, fragment):
    result = run(lay, *args)
    assert result.exit_code == 1
    assert result.output.strip() == f"Error: {fragment}" or fragment in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_no_state_dir(tmp_path):
    result = CliRunner().invoke(main, ["inject", "xid", "--node", "node1", "--gpu", "0",
                                       "--xid", "79", "--state-dir", str(tmp_path / "none")])
    assert result.exit_code == 1 and "no dev cluster files" in result.output


def test_default_state_dir_from_env(lay, monkeypatch):
    monkeypatch.setenv("RECOVERY_DEVCLUSTER_DIR", str(lay.root))
    result = CliRunner().invoke(main, ["inject", "xid", "--node", "node1", "--gpu", "2",
                                       "--xid", "95"])
    assert result.exit_code == 0, result.output
    assert "): 95, " in lay.kernel_log("node1").read_text()


def test_clear(lay):
    healthy = lay.gpu_state("node2").read_text()
    run(lay, "xid", "--node", "node2", "--gpu", "0", "--xid", "79")
    run(lay, "gpu", "--node", "node2", "--gpu", "0", "--set", "missing=true")
    result = run(lay, "clear", "--node", "node2")
    assert result.exit_code == 0, result.output
    assert "4 healthy GPU(s)" in result.output
    assert lay.gpu_state("node2").read_text() == healthy
    assert lay.kernel_log("node2").read_text() == ""


def test_clear_repairs_a_broken_state_file(lay):
    healthy = lay.gpu_state("node1").read_text()
    lay.gpu_state("node1").write_text("{not json")
    assert run(lay, "clear", "--node", "node1").exit_code == 0
    assert lay.gpu_state("node1").read_text() == healthy


def test_every_command_has_help_with_an_example():
    inject = main.commands["inject"]
    for name, command in [("inject", inject), *inject.commands.items()]:
        assert command.help and "Example:" in command.help, name
