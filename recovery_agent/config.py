"""The agent's configuration: one TOML file, then ``RECOVERY_*`` environment
variables, then command-line flags, into one frozen object.

Every key is declared once, below, with its type, default and help text; the
example file ``etc/recovery.toml`` and the reference docs are written from the
same declarations. Unknown keys and bad values are errors naming the key.
"""
from __future__ import annotations

import os
import re
import shlex
import tomllib
from dataclasses import Field, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping

from .errors import ConfigError

DEFAULT_PATH = Path("/etc/slurm-recovery/recovery.toml")
ENV_PATH = "RECOVERY_CONFIG"
MODES = ("monitor", "action", "external")
BACKENDS = ("auto", "cli", "pyslurm")
STRAGGLER_ACTIONS = ("none", "kill_requeue")
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_ALLOW_ENTRY = re.compile(r"^(?:\*\.)?[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252})(?::\d{1,5})?$")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}
# Lines that show a training loop advancing: "step 120", "iteration 40/1000",
# "global_step=7", "'epoch': 1.5", "Epoch 3:", tqdm's "2.1it/s" or "0.48s/it", and
# Megatron's "elapsed time per iteration". Kept free of single quotes, so the
# example file can hold it as a TOML literal string.
DEFAULT_PROGRESS_PATTERN = (
    r"(?i)\b(?:iter(?:ation)?|step|global[_ ]step|epoch|batch)\b[\x22\x27]?\s*[:=#]?"
    r"\s*\[?\s*\d|\d(?:\.\d+)?\s*(?:it/s|s/it)\b|elapsed time per iteration")


# Where job output usually lives: shared file systems, never the system's own
# directories (a user's --output=/etc/shadow must not even be tried).
DEFAULT_LOG_ROOTS = "/home,/scratch,/work,/projects,/data,/lustre,/gpfs,/nfs"


def _validate_log_keys(agent: "AgentConfig") -> None:
    for root in filter(None, (r.strip() for r in agent.log_roots.split(","))):
        if not root.startswith("/"):
            raise ConfigError(f"agent.log_roots: {root!r} is not an absolute path")
    if agent.log_max_backlog_mb < 0:
        raise ConfigError("agent.log_max_backlog_mb: must not be negative (0: never skip)")
    if agent.log_max_backlog_mb and not 0 < agent.log_keep_mb < agent.log_max_backlog_mb:
        raise ConfigError("agent.log_keep_mb: must be above 0 and below "
                          "agent.log_max_backlog_mb")


def parse_duration(value: Any, key: str = "duration") -> float:
    """Seconds from ``90``, ``"90s"``, ``"20m"``, ``"2h"`` or ``"1d"``."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a duration such as 90s, 20m or 2h, got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        match = _DURATION.match(str(value))
        if not match:
            raise ConfigError(f"{key}: expected a duration such as 90s, 20m or 2h, "
                              f"got {value!r}")
        seconds = float(match.group(1)) * _UNITS[match.group(2)]
    if seconds < 0:
        raise ConfigError(f"{key}: a duration cannot be negative")
    return seconds


def _doc(text: str, duration: bool = False, **kw: Any) -> Any:
    return field(metadata={"doc": text, "duration": duration}, **kw)


@dataclass(frozen=True)
class AgentConfig:
    cluster: str = _doc("Cluster name recorded with every job (part of the job key).",
                        default="default")
    state_dir: str = _doc("Directory for the store, spools and cursors.",
                          default="/var/lib/slurm-recovery")
    poll_interval: float = _doc("Time between scheduler polls (one batched query each).",
                                duration=True, default=2.0)
    log_level: str = _doc("DEBUG, INFO, WARNING or ERROR.", default="INFO")
    patterns_dir: str = _doc("A directory of the site's own pattern packs (*.toml), "
                             "loaded after the shipped ones.", default="")
    log_roots: str = _doc(
        "Comma-separated directories job output may be read from: the shared file "
        "systems where jobs write. The agent reads as root, so a job's --output is "
        "opened with its user's rights (links of theirs not followed, the file must be "
        "theirs) and, besides, must resolve under one of these. The default names the "
        "usual shared roots and none of the system's own directories (/, /tmp, /etc, "
        "/root, /var, /usr, /proc, /sys, /dev, /run, /boot); a root that does not "
        "exist here costs nothing. Empty: anywhere the user may read (not advised).",
        default=DEFAULT_LOG_ROOTS)
    log_max_backlog_mb: int = _doc(
        "A job output file more than this many MiB ahead of the agent (a flood of "
        "output) is skipped to its last log_keep_mb MiB, from a line start, and the skip "
        "goes on the job's timeline and into recovery_log_bytes_skipped_total. 0 never "
        "skips (a flood then delays detection for as long as it takes to read).",
        default=16)
    log_keep_mb: int = _doc("How much of the end of a skipped file is read (MiB, below "
                            "log_max_backlog_mb).", default=2)
    node_report_wait: float = _doc(
        "How long after a job ends its verdict waits for the epilog report of each of "
        "its nodes that sent this attempt's prolog report, before deciding without it "
        "(a report a node had to spool arrives when the node replays its spool). Not "
        "waited for: a NODE_FAIL job, one that completed, was cancelled or preempted, "
        "and one whose node reports already blame a node by a fatal XID. Size it to "
        "Slurm's HealthCheckInterval plus 30s (a health check replays the spool); "
        "below 15s it changes nothing.", duration=True, default=90.0)


@dataclass(frozen=True)
class SchedulerConfig:
    backend: str = _doc("auto (first viable), cli or pyslurm.", default="auto")
    command_timeout: float = _doc("Time before a Slurm command is abandoned.",
                                  duration=True, default=30.0)
    bin_dir: str = _doc("Directory of squeue/sinfo/scontrol; empty searches PATH.",
                        default="")
    slurm_conf: str = _doc("SLURM_CONF for the commands; empty keeps the environment's.",
                           default="")
    ssh_host: str = _doc("SSH mode: run every Slurm command on this host ([user@]host) "
                         "through ssh, for an agent outside the cluster. Empty: run them "
                         "here. bin_dir and slurm_conf then name paths on that host.",
                         default="")
    ssh_options: str = _doc("Extra ssh arguments in SSH mode, split like a shell would "
                            "(e.g. \"-i /etc/slurm-recovery/id_ed25519 -p 2222\"). "
                            "BatchMode, ConnectTimeout and keepalives are always set.",
                            default="")


@dataclass(frozen=True)
class StoreConfig:
    path: str = _doc("SQLite file; empty means <agent.state_dir>/recovery.db.", default="")


@dataclass(frozen=True)
class EnvironmentConfig:
    mode: str = _doc("monitor (record only), action (act on Slurm) or external "
                     "(a site controller acts through the Advisor API).", default="monitor")
    max_restarts: int = _doc("Requeues allowed per job before recovery stops.", default=3)
    hang: float = _doc("A job showing no progress for this long is hung (0 disables); "
                       "a job's hang= overrides it.", duration=True, default=0.0)
    progress_pattern: str = _doc("Regex for lines that show training progress (step, "
                                 "iteration, epoch, it/s). Once a job prints a matching "
                                 "line, only matching lines reset the hang clock; empty "
                                 "means any output is progress.",
                                 default=DEFAULT_PROGRESS_PATTERN)
    straggler_factor: float = _doc("A rank whose median step time exceeds the median of "
                                   "the other ranks by this factor is a straggler "
                                   "(above 1).", default=1.5)
    straggler_window: float = _doc("How far back step times are kept for straggler "
                                   "detection.", duration=True, default=600.0)
    notify: str = _doc("Where this environment reports a job recovery gave up on, "
                       "besides the job's own notify=: comma-separated mail (the job's "
                       "user, through the local MTA), http(s) URLs (a JSON POST) and "
                       "slack:URL (a Slack-compatible incoming webhook).", default="")
    notify_allow: str = _doc("Hosts a job's own notify= URL may reach: comma-separated "
                             "host names, host:port, or *.domain for any host under it "
                             "(default ports only, unless a port is named). Empty (the "
                             "default): none, because the agent posts as root from its own "
                             "host, where a user-given URL could reach services that trust "
                             "it (loopback, the cluster network). The environment's own "
                             "notify list is the admin's and needs no entry here.",
                             default="")
    straggler_action: str = _doc("What a straggler leads to: none (record it) or "
                                 "kill_requeue (kill the job and requeue it without the "
                                 "slow host).", default="none")
    unknown_max_restarts: int = _doc("Requeues allowed for failures nobody can explain "
                                     "(no evidence), within max_restarts.", default=1)
    no_progress_attempts: int = _doc("Stop once this many attempts in a row ended without "
                                     "a new checkpoint (0 disables; needs checkpoints "
                                     "to be seen: ckpt= or checkpoint log lines).",
                                     default=3)
    drain_hardware: bool = _doc("Drain a node blamed for a GPU hardware fault.",
                                default=True)
    interconnect_strikes: int = _doc("Drain a node once interconnect failures named it "
                                     "this many times across jobs within "
                                     "policy.strike_window (0 never drains). Failures "
                                     "only the jobs' own output speaks for count once "
                                     "per user.", default=2)


@dataclass(frozen=True)
class ApiConfig:
    bind: str = _doc("Address the agent's HTTP service listens on.", default="127.0.0.1")
    port: int = _doc("Port of the agent's HTTP service.", default=8787)
    auth: str = _doc("munge: hook reports must carry a munge credential bound to the "
                     "body; none: accept unsigned reports (tests only).", default="munge")
    munge_socket: str = _doc("munged's socket; empty uses munge's default.", default="")
    hook_uids: str = _doc("Comma-separated uids allowed to send hook reports (the "
                          "SlurmdUser, normally root).", default="0")
    admin_uids: str = _doc("Comma-separated uids with the admin role on the API and "
                           "recovery-ctl (everyone else is a user: own jobs only).",
                           default="0")
    admin_groups: str = _doc("Comma-separated Unix groups whose members are admins.",
                             default="")
    read_token_file: str = _doc("A file holding a bearer token that read-only endpoints "
                                "and the Console then require; empty: no token (keep "
                                "api.bind on localhost).", default="")
    claim_ttl: float = _doc("How long an external controller's claim (ack) on a "
                            "recommendation lasts before it is offered again.",
                            duration=True, default=120.0)


@dataclass(frozen=True)
class HooksConfig:
    agent_url: str = _doc("Where the node hooks POST their reports.",
                          default="http://127.0.0.1:8787")
    timeout: float = _doc("How long a hook waits for the agent before spooling.",
                          duration=True, default=0.5)
    spool_dir: str = _doc("Node-local directory for reports the agent did not take; "
                          "{node} is replaced by the node name.",
                          default="/var/spool/slurm-recovery")
    log_file: str = _doc("The hooks' own log ({node} allowed); empty logs to stderr.",
                         default="/var/log/slurm-recovery/hooks.log")
    kernel_log: str = _doc("Where XIDs are read: journal (journalctl -k), kmsg "
                           "(/dev/kmsg) or file:PATH ({node} allowed).", default="journal")
    xid_window: float = _doc("How far back the prolog and health check look for XIDs.",
                             duration=True, default=600.0)
    nvml_library: str = _doc("Load NVML from this path instead of the system's "
                             "libnvidia-ml.so.1 ({node} allowed).", default="")
    gpu_state_file: str = _doc("State file of the fake NVML used by tests ({node} "
                               "allowed); leave empty on real GPUs.", default="")
    expected_gpus: int = _doc("GPUs every node should show; fewer is a preflight fault "
                              "(0 disables the check).", default=0)
    preflight: str = _doc("off, report (record faults) or enforce (a critical GPU fault "
                          "fails the prolog, so Slurm drains the node and requeues the "
                          "job).", default="report")
    munge_socket: str = _doc("munged's socket for signing reports; empty uses munge's "
                             "default.", default="")


@dataclass(frozen=True)
class AttributionConfig:
    entry_point: str = _doc("Name of an installed Python entry point in the "
                            "slurm_recovery.attribution group: a callable taking the "
                            "evidence bundle and returning a verdict (docs/extending.md). "
                            "Empty: none.", default="")
    webhook_url: str = _doc("URL of a site attribution service: the evidence bundle is "
                            "POSTed as JSON and a verdict expected back. Empty: none. The "
                            "built-in verdict is used when it fails or times out.",
                            default="")
    webhook_timeout: float = _doc("How long an attribution webhook may take.",
                                  duration=True, default=5.0)
    webhook_token_file: str = _doc("File holding a bearer token for the webhook; empty "
                                   "sends none.", default="")


@dataclass(frozen=True)
class PolicyConfig:
    decision_timeout: float = _doc("A job held for a recovery decision longer than this "
                                   "is released to normal scheduling (the watchdog).",
                                   duration=True, default=60.0)
    action_retries: int = _doc("Failed Slurm commands one recommendation may meet "
                               "(all its steps together) before it ends failed.",
                               default=3)
    retry_backoff: float = _doc("Wait before the first retry; doubled for each next one.",
                                duration=True, default=1.0)
    max_drains_per_hour: int = _doc("Blast-radius budget: drains by us per hour, cluster "
                                    "wide. Over it, a drain is blocked_by_budget.",
                                    default=4)
    max_drained_percent: float = _doc("Blast-radius budget: the most of a partition's "
                                      "nodes we keep drained, in percent.", default=10.0)
    lemon_threshold: float = _doc("A node whose decayed strike score reaches this is a "
                                  "lemon: excluded from every tracked job's retries and "
                                  "drained (0 disables). Of the strikes only the jobs' "
                                  "own output speaks for, the score counts one per "
                                  "user.", default=3.0)
    lemon_half_life: float = _doc("Half-life of a strike in the lemon score.",
                                  duration=True, default=7 * 86400.0)
    strike_window: float = _doc("Window in which interconnect strikes are counted.",
                                duration=True, default=86400.0)
    resume_after: float = _doc("Resume a node we drained once its health reports have "
                               "been clean this long (0: never resume automatically).",
                               duration=True, default=1800.0)


@dataclass(frozen=True)
class SourcesConfig:
    """External stores the agent queries (empty URLs: not used). Credentials
    live in files named here, never in this file, the logs or show config."""

    prometheus_url: str = _doc("Prometheus or VictoriaMetrics base URL with DCGM-exporter "
                               "series; empty: not used.", default="")
    prometheus_auth: str = _doc("none, bearer or basic.", default="none")
    prometheus_credentials_file: str = _doc("File with the bearer token, or one line "
                                            "user:password for basic auth.", default="")
    prometheus_host_label: str = _doc("Label holding the node name (Hostname, or "
                                      "instance).", default="Hostname")
    prometheus_gpu_label: str = _doc("Label holding the GPU index.", default="gpu")
    prometheus_uuid_label: str = _doc("Label holding the GPU UUID.", default="UUID")
    prometheus_host_rewrite: str = _doc("How a host label value becomes a node name: none, "
                                        "port (strip :9400) or domain (strip the port and "
                                        "the domain).", default="port")
    prometheus_selector: str = _doc("Extra PromQL label matchers for every query, e.g. "
                                    "job=\"dcgm\".", default="")
    prometheus_step: float = _doc("Resolution of range queries; at most the scrape "
                                  "interval, so short XID values are not missed.",
                                  duration=True, default=15.0)
    loki_url: str = _doc("Grafana Loki base URL; empty: not used.", default="")
    loki_auth: str = _doc("none, bearer or basic.", default="none")
    loki_credentials_file: str = _doc("File with the bearer token or user:password.",
                                      default="")
    loki_tenant: str = _doc("X-Scope-OrgID sent to a multi-tenant Loki; empty: none.",
                            default="")
    loki_job_label: str = _doc("Stream label holding the Slurm job id; empty: no job feed.",
                               default="slurm_job_id")
    loki_host_label: str = _doc("Stream label holding the node name; empty: no node feed.",
                                default="host")
    loki_selector: str = _doc("Extra LogQL label matchers for every query, e.g. "
                              "cluster=\"hpc1\".", default="")
    victorialogs_url: str = _doc("VictoriaLogs base URL; empty: not used.", default="")
    victorialogs_auth: str = _doc("none, bearer or basic.", default="none")
    victorialogs_credentials_file: str = _doc("File with the bearer token or "
                                              "user:password.", default="")
    victorialogs_tenant: str = _doc("ACCOUNT:PROJECT ids sent as the AccountID and "
                                    "ProjectID headers; empty: the default tenant.",
                                    default="")
    victorialogs_job_field: str = _doc("Field holding the Slurm job id; empty: no job feed.",
                                       default="slurm_job_id")
    victorialogs_host_field: str = _doc("Field holding the node name; empty: no node feed.",
                                        default="host")
    victorialogs_filter: str = _doc("Extra LogsQL filters for every query.", default="")
    query_interval: float = _doc("Time between queries of one source for one job.",
                                 duration=True, default=30.0)
    timeout: float = _doc("A query taking longer than this fails (and is not retried).",
                          duration=True, default=10.0)
    retries: int = _doc("Retries after a refused connection, a 5xx or a 429 answer.",
                        default=2)
    ingest_delay: float = _doc("Data younger than this is left for the next query, as "
                               "stores ingest late (VictoriaMetrics hides its newest 30s).",
                               duration=True, default=30.0)
    page_limit: int = _doc("Log lines per request (Loki caps it at 5000 by default).",
                           default=1000)
    max_pages: int = _doc("Requests per job per query interval; the rest waits for the "
                          "next interval.", default=20)
    cursor_dir: str = _doc("Where log cursors are kept; empty means "
                           "<agent.state_dir>/cursors.", default="")


SECTIONS: dict[str, type] = {"agent": AgentConfig, "scheduler": SchedulerConfig,
                             "store": StoreConfig, "api": ApiConfig, "hooks": HooksConfig,
                             "policy": PolicyConfig, "sources": SourcesConfig,
                             "attribution": AttributionConfig}


@dataclass(frozen=True)
class Config:
    agent: AgentConfig = field(default_factory=AgentConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    api: ApiConfig = field(default_factory=ApiConfig)
    hooks: HooksConfig = field(default_factory=HooksConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    attribution: AttributionConfig = field(default_factory=AttributionConfig)
    sources: SourcesConfig = field(default_factory=SourcesConfig)
    environments: Mapping[str, EnvironmentConfig] = field(
        default_factory=lambda: {"default": EnvironmentConfig()})
    source: str = ""

    @property
    def store_path(self) -> Path:
        return Path(self.store.path or Path(self.agent.state_dir) / "recovery.db")

    @property
    def allowed_hook_uids(self) -> frozenset[int]:
        return frozenset(int(u) for u in self.api.hook_uids.split(",") if u.strip())

    @property
    def allowed_log_roots(self) -> tuple[str, ...]:
        """The directories of agent.log_roots (empty: no limit but the user's rights)."""
        return tuple(r.strip().rstrip("/") or "/" for r in self.agent.log_roots.split(",")
                     if r.strip())

    @property
    def admin_uids(self) -> frozenset[int]:
        return frozenset(int(u) for u in self.api.admin_uids.split(",") if u.strip())

    @property
    def admin_groups(self) -> tuple[str, ...]:
        return tuple(g.strip() for g in self.api.admin_groups.split(",") if g.strip())

    def environment(self, name: str) -> EnvironmentConfig:
        """The named environment; unknown names fall back to ``default``."""
        return self.environments.get(name) or self.environments.get(
            "default", EnvironmentConfig())


_KINDS = {"str": str, "int": int, "float": float, "bool": bool}


def _coerce(key: str, spec: Field, value: Any) -> Any:
    """``value`` as the declared type of ``spec``; ``key`` names it in errors."""
    if spec.metadata.get("duration"):
        return parse_duration(value, key)
    kind = _KINDS[str(spec.type)]
    if kind is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in {"1", "true", "yes", "on"}:
            return True
        if str(value).lower() in {"0", "false", "no", "off"}:
            return False
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            return int(value)
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):   # from the environment
            try:
                return float(value)
            except ValueError:
                pass
    elif kind is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"{key}: expected {kind.__name__}, got {value!r}")


def _build(cls: type, data: Mapping[str, Any], prefix: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix}: expected a table, got {data!r}")
    known = {f.name: f for f in fields(cls)}
    values = {}
    for key, value in data.items():
        if key not in known:
            raise ConfigError(f"{prefix}.{key}: unknown key (known: {', '.join(known)})")
        values[key] = _coerce(f"{prefix}.{key}", known[key], value)
    return cls(**values)


_SSH_HOST = re.compile(r"^(?!-)(?:[A-Za-z0-9._-]+@)?(?!-)[A-Za-z0-9.:\[\]_-]+$")


def _validate(cfg: Config) -> None:
    if cfg.scheduler.backend not in BACKENDS:
        raise ConfigError(f"scheduler.backend: must be one of {', '.join(BACKENDS)}, "
                          f"got {cfg.scheduler.backend!r}")
    if cfg.scheduler.ssh_host and not _SSH_HOST.match(cfg.scheduler.ssh_host):
        raise ConfigError(f"scheduler.ssh_host: {cfg.scheduler.ssh_host!r} must be "
                          "[user@]host (no spaces, not starting with '-')")
    try:
        shlex.split(cfg.scheduler.ssh_options)
    except ValueError as exc:
        raise ConfigError(f"scheduler.ssh_options: {exc}") from None
    if cfg.agent.poll_interval <= 0:
        raise ConfigError("agent.poll_interval: must be above zero")
    _validate_log_keys(cfg.agent)
    if cfg.agent.node_report_wait > 3600:
        raise ConfigError("agent.node_report_wait: at most 1h (a verdict should not "
                          "wait longer for one node)")
    for name, env in cfg.environments.items():
        for target in filter(None, (t.strip() for t in env.notify.split(","))):
            if not (target == "mail" or target.startswith(("http://", "https://"))
                    or target.startswith(("slack:http://", "slack:https://"))):
                raise ConfigError(f"environments.{name}.notify: {target!r} is not mail, "
                                  "an http(s) URL or slack:URL")
        for entry in filter(None, (t.strip() for t in env.notify_allow.split(","))):
            if not _ALLOW_ENTRY.match(entry):
                raise ConfigError(f"environments.{name}.notify_allow: {entry!r} is not a "
                                  "host name, host:port or *.domain")
    if cfg.attribution.webhook_url and not cfg.attribution.webhook_url.startswith(
            ("http://", "https://")):
        raise ConfigError("attribution.webhook_url: must be an http:// or https:// URL")
    if not 0 < cfg.attribution.webhook_timeout <= 60:
        raise ConfigError("attribution.webhook_timeout: must be above 0 and at most 60s")
    if cfg.agent.log_level.upper() not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
        raise ConfigError(f"agent.log_level: unknown level {cfg.agent.log_level!r}")
    if not _NAME.match(cfg.agent.cluster):
        raise ConfigError(f"agent.cluster: {cfg.agent.cluster!r} must match [A-Za-z0-9_-]{{1,64}}")
    if cfg.api.auth not in ("munge", "none"):
        raise ConfigError(f"api.auth: must be munge or none, got {cfg.api.auth!r}")
    if not 0 < cfg.api.port < 65536:
        raise ConfigError(f"api.port: {cfg.api.port} is not a port number")
    for key in ("hook_uids", "admin_uids"):
        text = getattr(cfg.api, key)
        if not all(u.strip().isdigit() for u in text.split(",") if u.strip()):
            raise ConfigError(f"api.{key}: expected comma-separated uids, got {text!r}")
    if cfg.api.claim_ttl <= 0:
        raise ConfigError("api.claim_ttl: must be above zero")
    if cfg.hooks.preflight not in ("off", "report", "enforce"):
        raise ConfigError(f"hooks.preflight: must be off, report or enforce, "
                          f"got {cfg.hooks.preflight!r}")
    source = cfg.hooks.kernel_log
    if source not in ("journal", "kmsg") and not source.startswith("file:"):
        raise ConfigError(f"hooks.kernel_log: must be journal, kmsg or file:PATH, "
                          f"got {source!r}")
    if not cfg.hooks.agent_url.startswith(("http://", "https://")):
        raise ConfigError(f"hooks.agent_url: must be an http(s) URL, got "
                          f"{cfg.hooks.agent_url!r}")
    for name, env in cfg.environments.items():
        if not _NAME.match(name):
            raise ConfigError(f"environments.{name}: names must match [A-Za-z0-9_-]{{1,64}}")
        if env.mode not in MODES:
            raise ConfigError(f"environments.{name}.mode: must be one of {', '.join(MODES)}, "
                              f"got {env.mode!r}")
        if not 0 <= env.max_restarts <= 1000:
            raise ConfigError(f"environments.{name}.max_restarts: must be 0-1000")
        try:
            re.compile(env.progress_pattern)
        except re.error as exc:
            raise ConfigError(f"environments.{name}.progress_pattern: not a valid "
                              f"regex: {exc}") from None
        if env.straggler_factor <= 1.0:
            raise ConfigError(f"environments.{name}.straggler_factor: must be above 1")
        if env.straggler_window <= 0:
            raise ConfigError(f"environments.{name}.straggler_window: must be above zero")
        if env.straggler_action not in STRAGGLER_ACTIONS:
            raise ConfigError(f"environments.{name}.straggler_action: must be none or "
                              f"kill_requeue, got {env.straggler_action!r}")
        for key in ("unknown_max_restarts", "no_progress_attempts", "interconnect_strikes"):
            if not 0 <= getattr(env, key) <= 1000:
                raise ConfigError(f"environments.{name}.{key}: must be 0-1000")
    pol = cfg.policy
    if pol.decision_timeout <= 0:
        raise ConfigError("policy.decision_timeout: must be above zero")
    if not 1 <= pol.action_retries <= 20:
        raise ConfigError("policy.action_retries: must be 1-20")
    if pol.max_drains_per_hour < 0:
        raise ConfigError("policy.max_drains_per_hour: must not be negative")
    if not 0 <= pol.max_drained_percent <= 100:
        raise ConfigError("policy.max_drained_percent: must be 0-100")
    if pol.lemon_threshold < 0:
        raise ConfigError("policy.lemon_threshold: must not be negative")
    if pol.lemon_half_life <= 0:
        raise ConfigError("policy.lemon_half_life: must be above zero")
    _validate_sources(cfg.sources)


_LABEL = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_FIELD = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:-]*$")


def _validate_sources(src: SourcesConfig) -> None:
    """URLs without inline credentials, known auth kinds, label names a query can hold."""
    for kind in ("prometheus", "loki", "victorialogs"):
        url = getattr(src, f"{kind}_url")
        if url and (not re.match(r"^https?://[^/@\s]+", url) or "@" in url.split("/")[2]):
            raise ConfigError(f"sources.{kind}_url: must be an http(s) URL without "
                              f"credentials in it (use {kind}_credentials_file)")
        auth = getattr(src, f"{kind}_auth")
        if auth not in ("none", "bearer", "basic"):
            raise ConfigError(f"sources.{kind}_auth: must be none, bearer or basic, "
                              f"got {auth!r}")
        if auth != "none" and not getattr(src, f"{kind}_credentials_file"):
            raise ConfigError(f"sources.{kind}_credentials_file: needed for {kind}_auth = "
                              f"{auth}")
    for key in ("prometheus_host_label", "prometheus_gpu_label", "prometheus_uuid_label"):
        if not _LABEL.match(getattr(src, key)):
            raise ConfigError(f"sources.{key}: {getattr(src, key)!r} is not a label name")
    for key in ("loki_job_label", "loki_host_label"):
        if getattr(src, key) and not _LABEL.match(getattr(src, key)):
            raise ConfigError(f"sources.{key}: {getattr(src, key)!r} is not a label name")
    for key in ("victorialogs_job_field", "victorialogs_host_field"):
        if getattr(src, key) and not _FIELD.match(getattr(src, key)):
            raise ConfigError(f"sources.{key}: {getattr(src, key)!r} is not a field name")
    for key in ("prometheus_selector", "loki_selector"):
        if any(c in getattr(src, key) for c in "{}"):
            raise ConfigError(f"sources.{key}: matchers only, without braces")
    if src.prometheus_host_rewrite not in ("none", "port", "domain"):
        raise ConfigError("sources.prometheus_host_rewrite: must be none, port or domain")
    if src.victorialogs_tenant and not re.match(r"^\d+:\d+$", src.victorialogs_tenant):
        raise ConfigError("sources.victorialogs_tenant: expected ACCOUNT:PROJECT, e.g. 12:34")
    if not 1 <= src.page_limit <= 5000:
        raise ConfigError("sources.page_limit: must be 1-5000")
    if not 1 <= src.max_pages <= 1000:
        raise ConfigError("sources.max_pages: must be 1-1000")
    if not 0 <= src.retries <= 10:
        raise ConfigError("sources.retries: must be 0-10")
    for key in ("query_interval", "timeout", "prometheus_step"):
        if getattr(src, key) <= 0:
            raise ConfigError(f"sources.{key}: must be above zero")


def from_mapping(data: Mapping[str, Any], source: str = "") -> Config:
    """A validated Config from parsed TOML (or any nested mapping)."""
    unknown = set(data) - set(SECTIONS) - {"environments"}
    if unknown:
        raise ConfigError(f"{sorted(unknown)[0]}: unknown section (known: "
                          f"{', '.join([*SECTIONS, 'environments'])})")
    parts = {name: _build(cls, data.get(name, {}), name) for name, cls in SECTIONS.items()}
    envs_raw = data.get("environments", {})
    if not isinstance(envs_raw, Mapping):
        raise ConfigError("environments: expected tables such as [environments.prod]")
    envs = {name: _build(EnvironmentConfig, value, f"environments.{name}")
            for name, value in envs_raw.items()}
    envs.setdefault("default", EnvironmentConfig())
    cfg = Config(**parts, environments=envs, source=source)
    _validate(cfg)
    return cfg


def apply_env(cfg: Config, environ: Mapping[str, str]) -> Config:
    """Apply ``RECOVERY_<SECTION>_<KEY>`` overrides, e.g. ``RECOVERY_SCHEDULER_BACKEND=cli``."""
    applied: dict[str, str] = {}
    for section, cls in SECTIONS.items():
        updates = {}
        for f in fields(cls):
            var = f"RECOVERY_{section}_{f.name}".upper()
            if var in environ:
                updates[f.name] = _coerce(f"{var} ({section}.{f.name})", f, environ[var])
                applied[f"{section}.{f.name}"] = var
        if updates:
            cfg = replace(cfg, **{section: replace(getattr(cfg, section), **updates)})
    try:
        _validate(cfg)
    except ConfigError as exc:
        var = next((v for k, v in applied.items() if str(exc).startswith(k)), None)
        raise ConfigError(f"{var}: {exc}" if var else str(exc)) from None
    return cfg


def load(path: str | Path | None = None, environ: Mapping[str, str] | None = None,
         required: bool = False) -> Config:
    """Load the config: ``path``, else ``$RECOVERY_CONFIG``, else the default path.

    A missing default file gives the built-in defaults (monitor mode), unless
    ``required``; a missing file that was named explicitly is an error.
    """
    environ = os.environ if environ is None else environ
    explicit = path or environ.get(ENV_PATH)
    target = Path(explicit) if explicit else DEFAULT_PATH
    try:
        with open(target, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        if explicit or required:
            raise ConfigError(f"{target}: config file not found") from None
        return apply_env(Config(), environ)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{target}: not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"{target}: cannot read: {exc.strerror}") from None
    try:
        return apply_env(from_mapping(data, str(target)), environ)
    except ConfigError as exc:
        raise ConfigError(f"{target}: {exc}") from None
