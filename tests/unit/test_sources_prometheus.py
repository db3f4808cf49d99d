"""DCGM series through the Prometheus HTTP API, against recorded answers
served by a real local HTTP server: detections, the hang check, degrading."""
from __future__ import annotations

import json
import logging
import re

import pytest

from recovery_agent.detect.attribution import attribute
from recovery_agent.detect.context import AttributionContext
from recovery_agent.inputs.sources import prometheus as prom
from recovery_agent.inputs.sources.base import SourceResponseError
from recovery_agent.inputs.sources.feed import CursorStore
from recovery_agent.inputs.sources.http import Endpoint
from recovery_agent.inputs.sources.prometheus import DcgmLabels, MetricsSource, counter_increase
from tests.fixtures.sources.httpfake import FakeServer, dead_url, json_reply, recorded

T0 = 1714557600.0     # 2024-05-01T10:00:00Z
NODES = ("gpu-n17", "gpu-n18")


def matrix(series) -> dict:
    return {"status": "success", "data": {"resultType": "matrix", "result": [
        {"metric": labels, "values": [[t, str(v)] for t, v in points]}
        for labels, points in series]}}


def labels(name, host, gpu, **extra):
    return {"__name__": name, "Hostname": host, "gpu": str(gpu), "UUID": f"GPU-{host}-{gpu}",
            **extra}


class FakeProm:
    """Answers query_range from two lists the test fills: event series and
    utilisation series (told apart by the query, as the real server would)."""

    def __init__(self, server: FakeServer) -> None:
        self.events: list = []
        self.util: list = []
        server.route("/api/v1/query_range", self.query_range)

    def query_range(self, request):
        query = request.params["query"]
        return json_reply(matrix(self.util if query.startswith(prom.UTIL) else self.events))


@pytest.fixture
def server():
    with FakeServer() as fake:
        yield fake


def source(url, **kw) -> MetricsSource:
    kw.setdefault("step", 15.0)
    kw.setdefault("delay", 0.0)
    endpoint = Endpoint(url, timeout=2.0, retries=0)
    return MetricsSource(endpoint, kw.pop("labels", DcgmLabels()), **kw)


def test_recorded_answer_gives_xid_and_nvlink_detections(server):
    server.route("/api/v1/query_range",
                 lambda r: (200, {}, recorded("prometheus_query_range_dcgm.json")))
    found = source(server.url).events(NODES, T0 - 5, T0 + 30)
    # a sticky XID 13 (there before the window) and a flat DBE counter: nothing
    assert sorted((d.rule, d.host, d.gpu) for d in found) == [
        ("dcgm.nvlink", "gpu-n17", "5"), ("dcgm.xid", "gpu-n18", "3")]
    by_rule = {d.rule: d for d in found}
    xid = by_rule["dcgm.xid"]
    assert (xid.host, xid.gpu, xid.xid, xid.category) == ("gpu-n18", "3", 79, "gpu_hardware")
    assert (xid.role, xid.action_hint, xid.severity) == ("root", "requeue_exclude", "critical")
    assert xid.pci == "0000:b7:00"
    assert xid.evidence[0].source == f"prometheus:127.0.0.1:{server.httpd.server_address[1]}"
    assert xid.evidence[0].time == T0 + 15
    assert "DCGM_FI_DEV_XID_ERRORS" in xid.evidence[0].text and "= 79" in xid.evidence[0].text
    nvlink = by_rule["dcgm.nvlink"]
    assert (nvlink.host, nvlink.gpu, nvlink.category) == ("gpu-n17", "5", "interconnect")
    assert "rose by 5" in nvlink.evidence[0].text    # 10 -> 12, then a reset to 3


def test_the_query_selects_the_job_nodes_and_every_dcgm_metric(server):
    fake = FakeProm(server)
    fake.events = []
    source(server.url, labels=DcgmLabels(selector='job="dcgm"')).events(
        ("gpu-n1.x", "gpu-n2"), T0, T0 + 60)
    sent = server.hits("/api/v1/query_range")[-1].params
    query = sent["query"]
    assert query.startswith("{Hostname=~")
    host_re = json.loads(re.search(r'Hostname=~("(?:[^"\\]|\\.)*")', query).group(1))
    assert re.fullmatch(host_re, "gpu-n1.x") and re.fullmatch(host_re, "gpu-n2:9400")
    assert not re.fullmatch(host_re, "gpu-n1yx") and not re.fullmatch(host_re, "gpu-n22")
    for name in ("DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",
                 "DCGM_FI_DEV_ROW_REMAP_FAILURE", "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL"):
        assert name in query
    assert 'job="dcgm"' in query
    assert float(sent["step"]) == 15.0
    assert float(sent["start"]) < T0                    # a baseline before the window


def test_a_dbe_increase_is_gpu_hardware_and_attributed(server):
    fake = FakeProm(server)
    fake.events = [
        (labels("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "gpu-n18", 2),
         [(T0 - 15, 0), (T0, 0), (T0 + 15, 1), (T0 + 30, 1)]),
        (labels("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "gpu-n18", 2),
         [(T0 - 15, 7), (T0, 7), (T0 + 15, 8), (T0 + 30, 8)]),
    ]
    found = source(server.url).events(NODES, T0, T0 + 30)
    assert len(found) == 1                                 # both counters: one detection
    dbe = found[0]
    assert (dbe.rule, dbe.category, dbe.host, dbe.gpu) == ("dcgm.ecc_dbe", "gpu_hardware",
                                                         "gpu-n18", "2")
    assert len(dbe.evidence) == 2
    verdict = attribute(found, AttributionContext(nodes=NODES))
    assert verdict.blame == "node" and verdict.nodes == ("gpu-n18",)
    assert verdict.action == "requeue_exclude"


def test_row_remap_failure_and_nvlink_xid(server):
    fake = FakeProm(server)
    fake.events = [
        (labels("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gpu-n17", 1), [(T0, 0), (T0 + 15, 1)]),
        (labels(prom.XID, "gpu-n17", 4), [(T0 - 15, 0), (T0 + 15, 74)]),
        (labels(prom.XID, "gpu-n18", 0), [(T0 - 15, 0), (T0 + 15, 13)]),
    ]
    found = {(d.rule, d.gpu): d for d in source(server.url).events(NODES, T0, T0 + 30)}
    assert found[("dcgm.row_remap_failure", "1")].category == "gpu_hardware"
    assert found[("dcgm.xid", "4")].category == "interconnect"     # NVLink XID
    app = found[("dcgm.xid", "0")]
    assert (app.xid, app.action_hint) == (13, "stop")              # application-ish XID


def test_thermal_signals_are_information_only(server):
    fake = FakeProm(server)
    fake.events = [
        (labels(prom.THROTTLE, "gpu-n17", 0), [(T0, 0), (T0 + 15, 0x40)]),
        (labels(prom.TEMP, "gpu-n17", 1), [(T0, 70), (T0 + 15, 93)]),
        (labels(prom.TEMP, "gpu-n18", 1), [(T0, 70), (T0 + 15, 75)]),
    ]
    found = source(server.url).events(NODES, T0, T0 + 30)
    assert {(d.rule, d.gpu, d.severity) for d in found} == {("dcgm.thermal", "0", "info"),
                                                           ("dcgm.thermal", "1", "info")}
    assert any("HW thermal" in d.evidence[0].text for d in found)


def test_series_of_other_nodes_and_without_host_are_ignored(server):
    fake = FakeProm(server)
    fake.events = [
        (labels(prom.XID, "gpu-n99", 0), [(T0 - 15, 0), (T0 + 15, 79)]),
        ({"__name__": prom.XID, "gpu": "0"}, [(T0 - 15, 0), (T0 + 15, 79)]),
    ]
    assert source(server.url).events(NODES, T0, T0 + 30) == []


def test_instance_label_with_port(server):
    fake = FakeProm(server)
    fake.events = [({"__name__": prom.XID, "instance": "gpu-n18.cluster:9400", "gpu": "3"},
                    [(T0 - 15, 0), (T0 + 15, 48)])]
    lab = DcgmLabels(host="instance", host_rewrite="domain")
    found = source(server.url, labels=lab).events(NODES, T0, T0 + 30)
    assert [(d.host, d.xid) for d in found] == [("gpu-n18", 48)]


@pytest.mark.parametrize("base,points,increase", [
    (None, [(1, 5), (2, 5)], 0),
    (5, [(1, 5), (2, 7)], 2),
    (5, [(1, 9), (2, 2), (3, 4)], 8),       # 5 -> 9 (+4), reset to 2 (+2), -> 4 (+2)
])
def test_counter_increase(base, points, increase):
    assert counter_increase(base, points)[0] == increase


# -- the hang check ---------------------------------------------------------------------

def util(host, gpu, values, start=T0, step=15):
    return (labels(prom.UTIL, host, gpu), [(start + i * step, v) for i, v in enumerate(values)])


def test_all_gpus_idle_for_the_window_is_a_hang(server):
    fake = FakeProm(server)
    fake.util = [util(h, g, [0] * 41) for h in NODES for g in range(2)]
    hang = source(server.url).hang(NODES, 600, T0 + 600)
    assert hang is not None
    assert (hang.rule, hang.category, hang.action_hint) == ("hang", "nccl_timeout_hang",
                                                           "kill_requeue")
    assert "all 4 GPUs of 2 node(s)" in hang.detail
    assert {e.text.split('"')[1] for e in hang.evidence} == set(NODES)


@pytest.mark.parametrize("series", [
    [util("gpu-n17", 0, [0] * 41), util("gpu-n18", 0, [0] * 40 + [3])],   # one GPU woke up
    [util("gpu-n17", 0, [0] * 41)],                                           # a node without data
    [util(h, 0, [0] * 10, start=T0 + 450) for h in NODES],                    # data too recent
])
def test_no_hang_without_full_evidence(server, series):
    fake = FakeProm(server)
    fake.util = series
    assert source(server.url).hang(NODES, 600, T0 + 600) is None


def test_hang_only_for_the_job_gpus(server):
    fake = FakeProm(server)
    fake.util = [util("gpu-n17", 0, [0] * 41), util("gpu-n17", 1, [90] * 41)]
    src = source(server.url)
    assert src.hang(("gpu-n17",), 600, T0 + 600) is None
    assert src.hang(("gpu-n17",), 600, T0 + 600, gpus={"gpu-n17": ["0"]}) is not None


# -- poll: cursors, once-only hang, degrading -------------------------------------------------

def test_poll_advances_and_fires_a_hang_once(server, tmp_path):
    fake = FakeProm(server)
    fake.util = [util(h, 0, [0] * 200, start=T0 - 1200) for h in NODES]
    src = source(server.url, cursors=CursorStore(tmp_path, "prometheus"))
    first = src.poll("77", NODES, since=T0 - 1200, now=T0 + 10, hang=600)
    assert first.error is None and [d.rule for d in first.detections] == ["hang"]
    assert first.window == (T0 - 1200, T0 + 10)
    again = src.poll("77", NODES, since=T0 - 1200, now=T0 + 40, hang=600)
    assert again.window == (T0 + 10, T0 + 40) and again.detections == []
    src.save()
    restarted = source(server.url, cursors=CursorStore(tmp_path, "prometheus"))
    assert restarted.poll("77", NODES, since=T0 - 1200, now=T0 + 70, hang=600).window[0] == \
        T0 + 40


def test_a_dead_server_degrades_with_one_log_line(caplog):
    src = source(dead_url(), interval=30.0)
    caplog.set_level(logging.INFO)
    first = src.poll("1", NODES, since=T0, now=T0 + 60)
    assert first.error_kind == "unavailable" and "cannot connect" in first.error
    skipped = src.poll("1", NODES, since=T0, now=T0 + 61)
    assert skipped.error_kind == "skipped"
    src.poll("1", NODES, since=T0, now=T0 + 200)
    assert src.health.errors_total == 2
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1


def test_an_error_answer_is_reported(server):
    server.route("/api/v1/query_range", lambda r: (400, {}, recorded("prometheus_error.json")))
    result = source(server.url).poll("1", NODES, since=T0, now=T0 + 60)
    assert result.error_kind == "malformed" and "parse error" in result.error


@pytest.mark.parametrize("body,message", [
    ({"status": "success", "data": {"resultType": "vector", "result": []}}, "expected a matrix"),
    ({"data": {}}, "no 'status'"),
    ({"status": "error", "errorType": "timeout", "error": "query timed out"}, "timeout: query"),
    ({"status": "success", "data": {"resultType": "matrix", "result": [{"values": []}]}},
     "lacks its 'metric'"),
    ({"status": "success", "data": {"resultType": "matrix",
                                    "result": [{"metric": {}, "values": [["x"]]}]}},
     "not \\[time"),
])
def test_malformed_answers(server, body, message):
    server.route("/api/v1/query_range", lambda r: json_reply(body))
    with pytest.raises(SourceResponseError, match=message):
        source(server.url).events(NODES, T0, T0 + 60)


def test_warnings_are_passed_on(server):
    body = matrix([])
    body["warnings"] = ["PromQL info: metric might not be a counter"]
    server.route("/api/v1/query_range", lambda r: json_reply(body))
    result = source(server.url).poll("1", NODES, since=T0, now=T0 + 60)
    assert result.warnings == ["PromQL info: metric might not be a counter"]


def test_a_failed_poll_is_repeated_whole(server):
    fake = FakeProm(server)
    fake.events = [(labels(prom.XID, "gpu-n18", 3), [(T0 - 15, 0), (T0 + 15, 79)])]
    broken = {"util": True}

    def query_range(request):
        if request.params["query"].startswith(prom.UTIL) and broken["util"]:
            return 503, {}, b"overloaded"
        return fake.query_range(request)
    server.route("/api/v1/query_range", query_range)
    src = source(server.url)
    failed = src.poll("9", NODES, since=T0 - 700, now=T0 + 30, hang=600)
    assert failed.error_kind == "unavailable" and failed.detections == []
    broken["util"] = False
    src.health.retry_at = 0.0
    again = src.poll("9", NODES, since=T0 - 700, now=T0 + 30, hang=600)
    assert [d.xid for d in again.detections] == [79] and again.window[0] == T0 - 700
