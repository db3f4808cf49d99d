"""Shared test helpers: where the recorded Slurm output lives."""
from __future__ import annotations

import contextlib
import json
import subprocess
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
SLURM_VERSIONS = ("22.05", "24.11", "26.05")


def slurm_fixture(version: str, name: str) -> dict:
    return json.loads((FIXTURES / "slurm" / version / name).read_text())


@pytest.fixture(params=SLURM_VERSIONS)
def slurm_version(request) -> str:
    return request.param


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str):
    """Mount a tmpfs of ``size`` on ``path`` (created) for a full-disk test;
    yields whether the mount worked (it needs root), unmounts afterwards."""
    path.mkdir(exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                              str(path)], capture_output=True).returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", str(path)], check=False)



# -- the resilience campaign's table (make resilience) -------------------------
# Tests marked ``@pytest.mark.resilience(scenario, checks)`` are rows of
# docs/resilience.md; a test may count several runs with
# ``record_property("runs", n)``.
_CAMPAIGN: dict[str, dict] = {}


def pytest_addoption(parser):
    parser.addoption("--resilience-report", metavar="PATH", default=None,
                     help="write the resilience campaign table (markdown) to PATH")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    marker = item.get_closest_marker("resilience")
    if marker is None or not (report.when == "call" or report.outcome != "passed"):
        return
    if report.when == "teardown" and report.outcome == "failed":
        row = _CAMPAIGN.get(marker.args[0])
        if row and item.nodeid in row["ids"] and row["ids"][item.nodeid]:
            row["passed"] -= row["ids"][item.nodeid]     # a failed teardown undoes a pass
            row["ids"][item.nodeid] = 0
        return
    scenario = marker.args[0]
    checks = marker.args[1] if len(marker.args) > 1 else ""
    runs = int(dict(report.user_properties).get("runs", 1))
    row = _CAMPAIGN.setdefault(scenario, {"tests": 0, "runs": 0, "passed": 0, "checks": [],
                                          "ids": {}})
    row["tests"] += 1
    row["runs"] += runs
    passed = runs if report.passed else 0
    row["passed"] += passed
    row["ids"][item.nodeid] = passed
    if checks and checks not in row["checks"]:
        row["checks"].append(checks)


def pytest_sessionfinish(session, exitstatus):
    path = session.config.getoption("--resilience-report", default=None)
    if not path or not _CAMPAIGN:
        return
    import datetime
    import platform
    lines = ["# Resilience campaign", "",
             "Made by `make resilience` (pytest `-m resilience`, the slow scenarios "
             "included) on a real dev cluster: Slurm, munge and the agent run for real; "
             f"{datetime.date.today().isoformat()}, {platform.node()}, "
             f"{platform.python_implementation()} {platform.python_version()}.", "",
             "Each row ends with the same checks: no report lost, no action done twice, no "
             "job left held, and a log or audit line saying what happened.", "",
             "| scenario | tests | runs | passed | what was checked |", "|---|---|---|---|---|"]
    for scenario in sorted(_CAMPAIGN):
        row = _CAMPAIGN[scenario]
        lines.append(f"| {scenario} | {row['tests']} | {row['runs']} | {row['passed']} | "
                     f"{'; '.join(row['checks'])} |")
    total_runs = sum(r["runs"] for r in _CAMPAIGN.values())
    total_passed = sum(r["passed"] for r in _CAMPAIGN.values())
    lines += ["", f"{len(_CAMPAIGN)} scenarios, {total_runs} runs, {total_passed} passed.", ""]
    text = "\n".join(lines)
    Path(path).write_text(text)
    print("\n" + text)


# -- real unprivileged users (the hostile-user suite, -m security) -------------
@pytest.fixture(scope="session")
def unix_users():
    """``unix_users("mallory")``: a real unprivileged Unix user (see tests/hostile.py),
    the same one for the whole session, deleted at its end."""
    from tests.hostile import Users
    users = Users()
    yield users
    users.remove_all()
