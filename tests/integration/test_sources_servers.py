"""The metrics source against real servers: Debian's ``prometheus`` and
``victoria-metrics`` binaries, started here on loopback ports, scraping every
second a small prometheus-client exporter per fake node that serves
DCGM-exporter series (same metric and label names).

The scenario runs once for both servers: all GPUs busy, then an XID 79 on
node2 GPU 3, a double-bit ECC error on node3 GPU 1, NVLink replays on node1
GPU 0, and node1/node2 GPUs idle. Each server must show the XID as a
gpu_hardware detection for node2 GPU 3, the idle GPUs as a hang (and the busy
ones as none), and pass the ingestion check while a dead URL fails it.

Needs no Slurm cluster. Skips a server whose binary is missing (apt packages
``prometheus`` and ``victoria-metrics``).
"""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import requests
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily

from recovery_agent.detect.attribution import attribute
from recovery_agent.detect.context import AttributionContext
from recovery_agent.inputs.sources.http import Endpoint
from recovery_agent.inputs.sources.check import check_source
from recovery_agent.inputs.sources.prometheus import DcgmLabels, MetricsSource

NODES = ("node1", "node2", "node3")
GPUS = 4
PORTS = range(39100, 39200)
SERVERS = {"prometheus": "prometheus", "victoria-metrics": "victoria-metrics"}
BUSY, SWITCH_HOLD, IDLE_HOLD = 60.0, 4.0, 6.0

pytestmark = pytest.mark.timeout(120)


# -- a DCGM-format exporter per fake node ----------------------------------------------------

class DcgmNode:
    """Collects the DCGM series of one fake node from a mutable state. Every
    metric is exposed as a gauge: the TYPE line does not change any query."""

    METRICS = ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_XID_ERRORS",
               "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",
               "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", "DCGM_FI_DEV_ROW_REMAP_FAILURE")

    def __init__(self, host: str, gpus: int = GPUS) -> None:
        self.host = host
        self.state = {gpu: {name: 0.0 for name in self.METRICS} for gpu in range(gpus)}
        for values in self.state.values():
            values["DCGM_FI_DEV_GPU_UTIL"] = BUSY
            values["DCGM_FI_DEV_GPU_TEMP"] = 55.0

    def identity(self, gpu: int) -> tuple[str, str]:
        """The UUID and PCI bus id one GPU is labelled with."""
        return f"GPU-{self.host}-000{gpu}", f"00000000:{0x1a + gpu:02X}:00.0"

    def collect(self):
        labels = ["gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname"]
        for name in self.METRICS:
            family = GaugeMetricFamily(name, f"{name} (fake DCGM)", labels=labels)
            for gpu, values in self.state.items():
                family.add_metric([str(gpu), *self.identity(gpu), f"nvidia{gpu}",
                                   "NVIDIA H100 80GB HBM3", self.host], values[name])
            yield family


@pytest.fixture(scope="module")
def exporters():
    nodes, servers = {}, []
    for host in NODES:
        node = DcgmNode(host)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(node)
        httpd, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
        nodes[host] = (node, httpd.server_port)
        servers.append(httpd)
    yield nodes
    for httpd in servers:
        httpd.shutdown()


# -- the servers ------------------------------------------------------------------------

def free_port(taken: set[int], ports: range = PORTS) -> int:
    for port in ports:
        if port in taken:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        taken.add(port)
        return port
    pytest.skip(f"no free port in {ports.start}-{ports.stop - 1}")


def scrape_config(path: Path, exporters) -> None:
    lines = ["global:", "  scrape_interval: 1s", "  scrape_timeout: 1s", "scrape_configs:",
             "  - job_name: dcgm", "    static_configs:"]
    for host, (_, port) in exporters.items():
        lines += [f"      - targets: ['127.0.0.1:{port}']",
                  f"        labels: {{instance: '{host}:9400'}}"]
    path.write_text("\n".join(lines) + "\n")


def argv(kind: str, port: int, tmp: Path, config: Path) -> list[str]:
    if kind == "prometheus":
        return ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]
    return ["victoria-metrics", f"-httpListenAddr=127.0.0.1:{port}",
            f"-storageDataPath={tmp / 'vmdata'}", f"-promscrape.config={config}",
            "-search.latencyOffset=1s", "-search.disableCache", "-loggerLevel=ERROR"]


def wait_ready(url: str, proc: subprocess.Popen, log: Path, deadline: float) -> None:
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{url} exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            answer = requests.get(url + "/api/v1/query",
                                  params={"query": "count(DCGM_FI_DEV_GPU_UTIL)"},
                                  timeout=1).json()
            result = answer.get("data", {}).get("result") or []
            if result and float(result[0]["value"][1]) == len(NODES) * GPUS:
                return
        except (requests.RequestException, ValueError, KeyError):
            pass
        time.sleep(0.25)
    pytest.fail(f"{url}: no DCGM series scraped in time: {log.read_text()[-2000:]}")


@pytest.fixture(scope="module")
def scenario(exporters, tmp_path_factory):
    """Both servers up and scraping; then the busy and the failing phase.
    Yields {server kind: url}, the phase times and the dead URL."""
    tmp = tmp_path_factory.mktemp("metrics-servers")
    config = tmp / "scrape.yml"
    scrape_config(config, exporters)
    taken: set[int] = set()
    procs, urls = [], {}
    try:
        for kind, binary in SERVERS.items():
            if shutil.which(binary) is None:
                continue
            port = free_port(taken)
            log = tmp / f"{kind}.log"
            with open(log, "wb") as out:
                procs.append((subprocess.Popen(argv(kind, port, tmp, config), stdout=out,
                                               stderr=subprocess.STDOUT), log))
            urls[kind] = f"http://127.0.0.1:{port}"
        if not urls:
            pytest.skip("neither prometheus nor victoria-metrics is installed "
                        "(apt-get install prometheus victoria-metrics)")
        deadline = time.time() + 30
        for (proc, log), url in zip(procs, urls.values(), strict=True):
            wait_ready(url, proc, log, deadline)
        busy_from = time.time()
        time.sleep(SWITCH_HOLD)
        switched = time.time()
        nodes = {host: node for host, (node, _) in exporters.items()}
        nodes["node2"].state[3]["DCGM_FI_DEV_XID_ERRORS"] = 79
        nodes["node3"].state[1]["DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"] += 1
        nodes["node1"].state[0]["DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL"] += 5
        for host in ("node1", "node2"):
            for values in nodes[host].state.values():
                values["DCGM_FI_DEV_GPU_UTIL"] = 0.0
        time.sleep(IDLE_HOLD)
        ended = time.time()
        time.sleep(1.5)          # past VictoriaMetrics' latency offset
        taken.add(0)
        yield {"urls": urls, "busy_from": busy_from, "switched": switched, "ended": ended,
               "dead": f"http://127.0.0.1:{free_port(taken)}"}
    finally:
        for proc, _ in procs:
            proc.terminate()
        for proc, _ in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture(params=list(SERVERS))
def server(request, scenario):
    kind = request.param
    if kind not in scenario["urls"]:
        pytest.skip(f"{SERVERS[kind]} binary not installed (apt-get install {SERVERS[kind]})")
    # Prometheus: the exporter's Hostname label; VictoriaMetrics: the target's
    # instance label with its port stripped, as sites relabel it.
    labels = (DcgmLabels() if kind == "prometheus"
              else DcgmLabels(host="instance", host_rewrite="port"))
    source = MetricsSource(Endpoint(scenario["urls"][kind], timeout=5.0, retries=1), labels,
                           step=1.0, delay=0.0, name=kind)
    return source, scenario


def test_an_injected_xid_is_a_gpu_hardware_detection_for_node2_gpu3(server):
    source, s = server
    found = source.events(NODES, s["switched"] - 1.0, s["ended"])
    xids = [d for d in found if d.rule == "dcgm.xid"]
    assert [(d.host, d.gpu, d.xid, d.category) for d in xids] == [("node2", "3", 79,
                                                                   "gpu_hardware")]
    assert xids[0].pci == "0000:1d:00" and s["switched"] - 2 <= xids[0].evidence[0].time
    others = {(d.rule, d.host, d.gpu, d.category) for d in found if d.rule != "dcgm.xid"}
    assert others == {("dcgm.ecc_dbe", "node3", "1", "gpu_hardware"),
                      ("dcgm.nvlink", "node1", "0", "interconnect")}
    assert source.events(NODES, s["busy_from"], s["switched"] - 1.0) == []


def test_a_job_whose_only_evidence_is_the_xid_metric_is_attributed(server):
    source, s = server
    result = source.poll("4242", ["node1", "node2"], since=s["busy_from"],
                         now=s["ended"], hang=3.0)
    assert result.error is None
    verdict = attribute(result.detections, AttributionContext(nodes=("node1", "node2")))
    assert verdict.blame == "node" and verdict.nodes == ("node2",)
    assert verdict.action == "requeue_exclude"
    assert verdict.gpus == ("0000:1d:00",)            # GPU 3's PCI address, from its label


def test_idle_gpus_are_a_hang_and_busy_ones_are_not(server):
    source, s = server
    hang = source.hang(("node1", "node2"), 3.0, s["ended"])
    assert hang is not None and hang.rule == "hang" and hang.category == "nccl_timeout_hang"
    assert "all 8 GPUs of 2 node(s)" in hang.detail
    assert source.hang(("node1", "node3"), 3.0, s["ended"]) is None       # node3 still busy
    assert source.hang(("node1", "node2"), 3.0, s["switched"] - 0.5) is None   # before


def test_the_check_passes_for_the_live_server_and_fails_for_a_dead_url(server):
    source, s = server
    now = time.time()
    live = check_source(source, list(NODES), {"4242": ["node1", "node2"]}, now=now)
    assert live.ok, live.reason
    assert live.nodes_seen == NODES and live.jobs_seen == ("4242",)
    assert live.lag is not None and live.lag < 30
    dead = MetricsSource(Endpoint(s["dead"], timeout=2.0, retries=0), source.labels)
    result = check_source(dead, list(NODES), now=now)
    assert not result.ok and not result.reachable and "unreachable" in result.reason
