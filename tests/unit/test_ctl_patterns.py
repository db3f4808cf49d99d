"""``recovery-ctl patterns test``: human output, ``--json`` shape, site packs, errors."""
from __future__ import annotations

import json
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from recovery_agent.interfaces.ctl import main
from recovery_agent.detect.engines import hyperscan_probe

XID_LOG = ["step 400 | loss 2.01",
           "Mar  3 02:11:09 gpu-q12 kernel: [88123.1] NVRM: Xid (PCI:0000:b7:00): 79, "
           "pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
           "RuntimeError: CUDA error: unspecified launch failure"]
BENIGN_LOG = ["gpu-q12:10:10 [0] NCCL INFO Channel 00/32 :    0   1   2   3",
              "step 401 | loss 2.00",
              "slurmstepd: error: *** JOB 4 ON gpu-q12 CANCELLED AT 2025-01-01T00:00:00 "
              "DUE TO JOB REQUEUE ***"]
SITE_PACK = """
[[rule]]
id = "site.fan_failure"
category = "gpu_hardware"
action = "requeue_exclude"
regex = '''ipmi: fan (?P<gpu>FAN\\d+) failed on (?P<host>\\S+)'''
examples.match = ["ipmi: fan FAN3 failed on gpu-q12"]
examples.no_match = ["ipmi: fan FAN3 ok on gpu-q12"]
"""


@pytest.fixture
def logs(tmp_path: Path) -> dict[str, Path]:
    out = {}
    for name, lines in (("xid.log", XID_LOG), ("benign.log", BENIGN_LOG)):
        out[name] = tmp_path / name
        out[name].write_text("\n".join(lines) + "\n")
    return out


def _run(*args: str) -> click.testing.Result:
    return CliRunner().invoke(main, ["patterns", "test", *args], catch_exceptions=False)


def test_human_output_lists_detections_and_verdict(logs):
    result = _run(str(logs["xid.log"]))
    assert result.exit_code == 0, result.output
    out = result.output
    assert str(logs["xid.log"]) in out
    assert "line      2  kernel.xid" in out and "gpu_hardware" in out and "host=gpu-q12" in out
    assert "verdict: category=gpu_hardware action=requeue_exclude blame=node nodes=gpu-q12" in out


def test_json_is_one_object_per_file_in_the_documented_shape(logs):
    result = _run("--json", str(logs["xid.log"]), str(logs["benign.log"]))
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.output.splitlines()]
    assert len(rows) == 2
    xid, benign = rows
    assert set(xid) == {"file", "detections", "verdict"}
    assert xid["file"] == str(logs["xid.log"])
    assert xid["detections"][0] == {"rule": "kernel.xid", "category": "gpu_hardware",
                                    "line": 2, "host": "gpu-q12"}
    assert all(set(d) == {"rule", "category", "line", "host"} for d in xid["detections"])
    assert xid["verdict"] == {"category": "gpu_hardware", "action": "requeue_exclude",
                              "nodes": ["gpu-q12"]}
    # the requeue banner is noted (information) with the node slurmstepd names, nothing fires
    assert benign == {"file": str(logs["benign.log"]),
                      "detections": [{"rule": "slurm.requeued", "category": "system_software",
                                      "line": 3, "host": "gpu-q12"}],
                      "verdict": {"category": None, "action": "none", "nodes": []}}


def test_benign_file_human_output(logs):
    out = _run(str(logs["benign.log"])).output
    assert "category=- action=none" in out and "only informational lines" in out


@pytest.mark.parametrize("engine", ["re", pytest.param("hyperscan", marks=pytest.mark.skipif(
    hyperscan_probe() is not None, reason="hyperscan does not import"))])
def test_engines_print_the_same(logs, engine):
    assert _run("--json", "--engine", engine, str(logs["xid.log"])).output == \
        _run("--json", str(logs["xid.log"])).output


def test_site_pack_dir(logs, tmp_path):
    packs = tmp_path / "packs"
    packs.mkdir()
    (packs / "site.toml").write_text(SITE_PACK)
    log = tmp_path / "fan.log"
    log.write_text("ipmi: fan FAN2 failed on gpu-q13\n")
    row = json.loads(_run("--json", "--patterns-dir", str(packs), str(log)).output)
    assert row["detections"] == [{"rule": "site.fan_failure", "category": "gpu_hardware",
                                  "line": 1, "host": "gpu-q13"}]
    assert row["verdict"]["nodes"] == ["gpu-q13"]


def test_a_bad_pack_is_a_clean_error_naming_file_and_rule(logs, tmp_path):
    packs = tmp_path / "packs"
    packs.mkdir()
    (packs / "bad.toml").write_text(SITE_PACK.replace("action = ", "colour = 1\naction = "))
    result = CliRunner().invoke(main, ["patterns", "test", "--patterns-dir", str(packs),
                                       str(logs["xid.log"])])
    assert result.exit_code == 1
    assert "bad.toml: rule 'site.fan_failure': unknown key(s) ['colour']" in result.output


def test_missing_file_is_a_usage_error(tmp_path):
    result = CliRunner().invoke(main, ["patterns", "test", str(tmp_path / "nope.log")])
    assert result.exit_code == 2 and "does not exist" in result.output


def _commands(group: click.Group, prefix: str = ""):
    for name, command in group.commands.items():
        yield f"{prefix}{name}", command
        if isinstance(command, click.Group):
            yield from _commands(command, f"{prefix}{name} ")


def test_every_command_has_help_with_an_example():
    assert "Example" in (main.help or "")
    for name, command in _commands(main):
        assert command.help and "Example" in command.help, name
        result = CliRunner().invoke(main, [*name.split(), "-h"])
        assert result.exit_code == 0 and "Usage:" in result.output, name
