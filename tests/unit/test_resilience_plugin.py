"""The resilience campaign's pytest plugin (tests/conftest.py): repetitions
with --resilience-runs, and the table they make, run on tiny test files in a
pytest of their own (pytester)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import repetitions, wait_clean

pytest_plugins = ["pytester"]
CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

SUITE = '''
import pytest

SETUPS = []

@pytest.fixture(scope="module")
def shared():
    SETUPS.append("module")
    return object()

@pytest.fixture
def per_run():
    SETUPS.append("function")
    yield
    SETUPS.append("function done")

@pytest.mark.resilience("flaky scenario", "fails on its second repetition")
def test_flaky(resilience_run, shared, per_run):
    assert resilience_run != 2

@pytest.mark.resilience("steady scenario", "always passes")
@pytest.mark.parametrize("kind", ["a", "b"])
def test_steady(kind, shared):
    pass

@pytest.mark.resilience("looping scenario", "drives itself four times", runs=4)
def test_loops():
    pass

@pytest.mark.resilience("breaking cleanup", "its teardown fails")
def test_cleanup_breaks(broken_teardown):
    pass

@pytest.fixture
def broken_teardown():
    yield
    raise RuntimeError("cleanup failed")

def test_plain():
    pass

def test_counts():
    """Runs last: module fixtures were set up once, function ones per repetition."""
    assert SETUPS.count("module") == 1
    assert SETUPS.count("function") == SETUPS.count("function done")
'''


@pytest.fixture
def campaign(pytester):
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makeini("[pytest]\nmarkers =\n    resilience(scenario, checks): a row\n")
    pytester.makepyfile(test_campaign=SUITE)
    return pytester


def rows(report: Path) -> dict[str, list[str]]:
    out = {}
    for line in report.read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 5 and cells[0] != "scenario":
            out[cells[0]] = cells[1:4]
    return out


def test_one_run_each_by_default_and_ids_unchanged(campaign):
    result = campaign.runpytest("--resilience-report=report.md", "-p", "no:cacheprovider",
                                "--collect-only", "-q")
    ids = [line for line in result.outlines if "::" in line]
    assert "test_campaign.py::test_flaky" in ids and "test_campaign.py::test_steady[a]" in ids
    assert not any("run" in i.split("::")[1] for i in ids), ids
    result = campaign.runpytest("--resilience-report=report.md", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=7, errors=1)   # test_cleanup_breaks errors in teardown
    table = rows(campaign.path / "report.md")
    assert table["flaky scenario"] == ["1", "1", "1"]
    assert table["steady scenario"] == ["2", "2", "2"]
    assert table["looping scenario"] == ["1", "4", "4"]
    assert table["breaking cleanup"] == ["1", "1", "**0**"]
    assert "Each test ran once" in (campaign.path / "report.md").read_text()


def test_repetitions_are_items_of_their_own_and_a_failed_one_shows(campaign):
    result = campaign.runpytest("--resilience-report=report.md", "--resilience-runs=3",
                                "-p", "no:cacheprovider", "-v")
    assert result.ret == 1                                   # make resilience fails
    outcomes = result.parseoutcomes()
    # flaky x3 + steady 2x3 + loops 1 (4 runs >= 3) + cleanup x3 + plain + counts
    assert outcomes["passed"] == 2 + 6 + 1 + 3 + 1 + 1 and outcomes["failed"] == 1
    assert outcomes["errors"] == 3
    text = "\n".join(result.outlines)
    for i in (1, 2, 3):
        assert f"test_campaign.py::test_flaky[run{i}of3] " in text
    assert "test_campaign.py::test_steady[b-run3of3] PASSED" in text
    assert "test_campaign.py::test_flaky[run2of3] FAILED" in text
    assert "test_loops[" not in text                         # 4 runs in one go already
    report = (campaign.path / "report.md").read_text()
    table = rows(campaign.path / "report.md")
    assert table["flaky scenario"] == ["1", "3", "**2**"]
    assert table["steady scenario"] == ["2", "6", "6"]
    assert table["looping scenario"] == ["1", "4", "4"]
    assert table["breaking cleanup"] == ["1", "3", "**0**"]
    assert "- flaky scenario: `test_campaign.py::test_flaky[run2of3]`" in report
    assert "until it had made at least 3 runs" in report
    assert "4 scenarios, 16 runs, 12 passed." in report


def test_a_bad_count_is_a_usage_error(campaign):
    result = campaign.runpytest("--resilience-runs=0", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "--resilience-runs: must be at least 1" in "\n".join(result.errlines)


def test_repetitions_cover_the_declared_runs():
    assert [repetitions(20, k) for k in (1, 3, 20, 50)] == [20, 7, 1, 1]
    assert repetitions(1, 1) == 1


class Cluster:
    """A scheduler whose job and node lists clear up after ``settle`` looks."""

    def __init__(self, settle: int) -> None:
        self.looks = 0
        self.settle = settle

    def list_jobs(self):
        from recovery_agent.scheduler.base import Job
        self.looks += 1
        held = self.looks <= self.settle
        return [Job(job_id="7", numeric_id=7, state="PENDING", held=held),
                Job(job_id="8", numeric_id=8, state="COMPLETED", held=True)]

    def list_nodes(self):
        from recovery_agent.scheduler.base import Node
        flags = frozenset({"DRAIN"}) if self.looks <= self.settle else frozenset()
        return [Node(name="node1", state="IDLE", flags=flags), Node(name="node2", state="IDLE")]


def test_between_repetitions_the_cluster_must_settle():
    assert wait_clean(Cluster(settle=2), timeout=5, interval=0.01) == ""
    problem = wait_clean(Cluster(settle=10**6), timeout=0.05, interval=0.01)
    assert problem == "jobs left held: 7; nodes not available: node1"


def test_shares_split_the_tests_and_join_into_the_same_table(campaign):
    from tests.conftest import merge_campaigns
    whole = campaign.runpytest("--resilience-report=whole.md", "--resilience-runs=3",
                               "-p", "no:cacheprovider")
    assert whole.ret == 1
    ran = []
    for k in (1, 2):
        part = campaign.runpytest(f"--resilience-shard={k}/2", f"--resilience-report=s{k}.json",
                                  "--resilience-runs=3", "-p", "no:cacheprovider", "-v")
        ran.append({line.split(" ")[0] for line in part.outlines
                    if line.startswith("test_campaign.py::")})
    assert ran[0] and ran[1] and not ran[0] & ran[1]
    # a test's repetitions stay together in one share
    flaky = [i for i, names in enumerate(ran) if any("test_flaky[" in n for n in names)]
    assert len(flaky) == 1 and len([n for n in ran[flaky[0]] if "test_flaky[" in n]) == 3
    import json
    parts = [json.loads((campaign.path / f"s{k}.json").read_text()) for k in (1, 2)]
    merged = merge_campaigns(parts)
    from tests.conftest import campaign_report
    (campaign.path / "joined.md").write_text(campaign_report(merged, 3, shares=2))
    assert rows(campaign.path / "joined.md") == rows(campaign.path / "whole.md")
    assert "make resilience RUNS=3 SHARDS=2" in (campaign.path / "joined.md").read_text()


def test_a_bad_share_is_a_usage_error(campaign):
    for bad in ("0/2", "3/2", "two", "1/0"):
        result = campaign.runpytest(f"--resilience-shard={bad}", "-p", "no:cacheprovider")
        assert result.ret == pytest.ExitCode.USAGE_ERROR, bad
        assert "expected K/N with 1 <= K <= N" in "\n".join(result.errlines)


def test_the_merge_tool_refuses_a_share_that_left_no_rows(tmp_path, capsys):
    from tests.resilience_merge import main
    good = tmp_path / "a.json"
    good.write_text('{"s": {"tests": ["t"], "items": 1, "runs": 1, "passed": 1, '
                    '"checks": ["c"], "ids": {"t": 1}, "failed": []}}')
    assert main(["--runs", "1", "--out", str(tmp_path / "r.md"), str(good),
                 str(tmp_path / "missing.json")]) == 1
    assert "missing.json" in capsys.readouterr().err and not (tmp_path / "r.md").exists()
    assert main(["--runs", "1", "--out", str(tmp_path / "r.md"), str(good), str(good)]) == 0
    assert "| s | 1 | 2 | 2 | c |" in (tmp_path / "r.md").read_text()
