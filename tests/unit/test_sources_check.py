"""The ingestion check against recorded answers on a real local HTTP server:
pass for a healthy source, a clear fail for a dead one, a malformed answer, a
wrong label schema, stale data; plus building sources from the config and
polling them per job."""
from __future__ import annotations

import re

import pytest

from recovery_agent import config
from recovery_agent.detect.patterns import load_rules
from recovery_agent.inputs.sources import (JobRef, LokiSource, MetricsSource, SourcePoller,
                                           VictoriaLogsSource, build_sources)
from recovery_agent.inputs.sources.http import Endpoint
from recovery_agent.inputs.sources.check import (CheckResult, check_source, check_sources,
                                                 summary_lines)
from recovery_agent.inputs.sources.loki import LokiLabels
from recovery_agent.inputs.sources.prometheus import DcgmLabels
from tests.fixtures.sources.httpfake import FakeServer, dead_url, json_reply, recorded
from tests.unit.test_sources_victorialogs import FakeVictoriaLogs

NOW = 1714557600.0
NS = 10**9


@pytest.fixture
def server():
    with FakeServer() as fake:
        yield fake


def vector(items) -> dict:
    return {"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": m, "value": [NOW, str(v)]} for m, v in items]}}


def fake_prometheus(server, sample_labels, newest: dict[str, float]) -> None:
    def query(request):
        q = request.params["query"]
        if q.startswith("topk("):
            return json_reply(vector([(m, 50) for m in sample_labels]))
        return json_reply(vector([({"Hostname": h}, t) for h, t in newest.items()]))
    server.route("/api/v1/query", query)


def prom(url) -> MetricsSource:
    return MetricsSource(Endpoint(url, timeout=1.0, retries=0), DcgmLabels())


GOOD = [{"__name__": "DCGM_FI_DEV_GPU_UTIL", "Hostname": "gpu-n17", "gpu": "0", "UUID": "GPU-a",
         "modelName": "NVIDIA H100 80GB HBM3", "instance": "gpu-n17:9400"}]


def test_prometheus_pass(server):
    fake_prometheus(server, GOOD, {"gpu-n17": NOW - 20, "gpu-n18": NOW - 25})
    result = check_source(prom(server.url), ["gpu-n17", "gpu-n18", "gpu-n19"],
                          {"77": ["gpu-n17", "gpu-n18"], "78": ["gpu-n19"]}, now=NOW)
    assert result.ok, result.reason
    assert result.lag == 20 and result.nodes_missing == ("gpu-n19",)
    assert result.jobs_seen == ("77",) and result.jobs_missing == ("78",)
    assert "2/3 nodes (missing: gpu-n19)" in result.reason and "lag 20s" in result.reason
    assert result.line().startswith(f"PASS prometheus ({server.url}): ")


def test_prometheus_wrong_label_schema(server):
    relabelled = [{"__name__": "DCGM_FI_DEV_GPU_UTIL", "instance": "gpu-n17:9400",
                   "gpu": "0", "UUID": "GPU-a"}]
    fake_prometheus(server, relabelled, {})
    result = check_source(prom(server.url), ["gpu-n17"], now=NOW)
    assert not result.ok and result.reachable
    assert "wrong label schema: 'Hostname' not found" in result.reason
    assert "instance" in result.reason                      # says what is there instead
    assert result.labels_missing == ("Hostname",)


def test_prometheus_without_dcgm_series(server):
    fake_prometheus(server, [], {})
    result = check_source(prom(server.url), ["gpu-n17"], now=NOW)
    assert not result.ok and "no data in the last 15m" in result.reason


def test_prometheus_stale_data(server):
    fake_prometheus(server, GOOD, {"gpu-n17": NOW - 1800})
    result = check_source(prom(server.url), ["gpu-n17"], now=NOW)
    assert not result.ok and "lag 30m behind real time (limit 5m)" in result.reason


def test_nodes_without_data_fail(server):
    fake_prometheus(server, GOOD, {})
    result = check_source(prom(server.url), ["gpu-n17"], now=NOW)
    assert not result.ok and "no recent data for any of the 1 node(s)" in result.reason


def test_dead_source_fails_as_unreachable():
    result = check_source(prom(dead_url()), ["gpu-n17"], now=NOW)
    assert not result.ok and not result.reachable
    assert result.reason.startswith("unreachable: ")


def test_malformed_answer_fails_clearly(server):
    server.route("/api/v1/query", lambda r: (200, {}, b"<html>proxy login</html>"))
    result = check_source(prom(server.url), ["gpu-n17"], now=NOW)
    assert not result.ok and result.reachable
    assert result.reason.startswith("malformed answer: ") and "not JSON" in result.reason


# -- Loki ---------------------------------------------------------------------------------

def fake_loki(server, labels_file="loki_labels.json", newest_ns=None):
    server.route("/loki/api/v1/labels", lambda r: (200, {}, recorded(labels_file)))
    server.route("/loki/api/v1/label/host/values",
                 lambda r: (200, {}, recorded("loki_label_values_host.json")))
    server.route("/loki/api/v1/label/slurm_job_id/values",
                 lambda r: (200, {}, recorded("loki_label_values_job.json")))
    values = [[str(newest_ns), "a line"]] if newest_ns else []
    body = {"status": "success", "data": {"resultType": "streams", "result": [
        {"stream": {"host": "gpu-n17"}, "values": values}] if values else []}}
    server.route("/loki/api/v1/query_range", lambda r: json_reply(body))


def loki(url) -> LokiSource:
    return LokiSource(Endpoint(url, timeout=1.0, retries=0), LokiLabels())


def test_loki_pass(server):
    fake_loki(server, newest_ns=int((NOW - 4) * NS))
    result = check_source(loki(server.url), ["gpu-n17", "gpu-n18"],
                          {"4242": ["gpu-n17"], "9999": ["gpu-n18"]}, now=NOW)
    assert result.ok, result.reason
    assert result.nodes_seen == ("gpu-n17", "gpu-n18") and result.jobs_missing == ("9999",)
    assert result.lag == pytest.approx(4.0)
    lag_query = server.hits("/loki/api/v1/query_range")[-1].params
    assert lag_query["direction"] == "backward" and lag_query["limit"] == "1"


def test_loki_wrong_label_schema(server):
    fake_loki(server, "loki_labels_wrong.json")
    result = check_source(loki(server.url), ["gpu-n17"], {"4242": ["gpu-n17"]}, now=NOW)
    assert not result.ok
    assert "'slurm_job_id', 'host' not found" in result.reason
    assert "hostname" in result.reason and "jobid" in result.reason
    assert not server.hits("/loki/api/v1/label/host/values")


def test_loki_answer_of_the_wrong_shape(server):
    server.route("/loki/api/v1/labels", lambda r: json_reply({"status": "success",
                                                              "data": {"host": 1}}))
    result = check_source(loki(server.url), ["gpu-n17"], now=NOW)
    assert not result.ok and "'data' is not a list" in result.reason


# -- VictoriaLogs --------------------------------------------------------------------------

def vl_rows(with_job: bool = True) -> list[dict]:
    rows = []
    for i, host in enumerate(["gpu-n17", "gpu-n18"]):
        row = {"_msg": f"hello from {host}", "_time": int((NOW - 10 - i) * NS),
               "_stream": f'{{host="{host}"}}', "host": host}
        if with_job:
            row["slurm_job_id"] = "4242"
        rows.append(row)
    return rows


def test_victorialogs_pass(server):
    FakeVictoriaLogs(server, vl_rows())
    src = VictoriaLogsSource(Endpoint(server.url, timeout=1.0, retries=0))
    result = check_source(src, ["gpu-n17", "gpu-n18"], {"4242": ["gpu-n17"]}, now=NOW)
    assert result.ok, result.reason
    assert result.lag == pytest.approx(10.0) and result.jobs_seen == ("4242",)
    assert result.nodes_seen == ("gpu-n17", "gpu-n18")


def test_victorialogs_without_the_job_field(server):
    FakeVictoriaLogs(server, vl_rows(with_job=False))
    src = VictoriaLogsSource(Endpoint(server.url, timeout=1.0, retries=0))
    result = check_source(src, ["gpu-n17"], {"4242": ["gpu-n17"]}, now=NOW)
    assert not result.ok and "'slurm_job_id' not found" in result.reason


# -- all together ------------------------------------------------------------------------------

def test_summary_lines_one_per_source():
    results = [CheckResult("prometheus", "prometheus", "http://p:9090", True, "1/1 nodes"),
               CheckResult("loki", "loki", "http://l:3100", False, "unreachable: refused")]
    lines = summary_lines(results)
    assert lines == ["PASS prometheus (http://p:9090): 1/1 nodes",
                     "FAIL loki (http://l:3100): unreachable: refused",
                     "1/2 sources pass, 1 fail"]
    assert summary_lines([]) == ["no sources configured"]


def test_a_crashing_probe_is_a_failed_check_not_a_crash(server):
    class Broken(MetricsSource):
        def probe(self, *a):
            raise KeyError("surprise")
    results = check_sources([Broken(Endpoint(server.url))], ["gpu-n17"], now=NOW)
    assert not results[0].ok and "internal error" in results[0].reason


def test_build_sources_from_config(tmp_path):
    token = tmp_path / "token"
    token.write_text("abc123")
    cfg = config.from_mapping({
        "agent": {"state_dir": str(tmp_path)},
        "sources": {"prometheus_url": "http://prom:9090", "prometheus_host_label": "instance",
                    "loki_url": "http://loki:3100", "loki_auth": "bearer",
                    "loki_credentials_file": str(token), "loki_tenant": "team-a",
                    "victorialogs_url": "http://vl:9428", "victorialogs_tenant": "12:34"}})
    prom_src, loki_src, vl_src = build_sources(cfg, load_rules())
    assert prom_src.labels.host == "instance"
    assert loki_src.endpoint.headers == {"X-Scope-OrgID": "team-a"}
    assert loki_src.endpoint.credentials.secret == "abc123"
    assert "abc123" not in repr(loki_src.endpoint)
    assert vl_src.endpoint.headers == {"AccountID": "12", "ProjectID": "34"}
    # the prefilter lets an XID line through (as "NVRM: Xid", or a shorter
    # literal of another kernel rule that holds it)
    assert loki_src.prefilter and re.search(
        loki_src.prefilter, "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.")
    assert loki_src.cursors.path == tmp_path / "cursors" / "loki.json"
    assert build_sources(config.Config()) == []


def test_poller_queries_each_source_once_per_interval(server, tmp_path):
    server.route("/loki/api/v1/query_range",
                 lambda r: (200, {}, recorded("loki_query_range.json")))
    good = LokiSource(Endpoint(server.url, timeout=1.0, retries=0), LokiLabels(host=""),
                      interval=30.0, delay=0.0)
    dead = MetricsSource(Endpoint(dead_url(), timeout=1.0, retries=0), interval=30.0,
                         delay=0.0)
    poller = SourcePoller([good, dead])
    job = JobRef("4242", ("gpu-n17",), since=NOW - 60)
    found = poller.poll([job], now=NOW)["4242"]
    assert len(found.lines) == 3 and "cannot connect" in found.errors["prometheus"]
    assert poller.poll([job], now=NOW + 10) == {}           # nothing due yet
    assert len(server.hits("/loki/api/v1/query_range")) == 1
    counters = poller.counters()
    assert counters["prometheus"]["up"] is False and counters["prometheus"]["errors_total"] == 1
    assert counters["loki"]["up"] is True
    poller.forget("4242")
    assert good.cursors.keys() == []
