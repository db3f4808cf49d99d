"""The configuration's schema: every section as a frozen dataclass, each key
declared once with its type, default and help text (``_doc``), and the
constants those defaults use.

The example file ``etc/recovery.toml`` and the reference docs are written from
these declarations; :mod:`.loading` reads a file into them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

MODES = ("monitor", "action", "external")
BACKENDS = ("auto", "cli", "pyslurm", "rest")
REST_AUTHS = ("jwt", "local")
REST_FALLBACKS = ("cli", "none")
# The slurmrestd OpenAPI versions the REST backend speaks, newest first: 26.05
# (v0.0.42-v0.0.45), 25.x (v0.0.43/44), 24.11 (v0.0.40-v0.0.42), 22.05 (v0.0.38).
REST_VERSIONS = ("v0.0.45", "v0.0.44", "v0.0.43", "v0.0.42", "v0.0.41", "v0.0.40", "v0.0.38")
STRAGGLER_ACTIONS = ("none", "kill_requeue")
PROACTIVE_MODES = ("action", "monitor", "off")

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
    report_wakeup_gap: float = _doc(
        "A node report of a watched job that brings evidence (an epilog, XIDs, log "
        "lines) starts a watch cycle at once instead of at the next poll, so a verdict "
        "waits on the report, not on the clock; for 5 s after it, one every this many "
        "seconds while that job is still COMPLETING. An early cycle starts no sooner "
        "than this long after the last one ended (each lists the jobs once, as a poll "
        "does), and never delays the poll. 0: cycles on the poll only.", duration=True,
        default=0.25)
    node_poll_interval: float = _doc(
        "How often the watch loop lists the nodes (sinfo) and records each change of a "
        "node's availability (down, drained, its drain reason, user and time), which "
        "recovery-ctl report scores monitor mode against, including drains lifted "
        "since. 0 records nothing.", duration=True, default=30.0)
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
        "goes on the job's timeline and into slurm_recovery_log_bytes_skipped_total. 0 never "
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
    backend: str = _doc("auto (the first viable of rest, pyslurm, cli; rest only when "
                        "rest_url is set), cli, pyslurm or rest.", default="auto")
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
    rest_url: str = _doc("REST backend: the slurmrestd to use, http(s)://host:port or "
                         "unix:/path/to/slurmrestd.socket. Empty: no REST backend.",
                         default="")
    rest_auth: str = _doc("REST backend: jwt (a token in X-SLURM-USER-TOKEN; slurm.conf "
                          "needs AuthAltTypes=auth/jwt) or local (unix socket only: "
                          "slurmrestd acts as the socket's caller).", default="jwt")
    rest_token_file: str = _doc("REST backend, jwt: a file holding the token (or a "
                                "SLURM_JWT= line), re-read when it changes. Empty: ask "
                                "`scontrol token` through the command seam, renewed at half "
                                "its lifespan.", default="")
    rest_token_lifespan: float = _doc("REST backend, jwt without a token file: lifespan of "
                                      "the tokens asked of `scontrol token`.", duration=True,
                                      default=3600.0)
    rest_user: str = _doc("REST backend: X-SLURM-USER-NAME, the user the token belongs to: "
                          "an operator (root, SlurmUser or AdminLevel=Operator), since the "
                          "agent requeues other users' jobs. Empty: the agent's own user.",
                          default="")
    rest_version: str = _doc("REST backend: the OpenAPI version to speak (e.g. v0.0.42). "
                             "Empty: the newest the server offers of v0.0.38, "
                             "v0.0.40-v0.0.45.", default="")
    rest_ca_file: str = _doc("REST backend, https: the CA bundle to trust (empty: the "
                             "system's).", default="")
    rest_retries: int = _doc("REST backend: extra attempts of a read after a connection "
                             "error or a 5xx without a Slurm error (changes are retried only "
                             "when the connection never opened).", default=2)
    rest_fallback: str = _doc("REST backend: what runs a step the server's OpenAPI version "
                              "has no endpoint for (22.05: requeue, node drain/resume; "
                              "24.11: requeue): cli (the scontrol command, through the same "
                              "seam as the CLI backend) or none (a SchedulerError).",
                              default="cli")


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
    proactive: str = _doc("Moving jobs off a degrading node before it fails "
                          "(docs/proactive.md): action (as the environment's mode allows), "
                          "monitor (record would_have only, whatever the mode) or off (never; "
                          "each refusal is still recorded). A job's proactive=no opts it "
                          "out.", default="monitor")


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


@dataclass(frozen=True)
class LedgerConfig:
    """The goodput ledger's assumptions about plain Slurm (docs/goodput.md)."""

    requeue_delay: float = _doc("The wait plain Slurm puts on a requeued job before it "
                                "may start again (its BeginTime).", duration=True,
                                default=120.0)
    repeat_on_node: bool = _doc("Under plain Slurm, a fault that stays with a node nothing "
                                "excluded costs one more attempt (as long as the failed "
                                "one ran, plus one more requeue delay).", default=True)
    restart_after_decision: float = _doc("Monitor mode: how long after our decision the "
                                         "job would have run again had we acted.",
                                         duration=True, default=30.0)
    hang_noticed_after: float = _doc("How long plain Slurm leaves a hung job before someone "
                                     "ends it; 0: unknown (a hang's saving is then unknown).",
                                     duration=True, default=0.0)
    seen_within: float = _doc("An attempt the agent first saw later than this after its "
                              "start ran before the agent watched it (its earlier "
                              "checkpoints count as unknown).", duration=True, default=120.0)
    time_slack: float = _doc("A checkpoint of the failed attempt dated at most this after "
                             "the failure counts as saved at the failure (work lost 0); "
                             "later, its work lost is unknown. It covers Slurm's end time "
                             "in whole seconds and node clock skew (and, for a save line "
                             "without a time stamp, the agent's reading lag).",
                             duration=True, default=3.0)
    blame_horizon: float = _doc("How long after a node was excluded or drained its health "
                                "reports and later jobs count for or against the blame "
                                "(the precision of node blame).", duration=True,
                                default=7 * 86400.0)
    resubmit_within: float = _doc("A stopped job its user submits again unchanged (same "
                                  "name, script and directive) within this counts as "
                                  "resubmitted (the false-stop evidence).", duration=True,
                                  default=86400.0)
    metrics_window: float = _doc("The window of the slurm_recovery_ettr gauge on /metrics "
                                 "(the counters cover the whole store).", duration=True,
                                 default=30 * 86400.0)


# Clock-event bits (nvml.h nvmlClocksEventReason*) that mean the GPU slowed itself
# down: HW slowdown 0x8, SW thermal 0x20, HW thermal 0x40, HW power brake 0x80. The
# SW power cap (0x4) and idle (0x1) are left out: a busy GPU at its power limit is
# working as designed.
DEFAULT_SLOWDOWN_REASONS = 0x08 | 0x20 | 0x40 | 0x80


@dataclass(frozen=True)
class ProactiveConfig:
    """Precursor signals, the degradation score and the move of jobs off a
    degraded node (docs/proactive.md says what is built)."""

    window: float = _doc("How far back a GPU's readings count for its degradation score: "
                         "rates and slowdowns are trends over this window, never one "
                         "reading.", duration=True, default=6 * 3600.0)
    min_span: float = _doc("A rate needs readings at least this far apart (first to last "
                           "in the window) before it can fire, so two readings a few "
                           "seconds apart never make a rate.", duration=True,
                           default=900.0)
    sbe_per_hour: float = _doc("Corrected (single-bit) ECC errors per hour over the window "
                               "above which the 'sbe_rate' rule fires.", default=100.0)
    retired_pages_limit: int = _doc("The page retirements a pre-Ampere GPU can make in its "
                                    "life (NVIDIA's dynamic page retirement: 64).",
                                    default=64)
    retired_pages_near: float = _doc("The 'retired_pages_near_limit' rule fires once the "
                                     "retired pages reach this fraction of "
                                     "retired_pages_limit (0-1).", default=0.75)
    nvlink_replay_per_hour: float = _doc("NVLink data-link replays per hour on one link "
                                         "above which 'nvlink_replay_rising' fires.",
                                         default=60.0)
    nvlink_crc_per_hour: float = _doc("NVLink CRC errors (flit plus data) per hour on one "
                                      "link above which 'nvlink_crc_rising' fires.",
                                      default=60.0)
    nvlink_recovery_per_hour: float = _doc("NVLink link recoveries per hour on one link "
                                           "above which 'nvlink_recovery_rising' fires.",
                                           default=1.0)
    slowdown_reasons: int = _doc("Clock-event reason bits (nvml.h) that count as a "
                                 "slowdown: by default HW slowdown, SW and HW thermal "
                                 "slowdown and HW power brake (0xE8).",
                                 default=DEFAULT_SLOWDOWN_REASONS)
    slowdown_fraction: float = _doc("'thermal_power_slowdown' fires when at least this "
                                    "fraction of the window's readings (and at least two) "
                                    "show a slowdown reason (0-1).", default=0.5)
    degraded_score: float = _doc("A GPU whose score reaches this is 'degraded'; above 0 "
                                 "and below it, 'watch' (scores run 0-1).", default=1.0)
    migrate_cooldown: float = _doc("A job moved off a degraded node is not moved again "
                                   "within this long.", duration=True, default=6 * 3600.0)
    checkpoint_wait: float = _doc("How long a move waits for the job's new checkpoint after "
                                  "the checkpoint signal; none by then: the job is left "
                                  "alone and the node drained for new work only.",
                                  duration=True, default=600.0)


SECTIONS: dict[str, type] = {"agent": AgentConfig, "scheduler": SchedulerConfig,
                             "store": StoreConfig, "api": ApiConfig, "hooks": HooksConfig,
                             "policy": PolicyConfig, "sources": SourcesConfig,
                             "attribution": AttributionConfig, "ledger": LedgerConfig,
                             "proactive": ProactiveConfig}


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
    ledger: LedgerConfig = field(default_factory=LedgerConfig)
    proactive: ProactiveConfig = field(default_factory=ProactiveConfig)
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
