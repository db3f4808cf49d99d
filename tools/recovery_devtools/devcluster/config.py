"""The files a dev cluster runs from: slurm.conf, gres.conf, plugstack.conf, and
the per-node fault-injection files (kernel log, fake GPU state)."""
from __future__ import annotations

import getpass
import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_NODES = 4
DEFAULT_GPUS = 2
DEFAULT_PORT = 16817  # Slurm's default is 6817; stay clear of a real cluster
CLUSTER_NAME = "devcluster"
NODE_MEMORY_MB = 1000
FAKE_GPU_NAME = "NVIDIA H100 80GB HBM3"


@dataclass(frozen=True)
class Layout:
    """Where everything of one dev cluster lives, under its state dir."""

    root: Path

    @property
    def marker(self) -> Path:
        return self.root / ".recovery-devcluster"

    @property
    def record(self) -> Path:
        return self.root / "cluster.json"

    @property
    def etc(self) -> Path:
        return self.root / "etc"

    @property
    def slurm_conf(self) -> Path:
        return self.etc / "slurm.conf"

    @property
    def munge_dir(self) -> Path:
        return self.root / "munge"

    @property
    def munge_key(self) -> Path:
        return self.munge_dir / "munge.key"

    @property
    def run_dir(self) -> Path:
        return self.root / "run"

    @property
    def munge_socket(self) -> Path:
        return self.run_dir / "munge.sock"

    @property
    def ctld_dir(self) -> Path:
        return self.root / "ctld"

    @property
    def spool(self) -> Path:
        return self.root / "spool"

    @property
    def logs(self) -> Path:
        return self.root / "log"

    @property
    def jobs(self) -> Path:
        """A scratch directory for job scripts and outputs."""
        return self.root / "jobs"

    def node_dir(self, node: str) -> Path:
        return self.root / "nodes" / node

    def kernel_log(self, node: str) -> Path:
        """The node's kernel-log file: tests append XID lines here."""
        return self.node_dir(node) / "kern.log"

    def gpu_state(self, node: str) -> Path:
        """The node's fake-GPU state, read by the fake NVML library."""
        return self.node_dir(node) / "gpus.json"

    @property
    def agent_config(self) -> Path:
        """recovery.toml for the hooks and for an agent serving this cluster."""
        return self.etc / "recovery.toml"

    def hook_wrapper(self, hook: str) -> Path:
        return self.root / "bin" / HOOKS[hook]

    def spool_dir(self, node: str) -> Path:
        return self.node_dir(node) / "spool"

    def hooks_log(self, node: str) -> Path:
        return self.node_dir(node) / "hooks.log"

    def daemon_log(self, daemon: str) -> Path:
        return self.logs / f"{daemon}.log"

    @property
    def jwt_key(self) -> Path:
        """The HS256 key slurmctld checks slurmrestd's tokens with (REST only)."""
        return self.etc / "jwt.key"

    @property
    def rest_token(self) -> Path:
        """A token from ``scontrol token`` for the REST backend (REST only)."""
        return self.etc / "rest.token"

    @property
    def rest_socket(self) -> Path:
        """slurmrestd's unix socket (local auth: it acts as its own user)."""
        return self.run_dir / "rest" / "slurmrestd.sock"


@dataclass(frozen=True)
class ClusterSpec:
    """The shape of a dev cluster: node count, GPUs per node, ports, hooks."""

    nodes: int = DEFAULT_NODES
    gpus_per_node: int = DEFAULT_GPUS
    port: int = DEFAULT_PORT
    user: str = field(default_factory=getpass.getuser)
    hooks_bin: str = ""      # directory holding recovery-prolog/-epilog/-healthcheck
    fake_nvml: str = ""      # the fake libnvidia-ml.so.1 the hooks load instead of NVML
    spank_plugin: str = ""
    spank_args: str = ""
    extra_conf: tuple[str, ...] = ()   # more slurm.conf lines (benchmarks: RequeueExit=...)
    rest: bool = False       # also run slurmrestd (auth/jwt on rest_port, local on a socket)

    @property
    def node_names(self) -> list[str]:
        return [f"node{i}" for i in range(1, self.nodes + 1)]

    @property
    def agent_port(self) -> int:
        """Where the dev cluster's hooks expect the agent (which tests start)."""
        return self.port + 90

    @property
    def rest_port(self) -> int:
        """slurmrestd's TCP port, when ``rest`` is on."""
        return self.port + 80

    @property
    def ports(self) -> dict[str, int]:
        """slurmctld on ``port``; slurmd of node K on ``port + 1 + K``;
        slurmrestd on ``port + 80`` when it runs."""
        ports = {"slurmctld": self.port}
        for i, name in enumerate(self.node_names, start=1):
            ports[f"slurmd-{name}"] = self.port + 1 + i
        if self.rest:
            ports["slurmrestd"] = self.rest_port
        return ports

    def comparable(self) -> dict:
        """What must match for a running cluster to be reused as it is."""
        return {"nodes": self.nodes, "gpus_per_node": self.gpus_per_node, "port": self.port,
                "hooks_bin": self.hooks_bin, "fake_nvml": self.fake_nvml,
                "spank_plugin": self.spank_plugin,
                "spank_args": self.spank_args, "extra_conf": list(self.extra_conf),
                # only when on: clusters recorded before slurmrestd existed stay reusable
                **({"rest": True} if self.rest else {})}


def local_spec(nodes: int = DEFAULT_NODES, gpus_per_node: int = DEFAULT_GPUS,
               port: int = DEFAULT_PORT, rest: bool | None = None) -> ClusterSpec:
    """A spec wired to what this install has: the node hooks when their entry
    points are on PATH, the SPANK plugin when it is built in this checkout.
    slurmrestd runs only when asked (``rest``, else ``RECOVERY_DEVCLUSTER_REST=1``):
    it needs the slurmrestd and slurm-wlm-jwt-plugin packages."""
    if rest is None:
        rest = os.environ.get("RECOVERY_DEVCLUSTER_REST", "") not in ("", "0")
    checkout = Path(__file__).resolve().parents[3]   # tools/recovery_devtools/devcluster/
    # RECOVERY_SPANK_PLUGIN: a build for another Slurm release (tests/slurm_matrix.sh
    # builds one per release, outside the checkout's spank/)
    plugin = Path(os.environ.get("RECOVERY_SPANK_PLUGIN")
                  or checkout / "spank" / "slurm_recovery.so")
    nvml = checkout / "tests" / "fake_nvml" / "libnvidia-ml.so.1"
    return ClusterSpec(nodes=nodes, gpus_per_node=gpus_per_node, port=port,
                       hooks_bin=hooks_bin(), fake_nvml=str(nvml) if nvml.exists() else "",
                       spank_plugin=str(plugin) if plugin.exists() else "", rest=rest)


HOOKS = {"prolog": "recovery-prolog", "epilog": "recovery-epilog",
         "health": "recovery-healthcheck"}


def hooks_bin() -> str:
    """The directory of this install's hook entry points: beside the running
    Python (a virtualenv's bin/), else wherever PATH finds them. Slurm runs
    hooks with an empty PATH, so the dev cluster needs a real directory, not a
    shim."""
    here = Path(sys.executable).parent
    if (here / HOOKS["prolog"]).exists():
        return str(here)
    found = shutil.which(HOOKS["prolog"])
    return str(Path(found).parent) if found else ""


def slurm_conf(spec: ClusterSpec, lay: Layout) -> str:
    first, last = spec.port + 2, spec.port + 1 + spec.nodes
    gres = f" Gres=gpu:{spec.gpus_per_node}" if spec.gpus_per_node else ""
    lines = [
        "# Written by recovery-devcluster: a real Slurm on one machine, for tests and demos.",
        f"ClusterName={CLUSTER_NAME}",
        "SlurmctldHost=localhost(127.0.0.1)",
        f"SlurmctldPort={spec.port}",
        f"SlurmdPort={first}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={lay.munge_socket}",
        f"SlurmUser={spec.user}",
        f"SlurmdUser={spec.user}",
        f"StateSaveLocation={lay.ctld_dir}",
        f"SlurmdSpoolDir={lay.spool}/%n",
        f"SlurmctldPidFile={lay.run_dir}/slurmctld.pid",
        f"SlurmdPidFile={lay.run_dir}/slurmd-%n.pid",
        f"SlurmctldLogFile={lay.daemon_log('slurmctld')}",
        f"SlurmdLogFile={lay.logs}/slurmd-%n.log",
        f"PlugStackConfig={lay.etc / 'plugstack.conf'}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SwitchType=switch/none",
        "MpiDefault=none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core_Memory",
        "SchedulerType=sched/backfill",
        "SlurmdParameters=config_overrides",
        "ReturnToService=2",
        "JobRequeue=1",
        "MinJobAge=600",
        "KillWait=5",
        "InactiveLimit=0",
        "SlurmctldTimeout=30",
        "SlurmdTimeout=30",
        "MessageTimeout=10",
    ]
    if spec.gpus_per_node:
        lines.append("GresTypes=gpu")
    if spec.hooks_bin:
        lines += [f"Prolog={lay.hook_wrapper('prolog')}", "PrologFlags=Alloc",
                  f"Epilog={lay.hook_wrapper('epilog')}",
                  f"HealthCheckProgram={lay.hook_wrapper('health')}",
                  "HealthCheckInterval=60", "HealthCheckNodeState=ANY"]
    if spec.rest:
        # slurmrestd hands each request's token to slurmctld, which checks it with the key
        lines += ["AuthAltTypes=auth/jwt", f"AuthAltParameters=jwt_key={lay.jwt_key}"]
    lines += list(spec.extra_conf)
    lines += [
        f"NodeName=node[1-{spec.nodes}] NodeHostname=localhost NodeAddr=127.0.0.1 "
        f"Port={first}-{last} CPUs=2 RealMemory={NODE_MEMORY_MB}{gres} State=UNKNOWN",
        "PartitionName=gpu Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
    ]
    return "\n".join(lines) + "\n"


def slurm_release(version_line: str) -> tuple[int, int]:
    """(major, minor) from `slurmctld -V` ("slurm 24.11.5"; Debian may add
    "-1"); (0, 0) when the line has no version."""
    words = version_line.split()
    parts = words[-1].split(".") if words else []
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return 0, 0


def release_files(release: tuple[int, int]) -> dict[str, str]:
    """Files a newer Slurm needs beside slurm.conf, by release. From 23.02 slurmd
    loads a cgroup plugin even with proctrack/linuxproc and task/none and exits
    where no cgroup filesystem is mounted (a chroot, a container); from then on
    ``CgroupPlugin=disabled`` exists to say there is none. 22.05 needs nothing."""
    if release >= (23, 2):
        return {"cgroup.conf": "# recovery-devcluster: no cgroups here\nCgroupPlugin=disabled\n"}
    return {}


def gres_conf(spec: ClusterSpec, lay: Layout) -> str:
    """Each node's GPUs are device links to /dev/null: Slurm insists on a
    character device per GPU, and these cost nothing."""
    lines = ["AutoDetect=off"]
    last = spec.gpus_per_node - 1
    for name in spec.node_names:
        lines.append(f"NodeName={name} Name=gpu File={lay.node_dir(name)}/dev/nvidia[0-{last}]")
    return "\n".join(lines) + "\n"


def plugstack_conf(spec: ClusterSpec) -> str:
    if spec.spank_plugin:
        return f"required {spec.spank_plugin} {spec.spank_args}".rstrip() + "\n"
    return "# no SPANK plugin built yet (make -C spank)\n"


def agent_toml(spec: ClusterSpec, lay: Layout) -> str:
    """The config the dev cluster's hooks read, and that an agent for this
    cluster can be started with (RECOVERY_CONFIG=<state>/etc/recovery.toml)."""
    node_dir = lay.root / "nodes" / "{node}"
    return "\n".join([
        "# Written by recovery-devcluster for this cluster's hooks and agent.",
        "[agent]", f'cluster = "{CLUSTER_NAME}"', f'state_dir = "{lay.root / "agent"}"',
        'poll_interval = "2s"',
        # the cluster's jobs write here (submit --chdir), not under a site root
        f'log_roots = "{lay.jobs}"',
        "[scheduler]", 'backend = "cli"', f'slurm_conf = "{lay.slurm_conf}"',
        "[api]", 'bind = "127.0.0.1"', f"port = {spec.agent_port}", 'auth = "munge"',
        f'munge_socket = "{lay.munge_socket}"', f'hook_uids = "{os.getuid()}"',
        "[hooks]", f'agent_url = "http://127.0.0.1:{spec.agent_port}"', 'timeout = "500ms"',
        f'spool_dir = "{node_dir / "spool"}"', f'log_file = "{node_dir / "hooks.log"}"',
        f'kernel_log = "file:{node_dir / "kern.log"}"', 'xid_window = "10m"',
        f'nvml_library = "{spec.fake_nvml}"',
        f'gpu_state_file = "{node_dir / "gpus.json"}"' if spec.fake_nvml
        else 'gpu_state_file = ""',
        f"expected_gpus = {spec.gpus_per_node}", 'preflight = "report"',
        f'munge_socket = "{lay.munge_socket}"',
        "[policy]", 'decision_timeout = "60s"', 'retry_backoff = "1s"',
        # four nodes: two of them may be drained by us at once
        "max_drains_per_hour = 4", "max_drained_percent = 50.0",
        "[environments.default]", 'mode = "monitor"',
        # the demo's environment acts; a job can still lower it with :monitor
        # both inherit the rest of default (max_restarts = 3 ...)
        "[environments.demo]", 'mode = "action"',
        "[environments.act]", 'mode = "action"',
    ]) + "\n"


def hook_wrapper(spec: ClusterSpec, lay: Layout, hook: str) -> str:
    """Slurm starts hooks with a bare environment, so the wrapper names the
    config. For the prolog and epilog it also takes the fast path itself: a job
    that did not opt in costs one /bin/sh, not a Python start."""
    fast_path = "" if hook == "health" else (
        "if [ -z \"${SPANK__SLURM_SPANK_OPTION_slurm_recovery_recovery+x}\" ] && "
        "[ -z \"${SLURM_RECOVERY+x}\" ]; then\n"
        "    case \"${SLURM_JOB_COMMENT:-}\" in *recovery=*) ;; *) exit 0 ;; esac\n"
        "fi\n")
    return (f"#!/bin/sh\n# recovery-devcluster: the {hook} hook with this cluster's config\n"
            f"{fast_path}RECOVERY_CONFIG={lay.agent_config}\nexport RECOVERY_CONFIG\n"
            f"exec {Path(spec.hooks_bin) / HOOKS[hook]} \"$@\"\n")


def fake_gpus(node: str, count: int) -> dict:
    """The fake-GPU state of a healthy node: stable UUIDs and bus ids per node."""
    gpus = []
    for index in range(count):
        digest = hashlib.sha1(f"{node}/{index}".encode()).hexdigest()
        uuid = f"GPU-{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"
        gpus.append({
            "index": index, "uuid": uuid, "name": FAKE_GPU_NAME,
            "pci_bus_id": f"00000000:{0x18 + index * 0x10:02X}:00.0",
            "temperature_c": 35, "ecc_volatile_uncorrected": 0,
            "ecc_aggregate_uncorrected": 0, "retired_pages_pending": False,
            "remapped_rows_pending": False, "remapped_rows_failure": False,
            "throttle_reasons": 0, "nvlink_active": [True] * 4, "missing": False,
            "ecc_volatile_corrected": 0, "ecc_aggregate_corrected": 0,
            "remapped_rows_correctable": 0, "remapped_rows_uncorrectable": 0,
            "retired_pages_sbe": 0, "retired_pages_dbe": 0,
            "nvlink_replay": [0] * 4, "nvlink_recovery": [0] * 4,
            "nvlink_crc_flit": [0] * 4, "nvlink_crc_data": [0] * 4,
            "nvlink_ecc_data": [0] * 4, "not_supported": [],
        })
    return {"node": node, "gpus": gpus}


def write_files(spec: ClusterSpec, lay: Layout, release: tuple[int, int] = (0, 0)) -> None:
    """Lay out a fresh state dir: config, munge key, per-node files; ``release``
    is the installed Slurm's (major, minor), for what it needs beyond slurm.conf."""
    for path in (lay.etc, lay.run_dir, lay.ctld_dir, lay.logs, lay.jobs):
        path.mkdir(parents=True, exist_ok=True)
    lay.marker.write_text("state dir of recovery-devcluster; `down` keeps it, `up` reuses it\n")
    lay.munge_dir.mkdir(mode=0o700, exist_ok=True)
    os.chmod(lay.munge_dir, 0o700)
    if not lay.munge_key.exists():
        fd = os.open(lay.munge_key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as fh:
            fh.write(os.urandom(1024))
    os.chmod(lay.run_dir, 0o755)
    os.chmod(lay.jobs, 0o1777)
    if spec.rest and not lay.jwt_key.exists():
        fd = os.open(lay.jwt_key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(os.urandom(64))
    lay.slurm_conf.write_text(slurm_conf(spec, lay))
    lay.agent_config.write_text(agent_toml(spec, lay))
    if spec.hooks_bin:
        (lay.root / "bin").mkdir(exist_ok=True)
        for hook in HOOKS:
            wrapper = lay.hook_wrapper(hook)
            wrapper.write_text(hook_wrapper(spec, lay, hook))
            wrapper.chmod(0o755)
    (lay.etc / "plugstack.conf").write_text(plugstack_conf(spec))
    for name, text in release_files(release).items():
        (lay.etc / name).write_text(text)
    if spec.gpus_per_node:
        (lay.etc / "gres.conf").write_text(gres_conf(spec, lay))
    for name in spec.node_names:
        (lay.spool / name).mkdir(parents=True, exist_ok=True)
        node_dir = lay.node_dir(name)
        (node_dir / "dev").mkdir(parents=True, exist_ok=True)
        for index in range(spec.gpus_per_node):
            link = node_dir / "dev" / f"nvidia{index}"
            if not link.is_symlink():
                link.symlink_to("/dev/null")
        lay.kernel_log(name).touch()
        lay.gpu_state(name).write_text(json.dumps(fake_gpus(name, spec.gpus_per_node),
                                                  indent=1) + "\n")
