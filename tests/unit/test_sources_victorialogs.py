"""VictoriaLogs (LogsQL, /select/logsql/query) against recorded JSON-lines
answers, served by a real local HTTP server; paging over a fake that keeps the
documented semantics (``limit=N``: the N newest matching entries)."""
from __future__ import annotations

import json
import re
import time

import pytest

from recovery_agent.inputs.sources.feed import CursorStore
from recovery_agent.inputs.sources.http import Endpoint, HttpClient
from recovery_agent.inputs.sources.query import format_rfc3339_ns, parse_rfc3339_ns
from recovery_agent.inputs.sources.victorialogs import VictoriaLogsFields, VictoriaLogsSource
from tests.fixtures.sources.httpfake import FakeServer, dead_url, recorded

T0 = 1714557600.0
NS = 10**9
PATH = "/select/logsql/query"
_STRING = r'"(?:[^"\\]|\\.)*"'


class FakeVictoriaLogs:
    """Evaluates exactly the LogsQL the client writes: a _time window, in()
    filters, field:* filters, a ~"regex" filter, and the fields/stats pipes."""

    def __init__(self, server: FakeServer, rows: list[dict]) -> None:
        self.rows = rows           # _time as ns
        server.route(PATH, self.query)

    def query(self, request):
        q = request.params["query"]
        filters, _, pipes = q.partition(" | ")
        rows = [r for r in self.rows if self._match(r, filters)]
        rows.sort(key=lambda r: r["_time"], reverse=True)       # newest first
        if "limit" in request.params:
            rows = rows[:int(request.params["limit"])]
        oldest = re.search(r"\| sort by \(_time\) limit (\d+)$", pipes)
        if oldest:            # the N oldest; ties in an order of the server's own
            rows = sorted(rows, key=lambda r: (r["_time"], r["_msg"][::-1]))
            rows = rows[:int(oldest.group(1))][::-1]
        stats = re.search(r"stats by \((" + _STRING + r")\) count\(\) hits", pipes)
        if stats:
            name = json.loads(stats.group(1))
            counts: dict = {}
            for r in rows:
                counts[r.get(name)] = counts.get(r.get(name), 0) + 1
            out = [{name: k, "hits": str(v)} for k, v in counts.items()]
        else:
            out = [{**r, "_time": format_rfc3339_ns(r["_time"])} for r in rows]
        return 200, {"Content-Type": "application/stream+json"}, \
            b"".join(json.dumps(o).encode() + b"\n" for o in out)

    @staticmethod
    def _match(row: dict, filters: str) -> bool:
        window = re.search(r"_time:\[(\S+), (\S+)([)\]])", filters)
        if window:
            lo, hi = parse_rfc3339_ns(window.group(1)), parse_rfc3339_ns(window.group(2))
            if row["_time"] < lo or row["_time"] > hi or (window.group(3) == ")" and
                                                          row["_time"] == hi):
                return False
        for name, values in re.findall(r"(" + _STRING + r"):in\(([^)]*)\)", filters):
            allowed = json.loads(f"[{values}]")
            if row.get(json.loads(name)) not in allowed:
                return False
        for name in re.findall(r"(" + _STRING + r"):\*", filters):
            if not row.get(json.loads(name)):
                return False
        regex = re.search(r" ~(" + _STRING + r")", filters)
        return not regex or re.search(json.loads(regex.group(1)), row["_msg"]) is not None


@pytest.fixture
def server():
    with FakeServer() as fake:
        yield fake


def vlogs(url, fields=VictoriaLogsFields(), sleeps=None, **kw) -> VictoriaLogsSource:
    endpoint = Endpoint(url, timeout=kw.pop("timeout", 2.0), retries=kw.pop("retries", 1))
    http = HttpClient(endpoint, sleep=(sleeps.append if sleeps is not None else lambda s: None))
    kw.setdefault("delay", 0.0)
    return VictoriaLogsSource(endpoint, fields, http=http, **kw)


def test_recorded_answer_becomes_sorted_lines(server):
    server.route(PATH, lambda r: (200, {}, recorded("victorialogs_query.jsonl")))
    result = vlogs(server.url).poll("4242", [], since=T0 - 60, now=T0 + 60)
    assert result.error is None
    assert [line.ns for line in result.lines] == [int(T0 * NS) - NS + 1, int(T0 * NS) + NS // 4,
                                                 int(T0 * NS) + NS // 2]
    xid, traceback, nccl = result.lines
    assert xid.host == "gpu-n18" and "Xid" in xid.text
    assert traceback.host == "gpu-n17"             # from _stream when the field is absent
    assert nccl.stream == '{host="gpu-n17",slurm_job_id="4242"}'
    assert xid.source == f"victorialogs:127.0.0.1:{server.httpd.server_address[1]}"


def test_the_query_pushes_window_selector_and_prefilter(server):
    FakeVictoriaLogs(server, [])
    fields = VictoriaLogsFields(filter='cluster:="hpc1"')
    src = vlogs(server.url, fields, prefilter=r'NVRM: Xid|say "hi"|a\.b')
    src.poll("4242", ["gpu-n17", "gpu-n18"], since=T0, now=T0 + 60)
    job_q, nodes_q = (r.params["query"] for r in server.hits(PATH))
    assert job_q.startswith("_time:[2024-05-01T10:00:00.000000000Z, "
                            "2024-05-01T10:01:00.000000000Z) ")
    assert '"slurm_job_id":in("4242")' in job_q and '(cluster:="hpc1")' in job_q
    assert '"host":in("gpu-n17","gpu-n18")' in nodes_q
    regex = json.loads(re.search(r" ~(" + _STRING + ")", job_q).group(1))
    assert regex == r'NVRM: Xid|say "hi"|a\.b'
    assert job_q.endswith('| fields _time, _msg, _stream, "host", "slurm_job_id" '
                          '| sort by (_time) limit 1000')


def rows_for(count: int, per_ns: int = 1, host: str = "gpu-n17") -> list[dict]:
    base = int(T0 * NS)
    return [{"_msg": f"NCCL error {i:03d}", "_time": base + (i // per_ns) * 7,
             "_stream": f'{{host="{host}"}}', "host": host, "slurm_job_id": "4242"}
            for i in range(count)]


def test_paging_walks_forward_oldest_first_and_resumes(server, tmp_path):
    rows = rows_for(40, per_ns=4)
    FakeVictoriaLogs(server, rows)
    src = vlogs(server.url, page_limit=6, max_pages=4, cursors=CursorStore(tmp_path, "vl"))
    got = []
    first = src.poll("4242", [], since=T0 - 1, now=T0 + 60)
    got += first.lines
    assert first.more and first.pages == 4
    src.save()
    src = vlogs(server.url, page_limit=6, max_pages=4, cursors=CursorStore(tmp_path, "vl"))
    for _ in range(30):
        result = src.poll("4242", [], since=T0 - 1, now=T0 + 60)
        got += result.lines
        if not result.more:
            break
    texts = [line.text for line in got]
    assert len(texts) == len(rows) and set(texts) == {r["_msg"] for r in rows}   # all, once
    assert [line.ns for line in got] == sorted(r["_time"] for r in rows)        # oldest first
    assert not result.truncated


def test_a_window_full_at_one_instant_is_flagged(server):
    rows = rows_for(8, per_ns=8) + [{"_msg": "later", "_time": int(T0 * NS) + 50,
                                      "_stream": "{}", "slurm_job_id": "4242"}]
    FakeVictoriaLogs(server, rows)
    result = vlogs(server.url, page_limit=5, max_pages=10).poll("4242", [], since=T0 - 1,
                                                                now=T0 + 60)
    assert result.truncated and result.lines[-1].text == "later"
    assert len(result.lines) == 6 and not result.more    # 5 of the 8, then "later"


def test_the_prefilter_is_applied_by_the_store(server):
    rows = rows_for(3) + [{"_msg": "step 10 loss 2.0", "_time": int(T0 * NS) + 1,
                           "slurm_job_id": "4242"}]
    FakeVictoriaLogs(server, rows)
    result = vlogs(server.url, prefilter="NCCL error").poll("4242", [], since=T0 - 1,
                                                            now=T0 + 60)
    assert [line.text for line in result.lines] == ["NCCL error 000", "NCCL error 001",
                                                    "NCCL error 002"]


def test_429_then_success(server):
    answers = iter([(429, {"Retry-After": "1"}, b"too many requests"),
                    (200, {}, recorded("victorialogs_query.jsonl"))])
    server.route(PATH, lambda r: next(answers))
    sleeps: list[float] = []
    result = vlogs(server.url, sleeps=sleeps).poll("4242", [], since=T0 - 60, now=T0 + 60)
    assert result.error is None and len(result.lines) == 3 and sleeps == [1.0]


def test_slow_answer_times_out_and_keeps_the_cursor(server, tmp_path):
    def slow(request):
        time.sleep(1.0)
        return 200, {}, recorded("victorialogs_query.jsonl")
    server.route(PATH, slow)
    src = vlogs(server.url, timeout=0.3, cursors=CursorStore(tmp_path, "vl"))
    result = src.poll("4242", [], since=T0 - 60, now=T0 + 60)
    assert result.error_kind == "timeout" and src.cursors.get("4242/job") is None


@pytest.mark.parametrize("body,message", [
    (b'{"_msg":"ok","_time":"2024-05-01T10:00:00Z"}\n{"_msg":"cut o', "line 2 of the answer"),
    (b'{"_msg":"no time"}\n', "lacks a valid '_time'"),
    (b'{"_msg":"x","_time":"yesterday"}\n', "lacks a valid '_time'"),
    (b'["not", "an", "object"]\n', "not a JSON object"),
])
def test_malformed_answers_are_clear_errors(server, body, message):
    server.route(PATH, lambda r: (200, {}, body))
    result = vlogs(server.url).poll("4242", [], since=T0 - 60, now=T0 + 60)
    assert result.error_kind == "malformed" and message in result.error
    assert result.lines == []


def test_a_bad_query_answer_is_quoted(server):
    server.route(PATH, lambda r: (400, {}, b'cannot parse query [foo:in(]: missing ")"'))
    result = vlogs(server.url).poll("4242", [], since=T0 - 60, now=T0 + 60)
    assert result.error_kind == "malformed" and "cannot parse query" in result.error


def test_unreachable_victorialogs_degrades():
    src = vlogs(dead_url(), retries=0)
    assert src.poll("4242", [], since=T0 - 60, now=T0 + 60).error_kind == "unavailable"
    assert src.health.errors_by_kind == {"unavailable": 1}


def test_tenant_headers_are_sent(server):
    FakeVictoriaLogs(server, [])
    endpoint = Endpoint(server.url, headers={"AccountID": "12", "ProjectID": "34"})
    VictoriaLogsSource(endpoint, delay=0.0).poll("4242", [], since=T0, now=T0 + 60)
    headers = server.hits(PATH)[0].headers
    assert headers["AccountID"] == "12" and headers["ProjectID"] == "34"
