"""The hooks as Slurm runs them: a fresh process, a bare environment, and an exit
code that fails a job only for an enforced preflight fault."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from recovery_devtools.devcluster.config import fake_gpus

REPO = Path(__file__).resolve().parents[2]
FAKE_NVML = REPO / "tests" / "fake_nvml" / "libnvidia-ml.so.1"
XID79 = ("2026-11-29T08:00:00+0000 node1 kernel: NVRM: Xid (PCI:0000:28:00): 79, pid=42, "
         "name=python, GPU has fallen off the bus.\n")


@pytest.fixture(scope="module", autouse=True)
def fake_nvml():
    result = subprocess.run(["make", "-s", "-C", str(FAKE_NVML.parent)], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NodeFiles:
    """One node's files and the recovery.toml pointing the hooks at them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "gpus.json").write_text(json.dumps(fake_gpus("node1", 2)))
        (root / "kern.log").write_text("")
        self.configure()

    def configure(self, **hooks) -> None:
        """(Re)write recovery.toml with some [hooks] values changed."""
        root = self.root
        values = {"agent_url": f"http://127.0.0.1:{closed_port()}", "timeout": "300ms",
                  "spool_dir": str(root / "spool"), "log_file": str(root / "hooks.log"),
                  "kernel_log": f"file:{root / 'kern.log'}",
                  "nvml_library": str(FAKE_NVML), "gpu_state_file": str(root / "gpus.json"),
                  "expected_gpus": 2, "preflight": "report"}
        values.update(hooks)
        lines = ["[hooks]"] + [f"{k} = {json.dumps(v)}" for k, v in values.items()]
        (root / "recovery.toml").write_text("\n".join(lines) + "\n")


@pytest.fixture
def files(tmp_path) -> NodeFiles:
    return NodeFiles(tmp_path)


@pytest.fixture
def node(files) -> Path:
    return files.root


@pytest.fixture
def configure(files):
    return files.configure


def run_hook(node_dir: Path, hook: str = "prolog", opted_in: bool = True, **env):
    environ = {"PATH": "/usr/bin:/bin", "RECOVERY_CONFIG": str(node_dir / "recovery.toml"),
               "SLURMD_NODENAME": "node1", "SLURM_JOB_ID": "4711",
               "SLURM_CLUSTER_NAME": "c1", "SLURM_JOB_RESTART_COUNT": "0"}
    if opted_in:
        environ["SPANK__SLURM_SPANK_OPTION_slurm_recovery_recovery"] = "prod:action"
    environ.update(env)
    entry = {"prolog": "prolog", "epilog": "epilog", "health": "healthcheck"}[hook]
    return subprocess.run([sys.executable, "-c",
                           f"import sys; from slurm_hooks.entry import {entry}; sys.exit({entry}())"],
                          env=environ, capture_output=True, text=True, timeout=60, cwd=REPO)


def spooled(node_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((node_dir / "spool").glob("*.json"))]


def test_not_opted_in_does_nothing(node):
    result = run_hook(node, opted_in=False)
    assert result.returncode == 0 and not (node / "spool").exists()
    assert not (node / "hooks.log").exists()


def test_agent_down_spools_a_full_report(node):
    result = run_hook(node)
    assert result.returncode == 0, result.stderr
    (report,) = spooled(node)
    assert report["hook"] == "prolog" and report["job"]["job_id"] == "4711"
    assert report["job"]["spec"] == "prod:action" and report["job"]["attempt"] == 0
    assert report["gpus"]["ok"] and report["gpus"]["count"] == 2
    assert report["preflight"]["verdict"] == "ok"
    assert "delivery=spooled" in (node / "hooks.log").read_text()


def test_epilog_reports_exit_and_xids_since_the_prolog(node):
    assert run_hook(node).returncode == 0
    with open(node / "kern.log", "a") as fh:
        fh.write(XID79.replace("2026-11-29T08:00:00", _now_iso()))
    assert run_hook(node, "epilog", SLURM_JOB_EXIT_CODE2="1:0").returncode == 0
    epilog = [r for r in spooled(node) if r["hook"] == "epilog"][0]
    assert epilog["exit"] == {"code": 1, "signal": None}
    assert [x["xid"] for x in epilog["xids"]] == [79]
    assert epilog["xids"][0]["pci"] == "0000:28:00"  # GPU 1 of the fake state


def _now_iso() -> str:
    import datetime
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")


def test_enforced_fatal_xid_fails_the_prolog(node, configure):
    (node / "kern.log").write_text(XID79)
    configure(preflight="enforce")
    result = run_hook(node)
    assert result.returncode == 1
    assert "fatal XID" in result.stderr and "79" in result.stderr
    (report,) = spooled(node)  # the fault is still reported
    assert report["preflight"]["verdict"] == "fault"


def test_reported_fault_does_not_fail_the_prolog(node):
    (node / "kern.log").write_text(XID79)
    result = run_hook(node)
    assert result.returncode == 0
    assert spooled(node)[0]["preflight"]["verdict"] == "fault"


@pytest.mark.parametrize("change, fault", [
    ({"missing": True}, "is lost"),
    ({"remapped_rows_failure": True}, "row-remap failure"),
])
def test_enforced_gpu_faults(node, configure, change, fault):
    state = fake_gpus("node1", 2)
    state["gpus"][1].update(change)
    (node / "gpus.json").write_text(json.dumps(state))
    configure(preflight="enforce")
    result = run_hook(node)
    assert result.returncode == 1 and fault in result.stderr


def test_fewer_gpus_than_expected(node, configure):
    configure(preflight="enforce", expected_gpus=4)
    result = run_hook(node)
    assert result.returncode == 1 and "2 GPUs visible, 4 expected" in result.stderr


def test_missing_nvml_library(node, configure):
    configure(nvml_library=str(node / "nope" / "libnvidia-ml.so.1"))
    assert run_hook(node).returncode == 0  # report mode: recorded, job goes on
    report = spooled(node)[0]
    assert not report["gpus"]["ok"] and report["preflight"]["verdict"] == "fault"
    configure(nvml_library=str(node / "nope" / "libnvidia-ml.so.1"), preflight="enforce")
    assert run_hook(node).returncode == 1  # NVML failing on a GPU node


def test_garbled_nvml_state(node):
    (node / "gpus.json").write_text('{"gpus": [{"index": 0, "uuid": ')
    result = run_hook(node)
    assert result.returncode == 0
    assert not spooled(node)[0]["gpus"]["ok"]


def test_bad_config_values_fail_open(node):
    text = (node / "recovery.toml").read_text() + "bogus_key = 1\n"
    (node / "recovery.toml").write_text(text.replace('"300ms"', '"soon"'))
    result = run_hook(node)
    assert result.returncode == 0 and len(spooled(node)) == 1
    log = (node / "hooks.log").read_text()
    assert "hooks.timeout: bad value" in log and "hooks.bogus_key: unknown key" in log


def test_unexpected_error_fails_open(node):
    result = run_hook(node, SLURM_JOB_RESTART_COUNT="not-a-number")
    assert result.returncode == 0
    assert "internal error, ignored" in result.stderr


def test_health_check_reports_the_node(node):
    result = run_hook(node, "health", opted_in=False)
    assert result.returncode == 0
    (report,) = spooled(node)
    assert report["hook"] == "health" and report["job"] is None and report["gpus"]["count"] == 2


@pytest.mark.resilience("spool directory unwritable on a node",
                        "the hook exits 0 (the job starts) and logs that the report was lost")
@pytest.mark.parametrize("breakage", ["a file where the directory should be",
                                      "an immutable directory"])
def test_unwritable_spool_still_exits_zero_and_logs(node, breakage):
    spool = node / "spool"
    if breakage.startswith("a file"):
        spool.write_text("not a directory\n")
    else:
        spool.mkdir()
        subprocess.run(["chattr", "+i", str(spool)], check=True)   # root ignores modes
    try:
        for hook in ("prolog", "epilog", "health"):
            result = run_hook(node, hook)
            assert result.returncode == 0, (hook, result.stderr)
    finally:
        if spool.is_dir():
            subprocess.run(["chattr", "-i", str(spool)], check=False)
    log = (node / "hooks.log").read_text()
    assert "spool" in log and ("lost" in log or "cannot" in log or "failed" in log), log


@pytest.mark.resilience("network partition between a node and the agent",
                        "a black-holed agent URL times out; the report is spooled, then "
                        "replayed by the next hook once the agent answers")
def test_black_holed_agent_spools_then_replays(node, configure):
    import http.server
    import threading
    import time
    # a listener that never accepts: connections hang in the backlog like
    # packets dropped on the way
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(0)
    filler = []
    for _ in range(3):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(hole.getsockname())
        filler.append(s)
    try:
        configure(agent_url=f"http://127.0.0.1:{hole.getsockname()[1]}", timeout="500ms")
        started = time.monotonic()
        assert run_hook(node, "prolog").returncode == 0
        assert time.monotonic() - started < 20
        assert len(spooled(node)) == 1
    finally:
        for s in filler:
            s.close()
        hole.close()
    got: list[dict] = []

    class Agent(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = self.rfile.read(int(self.headers["Content-Length"]))
            got.append(json.loads(body))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"ok": true}')

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Agent)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        # the partition heals: the next hook's delivery replays the spool first
        # (unsigned here: no munged runs in the unit suite)
        from slurm_hooks.delivery import Deliverer
        deliverer = Deliverer(f"http://127.0.0.1:{server.server_port}", 5.0, node / "spool",
                              sign=False)
        assert deliverer.deliver("epilog", "r2", json.dumps({"hook": "epilog"}).encode()) \
            in ("sent", "duplicate")
    finally:
        server.shutdown()
    assert [r["hook"] for r in got] == ["prolog", "epilog"]   # the old one first
    assert spooled(node) == []


# -- finding 11: a failed job's epilog tries harder, and its spool is replayed soon ---

class LateAgent:
    """An HTTP agent that starts listening on ``port`` only when told to."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.got: list[dict] = []
        self.server = None

    def start(self) -> None:
        import http.server
        import threading
        got = self.got

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                body["signed"] = self.headers.get("Authorization", "").startswith("Munge ")
                got.append(body)
                self.send_response(201)
                self.end_headers()
                self.wfile.write(b'{"ok": true}')

            def log_message(self, *args):
                pass

        self.server = http.server.HTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


@pytest.fixture(scope="module")
def munge_socket(tmp_path_factory):
    """A private munged, so that the hooks' reports are really signed (the
    detached replayer signs as every hook does)."""
    import os
    import shutil
    import time
    exe = shutil.which("munged") or "/usr/sbin/munged"
    assert Path(exe).exists(), "munged is needed (apt-get install munge; make deps)"
    root = tmp_path_factory.mktemp("munge")
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    sock = root / "munge.socket"
    proc = subprocess.Popen([exe, "--foreground", "--force", f"--key-file={key}",
                             f"--socket={sock}", f"--pid-file={root / 'munged.pid'}",
                             f"--log-file={root / 'munged.log'}", f"--seed-file={root / 'seed'}"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 15
    while not sock.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sock.exists(), "munged did not start"
    yield str(sock)
    proc.terminate()
    proc.wait(timeout=10)


def test_failed_jobs_epilog_retries_spools_and_its_replayer_delivers_soon(node, configure,
                                                                          munge_socket):
    import time
    port = closed_port()
    configure(agent_url=f"http://127.0.0.1:{port}", munge_socket=munge_socket)
    started = time.monotonic()
    result = run_hook(node, "epilog", SLURM_JOB_EXIT_CODE2="1:0")
    took = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    assert 1.5 <= took < 15, took          # two retries (0.5 s, 1 s), not more
    (path,) = (node / "spool").glob("*.json")
    assert path.name.endswith(".t3.json")   # three POSTs before it was spooled
    log = (node / "hooks.log").read_text()
    assert "a replayer retries" in log
    agent = LateAgent(port)
    agent.start()                           # the agent is back: no hook runs on the node
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not agent.got:
            time.sleep(0.2)
    finally:
        agent.stop()
    (report,) = agent.got
    assert report["hook"] == "epilog" and report["delivery"]["by"] == "replayer"
    assert report["signed"]
    assert report["delivery"]["tries"] >= 4
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and list((node / "spool").glob("*.json")):
        time.sleep(0.1)
    assert list((node / "spool").glob("*.json")) == []


def test_a_clean_epilog_spools_at_once_and_one_replayer_per_node(node):
    from slurm_hooks import replay
    (node / "spool").mkdir()
    lock = replay._hold_lock(node / "spool")   # a replayer is running on this node
    assert lock is not None
    try:
        assert replay.start(node / "spool", {}) is False
        result = run_hook(node, "epilog", SLURM_JOB_EXIT_CODE2="0:0")
        assert result.returncode == 0, result.stderr
    finally:
        lock.close()
    (path,) = (node / "spool").glob("*.json")
    assert path.name.endswith(".t1.json")   # a job that ended well: no retries
    assert "a replayer retries" not in (node / "hooks.log").read_text()


def test_replayer_stops_when_the_spool_is_empty_and_gives_up_at_its_window():
    from slurm_hooks import replay

    class Spool:
        def __init__(self, files: int, takes: bool) -> None:
            self.files, self.takes, self.tries = files, takes, 0

        def pending(self):
            return ["f"] * self.files

        def replay(self, by=""):
            self.tries += 1
            if self.takes:
                done, self.files = self.files, 0
                return done, True
            return 0, False

    slept: list[float] = []
    taken = Spool(2, takes=True)
    assert replay.run(taken, sleep=slept.append) is True and taken.tries == 1
    refused = Spool(1, takes=False)
    assert replay.run(refused, sleep=slept.append) is False
    assert refused.tries == len(replay.PAUSES) and sum(replay.PAUSES) == replay.WINDOW


# -- issue 22: the hooks take RECOVERY_HOOKS_* overrides by the agent's rule ----------

def test_the_real_hook_takes_environment_overrides_over_its_file(node, munge_socket):
    # the file names a closed port, munge's default socket and the node's log;
    # the environment names a listening agent, a running munged, another log,
    # more GPUs, and a timeout the rule cannot read
    agent = LateAgent(closed_port())
    agent.start()
    try:
        result = run_hook(node, RECOVERY_HOOKS_AGENT_URL=f"http://127.0.0.1:{agent.port}",
                          RECOVERY_HOOKS_MUNGE_SOCKET=munge_socket,
                          RECOVERY_HOOKS_LOG_FILE=str(node / "override.log"),
                          RECOVERY_HOOKS_EXPECTED_GPUS="4", RECOVERY_HOOKS_TIMEOUT="soon")
    finally:
        agent.stop()
    assert result.returncode == 0, result.stderr
    (report,) = agent.got
    assert report["job"]["job_id"] == "4711" and report["signed"] and spooled(node) == []
    # expected_gpus=4 from the environment: two GPUs seen is a preflight fault
    assert report["preflight"]["faults"] == ["2 GPUs visible, 4 expected"]
    assert not (node / "hooks.log").exists()
    log = (node / "override.log").read_text()
    assert "RECOVERY_HOOKS_TIMEOUT: expected a duration" in log and "using 0.3" in log


def test_an_override_the_hooks_cannot_read_keeps_the_file_value(node, configure):
    configure(preflight="enforce")
    (node / "kern.log").write_text(XID79)
    # a preflight mode the rule refuses does not lower enforce to report
    result = run_hook(node, RECOVERY_HOOKS_PREFLIGHT="lenient")
    assert result.returncode == 1 and "fatal XID" in result.stderr
    assert "RECOVERY_HOOKS_PREFLIGHT: must be one of off, report, enforce" in \
        (node / "hooks.log").read_text()
    # a valid one applies: report mode lets the job start
    assert run_hook(node, RECOVERY_HOOKS_PREFLIGHT="report").returncode == 0
