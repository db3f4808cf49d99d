"""Loki (LogQL, /loki/api/v1/query_range) against recorded answers in the
documented shape, served by a real local HTTP server; paging over a fake that
keeps Loki's start-inclusive, end-exclusive, limit-by-time semantics."""
from __future__ import annotations

import json
import re
import time

import pytest

from recovery_agent.inputs.sources.feed import CursorStore
from recovery_agent.inputs.sources.http import Endpoint, HttpClient
from recovery_agent.inputs.sources.loki import LokiLabels, LokiSource
from tests.fixtures.sources.httpfake import FakeServer, dead_url, json_reply, recorded

T0 = 1714557600.0
NS = 10**9
PATH = "/loki/api/v1/query_range"
JOB = {"host": "gpu-n17", "slurm_job_id": "4242"}
JOB2 = {"host": "gpu-n18", "slurm_job_id": "4242"}


def answer(entries, start, end, limit, direction="forward", warnings=None) -> dict:
    """What Loki returns for a stream selector over ``entries`` (labels, ns, line):
    the first ``limit`` by time in [start, end), grouped by stream. Ties are
    ordered differently from the client, on purpose."""
    pool = sorted((e for e in entries if start <= e[1] < end),
                  key=lambda e: (e[1], e[2][::-1]), reverse=direction == "backward")[:limit]
    streams: dict[str, dict] = {}
    for lab, ns, line in pool:
        item = streams.setdefault(json.dumps(lab, sort_keys=True), {"stream": lab, "values": []})
        item["values"].append([str(ns), line])
    body = {"status": "success", "data": {"resultType": "streams",
                                          "result": list(streams.values()),
                                          "stats": {"summary": {"execTime": 0.001}}}}
    if warnings:
        body["warnings"] = warnings
    return body


class FakeLoki:
    def __init__(self, server: FakeServer, entries) -> None:
        self.entries = entries
        server.route(PATH, self.query_range)

    def query_range(self, request):
        p = request.params
        return json_reply(answer(self.entries, int(p["start"]), int(p["end"]), int(p["limit"]),
                                 p.get("direction", "backward")))


@pytest.fixture
def server():
    with FakeServer() as fake:
        yield fake


def loki(url, labels=LokiLabels(host=""), sleeps=None, **kw) -> LokiSource:
    endpoint = Endpoint(url, timeout=kw.pop("timeout", 2.0), retries=kw.pop("retries", 1))
    http = HttpClient(endpoint, sleep=(sleeps.append if sleeps is not None else lambda s: None))
    kw.setdefault("delay", 0.0)
    return LokiSource(endpoint, labels, http=http, **kw)


def test_recorded_answer_becomes_lines(server):
    server.route(PATH, lambda r: (200, {}, recorded("loki_query_range.json")))
    src = loki(server.url, LokiLabels())          # no nodes given: the job feed only
    result = src.poll("4242", [], since=T0 - 60, now=T0 + 60)
    assert result.error is None and not result.more
    assert [line.time for line in result.lines] == [T0 - 1, T0, T0 + 1.5]
    xid = result.lines[0]
    assert xid.host == "gpu-n18" and "Xid" in xid.text
    assert xid.source == f"loki:127.0.0.1:{server.httpd.server_address[1]}"
    assert xid.stream == "host=gpu-n18,job=kernel,slurm_job_id=4242"
    sent = server.hits(PATH)[0].params
    assert sent["direction"] == "forward" and sent["limit"] == "1000"
    assert sent["start"] == str(int((T0 - 60) * NS)) and sent["end"] == str(int((T0 + 60) * NS))


def test_queries_carry_the_selector_and_the_prefilter(server):
    FakeLoki(server, [])
    labels = LokiLabels(job="slurm_job_id", host="host", selector='cluster="hpc1"')
    prefilter = r'NVRM: Xid|NCCL error|(?i:out of memory)|say "hi"'
    loki(server.url, labels, prefilter=prefilter).poll("4242", ["gpu-n17", "gpu.n18"],
                                                       since=T0, now=T0 + 60)
    job_q, nodes_q = (r.params["query"] for r in server.hits(PATH))
    assert job_q.startswith('{slurm_job_id="4242",cluster="hpc1"} |~ ')
    assert json.loads(job_q.split("|~ ", 1)[1]) == prefilter      # quoted, escapes intact
    selector = re.match(r'\{host=~("(?:[^"\\]|\\.)*"),cluster="hpc1"\}', nodes_q)
    assert selector, nodes_q
    hosts = json.loads(selector.group(1))
    assert re.fullmatch(hosts, "gpu.n18") and not re.fullmatch(hosts, "gpu-n18")


def test_paging_delivers_every_line_once_across_polls_and_a_restart(server, tmp_path):
    entries = []
    for i in range(23):          # two streams, timestamps shared at page boundaries
        ns = int(T0 * NS) + (i // 2) * 1000
        entries.append((JOB if i % 2 else JOB2, ns, f"line {i:02d} NCCL error"))
    FakeLoki(server, entries)
    src = loki(server.url, page_limit=5, max_pages=3,
               cursors=CursorStore(tmp_path, "loki"))
    got, polls = [], 0
    first = src.poll("4242", [], since=T0 - 1, now=T0 + 60)
    got += first.lines
    assert first.more and first.pages == 3
    src.save()
    src = loki(server.url, page_limit=5, max_pages=3, cursors=CursorStore(tmp_path, "loki"))
    while True:
        polls += 1
        result = src.poll("4242", [], since=T0 - 1, now=T0 + 60)
        got += result.lines
        if not result.more:
            break
        assert polls < 10
    texts = [line.text for line in got]
    assert sorted(texts) == sorted(e[2] for e in entries)       # all, and none twice
    assert [line.ns for line in got] == sorted(line.ns for line in got)
    assert not any(r.truncated for r in [first])
    later = src.poll("4242", [], since=T0 - 1, now=T0 + 120)
    assert later.lines == [] and not later.more


def test_more_than_a_page_at_one_instant_is_flagged_not_looped(server):
    ns = int(T0 * NS)
    entries = [(JOB, ns, f"same instant {i}") for i in range(7)] + [(JOB, ns + 5, "after")]
    FakeLoki(server, entries)
    result = loki(server.url, page_limit=5, max_pages=10).poll("4242", [], since=T0 - 1,
                                                               now=T0 + 60)
    assert result.truncated
    assert result.lines[-1].text == "after"
    assert len({line.text for line in result.lines}) == len(result.lines)
    assert len(server.hits(PATH)) <= 4


def test_429_is_honoured_and_the_poll_succeeds(server):
    answers = iter([(429, {"Retry-After": "2"}, b"Ingestion rate limit exceeded"),
                    (200, {}, recorded("loki_query_range.json"))])
    server.route(PATH, lambda r: next(answers))
    sleeps: list[float] = []
    result = loki(server.url, sleeps=sleeps).poll("4242", [], since=T0 - 60, now=T0 + 60)
    assert result.error is None and len(result.lines) == 3
    assert sleeps == [2.0]


def test_a_timeout_keeps_the_cursor(server, tmp_path):
    slow = {"on": True}

    def handler(request):
        if slow["on"]:
            time.sleep(1.0)
        return 200, {}, recorded("loki_query_range.json")
    server.route(PATH, handler)
    src = loki(server.url, timeout=0.3, cursors=CursorStore(tmp_path, "loki"))
    failed = src.poll("4242", [], since=T0 - 60, now=T0 + 60)
    assert failed.error_kind == "timeout" and failed.lines == []
    assert src.cursors.get("4242/job") is None
    slow["on"] = False
    src.health.retry_at = 0.0          # the pause after a failure is over
    ok = src.poll("4242", [], since=T0 - 60, now=T0 + 60)
    assert len(ok.lines) == 3
    assert server.hits(PATH)[-1].params["start"] == str(int((T0 - 60) * NS))


@pytest.mark.parametrize("reply,kind,message", [
    ((200, {}, b'{"status":"success","data":{"resultType":"streams","result":[{"str'),
     "malformed", "not JSON"),
    ((200, {}, recorded("loki_matrix.json")), "malformed", "expected resultType 'streams'"),
    ((200, {}, b'{"status":"error","errorType":"bad_data","error":"parse error"}'),
     "malformed", "bad_data: parse error"),
    ((200, {}, b'{"status":"success","data":{"resultType":"streams","result":'
               b'[{"stream":{},"values":[["yesterday","x"]]}]}}'),
     "malformed", "not nanoseconds"),
    ((400, {}, b"parse error at line 1, col 3: syntax error: unexpected IDENTIFIER"),
     "malformed", "HTTP 400: parse error"),
    ((502, {}, b"Bad Gateway"), "unavailable", "HTTP 502"),
])
def test_bad_answers_are_clear_errors_not_crashes(server, reply, kind, message):
    server.route(PATH, lambda r: reply)
    result = loki(server.url).poll("4242", [], since=T0 - 60, now=T0 + 60)
    assert result.error_kind == kind and message in result.error
    assert result.lines == []


def test_streams_without_the_host_label_still_deliver_lines(server):
    entries = [({"job": "slurm", "slurm_job_id": "4242"}, int(T0 * NS), "NCCL error")]
    FakeLoki(server, entries)
    result = loki(server.url, LokiLabels(host="host")).poll("4242", [], since=T0 - 1,
                                                            now=T0 + 60)
    assert [(line.host, line.text) for line in result.lines] == [(None, "NCCL error")]


def test_structured_metadata_values_and_warnings(server):
    body = json.loads(recorded("loki_query_range.json"))
    body["data"]["result"][0]["values"][0].append({"structuredMetadata": {"trace_id": "abc"}})
    body["warnings"] = ["query timed out on one querier: partial results"]
    server.route(PATH, lambda r: json_reply(body))
    result = loki(server.url).poll("4242", [], since=T0 - 60, now=T0 + 60)
    assert len(result.lines) == 3
    assert result.warnings == ["query timed out on one querier: partial results"]


def test_one_feed_failing_keeps_the_other(server):
    def handler(request):
        if "slurm_job_id" in request.params["query"]:
            return 200, {}, recorded("loki_query_range.json")
        return 500, {}, b"internal error"
    server.route(PATH, handler)
    src = loki(server.url, LokiLabels(), retries=0)
    result = src.poll("4242", ["gpu-n17"], since=T0 - 60, now=T0 + 60)
    assert len(result.lines) == 3 and result.error_kind == "unavailable"
    assert src.cursors.get("4242/job") is not None and src.cursors.get("4242/nodes") is None
    assert src.health.errors_total == 1


def test_unreachable_loki_degrades():
    src = loki(dead_url(), retries=0)
    result = src.poll("4242", [], since=T0 - 60, now=T0 + 60)
    assert result.error_kind == "unavailable" and not src.health.up
    assert src.poll("4242", [], since=T0 - 60, now=T0 + 61).error_kind == "skipped"


def test_the_delay_leaves_young_lines_for_later(server):
    FakeLoki(server, [(JOB, int(T0 * NS), "NCCL error")])
    src = loki(server.url, delay=30.0)
    assert src.poll("4242", [], since=T0 - 60, now=T0 + 10).lines == []
    assert [line.text for line in src.poll("4242", [], since=T0 - 60, now=T0 + 40).lines] == \
        ["NCCL error"]
    src.forget("4242")
    assert src.cursors.keys() == []
