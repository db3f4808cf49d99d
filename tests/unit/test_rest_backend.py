"""The REST backend against a stand-in slurmrestd (tests/unit/rest_server.py).

22.05 answers are slurmrestd's own, recorded from the dev cluster's
slurmrestd 22.05.8 (tests/fixtures/slurm/22.05/rest/). 24.11 and 26.05 answers
are the recorded ``scontrol --json``/``squeue --json`` of those releases, which
come from the same data_parser as their REST answers; their endpoint lists
follow slurmrestd's source. What each version is sent is checked against what
that version's slurmrestd accepts (the 22.05 bodies were tried live)."""
from __future__ import annotations

import logging
import time

import pytest

from recovery_agent.errors import ConfigError, JobNotFound, NodeNotFound, SchedulerError
from recovery_agent.scheduler.rest_backend import RestScheduler
from recovery_agent.scheduler.rest_client import RestClient, RestSettings
from recovery_agent.scheduler.runner import SlurmRunner
from tests.unit.rest_server import (ENDPOINTS_38, ENDPOINTS_40, ENDPOINTS_45, FIX, Answer,
                                    FakeRest, as_rest, openapi_doc, recorded, serve)
from tests.unit.test_runner import fake_command

REST = "22.05/rest"
TOKEN = "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.e30.sig"


@pytest.fixture
def fake():
    return FakeRest()


@pytest.fixture
def server(fake):
    url, stop = serve(fake)
    yield url
    stop()


@pytest.fixture
def cli(tmp_path):
    """The argv seam with a scontrol that records its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "scontrol.log"
    fake_command(bin_dir, "scontrol", f'echo "$@" >> {log}\n'
                 'if [ "$1" = token ]; then echo SLURM_JWT=fresh-$$; fi')
    runner = SlurmRunner(bin_dir=str(bin_dir))
    runner.log = log
    return runner


def token_file(tmp_path, text=f"SLURM_JWT={TOKEN}\n"):
    path = tmp_path / "token"
    path.write_text(text)
    return str(path)


def v38(fake):
    fake.answer("GET", "/openapi/v3", Answer(body=openapi_doc({"v0.0.38": ENDPOINTS_38})))
    fake.answer("GET", "/slurm/v0.0.38/ping/", Answer(body=recorded(REST, "ping.json")))
    fake.answer("GET", "/slurm/v0.0.38/jobs/", Answer(body=recorded(REST, "jobs.json")))
    fake.answer("GET", "/slurm/v0.0.38/nodes/", Answer(body=recorded(REST, "nodes.json")))
    fake.answer("POST", "/slurm/v0.0.38/job/1", Answer(body={"errors": []}))
    fake.answer("DELETE", "/slurm/v0.0.38/job/1", Answer(body={"errors": []}))


def v42(fake, versions=("v0.0.40", "v0.0.41", "v0.0.42")):
    fake.answer("GET", "/openapi/v3",
                Answer(body=openapi_doc({v: ENDPOINTS_40 for v in versions})))
    meta = recorded("24.11", "scontrol_show_job.json")["meta"]
    fake.answer("GET", "/slurm/v0.0.42/ping/",
                Answer(body=as_rest({"meta": meta, "errors": [], "pings": []}, "v0.0.42")))
    fake.answer("GET", "/slurm/v0.0.42/jobs/",
                Answer(body=as_rest(recorded("24.11", "scontrol_show_job.json"), "v0.0.42")))
    fake.answer("GET", "/slurm/v0.0.42/nodes/",
                Answer(body=as_rest(recorded("24.11", "scontrol_show_node.json"), "v0.0.42")))
    ok = Answer(body=as_rest({"errors": []}, "v0.0.42"))
    for method, path in (("POST", "/slurm/v0.0.42/job/5"), ("POST", "/slurm/v0.0.42/node/node3"),
                         ("DELETE", "/slurm/v0.0.42/job/5")):
        fake.answer(method, path, ok)


def test_2411_array_task_update_goes_to_the_tasks_own_job_id(fake, server, tmp_path):
    """24.11's slurmrestd refuses an update addressed to ``ARRAY_TASK``
    ("Submit job update against Array Job's JobID", HTTP 422, recorded live):
    the update goes to the id the task runs under, looked up first."""
    v42(fake)
    fake.answer("GET", "/slurm/v0.0.42/job/1_1",
                Answer(body=recorded("24.11", "rest_job_array_task.json")))
    fake.answer("POST", "/slurm/v0.0.42/job/1_1",
                Answer(422, recorded("24.11", "rest_update_array_task_refused.json")))
    fake.answer("POST", "/slurm/v0.0.42/job/1", Answer(body=as_rest({"errors": []}, "v0.0.42")))
    sched = rest(server, token_file=token_file(tmp_path))
    assert sched.lookup_job("1_1").numeric_id == 1
    sched.set_excluded_nodes("1_1", ["node4"])
    sched.set_excluded_nodes("1_1", [])
    sched.release("1_1")
    posts = [(s.path, s.body) for s in fake.requests("POST")]
    assert posts == [("/slurm/v0.0.42/job/1", {"excluded_nodes": ["node4"]}),
                     ("/slurm/v0.0.42/job/1", {"excluded_nodes": ""}),
                     ("/slurm/v0.0.42/job/1", {"hold": False})]


def test_2411_a_task_missing_from_its_arrays_answer_is_not_found(fake, server, tmp_path):
    """24.11 answers a task's lookup with every task of the array: a task that
    is not among them is gone, never a sibling (an update would go to the
    sibling's own id)."""
    v42(fake)
    fake.answer("GET", "/slurm/v0.0.42/job/1_5",
                Answer(body=recorded("24.11", "rest_job_array_task.json")))
    sched = rest(server, token_file=token_file(tmp_path))
    with pytest.raises(JobNotFound):
        sched.lookup_job("1_5")
    with pytest.raises(JobNotFound):
        sched.release("1_5")
    assert fake.requests("POST") == []


def test_2411_a_resumed_nodes_leftover_reason_reads_as_none(fake, server, tmp_path):
    """24.11 keeps a drain's reason after state=RESUME (recorded live: the
    node IDLE, the reason still there): it no longer says why the node is out."""
    v42(fake)
    fake.answer("GET", "/slurm/v0.0.42/node/node4",
                Answer(body=recorded("24.11", "rest_node_resumed_stale_reason.json")))
    raw = recorded("24.11", "rest_node_resumed_stale_reason.json")["nodes"][0]
    assert raw["reason"] and raw["state"] == ["IDLE"]
    node = rest(server, token_file=token_file(tmp_path)).get_node("node4")
    assert node.state == "IDLE" and not node.drained
    assert (node.reason, node.reason_user, node.reason_time) == ("", "", None)


def test_a_drained_nodes_reason_is_kept():
    from recovery_agent.scheduler.cli_parse import node_from_json
    raw = dict(recorded("24.11", "rest_node_resumed_stale_reason.json")["nodes"][0])
    raw["state"] = ["IDLE", "DRAIN"]
    node = node_from_json(raw)
    assert node.drained and node.reason == raw["reason"] and node.reason_user


def v45(fake):
    fake.answer("GET", "/openapi/v3", Answer(body=openapi_doc(
        {"v0.0.42": ENDPOINTS_40, "v0.0.43": ENDPOINTS_40, "v0.0.44": ENDPOINTS_40,
         "v0.0.45": ENDPOINTS_45})))
    fake.answer("GET", "/slurm/v0.0.45/jobs/",
                Answer(body=as_rest(recorded("26.05", "squeue_all.json"), "v0.0.45")))
    fake.answer("GET", "/slurm/v0.0.45/job/7/requeue",
                Answer(body=as_rest({"errors": [], "results": []}, "v0.0.45")))
    fake.answer("POST", "/slurm/v0.0.45/job/7", Answer(body=as_rest({"errors": []}, "v0.0.45")))


def test_2605_a_404_that_names_the_job_is_job_not_found(fake, server, tmp_path):
    """26.05 answers a requeue of an unknown job with HTTP 404 and Slurm's
    "Invalid job id specified" in a JSON body (recorded live): the job's error,
    not a missing endpoint. A 404 without Slurm's word stays an endpoint error."""
    v45(fake)
    fake.answer("GET", "/slurm/v0.0.45/job/987654/requeue",
                Answer(404, recorded("26.05", "rest_requeue_unknown_job.json")))
    sched = rest(server, token_file=token_file(tmp_path))
    with pytest.raises(JobNotFound) as info:
        sched.requeue_hold("987654")
    assert info.value.returncode == 404 and "Invalid job id" in str(info.value)


def rest(url, runner=None, **kw) -> RestScheduler:
    settings = RestSettings(url=url, **{"user": "slurm-recovery", "timeout": 5.0, **kw})
    sched = RestScheduler(settings, runner or SlurmRunner(bin_dir="/nonexistent"),
                          clock=lambda: 1_700_000_000)
    sched.client.sleep = lambda s: None
    return sched


# -- 22.05: slurmrestd's own answers ---------------------------------------------------

def test_2205_reads_speak_v0038_with_the_token(fake, server, tmp_path):
    v38(fake)
    sched = rest(server, token_file=token_file(tmp_path))
    probe = sched.probe()
    assert probe.viable is False   # requeue and drains need the CLI, which is absent here
    assert "no endpoint for requeue, node drain/resume" in probe.reason
    jobs = {j.job_id: j for j in sched.list_jobs()}
    assert jobs["1"].state == "RUNNING" and jobs["1"].nodes == ("node1", "node2")
    # 22.05 hands back the pattern; it is expanded as for squeue --json
    assert jobs["1"].stdout == "/tmp/dc-rest/jobs/restrec-1.out"
    assert jobs["2_[2-3%2]"].array_task_spec == "2-3%2"
    assert [n.name for n in sched.list_nodes()] == ["node1", "node2", "node3", "node4"]
    first = fake.requests("GET")[-1]
    assert first.headers["X-SLURM-USER-NAME"] == "slurm-recovery"
    assert first.headers["X-SLURM-USER-TOKEN"] == TOKEN


def test_2205_probe_is_viable_with_the_cli_fallback(fake, server, tmp_path, cli):
    v38(fake)
    probe = rest(server, cli, token_file=token_file(tmp_path)).probe()
    assert probe.viable and probe.version == "22.05.8"


def test_2205_not_found_answers_are_typed(fake, server, tmp_path):
    v38(fake)
    fake.answer("GET", "/slurm/v0.0.38/job/987654",
                Answer(500, recorded(REST, "job_not_found.json")))
    fake.answer("GET", "/slurm/v0.0.38/node/nosuch",
                Answer(500, recorded(REST, "node_not_found.json")))
    sched = rest(server, token_file=token_file(tmp_path))
    with pytest.raises(JobNotFound) as info:
        sched.lookup_job("987654")
    assert info.value.argv == ["GET", "/slurm/v0.0.38/job/987654"]
    assert info.value.returncode == 500
    with pytest.raises(NodeNotFound):
        sched.get_node("nosuch")
    # a Slurm answer is final: not retried like a broken server
    assert len(fake.requests("GET")) == 3


def test_2205_job_changes_use_sbatch_option_names(fake, server, tmp_path):
    v38(fake)
    sched = rest(server, token_file=token_file(tmp_path))
    sched.set_excluded_nodes("1", ["node2", "node1"])
    sched.set_excluded_nodes("1", [])
    sched.start_now("1")
    sched.release("1")
    sched.allow_requeue("1")
    sched.cancel("1", "TERM")
    posts = [s.body for s in fake.requests("POST")]
    # "excluded_nodes" is a disabled key in 22.05 (it answers "Disabled key"); sbatch's
    # -x name works, and "" clears the list (both tried live)
    assert posts == [{"exclude_nodes": "node[1-2]"}, {"exclude_nodes": ""},
                     {"begin_time": "now"}, {"hold": False}, {"requeue": True}]
    assert fake.requests("DELETE")[0].query == "signal=SIGTERM"


def test_2205_requeue_and_drain_fall_back_to_the_cli(fake, server, tmp_path, cli, caplog):
    v38(fake)
    sched = rest(server, cli, token_file=token_file(tmp_path))
    with caplog.at_level(logging.INFO):
        sched.requeue_hold("1")
        sched.drain_node("node3", "recovery: xid 79")
        sched.resume_node("node3")
    assert cli.log.read_text().splitlines() == [
        "requeuehold 1", "update nodename=node3 state=DRAIN reason=recovery: xid 79",
        "update nodename=node3 state=RESUME"]
    assert "has no requeue: running it through the CLI" in caplog.text


def test_2205_without_fallback_a_missing_endpoint_is_an_error(fake, server, tmp_path, cli):
    v38(fake)
    sched = rest(server, cli, token_file=token_file(tmp_path), fallback="none")
    with pytest.raises(SchedulerError) as info:
        sched.requeue_hold("1")
    assert info.value.argv == ["GET", "/slurm/v0.0.38/job/1/requeue"]
    assert "no endpoint for requeue" in str(info.value)
    with pytest.raises(SchedulerError, match="no endpoint for node update"):
        sched.drain_node("node3", "recovery: x")
    assert not cli.log.exists()     # nothing ran


def test_an_error_entry_in_a_200_is_a_refusal(fake, server, tmp_path):
    v38(fake)
    # what 22.05 answers, with HTTP 200, to a key it does not take
    fake.answer("POST", "/slurm/v0.0.38/job/1", Answer(200, {"errors": [
        {"description": 'Disabled key: "excluded_nodes"', "error_number": 1,
         "error": "Operation not permitted", "source": "openapi specification"}]}))
    sched = rest(server, token_file=token_file(tmp_path))
    with pytest.raises(SchedulerError, match="Disabled key") as info:
        sched.release("1")
    assert info.value.argv == ["POST", "/slurm/v0.0.38/job/1"]
    assert len(fake.requests("POST")) == 1


# -- 24.11 and 26.05: data_parser shapes ------------------------------------------------

def test_2411_picks_v0042_and_sends_data_parser_fields(fake, server, tmp_path):
    v42(fake)
    sched = rest(server, token_file=token_file(tmp_path))
    assert sched.probe().viable is False    # no requeue endpoint, no CLI here
    assert sched.api().version == "v0.0.42"
    jobs = sched.list_jobs()
    assert jobs and all(j.numeric_id for j in jobs)
    held = next(j for j in jobs if j.job_id == "14")   # requeued, held, without node3
    assert held.excluded_nodes == ("node3",) and held.restart_count == 1
    assert held.held and held.is_pending
    assert {n.name for n in sched.list_nodes()} == {"node1", "node2", "node3"}
    sched.set_excluded_nodes("5", ["node1", "node3"])
    sched.start_now("5")
    sched.release("5")
    sched.drain_node("node3", "recovery: xid 79")
    sched.resume_node("node3")
    sched.cancel("5")
    posts = [(s.path, s.body) for s in fake.requests("POST")]
    assert posts == [
        ("/slurm/v0.0.42/job/5", {"excluded_nodes": ["node1", "node3"]}),
        ("/slurm/v0.0.42/job/5", {"begin_time": 1_700_000_000}),
        ("/slurm/v0.0.42/job/5", {"hold": False}),
        ("/slurm/v0.0.42/node/node3", {"state": ["DRAIN"], "reason": "recovery: xid 79"}),
        ("/slurm/v0.0.42/node/node3", {"state": ["RESUME"]})]
    assert fake.requests("DELETE")[0].query == ""      # SIGKILL, as scancel


def test_2411_requeue_falls_back_and_drain_does_not(fake, server, tmp_path, cli):
    v42(fake)
    sched = rest(server, cli, token_file=token_file(tmp_path))
    assert sched.probe().viable
    sched.requeue_hold("5")
    sched.drain_node("node3", "recovery: x")
    assert cli.log.read_text().splitlines() == ["requeuehold 5"]


def test_2605_requeues_through_rest(fake, server, tmp_path, cli):
    v45(fake)
    sched = rest(server, cli, token_file=token_file(tmp_path))
    assert sched.api().version == "v0.0.45"
    sched.requeue_hold("7")
    (call,) = [s for s in fake.requests("GET") if s.path.endswith("/requeue")]
    assert call.query == "Hold=true"
    assert not cli.log.exists()
    assert any(j.job_id for j in sched.list_jobs())


def test_a_pinned_version_is_used_or_refused(fake, server, tmp_path):
    v42(fake)
    assert rest(server, token_file=token_file(tmp_path), version="v0.0.40").api().version \
        == "v0.0.40"
    with pytest.raises(SchedulerError, match="offers OpenAPI v0.0.42, v0.0.41, v0.0.40"):
        rest(server, token_file=token_file(tmp_path), version="v0.0.38").api()


# -- bad input: the list --------------------------------------------------------

def test_401_names_the_endpoint_and_the_status(fake, server, tmp_path):
    raw = (FIX / REST / "unauthorized.http").read_text()
    fake.answer("GET", "/openapi/v3", Answer(401, raw.split("\n\n", 1)[-1].strip(),
                                              "text/plain"))
    sched = rest(server, token_file=token_file(tmp_path))
    with pytest.raises(SchedulerError) as info:
        sched.list_jobs()
    assert info.value.returncode == 401 and info.value.argv == ["GET", "/openapi/v3"]
    assert "HTTP 401" in str(info.value) and "Authentication failure" in info.value.stderr
    assert not sched.probe().viable


def test_401_with_an_scontrol_token_renews_it_once(fake, server, cli):
    v38(fake)
    answers = iter([Answer(401, "Authentication failure", "text/plain"),
                    Answer(body=recorded(REST, "jobs.json"))])
    fake.answer("GET", "/slurm/v0.0.38/jobs/", lambda seen: next(answers))
    sched = rest(server, cli)
    assert sched.list_jobs()
    tokens = [s.headers["X-SLURM-USER-TOKEN"] for s in fake.requests("GET")[-2:]]
    assert tokens[0] != tokens[1] and all(t.startswith("fresh-") for t in tokens)
    assert cli.log.read_text().count("token username=slurm-recovery lifespan=3600") == 2
    fake.answer("GET", "/slurm/v0.0.38/jobs/", Answer(401, "Authentication failure",
                                                       "text/plain"))
    with pytest.raises(SchedulerError, match="HTTP 401"):
        sched.list_jobs()
    assert cli.log.read_text().count("token ") == 3     # one renewal per request


def test_5xx_reads_are_retried_a_bounded_number_of_times(fake, server, tmp_path):
    v38(fake)
    fake.answer("GET", "/slurm/v0.0.38/jobs/", Answer(502, "bad gateway", "text/plain"))
    sched = rest(server, token_file=token_file(tmp_path), retries=2)
    with pytest.raises(SchedulerError) as info:
        sched.list_jobs()
    assert info.value.returncode == 502
    assert info.value.argv == ["GET", "/slurm/v0.0.38/jobs/"]
    assert len([s for s in fake.requests("GET") if s.path.endswith("/jobs/")]) == 3


def test_a_5xx_that_recovers_gives_the_listing(fake, server, tmp_path):
    v38(fake)
    answers = iter([Answer(503, "", "text/plain"), Answer(body=recorded(REST, "jobs.json"))])
    fake.answer("GET", "/slurm/v0.0.38/jobs/", lambda seen: next(answers))
    assert rest(server, token_file=token_file(tmp_path)).list_jobs()


def test_a_change_is_not_repeated_after_a_5xx(fake, server, tmp_path):
    v38(fake)
    fake.answer("POST", "/slurm/v0.0.38/job/1", Answer(500, "<html>oops</html>", "text/html"))
    sched = rest(server, token_file=token_file(tmp_path), retries=3)
    with pytest.raises(SchedulerError) as info:
        sched.release("1")
    assert info.value.returncode == 500 and "HTML" in str(info.value)
    assert len(fake.requests("POST")) == 1


@pytest.mark.parametrize("answer,said", [
    (Answer(200, "<!DOCTYPE html><html><body>proxy login</body></html>", "text/html"),
     "an HTML page"),
    (Answer(200, '{"meta": {}, "errors": [], "jobs": [', ), "not a JSON object"),
    (Answer(200, "[]"), "not a JSON object"),
    (Answer(200, ""), "an empty body"),
])
def test_html_and_broken_bodies_are_errors_not_empty_listings(fake, server, tmp_path,
                                                              answer, said):
    v38(fake)
    fake.answer("GET", "/slurm/v0.0.38/jobs/", answer)
    sched = rest(server, token_file=token_file(tmp_path))
    with pytest.raises(SchedulerError) as info:
        sched.list_jobs()
    assert said in str(info.value) and "GET /slurm/v0.0.38/jobs/: HTTP 200" in str(info.value)


def test_a_truncated_body_is_an_error(fake, server, tmp_path):
    v38(fake)
    body = (FIX / REST / "jobs.json").read_text()
    fake.answer("GET", "/slurm/v0.0.38/jobs/", Answer(200, body[:2000], truncate=5000))
    sched = rest(server, token_file=token_file(tmp_path), retries=1)
    with pytest.raises(SchedulerError, match="truncated body") as info:
        sched.list_jobs()
    assert info.value.argv == ["GET", "/slurm/v0.0.38/jobs/"]


def test_a_listing_with_errors_is_never_no_jobs(fake, server, tmp_path):
    v38(fake)
    frozen = recorded("22.05", "squeue_ctld_frozen.json")     # "jobs": [] plus an error
    fake.answer("GET", "/slurm/v0.0.38/jobs/", Answer(500, frozen))
    sched = rest(server, token_file=token_file(tmp_path))
    with pytest.raises(SchedulerError, match="slurm_load_jobs"):
        sched.list_jobs()
    with pytest.raises(SchedulerError) as info:
        sched.get_job("1")
    assert not isinstance(info.value, JobNotFound)


def test_wrong_openapi_versions_are_refused(fake, server, tmp_path):
    fake.answer("GET", "/openapi/v3", Answer(body=openapi_doc(
        {"v0.0.36": ENDPOINTS_38, "v0.0.39": ENDPOINTS_40})))
    sched = rest(server, token_file=token_file(tmp_path))
    with pytest.raises(SchedulerError, match="offers OpenAPI v0.0.39, v0.0.36; this "
                                             "backend speaks v0.0.45") as info:
        sched.list_jobs()
    assert info.value.argv == ["GET", "/openapi/v3"]


def test_an_answer_from_another_version_is_refused(fake, server, tmp_path):
    v38(fake)
    wrong = recorded(REST, "jobs.json")
    wrong["meta"]["plugin"]["type"] = "openapi/v0.0.37"
    fake.answer("GET", "/slurm/v0.0.38/jobs/", Answer(body=wrong))
    with pytest.raises(SchedulerError, match="answered in OpenAPI v0.0.37, asked for v0.0.38"):
        rest(server, token_file=token_file(tmp_path)).list_jobs()


def test_an_unreachable_server_is_a_scheduler_error(tmp_path):
    sched = rest("http://127.0.0.1:9", token_file=token_file(tmp_path), retries=1)
    with pytest.raises(SchedulerError, match="cannot connect") as info:
        sched.list_jobs()
    assert info.value.returncode is None
    assert not sched.probe().viable


def test_a_slow_server_times_out(fake, server, tmp_path):
    v38(fake)

    def slow(seen):
        time.sleep(1.5)
        return Answer(body=recorded(REST, "jobs.json"))
    fake.answer("GET", "/slurm/v0.0.38/jobs/", slow)
    sched = rest(server, token_file=token_file(tmp_path), timeout=0.5, retries=0)
    started = time.monotonic()
    with pytest.raises(SchedulerError, match="timed out"):
        sched.list_jobs()
    assert time.monotonic() - started < 1.4


def test_the_watch_loop_survives_a_broken_slurmrestd(fake, server, tmp_path):
    from recovery_agent.config import from_mapping
    from recovery_agent.detect.patterns import load_rules
    from recovery_agent.detect.scanner import Scanner
    from recovery_agent.inputs.logline import MemoryCursorStore
    from recovery_agent.inputs.tail import Tailer
    from recovery_agent.store import Store
    from recovery_agent.watch import Watcher
    v38(fake)
    cfg = from_mapping({"agent": {"cluster": "c1"}})
    store = Store(tmp_path / "r.db")
    watcher = Watcher(cfg, store, rest(server, token_file=token_file(tmp_path)),
                      Scanner(load_rules(), engine="re"), Tailer(MemoryCursorStore()))
    assert watcher.run_once() is True
    fake.answer("GET", "/slurm/v0.0.38/jobs/", Answer(200, "<html>maintenance</html>",
                                                       "text/html"))
    assert watcher.run_once() is False      # the cycle failed, the loop goes on
    assert "HTTP 200" in store.health["error"] and "jobs/" in store.health["error"]
    assert watcher.watches or store.db["jobs"].count == 0   # nothing was forgotten or acted on


# -- transport and auth ----------------------------------------------------------------

def test_local_auth_on_a_unix_socket_sends_no_token(fake, tmp_path):
    v38(fake)
    url, stop = serve(fake, str(tmp_path / "rest.sock"))
    try:
        sched = rest(url, auth="local", user="")
        assert len(sched.list_jobs()) == 4
    finally:
        stop()
    assert all("X-SLURM-USER-TOKEN" not in s.headers for s in fake.seen)
    assert all("X-SLURM-USER-NAME" not in s.headers for s in fake.seen)


def test_a_rotated_token_file_is_read_again(fake, server, tmp_path):
    v38(fake)
    path = token_file(tmp_path)
    sched = rest(server, token_file=path)
    sched.list_jobs()
    with open(path, "w") as fh:
        fh.write("second-token-value-longer\n")
    sched.list_jobs()
    assert fake.requests("GET")[-1].headers["X-SLURM-USER-TOKEN"] == "second-token-value-longer"


def test_an_empty_token_file_is_an_error(fake, server, tmp_path):
    v38(fake)
    sched = rest(server, token_file=token_file(tmp_path, "\n"))
    with pytest.raises(SchedulerError, match="holds no token"):
        sched.list_jobs()


def test_a_url_prefix_is_kept(fake, server, tmp_path):
    fake.answer("GET", "/slurm-api/openapi/v3",
                Answer(body=openapi_doc({"v0.0.38": ENDPOINTS_38})))
    client = RestClient(RestSettings(url=server + "/slurm-api/", token_file=token_file(tmp_path)))
    assert client.choose_version()[0] == "v0.0.38"


@pytest.mark.parametrize("settings,said", [
    (RestSettings(url=""), "rest_url: not set"),
    (RestSettings(url="ftp://x"), "neither"),
    (RestSettings(url="http://x", auth="munge"), "rest_auth"),
])
def test_bad_settings_are_config_errors(settings, said):
    with pytest.raises(ConfigError, match=said):
        RestClient(settings)


# -- config ------------------------------------------------------------------------------

@pytest.mark.parametrize("scheduler,said", [
    ({"backend": "rest"}, "scheduler.rest_url: must be set"),
    ({"rest_url": "slurmrestd:6820"}, "scheduler.rest_url"),
    ({"rest_url": "http://h:6820", "rest_auth": "local"}, "only over a unix socket"),
    ({"rest_url": "unix:/run/r.sock", "rest_auth": "munge"}, "scheduler.rest_auth"),
    ({"rest_fallback": "ssh"}, "scheduler.rest_fallback"),
    ({"rest_version": "v0.0.39"}, "scheduler.rest_version"),
    ({"rest_retries": 50}, "scheduler.rest_retries"),
    ({"rest_token_lifespan": "10s"}, "scheduler.rest_token_lifespan"),
])
def test_rest_config_errors_name_the_key(scheduler, said):
    from recovery_agent.config import from_mapping
    with pytest.raises(ConfigError, match=said):
        from_mapping({"scheduler": scheduler})


def test_rest_settings_come_from_the_config():
    from recovery_agent.config import from_mapping
    cfg = from_mapping({"scheduler": {"backend": "rest", "rest_url": "unix:/run/r.sock",
                                      "rest_auth": "local", "rest_token_lifespan": "2h",
                                      "command_timeout": "12s", "rest_fallback": "none"}})
    settings = RestSettings.from_config(cfg.scheduler)
    assert (settings.url, settings.auth, settings.token_lifespan, settings.timeout,
            settings.fallback) == ("unix:/run/r.sock", "local", 7200, 12.0, "none")


def test_2411_per_job_refusals_in_a_clean_answer_are_errors(fake, server, tmp_path):
    """23.11+ answer an update and a signal with an empty errors list and one
    entry per job (shapes from data_parser v0.0.42's JOB_ARRAY_RESPONSE_MSG_ENTRY
    and KILL_JOBS_RESP_JOB)."""
    v42(fake)
    fake.answer("POST", "/slurm/v0.0.42/job/5", Answer(body=as_rest({"errors": [], "results": [
        {"job_id": 5, "step_id": "5", "error_code": 2017, "error": "Invalid job id specified",
         "why": ""}]}, "v0.0.42")))
    fake.answer("DELETE", "/slurm/v0.0.42/job/5", Answer(body=as_rest({"errors": [], "status": [
        {"error": {"string": "Job/step already completing or completed", "code": 2021,
                   "message": ""}, "step_id": "5", "job_id": 5,
         "federation": {"sibling": ""}}]}, "v0.0.42")))
    sched = rest(server, token_file=token_file(tmp_path))
    with pytest.raises(JobNotFound, match="Invalid job id"):
        sched.release("5")
    with pytest.raises(SchedulerError, match="already completing") as info:
        sched.cancel("5")
    assert info.value.argv == ["DELETE", "/slurm/v0.0.42/job/5"]
    fake.answer("POST", "/slurm/v0.0.42/job/5", Answer(body=as_rest({"errors": [], "results": [
        {"job_id": 5, "step_id": "5", "error_code": 0, "error": "No error", "why": ""}]},
        "v0.0.42")))
    sched.release("5")


def test_2205_changes_to_an_unknown_job_are_job_not_found(fake, server, tmp_path):
    v38(fake)
    fake.answer("POST", "/slurm/v0.0.38/job/987654",
                Answer(500, recorded(REST, "update_not_found.json")))
    fake.answer("DELETE", "/slurm/v0.0.38/job/987654",
                Answer(500, recorded(REST, "cancel_not_found.json")))
    sched = rest(server, token_file=token_file(tmp_path))
    for change in (sched.release, sched.start_now, sched.cancel):
        with pytest.raises(JobNotFound) as info:
            change("987654")
        assert info.value.returncode == 500 and "/job/987654" in info.value.argv[1]


def test_the_pending_rest_of_an_array_is_looked_up_through_its_array(fake, server, tmp_path):
    v38(fake)
    fake.answer("GET", "/slurm/v0.0.38/job/2", Answer(body=recorded(REST, "jobs.json")))
    fake.answer("GET", "/slurm/v0.0.38/job/2_1", Answer(body=recorded(REST, "jobs.json")))
    sched = rest(server, token_file=token_file(tmp_path))
    rest_of = sched.lookup_job("2_[2-3%2]")
    assert rest_of.array_task_spec == "2-3%2" and rest_of.is_pending
    assert sched.lookup_job("2_1").array_task_id == 1
    only_tasks = recorded(REST, "jobs.json")
    only_tasks["jobs"] = [j for j in only_tasks["jobs"] if not j["array_task_string"]]
    fake.answer("GET", "/slurm/v0.0.38/job/2", Answer(body=only_tasks))
    with pytest.raises(JobNotFound, match="no such pending tasks"):
        sched.lookup_job("2_[2-3%2]")     # every task has started: that entry is gone


def test_an_empty_lookup_without_an_error_proves_nothing(fake, server, tmp_path):
    v38(fake)
    empty = recorded(REST, "job_not_found.json")
    empty["errors"] = []
    fake.answer("GET", "/slurm/v0.0.38/job/1", Answer(body=empty))
    with pytest.raises(SchedulerError) as info:
        rest(server, token_file=token_file(tmp_path)).lookup_job("1")
    assert not isinstance(info.value, JobNotFound)


def test_a_404_on_a_versioned_path_asks_for_the_versions_again(fake, server, tmp_path):
    v38(fake)
    sched = rest(server, token_file=token_file(tmp_path))
    assert sched.list_jobs()
    v42(fake)      # slurmrestd restarted as 24.11: v0.0.38 is gone
    fake.routes.pop(("GET", "/slurm/v0.0.38/jobs/"))
    with pytest.raises(SchedulerError, match="HTTP 404"):
        sched.list_jobs()
    assert sched.list_jobs() and sched.api().version == "v0.0.42"


# -- the dev cluster's slurmrestd ----------------------------------------------------------

def test_the_dev_cluster_runs_slurmrestd_only_when_asked(tmp_path, monkeypatch):
    from recovery_devtools.devcluster.config import ClusterSpec, Layout, local_spec, slurm_conf
    lay = Layout(tmp_path)
    plain = ClusterSpec(port=30000)
    assert "AuthAltTypes" not in slurm_conf(plain, lay)
    assert "slurmrestd" not in plain.ports and "rest" not in plain.comparable()
    with_rest = ClusterSpec(port=30000, rest=True)
    conf = slurm_conf(with_rest, lay)
    assert "AuthAltTypes=auth/jwt\n" in conf
    assert f"AuthAltParameters=jwt_key={lay.jwt_key}\n" in conf
    assert with_rest.ports["slurmrestd"] == 30080 and with_rest.comparable()["rest"] is True
    monkeypatch.setenv("RECOVERY_DEVCLUSTER_REST", "1")
    assert local_spec().rest and not local_spec(rest=False).rest
    monkeypatch.setenv("RECOVERY_DEVCLUSTER_REST", "0")
    assert not local_spec().rest


def test_the_dev_cluster_refuses_a_state_dir_nobody_can_reach(tmp_path):
    from recovery_devtools.devcluster.cluster import DevClusterError, _reachable_by_others
    locked = tmp_path / "locked"
    (locked / "dc").mkdir(parents=True)
    locked.chmod(0o700)
    with pytest.raises(DevClusterError, match="does not let others pass"):
        _reachable_by_others(locked / "dc")
    locked.chmod(0o755)
    tmp_path.chmod(0o755)
    for parent in tmp_path.parents:
        if not parent.stat().st_mode & 0o001:
            return      # this machine's temp root is private: the check above stands
    _reachable_by_others(locked / "dc")


def test_2205_false_failure_of_an_array_task_update_is_ignored(fake, server, tmp_path):
    """22.05 answers a successful update of an array task with an error entry
    without a number (the update took effect: checked live); a real refusal of
    an array task carries its number."""
    v38(fake)
    fake.answer("POST", "/slurm/v0.0.38/job/69_3",
                Answer(200, recorded(REST, "update_array_task.json")))
    fake.answer("POST", "/slurm/v0.0.38/job/98765_1",
                Answer(200, recorded(REST, "update_array_task_not_found.json")))
    sched = rest(server, token_file=token_file(tmp_path))
    sched.start_now("69_3")
    sched.set_excluded_nodes("69_3", ["node1"])
    with pytest.raises(JobNotFound):
        sched.release("98765_1")
    # the same entry is a refusal in any other request, and on newer versions
    fake.answer("DELETE", "/slurm/v0.0.38/job/69_3",
                Answer(200, recorded(REST, "update_array_task.json")))
    with pytest.raises(SchedulerError, match="job array update"):
        sched.cancel("69_3")


def test_a_sinfo_group_back_in_service_has_no_reason():
    """The grouped sinfo of 23.02+ reads reasons by the same rule as the
    per-node lists: a leftover on a node back in service is none."""
    from recovery_agent.scheduler.cli_parse import nodes_from_sinfo_groups
    group = {"node": {"state": ["IDLE"]}, "nodes": {"nodes": ["node4"]},
             "reason": {"description": "probe cli", "time": 1796173067, "user": "root"}}
    (node,) = nodes_from_sinfo_groups([group])
    assert (node.reason, node.reason_user, node.reason_time) == ("", "", None)
    group["node"]["state"] = ["IDLE", "DRAIN"]
    (node,) = nodes_from_sinfo_groups([group])
    assert node.drained and (node.reason, node.reason_user) == ("probe cli", "root")
