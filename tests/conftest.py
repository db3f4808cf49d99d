"""Shared test helpers: where the recorded Slurm output lives."""
from __future__ import annotations

import contextlib
import json
import re
import subprocess
import time
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
        if mounted and subprocess.run(["umount", str(path)], capture_output=True,
                                      check=False).returncode != 0:
            # something still holds a file there (a thread of the code under
            # test): detach it now, the kernel frees it once the last one closes
            subprocess.run(["umount", "--lazy", str(path)], check=False)



# -- the resilience campaign (make resilience [RUNS=N]) ------------------------
# Tests marked ``@pytest.mark.resilience(scenario, checks)`` are the rows of
# docs/resilience.md. A *run* is one pass through a scenario: one execution of a
# test, or, for a test that drives its scenario K times itself (the SIGKILL
# loops), each of those K passes, declared with ``resilience(..., runs=K)`` or
# recorded with ``record_property("runs", K)``. ``--resilience-runs N`` repeats
# every such test until it has made at least N runs (N / K repetitions, rounded
# up; K as declared, else 1); each repetition is a test item of its own, its id
# ending in ``runIofM``, with its own function-scoped fixtures (module and
# session ones are shared). A repetition that fails, in its test or in its
# cleanup, counts none of its runs as passed. Between repetitions on the dev
# cluster no job may be left held and every node must be available again.
RUN_FIXTURE = "resilience_run"
CLEAN_WAIT = 60.0   # how long a repetition's cleanup may take to settle the cluster
_CAMPAIGN: dict[str, dict] = {}
_RUN_ID = re.compile(r"(?:-|(?<=\[))run\d+of\d+(?=\])")


def pytest_addoption(parser):
    parser.addoption("--resilience-report", metavar="PATH", default=None,
                     help="write the resilience campaign table (markdown) to PATH")
    parser.addoption("--resilience-runs", metavar="N", type=int, default=1,
                     help="repeat every resilience-marked test until it has made N "
                          "runs, each repetition a test of its own (default 1: no "
                          "repetition)")
    parser.addoption("--resilience-shard", metavar="K/N", default=None,
                     help="run only the K-th of N shares of the resilience tests (each "
                          "share on a dev cluster of its own), and write the campaign's "
                          "rows as JSON to the report path for `python -m "
                          "tests.resilience_merge` to join")


def pytest_configure(config):
    if config.getoption("--resilience-runs") < 1:
        raise pytest.UsageError("--resilience-runs: must be at least 1")
    shard_of(config)


def shard_of(config) -> tuple[int, int] | None:
    """``--resilience-shard K/N`` as (K, N), 1 <= K <= N; None when not given."""
    text = config.getoption("--resilience-shard", default=None)
    if text is None:
        return None
    match = re.fullmatch(r"(\d+)/(\d+)", text.strip())
    if not match or not 1 <= int(match[1]) <= int(match[2]):
        raise pytest.UsageError(f"--resilience-shard {text!r}: expected K/N with 1 <= K <= N")
    return int(match[1]), int(match[2])


def shares(base_ids: list[str], count: int) -> dict[str, int]:
    """Which share (1..count) each test goes to: round robin in collection order,
    within each directory (the slow live tests are spread over the shares, and so
    are the fast unit ones). Every repetition of a test goes with it."""
    seen: dict[str, int] = {}
    placed: dict[str, int] = {}
    for base in base_ids:
        if base in placed:
            continue
        folder = base.split("::")[0].rpartition("/")[0]
        placed[base] = seen.get(folder, 0) % count + 1
        seen[folder] = seen.get(folder, 0) + 1
    return placed


def pytest_collection_modifyitems(config, items):
    shard = shard_of(config)
    if shard is None:
        return
    mine, count = shard
    placed = shares([_RUN_ID.sub("", i.nodeid) for i in items
                     if i.get_closest_marker("resilience")], count)
    keep, drop = [], []
    for item in items:
        (keep if placed.get(_RUN_ID.sub("", item.nodeid)) == mine else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _declared_runs(marker) -> int:
    runs = marker.kwargs.get("runs", 1)
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        raise pytest.UsageError(f"resilience(runs={runs!r}): expected a whole number >= 1")
    return runs


def repetitions(wanted: int, declared: int) -> int:
    """Repetitions of a test that makes ``declared`` runs, for ``wanted`` runs."""
    return max(1, -(-wanted // declared))


@pytest.fixture
def resilience_run(request) -> int:
    """Which repetition of a resilience test this is, from 1 (1 when not
    repeated): a test may vary its random seed with it."""
    return getattr(request, "param", 1)


@pytest.hookimpl(trylast=True)   # after @parametrize: a test's repetitions come together
def pytest_generate_tests(metafunc):
    marker = metafunc.definition.get_closest_marker("resilience")
    if marker is None:
        return
    count = repetitions(metafunc.config.getoption("--resilience-runs"),
                        _declared_runs(marker))
    if count == 1:
        return
    if RUN_FIXTURE not in metafunc.fixturenames:
        metafunc.fixturenames.append(RUN_FIXTURE)
    width = len(str(count))
    metafunc.parametrize(RUN_FIXTURE, range(1, count + 1), indirect=True,
                         ids=[f"run{i:0{width}d}of{count}" for i in range(1, count + 1)])


def _repeated(item) -> bool:
    callspec = getattr(item, "callspec", None)
    return callspec is not None and RUN_FIXTURE in callspec.params


@pytest.fixture(autouse=True)
def _clean_between_repetitions(request):
    """A repeated live resilience test leaves no job held and every node
    available (within CLEAN_WAIT), or its repetition fails in its teardown."""
    cluster = None
    if _repeated(request.node) and "devcluster" in request.fixturenames:
        cluster = request.getfixturevalue("devcluster")
    yield
    if cluster is not None:
        problem = wait_clean(cluster.scheduler(), CLEAN_WAIT)
        if problem:
            pytest.fail(f"repetition left the dev cluster unclean: {problem}", pytrace=False)


def wait_clean(scheduler, timeout: float, interval: float = 1.0) -> str:
    """'' once no job is held and every node is available; else, after
    ``timeout``, what is still wrong."""
    from recovery_agent.errors import RecoveryError
    deadline = time.monotonic() + timeout
    while True:
        try:
            held = sorted(j.job_id for j in scheduler.list_jobs() if j.is_pending and j.held)
            away = sorted(n.name for n in scheduler.list_nodes() if not n.available)
            problem = "; ".join(filter(None, [
                held and f"jobs left held: {', '.join(held)}",
                away and f"nodes not available: {', '.join(away)}"]))
        except RecoveryError as exc:
            problem = f"Slurm does not answer: {exc}"
        if not problem or time.monotonic() >= deadline:
            return problem
        time.sleep(interval)


def _empty_row() -> dict:
    """One scenario's row of the campaign, before any run is counted."""
    return {"tests": set(), "items": 0, "runs": 0, "passed": 0, "checks": [], "ids": {},
            "failed": []}


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
            row["failed"].append(item.nodeid)
        return
    scenario = marker.args[0]
    checks = marker.args[1] if len(marker.args) > 1 else ""
    runs = int(dict(report.user_properties).get("runs", _declared_runs(marker)))
    row = _CAMPAIGN.setdefault(scenario, _empty_row())
    row["tests"].add(_RUN_ID.sub("", item.nodeid).replace("[]", ""))
    row["items"] += 1
    row["runs"] += runs
    passed = runs if report.passed else 0
    row["passed"] += passed
    row["ids"][item.nodeid] = passed
    if not report.passed:
        row["failed"].append(item.nodeid)
    if checks and checks not in row["checks"]:
        row["checks"].append(checks)


def campaign_report(campaign: dict[str, dict], wanted: int, shares: int = 1) -> str:
    """docs/resilience.md from the rows collected (of ``shares`` pytest runs side by
    side, each on a dev cluster of its own)."""
    import datetime
    import platform
    make = "make resilience" + (f" RUNS={wanted}" if wanted > 1 else "") + (
        f" SHARDS={shares}" if shares > 1 else "")
    where = ("on a real dev cluster" if shares == 1 else
             f"in {shares} shares at once, each a pytest of its own on a real dev cluster of "
             "its own")
    lines = ["# Resilience campaign", "",
             f"Made by `{make}` (pytest `-m resilience --resilience-runs={wanted}`, the slow "
             f"scenarios included) {where}: Slurm, munge and the agent run for "
             f"real; {datetime.date.today().isoformat()}, {platform.node()}, "
             f"{platform.python_implementation()} {platform.python_version()}"
             f"{_commit()}.", "",
             "A run is one pass through a scenario: one execution of a test, or, for a test "
             "that drives its scenario several times itself (the SIGKILL loops), each of "
             "those passes. " + (
                 f"Every test was repeated until it had made at least {wanted} runs, each "
                 "repetition a test of its own (`runIofM` in its id) with its own jobs and "
                 "faults, cleaned up before the next one: no job left held, every node "
                 "available again. " if wanted > 1 else
                 "Each test ran once; `make resilience RUNS=N` repeats each until it has "
                 "made N runs. ") +
             "`passed` counts the runs of the tests that passed; one that failed, in its "
             "test or in its cleanup, counts none.", "",
             "Each row ends with the same checks: no report lost, no action done twice, no "
             "job left held, and a log or audit line saying what happened.", "",
             "| scenario | tests | runs | passed | what was checked |", "|---|---|---|---|---|"]
    for scenario in sorted(campaign):
        row = campaign[scenario]
        passed = str(row["passed"]) if row["passed"] == row["runs"] else f"**{row['passed']}**"
        lines.append(f"| {scenario} | {len(row['tests'])} | {row['runs']} | {passed} | "
                     f"{'; '.join(row['checks'])} |")
    total_runs = sum(r["runs"] for r in campaign.values())
    total_passed = sum(r["passed"] for r in campaign.values())
    lines += ["", f"{len(campaign)} scenarios, {total_runs} runs, {total_passed} passed.", ""]
    failed = [(s, n) for s in sorted(campaign) for n in campaign[s]["failed"]]
    if failed:
        lines += ["## Failed repetitions", ""] + [f"- {s}: `{n}`" for s, n in failed] + [""]
    return "\n".join(lines)


def _commit() -> str:
    """', commit abc1234' (with '+' when the work tree has changes), or '' outside git."""
    try:
        root = Path(__file__).resolve().parents[1]
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    if head.returncode != 0:
        return ""
    return f", commit {head.stdout.strip()}{'+' if dirty.stdout.strip() else ''}"


def campaign_json(campaign: dict[str, dict]) -> str:
    """The rows as JSON, for a campaign run in shares (tests.resilience_merge)."""
    return json.dumps({s: {**r, "tests": sorted(r["tests"])} for s, r in campaign.items()},
                      indent=1, sort_keys=True)


def merge_campaigns(parts: list[dict[str, dict]]) -> dict[str, dict]:
    """The rows of several shares as one campaign (a scenario's tests may sit in
    several shares)."""
    merged: dict[str, dict] = {}
    for part in parts:
        for scenario, row in part.items():
            into = merged.setdefault(scenario, _empty_row())
            into["tests"] |= set(row["tests"])
            for key in ("items", "runs", "passed"):
                into[key] += row[key]
            into["ids"].update(row["ids"])
            into["failed"] += row["failed"]
            into["checks"] += [c for c in row["checks"] if c not in into["checks"]]
    return merged


def pytest_sessionfinish(session, exitstatus):
    path = session.config.getoption("--resilience-report", default=None)
    if not path or not _CAMPAIGN:
        return
    if shard_of(session.config) is not None:
        Path(path).write_text(campaign_json(_CAMPAIGN) + "\n")
        return
    text = campaign_report(_CAMPAIGN, session.config.getoption("--resilience-runs"))
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
