"""The shipped systemd units start commands this package really installs."""
from __future__ import annotations

import configparser
import shlex
import tomllib
from pathlib import Path

from click.testing import CliRunner

from recovery_agent.interfaces.ctl import main as ctl

REPO = Path(__file__).resolve().parents[2]
UNITS = REPO / "contrib" / "systemd"


def unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str
    parser.read(UNITS / name)
    return parser


def scripts() -> set[str]:
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    return set(data["project"]["scripts"])


def test_agent_service_runs_the_agent_with_a_config():
    svc = unit("slurm-recovery-agent.service")
    argv = shlex.split(svc["Service"]["ExecStart"])
    assert Path(argv[0]).name == "recovery-agent" and "recovery-agent" in scripts()
    assert "RECOVERY_CONFIG=" in svc["Service"]["Environment"]
    assert svc["Service"]["Restart"] == "on-failure"


def test_watchdog_timer_drives_a_oneshot_that_calls_a_real_subcommand():
    timer = unit("slurm-recovery-watchdog.timer")
    assert timer["Timer"]["OnUnitActiveSec"].endswith("s")
    svc = unit("slurm-recovery-watchdog.service")
    assert svc["Service"]["Type"] == "oneshot"
    argv = shlex.split(svc["Service"]["ExecStart"])
    assert Path(argv[0]).name == "recovery-ctl" and "recovery-ctl" in scripts()
    result = CliRunner().invoke(ctl, [*argv[1:], "--help"])
    assert result.exit_code == 0 and "decision_timeout" in result.output
