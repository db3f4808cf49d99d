"""Loading the configuration: coercing TOML and environment values to the
declared types, building the sections, validating them (errors name the key),
``RECOVERY_*`` environment overrides, and :func:`load` itself.
"""
from __future__ import annotations

import os
import re
import shlex
import tomllib
from dataclasses import Field, fields, replace
from pathlib import Path
from typing import Any, Mapping

from slurm_hooks import overrides

from ..errors import ConfigError
from .schema import (BACKENDS, MODES, PROACTIVE_MODES, REST_AUTHS, REST_FALLBACKS,
                     REST_VERSIONS, SECTIONS, STRAGGLER_ACTIONS, AgentConfig, ApiConfig,
                     AttributionConfig, Config, EnvironmentConfig, HooksConfig, PolicyConfig,
                     ProactiveConfig, SchedulerConfig, SourcesConfig)

DEFAULT_PATH = Path("/etc/slurm-recovery/recovery.toml")
ENV_PATH = "RECOVERY_CONFIG"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_ALLOW_ENTRY = re.compile(r"^(?:\*\.)?[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252})(?::\d{1,5})?$")


def parse_duration(value: Any, key: str = "duration") -> float:
    """Seconds from a number or a string: ``90`` (a bare number is seconds, as it
    always was here), ``"1.5h"``, ``"250ms"``, or any form of
    :mod:`slurm_hooks.durations` (``"1h30m"``, ``"01:30:00"``, ``"2-00"``)."""
    expected = f"{key}: expected a duration such as 90s, 20m, 1h30m or 01:30:00, got {value!r}"
    if isinstance(value, bool):
        raise ConfigError(expected)
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif (text := overrides.duration_seconds(str(value))) is not None:
        seconds = text
    else:
        raise ConfigError(expected)
    if seconds < 0:
        raise ConfigError(f"{key}: a duration cannot be negative")
    return seconds


_KINDS = {"str": str, "int": int, "float": float, "bool": bool}


def _coerce(key: str, spec: Field, value: Any) -> Any:
    """``value`` as the declared type of ``spec``; ``key`` names it in errors.
    Text (from the environment, or a quoted number in the file) is read by the
    override rule the node hooks share (:mod:`slurm_hooks.overrides`)."""
    if spec.metadata.get("duration"):
        return parse_duration(value, key)
    kind = _KINDS[str(spec.type)]
    if isinstance(value, str):
        try:
            return overrides.parse(kind.__name__, value)
        except ValueError:
            pass
    elif kind is bool:
        if isinstance(value, bool):
            return value
        if value in (0, 1):
            return bool(value)
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    raise ConfigError(f"{key}: expected {kind.__name__}, got {value!r}")


def _values(cls: type, data: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """The keys of a table, each coerced to ``cls``'s declared type."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix}: expected a table, got {data!r}")
    known = {f.name: f for f in fields(cls)}
    values = {}
    for key, value in data.items():
        if key not in known:
            raise ConfigError(f"{prefix}.{key}: unknown key (known: {', '.join(known)})")
        values[key] = _coerce(f"{prefix}.{key}", known[key], value)
    return values


def _build(cls: type, data: Mapping[str, Any], prefix: str, base: Any = None) -> Any:
    """``cls`` from a table: its keys over ``base`` (an instance to inherit
    from), else over the built-in defaults."""
    values = _values(cls, data, prefix)
    return replace(base, **values) if base is not None else cls(**values)


def environments(raw: Any) -> dict[str, EnvironmentConfig]:
    """The ``[environments.*]`` tables: ``default`` over the built-in
    defaults, and every other one over ``default``, so that a key set once in
    ``[environments.default]`` holds everywhere unless an environment sets
    its own."""
    if not isinstance(raw, Mapping):
        raise ConfigError("environments: expected tables such as [environments.prod]")
    default = _build(EnvironmentConfig, raw.get("default", {}), "environments.default")
    return {"default": default,
            **{name: _build(EnvironmentConfig, value, f"environments.{name}", base=default)
               for name, value in raw.items() if name != "default"}}


def inherited_anyway(raw: Any) -> list[tuple[str, str, Any]]:
    """The keys of ``[environments.NAME]`` tables (not ``default``'s) set to
    the value they would inherit from ``[environments.default]`` anyway:
    (environment, key, value), for ``recovery-ctl check`` to point out. The
    tables are assumed valid (:func:`environments` took them)."""
    if not isinstance(raw, Mapping):
        return []
    default = environments(raw)["default"]
    found = []
    for name, table in raw.items():
        if name == "default" or not isinstance(table, Mapping):
            continue
        for key, value in _values(EnvironmentConfig, table, f"environments.{name}").items():
            if value == getattr(default, key):
                found.append((name, key, value))
    return found


_SSH_HOST = re.compile(r"^(?!-)(?:[A-Za-z0-9._-]+@)?(?!-)[A-Za-z0-9.:\[\]_-]+$")


def _validate(cfg: Config) -> None:
    """Every check, section by section, in the order a file's first error is named."""
    _validate_scheduler(cfg.scheduler)
    _validate_agent(cfg.agent)
    _validate_notify(cfg.environments)
    _validate_attribution(cfg.attribution)
    _validate_agent_names(cfg.agent)
    _validate_api(cfg.api)
    _validate_hooks(cfg.hooks)
    _validate_environments(cfg.environments)
    _validate_policy(cfg.policy)
    _validate_sources(cfg.sources)
    _validate_proactive(cfg.proactive)


def _validate_scheduler(sched: SchedulerConfig) -> None:
    if sched.backend not in BACKENDS:
        raise ConfigError(f"scheduler.backend: must be one of {', '.join(BACKENDS)}, "
                          f"got {sched.backend!r}")
    if sched.ssh_host and not _SSH_HOST.match(sched.ssh_host):
        raise ConfigError(f"scheduler.ssh_host: {sched.ssh_host!r} must be "
                          "[user@]host (no spaces, not starting with '-')")
    try:
        shlex.split(sched.ssh_options)
    except ValueError as exc:
        raise ConfigError(f"scheduler.ssh_options: {exc}") from None
    _validate_rest(sched)


def _validate_rest(sched: SchedulerConfig) -> None:
    if sched.rest_auth not in REST_AUTHS:
        raise ConfigError(f"scheduler.rest_auth: must be one of {', '.join(REST_AUTHS)}, "
                          f"got {sched.rest_auth!r}")
    if sched.rest_fallback not in REST_FALLBACKS:
        raise ConfigError(f"scheduler.rest_fallback: must be one of "
                          f"{', '.join(REST_FALLBACKS)}, got {sched.rest_fallback!r}")
    url = sched.rest_url
    if url and not (url.startswith(("http://", "https://")) or
                    (url.startswith("unix:/") and len(url) > len("unix:/"))):
        raise ConfigError(f"scheduler.rest_url: {url!r} must be http(s)://host[:port] or "
                          "unix:/absolute/path")
    if sched.rest_auth == "local" and url and not url.startswith("unix:"):
        raise ConfigError("scheduler.rest_auth: local works only over a unix socket "
                          "(rest_url = \"unix:/path\")")
    if sched.backend == "rest" and not url:
        raise ConfigError("scheduler.rest_url: must be set when scheduler.backend is rest")
    if sched.rest_version and sched.rest_version not in REST_VERSIONS:
        raise ConfigError(f"scheduler.rest_version: {sched.rest_version!r} is not one of "
                          f"{', '.join(REST_VERSIONS)}")
    if not 0 <= sched.rest_retries <= 10:
        raise ConfigError("scheduler.rest_retries: must be between 0 and 10")
    if sched.rest_token_lifespan < 60:
        raise ConfigError("scheduler.rest_token_lifespan: at least 60s")


def _validate_agent(agent: AgentConfig) -> None:
    if agent.poll_interval <= 0:
        raise ConfigError("agent.poll_interval: must be above zero")
    if not 0 <= agent.report_wakeup_gap <= 60:
        raise ConfigError("agent.report_wakeup_gap: between 0 (off) and 60s")
    _validate_log_keys(agent)
    if agent.node_report_wait > 3600:
        raise ConfigError("agent.node_report_wait: at most 1h (a verdict should not "
                          "wait longer for one node)")


def _validate_log_keys(agent: AgentConfig) -> None:
    for root in filter(None, (r.strip() for r in agent.log_roots.split(","))):
        if not root.startswith("/"):
            raise ConfigError(f"agent.log_roots: {root!r} is not an absolute path")
    if agent.log_max_backlog_mb < 0:
        raise ConfigError("agent.log_max_backlog_mb: must not be negative (0: never skip)")
    if agent.log_max_backlog_mb and not 0 < agent.log_keep_mb < agent.log_max_backlog_mb:
        raise ConfigError("agent.log_keep_mb: must be above 0 and below "
                          "agent.log_max_backlog_mb")


def _validate_agent_names(agent: AgentConfig) -> None:
    if agent.log_level.upper() not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
        raise ConfigError(f"agent.log_level: unknown level {agent.log_level!r}")
    if not _NAME.match(agent.cluster):
        raise ConfigError(f"agent.cluster: {agent.cluster!r} must match [A-Za-z0-9_-]{{1,64}}")


def _validate_notify(environments: Mapping[str, EnvironmentConfig]) -> None:
    for name, env in environments.items():
        for target in filter(None, (t.strip() for t in env.notify.split(","))):
            if not (target == "mail" or target.startswith(("http://", "https://"))
                    or target.startswith(("slack:http://", "slack:https://"))):
                raise ConfigError(f"environments.{name}.notify: {target!r} is not mail, "
                                  "an http(s) URL or slack:URL")
        for entry in filter(None, (t.strip() for t in env.notify_allow.split(","))):
            if not _ALLOW_ENTRY.match(entry):
                raise ConfigError(f"environments.{name}.notify_allow: {entry!r} is not a "
                                  "host name, host:port or *.domain")


def _validate_attribution(attr: AttributionConfig) -> None:
    if attr.webhook_url and not attr.webhook_url.startswith(("http://", "https://")):
        raise ConfigError("attribution.webhook_url: must be an http:// or https:// URL")
    if not 0 < attr.webhook_timeout <= 60:
        raise ConfigError("attribution.webhook_timeout: must be above 0 and at most 60s")


def _validate_api(api: ApiConfig) -> None:
    if api.auth not in ("munge", "none"):
        raise ConfigError(f"api.auth: must be munge or none, got {api.auth!r}")
    if not 0 < api.port < 65536:
        raise ConfigError(f"api.port: {api.port} is not a port number")
    for key in ("hook_uids", "admin_uids"):
        text = getattr(api, key)
        if not all(u.strip().isdigit() for u in text.split(",") if u.strip()):
            raise ConfigError(f"api.{key}: expected comma-separated uids, got {text!r}")
    if api.claim_ttl <= 0:
        raise ConfigError("api.claim_ttl: must be above zero")


def _validate_hooks(hooks: HooksConfig) -> None:
    if hooks.preflight not in ("off", "report", "enforce"):
        raise ConfigError(f"hooks.preflight: must be off, report or enforce, "
                          f"got {hooks.preflight!r}")
    source = hooks.kernel_log
    if source not in ("journal", "kmsg") and not source.startswith("file:"):
        raise ConfigError(f"hooks.kernel_log: must be journal, kmsg or file:PATH, "
                          f"got {source!r}")
    if not hooks.agent_url.startswith(("http://", "https://")):
        raise ConfigError(f"hooks.agent_url: must be an http(s) URL, got "
                          f"{hooks.agent_url!r}")


def _validate_environments(environments: Mapping[str, EnvironmentConfig]) -> None:
    for name, env in environments.items():
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
        if env.proactive not in PROACTIVE_MODES:
            raise ConfigError(f"environments.{name}.proactive: must be one of "
                              f"{', '.join(PROACTIVE_MODES)}, got {env.proactive!r}")
        for key in ("unknown_max_restarts", "no_progress_attempts", "interconnect_strikes"):
            if not 0 <= getattr(env, key) <= 1000:
                raise ConfigError(f"environments.{name}.{key}: must be 0-1000")


def _validate_policy(pol: PolicyConfig) -> None:
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


def _validate_proactive(pro: ProactiveConfig) -> None:
    if pro.window <= 0:
        raise ConfigError("proactive.window: must be above zero")
    if not 0 <= pro.min_span <= pro.window:
        raise ConfigError("proactive.min_span: must be 0 up to proactive.window")
    for key in ("sbe_per_hour", "nvlink_replay_per_hour", "nvlink_crc_per_hour",
                "nvlink_recovery_per_hour"):
        if getattr(pro, key) <= 0:
            raise ConfigError(f"proactive.{key}: must be above zero")
    if pro.retired_pages_limit < 1:
        raise ConfigError("proactive.retired_pages_limit: must be at least 1")
    for key in ("retired_pages_near", "slowdown_fraction"):
        if not 0 < getattr(pro, key) <= 1:
            raise ConfigError(f"proactive.{key}: must be above 0, at most 1")
    if pro.slowdown_reasons < 0:
        raise ConfigError("proactive.slowdown_reasons: must not be negative")
    if not 0 < pro.degraded_score <= 1:
        raise ConfigError("proactive.degraded_score: must be above 0, at most 1")
    if pro.migrate_cooldown < 0:
        raise ConfigError("proactive.migrate_cooldown: must not be negative")
    if not 0 < pro.checkpoint_wait <= 86400:
        raise ConfigError("proactive.checkpoint_wait: must be above 0, at most 1d")


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
    cfg = Config(**parts, environments=environments(data.get("environments", {})),
                 source=source)
    _validate(cfg)
    return cfg


def apply_env(cfg: Config, environ: Mapping[str, str]) -> Config:
    """Apply ``RECOVERY_<SECTION>_<KEY>`` overrides, e.g. ``RECOVERY_SCHEDULER_BACKEND=cli``,
    by the rule the node hooks apply to ``[hooks]`` too (:mod:`slurm_hooks.overrides`)."""
    applied: dict[str, str] = {}
    for section, cls in SECTIONS.items():
        updates = {}
        specs = {f.name: f for f in fields(cls)}
        for name, var, text in overrides.given(section, specs, environ):
            updates[name] = _coerce(f"{var} ({section}.{name})", specs[name], text)
            applied[f"{section}.{name}"] = var
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
