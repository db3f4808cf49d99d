"""The JSON parsers against real output recorded from Slurm 22.05, 24.11 and 26.05.

Each recording holds the same scene (see tests/fixtures/slurm/README.md): a
running opted-in job, a job failed with exit 3, an array 0-3%2, a user-held job,
a requeued-held job excluded from node3 with one restart, node3 drained by us.
"""
from __future__ import annotations

import re

import pytest

from recovery_agent.scheduler.base import Job
from recovery_agent.scheduler.cli_parse import (exit_status, expand_nodes, expand_output_path,
                                                number, parse_nodes, parse_squeue,
                                                slurm_version, split_state)
from tests.conftest import FIXTURES, slurm_fixture

# the scene's job ids per version, from each directory's README.txt
SCENES = {}
for _v in ("22.05", "24.11", "26.05"):
    _text = (FIXTURES / "slurm" / _v / "README.txt").read_text()
    SCENES[_v] = {k: v for k, v in re.findall(r"(\w+)=(\d+)", _text)}


def jobs_by_id(version: str) -> dict[str, Job]:
    return {j.job_id: j for j in parse_squeue(slurm_fixture(version, "squeue_all.json"))}


def test_version_is_read_from_meta(slurm_version):
    major, minor, _ = slurm_version_tuple = slurm_version_of(slurm_version)
    assert f"{major}.{minor:02d}" == slurm_version
    assert slurm_version_tuple >= (22, 5, 0)


def slurm_version_of(version: str):
    return slurm_version(slurm_fixture(version, "squeue_all.json"))


def test_running_job(slurm_version):
    scene = SCENES[slurm_version]
    job = jobs_by_id(slurm_version)[scene["running"]]
    assert job.state == "RUNNING" and job.is_active
    assert job.nodes == ("node1",) and job.batch_host == "node1"
    assert job.comment == "recovery=prod:action"
    assert job.exit_code == 0 and job.exit_signal is None
    assert job.submit_time and job.start_time and job.start_time >= job.submit_time
    assert job.user == "root" and job.name == "train-run"
    assert job.stdout == f"/tmp/sl/jobs/train-run-{scene['running']}.out"
    assert job.stderr == job.stdout  # no --error given: stderr goes with stdout
    assert not job.held and job.requeue_allowed


def test_failed_job_exit_code(slurm_version):
    job = jobs_by_id(slurm_version)[SCENES[slurm_version]["failed"]]
    assert job.state == "FAILED" and job.is_finished
    assert job.exit_code == 3 and job.exit_signal is None
    assert job.reason == "NonZeroExitCode"


def test_requeued_held_job_with_exclusion(slurm_version):
    job = jobs_by_id(slurm_version)[SCENES[slurm_version]["requeued_held_excluded"]]
    assert job.state == "PENDING" and job.held
    assert job.excluded_nodes == ("node3",)
    assert job.restart_count == 1
    assert job.nodes == ()


def test_user_held_job(slurm_version):
    job = jobs_by_id(slurm_version)[SCENES[slurm_version]["held"]]
    assert job.held and job.reason == "JobHeldUser"
    assert job.stdout.endswith(f"slurm-{SCENES[slurm_version]['held']}.out")


def test_array_tasks_are_separate_jobs(slurm_version):
    array = SCENES[slurm_version]["array"]
    jobs = jobs_by_id(slurm_version)
    task0, task1 = jobs[f"{array}_0"], jobs[f"{array}_1"]
    assert task0.array_job_id == int(array) and task0.array_task_id == 0
    assert task1.array_task_id == 1 and task0.numeric_id != task1.numeric_id
    assert task0.stdout == f"/tmp/sl/jobs/arr-{array}_0.out"
    rest = jobs[f"{array}_[2-3%2]"]
    assert rest.is_pending and rest.array_task_spec == "2-3%2" and rest.array_task_id is None
    assert rest.stdout == ""  # the pending remainder has no file of its own yet


def test_drained_node(slurm_version):
    nodes = {n.name: n for n in parse_nodes(slurm_fixture(slurm_version, "sinfo.json"))}
    node3 = nodes["node3"]
    assert node3.drained and not node3.available
    assert node3.state == "MIXED" and "DRAIN" in node3.flags
    assert node3.reason == "recovery: rec-42 gpu_hardware xid=79"
    assert node3.reason_user == "root" and node3.reason_time
    assert node3.partitions == ("gpu",)
    assert nodes["node1"].available and not nodes["node1"].drained


@pytest.mark.parametrize("version", ["24.11", "26.05"])
def test_scontrol_json_nodes_agree_with_sinfo(version):
    via_scontrol = {n.name: n for n in parse_nodes(slurm_fixture(version,
                                                                  "scontrol_show_node.json"))}
    via_sinfo = {n.name: n for n in parse_nodes(slurm_fixture(version, "sinfo.json"))}
    assert set(via_scontrol) == set(via_sinfo)
    for name, node in via_sinfo.items():
        assert (node.state, node.flags, node.reason) == (
            via_scontrol[name].state, via_scontrol[name].flags, via_scontrol[name].reason)


@pytest.mark.parametrize("version,name", [("22.05", "sinfo.json"),
                                          ("24.11", "scontrol_show_node.json"),
                                          ("26.05", "scontrol_show_node.json")])
def test_nodes_carry_their_slurm_address_and_hostname(version, name):
    # the dev cluster's nodes, recorded: every one at NodeAddr 127.0.0.1
    nodes = {n.name: n for n in parse_nodes(slurm_fixture(version, name))}
    assert (nodes["node1"].address, nodes["node1"].hostname) == ("127.0.0.1", "localhost")


def test_signalled_exit_in_object_form():
    jobs = jobs_by_id("24.11")
    cancelled = jobs["1"]  # an earlier run of train-run, cancelled by SIGTERM
    assert cancelled.state == "CANCELLED"
    assert cancelled.exit_code is None and cancelled.exit_signal == 15
    assert cancelled.nodes == ("node1", "node2")


@pytest.mark.parametrize("raw, expected", [
    (0, (0, None)), (768, (3, None)), (9, (None, 9)), (15, (None, 15)), (None, (None, None)),
    ({"return_code": {"set": True, "infinite": False, "number": 7},
      "signal": {"id": {"set": False, "infinite": False, "number": 0}}}, (7, None)),
])
def test_exit_status(raw, expected):
    assert exit_status(raw) == expected


@pytest.mark.parametrize("raw, expected", [
    (5, 5), ({"set": True, "infinite": False, "number": 5}, 5),
    ({"set": False, "infinite": False, "number": 5}, None),
    ({"set": True, "infinite": True, "number": 0}, None), (None, None), ("12", 12), (True, None),
])
def test_number(raw, expected):
    assert number(raw) == expected


def test_split_state_forms():
    assert split_state("mixed", frozenset({"MIXED"})) == ("MIXED", frozenset())
    assert split_state("IDLE+DRAIN", frozenset({"IDLE"})) == ("IDLE", frozenset({"DRAIN"}))
    assert split_state(["DRAIN", "IDLE"], frozenset({"IDLE"})) == ("IDLE", frozenset({"DRAIN"}))
    assert split_state([], frozenset({"IDLE"}))[0] == "UNKNOWN"


def test_expand_nodes():
    assert expand_nodes("gpu[01-03],cpu7") == ("gpu01", "gpu02", "gpu03", "cpu7")
    assert expand_nodes("") == () and expand_nodes(None) == () and expand_nodes("(null)") == ()


def _job(**kw) -> Job:
    base = dict(job_id="1234", numeric_id=1234, name="train", user="alice",
                batch_host="gpu07", nodes=("gpu07", "gpu08"), workdir="/scratch/alice")
    base.update(kw)
    return Job(**base)


@pytest.mark.parametrize("pattern, expected", [
    ("%x-%j.out", "/scratch/alice/train-1234.out"),
    ("/logs/%u/%x_%A.%a.out", "/logs/alice/train_1234.4294967294.out"),
    ("/logs/%N-%n-%t.log", "/logs/gpu07-0-0.log"),
    ("/logs/100%%-%j", "/logs/100%-1234"),
    ("/logs/%8j.out", "/logs/00001234.out"),
    ("/logs/%J.out", "/logs/1234.batch.out"),
    ("/logs/\\%j.out", "/logs/%j.out"),  # a backslash turns expansion off
    ("", "/scratch/alice/slurm-1234.out"),
])
def test_expand_output_path(pattern, expected):
    assert expand_output_path(pattern, _job(), default="slurm-%j.out") == expected


def test_expand_output_path_for_array_task():
    task = _job(job_id="1200_7", numeric_id=1234, array_job_id=1200, array_task_id=7)
    assert expand_output_path("o-%A_%a-%j-%3a-%b.txt", task) == \
        "/scratch/alice/o-1200_7-1234-007-7.txt"
    assert expand_output_path("", task, default="slurm-%A_%a.out") == \
        "/scratch/alice/slurm-1200_7.out"


def test_cached_parse_gives_the_same_jobs_and_reparses_only_changes():
    import copy

    from recovery_agent.scheduler import cli_parse
    from tests.conftest import slurm_fixture
    doc = slurm_fixture("22.05", "squeue_all.json")
    cache: dict = {}
    first = cli_parse.parse_squeue(doc, cache)
    assert first == cli_parse.parse_squeue(doc)
    changed = copy.deepcopy(doc)
    changed["jobs"][0]["restart_cnt"] = 7
    calls = []
    real = cli_parse.job_from_json
    cli_parse.job_from_json = lambda raw, v: calls.append(raw["job_id"]) or real(raw, v)
    try:
        second = cli_parse.parse_squeue(changed, cache)
    finally:
        cli_parse.job_from_json = real
    assert calls == [changed["jobs"][0]["job_id"]]          # only the changed record
    assert second[0].restart_count == 7 and second[1:] == first[1:]
    assert len(cache) == len(doc["jobs"])


# -- record-by-record parsing of the command's text ------------------------
from recovery_agent.scheduler.cli_parse import (parse_nodes_text,  # noqa: E402
                                                parse_squeue_text, split_listing)


def _text(version: str, name: str) -> str:
    return (FIXTURES / "slurm" / version / name).read_text()


@pytest.mark.parametrize("as_bytes", [False, True])
@pytest.mark.parametrize("version", ["22.05", "24.11", "26.05"])
def test_text_parse_matches_whole_parse(version, as_bytes):
    text = _text(version, "squeue_all.json")
    data = text.encode() if as_bytes else text
    split = split_listing(data, "jobs")
    assert split is not None, "Slurm's own layout must be recognised"
    assert len(list(split[1])) == len(__import__("json").loads(text)["jobs"])
    assert parse_squeue_text(data) == parse_squeue(slurm_fixture(version, "squeue_all.json"))


@pytest.mark.parametrize("as_bytes", [False, True])
@pytest.mark.parametrize("version", ["22.05", "24.11", "26.05"])
def test_text_parse_of_nodes_matches_whole_parse(version, as_bytes):
    text = _text(version, "sinfo.json")
    data = text.encode() if as_bytes else text
    assert parse_nodes_text(data) == parse_nodes(slurm_fixture(version, "sinfo.json"))


def test_unchanged_records_are_not_parsed_again():
    text = _text("22.05", "squeue_all.json")
    calls = []

    def loads(s):
        calls.append(len(s))
        return __import__("json").loads(s)

    cache: dict = {}
    first = parse_squeue_text(text, cache, loads)
    n = len(first)
    assert len(calls) == 1 + n        # the document around the list, then each record
    calls.clear()
    again = parse_squeue_text(text, cache, loads)
    assert again == first and len(calls) == 1
    # one record changes: only that one is parsed, and it shows the change
    target = first[0]
    changed = text.replace(f'"job_id": {target.numeric_id},', f'"job_id": {target.numeric_id},'
                           '\n      "comment_extra": 1,', 1)
    calls.clear()
    third = parse_squeue_text(changed, cache, loads)
    assert len(calls) == 2 and third == first
    assert len(cache) == n


def test_state_change_is_seen_through_the_cache():
    text = _text("22.05", "squeue_all.json")
    cache: dict = {}
    before = {j.job_id: j for j in parse_squeue_text(text, cache)}
    running = next(j for j in before.values() if j.state == "RUNNING")
    start = text.index(f'"job_id": {running.numeric_id},')
    state_at = text.index('"job_state": "RUNNING"', text.rindex("\n    {", 0, start))
    failed = text[:state_at] + '"job_state": "FAILED"' + text[state_at + 22:]
    after = {j.job_id: j for j in parse_squeue_text(failed, cache)}
    assert after[running.job_id].state == "FAILED"
    assert all(after[k] == v for k, v in before.items() if k != running.job_id)


def test_compact_json_is_parsed_whole():
    import json
    doc = slurm_fixture("22.05", "squeue_all.json")
    compact = json.dumps(doc)
    assert split_listing(compact, "jobs") is None
    assert parse_squeue_text(compact) == parse_squeue(doc)


@pytest.mark.parametrize("layout", ['{\n  "jobs": [\n  ],\n  "meta": {}\n}',
                                    '{\n  "jobs": [],\n  "meta": {}\n}'])
def test_empty_listing(layout):
    assert parse_squeue_text(layout) == []


def test_a_record_the_cut_cannot_parse_falls_back_to_the_whole_document():
    # a string holding the separator's characters escaped is still one record
    import json
    doc = slurm_fixture("22.05", "squeue_all.json")
    doc["jobs"][0]["comment"] = "recovery=prod\n    },\n    {"
    text = json.dumps(doc, indent=2)
    assert parse_squeue_text(text) == parse_squeue(doc)
    # a broken record makes the fallback raise the JSON error, as a whole parse would
    broken = text.replace('"job_state"', '"job_state" "', 1)
    with pytest.raises(ValueError):
        parse_squeue_text(broken)


def test_no_recorded_listing_shows_a_signal(slurm_version):
    # none of the recorded jobs was submitted with --signal; 22.05 has no
    # submit_line at all, 26.05 has one for every job
    assert {j.signal for j in jobs_by_id(slurm_version).values()} == {""}


def test_the_signal_is_read_from_a_26_05_submit_line():
    doc = slurm_fixture("26.05", "squeue_one_running.json")
    raw = doc["jobs"][0]
    assert raw["submit_line"].startswith("sbatch ")
    raw["submit_line"] = "sbatch --parsable --signal=B:USR1@120 --mem=100 --wrap sleep 300"
    assert parse_squeue(doc)[0].signal == "B:USR1"


@pytest.mark.parametrize("line, expected", [
    ("sbatch --signal=USR1@90 train.sbatch", "USR1"),
    ("sbatch --signal=SIGUSR2 train.sbatch", "USR2"),
    ("sbatch --signal=R:TERM@60 train.sbatch", "TERM"),
    ("sbatch --signal=B:usr1 train.sbatch", "B:USR1"),
    ("sbatch --signal=10@30 x.sh", "10"),
    # the script's own arguments and a --wrap command are not sbatch's options
    ("sbatch train.sbatch --signal=USR1", ""),
    ("sbatch --wrap python train.py --signal=USR1", ""),
    # an option's separate value ends the scan: missed, never misread
    ("sbatch -J run --signal=USR1 x.sh", ""),
    ("sbatch --signal=$(id) x.sh", ""),
    ("", ""),
    (None, ""),
])
def test_submit_signal(line, expected):
    from recovery_agent.scheduler.base import submit_signal
    assert submit_signal(line) == expected


@pytest.mark.parametrize("jobs", [True, False])
def test_a_later_top_level_list_of_objects_is_not_read_as_records(jobs):
    """The list's end is searched from the back: a later list laid out the same
    way (24.11's warnings) then ends the cut, the last piece does not parse as a
    record, and the whole listing is parsed: the same jobs either way."""
    import json
    doc = slurm_fixture("24.11", "squeue_all.json")
    if not jobs:
        doc["jobs"] = []
    doc["warnings"] = [{"description": "a warning", "source": "slurmctld"},
                       {"description": "another", "source": "slurmctld"}]
    text = json.dumps(doc, indent=2)
    assert list(doc)[-1] == "warnings" and text.rstrip().endswith("}\n  ]\n}")
    assert parse_squeue_text(text) == parse_squeue(doc)
    assert parse_squeue_text(text.encode()) == parse_squeue(doc)
