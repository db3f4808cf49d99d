"""The files a dev cluster runs from: slurm.conf, gres.conf, plugstack.conf, and
the per-node fault-injection files (kernel log, fake GPU state)."""
from __future__ import annotations

import getpass
import hashlib
import json
import os
import shutil
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

    def daemon_log(self, daemon: str) -> Path:
        return self.logs / f"{daemon}.log"


@dataclass(frozen=True)
class ClusterSpec:
    """The shape of a dev cluster: node count, GPUs per node, ports, hooks."""

    nodes: int = DEFAULT_NODES
    gpus_per_node: int = DEFAULT_GPUS
    port: int = DEFAULT_PORT
    user: str = field(default_factory=getpass.getuser)
    prolog: str = ""
    epilog: str = ""
    health_check: str = ""
    spank_plugin: str = ""
    spank_args: str = ""

    @property
    def node_names(self) -> list[str]:
        return [f"node{i}" for i in range(1, self.nodes + 1)]

    @property
    def ports(self) -> dict[str, int]:
        """slurmctld on ``port``; slurmd of node K on ``port + 1 + K``."""
        ports = {"slurmctld": self.port}
        for i, name in enumerate(self.node_names, start=1):
            ports[f"slurmd-{name}"] = self.port + 1 + i
        return ports

    def comparable(self) -> dict:
        """What must match for a running cluster to be reused as it is."""
        return {"nodes": self.nodes, "gpus_per_node": self.gpus_per_node, "port": self.port,
                "prolog": self.prolog, "epilog": self.epilog,
                "health_check": self.health_check, "spank_plugin": self.spank_plugin,
                "spank_args": self.spank_args}


def local_spec(nodes: int = DEFAULT_NODES, gpus_per_node: int = DEFAULT_GPUS,
               port: int = DEFAULT_PORT) -> ClusterSpec:
    """A spec wired to what this install has: the node hooks when their entry
    points are on PATH, the SPANK plugin when it is built in this checkout."""
    plugin = Path(__file__).resolve().parents[2] / "spank" / "slurm_recovery.so"
    return ClusterSpec(nodes=nodes, gpus_per_node=gpus_per_node, port=port,
                       prolog=shutil.which("recovery-prolog") or "",
                       epilog=shutil.which("recovery-epilog") or "",
                       health_check=shutil.which("recovery-healthcheck") or "",
                       spank_plugin=str(plugin) if plugin.exists() else "")


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
        "HealthCheckInterval=0" if not spec.health_check else "HealthCheckInterval=30",
    ]
    if spec.gpus_per_node:
        lines.append("GresTypes=gpu")
    if spec.prolog:
        lines += [f"Prolog={spec.prolog}", "PrologFlags=Alloc"]
    if spec.epilog:
        lines.append(f"Epilog={spec.epilog}")
    if spec.health_check:
        lines += [f"HealthCheckProgram={spec.health_check}", "HealthCheckNodeState=ANY"]
    lines += [
        f"NodeName=node[1-{spec.nodes}] NodeHostname=localhost NodeAddr=127.0.0.1 "
        f"Port={first}-{last} CPUs=2 RealMemory={NODE_MEMORY_MB}{gres} State=UNKNOWN",
        "PartitionName=gpu Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
    ]
    return "\n".join(lines) + "\n"


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
        })
    return {"node": node, "gpus": gpus}


def write_files(spec: ClusterSpec, lay: Layout) -> None:
    """Lay out a fresh state dir: config, munge key, per-node files."""
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
    lay.slurm_conf.write_text(slurm_conf(spec, lay))
    (lay.etc / "plugstack.conf").write_text(plugstack_conf(spec))
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
