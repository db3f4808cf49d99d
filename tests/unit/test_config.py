"""Config: the TOML file, RECOVERY_* overrides, and errors that name the key."""
from __future__ import annotations

from pathlib import Path

import pytest

from recovery_agent import config
from recovery_agent.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parents[2] / "etc" / "recovery.toml"


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "recovery.toml"
    path.write_text(text)
    return path


def test_example_file_loads():
    cfg = config.load(EXAMPLE, environ={})
    assert cfg.agent.poll_interval == 2.0
    assert cfg.scheduler.command_timeout == 30.0
    assert cfg.environment("prod").hang == 1800.0
    assert cfg.environment("prod").max_restarts == 5
    assert cfg.environment("nonexistent") == cfg.environment("default")
    assert cfg.store_path == Path("/var/lib/slurm-recovery/recovery.db")


def test_missing_default_file_gives_defaults(tmp_path, monkeypatch):
    monkeypatch.setattr(config.loading, "DEFAULT_PATH", tmp_path / "absent.toml")
    cfg = config.load(environ={})
    assert cfg.environment("default").mode == "monitor"  # new installs only watch
    with pytest.raises(ConfigError, match="not found"):
        config.load(environ={}, required=True)


def test_named_file_must_exist(tmp_path):
    with pytest.raises(ConfigError, match="absent.toml: config file not found"):
        config.load(environ={"RECOVERY_CONFIG": str(tmp_path / "absent.toml")})


@pytest.mark.parametrize("text, key", [
    ("[agent]\npoll_intervl = 3\n", "agent.poll_intervl"),
    ("[agnet]\n", "agnet"),
    ("[agent]\npoll_interval = 'soon'\n", "agent.poll_interval"),
    ("[agent]\npoll_interval = 0\n", "agent.poll_interval"),
    ("[scheduler]\nbackend = 'slurmrestd'\n", "scheduler.backend"),
    ("[scheduler]\ncommand_timeout = true\n", "scheduler.command_timeout"),
    ("[environments.prod]\nmode = 'yolo'\n", "environments.prod.mode"),
    ("[environments.prod]\nmax_restarts = 5000\n", "environments.prod.max_restarts"),
    ("[environments.prod]\nmax_restarts = '3'\n", None),  # a digit string is accepted
    ("[environments.prod]\nretries = 3\n", "environments.prod.retries"),
    ("[environments.'bad name']\n", "environments.bad name"),
    ("[agent]\ncluster = 12\n", "agent.cluster"),
])
def test_bad_values_name_the_key(tmp_path, text, key):
    path = write(tmp_path, text)
    if key is None:
        assert config.load(path, environ={}).environment("prod").max_restarts == 3
        return
    with pytest.raises(ConfigError) as info:
        config.load(path, environ={})
    assert key in str(info.value) and str(path) in str(info.value)


def test_invalid_toml(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        config.load(write(tmp_path, "[agent\n"), environ={})


def test_environment_overrides_file(tmp_path):
    path = write(tmp_path, "[scheduler]\nbackend = 'pyslurm'\n[agent]\npoll_interval = 5\n")
    cfg = config.load(path, environ={"RECOVERY_SCHEDULER_BACKEND": "cli",
                                     "RECOVERY_AGENT_POLL_INTERVAL": "500ms"})
    assert cfg.scheduler.backend == "cli" and cfg.agent.poll_interval == 0.5
    with pytest.raises(ConfigError, match="RECOVERY_SCHEDULER_BACKEND"):
        config.load(path, environ={"RECOVERY_SCHEDULER_BACKEND": "nope"})


def test_config_is_frozen():
    cfg = config.Config()
    with pytest.raises(AttributeError):
        cfg.agent.cluster = "x"  # type: ignore[misc]


@pytest.mark.parametrize("text, seconds", [
    (90, 90.0), ("90s", 90.0), ("20m", 1200.0), ("2h", 7200.0), ("1d", 86400.0),
    ("250ms", 0.25), (" 3 ", 3.0),
])
def test_durations(text, seconds):
    assert config.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "ten", "5 weeks", "-3s", True])
def test_bad_durations(text):
    with pytest.raises(ConfigError):
        config.parse_duration(text, "hang")


def test_every_key_is_documented_in_the_example():
    text = EXAMPLE.read_text()
    from dataclasses import fields
    for section, cls in config.SECTIONS.items():
        for f in fields(cls):
            assert f"\n{f.name} = " in text, f"{section}.{f.name} missing from etc/recovery.toml"
            assert f.metadata.get("doc"), f"{section}.{f.name} has no doc text"
    for f in fields(config.EnvironmentConfig):
        assert f"\n{f.name} = " in text


def test_hooks_light_reader_agrees_with_the_config_model(tmp_path):
    """slurm_hooks.settings reads [hooks] without the full model: same keys,
    same defaults, same values from the example file."""
    from dataclasses import asdict

    from slurm_hooks import settings
    assert settings.DEFAULTS == asdict(config.HooksConfig())
    light = settings.load({"RECOVERY_CONFIG": str(EXAMPLE)})
    full = config.load(EXAMPLE, environ={}).hooks
    assert light.problems == []
    for key in settings.DEFAULTS:
        assert getattr(light, key) == getattr(full, key), key


def test_hooks_light_reader_fails_open(tmp_path):
    from slurm_hooks import settings
    path = write(tmp_path, "[hooks]\ntimeout = 'soon'\npreflight = 'always'\nbogus = 1\n"
                           "expected_gpus = 8\n")
    light = settings.load({"RECOVERY_CONFIG": str(path)})
    assert light.timeout == 0.5 and light.preflight == "report" and light.expected_gpus == 8
    assert len(light.problems) == 3
    broken = settings.load({"RECOVERY_CONFIG": str(write(tmp_path, "[hooks\n"))})
    assert broken.agent_url == settings.DEFAULTS["agent_url"] and broken.problems
    missing = settings.load({"RECOVERY_CONFIG": str(tmp_path / "nope.toml")})
    assert "not found" in missing.problems[0]


def test_float_keys_can_come_from_the_environment():
    from recovery_agent.config import Config, apply_env
    from recovery_agent.errors import ConfigError
    cfg = apply_env(Config(), {"RECOVERY_POLICY_MAX_DRAINED_PERCENT": "25.5"})
    assert cfg.policy.max_drained_percent == 25.5
    import pytest
    with pytest.raises(ConfigError, match="RECOVERY_POLICY_LEMON_THRESHOLD"):
        apply_env(Config(), {"RECOVERY_POLICY_LEMON_THRESHOLD": "lots"})


# -- issue 22, item 3: environments inherit from [environments.default] ----------------

def test_environments_inherit_from_default_then_the_built_in_defaults():
    cfg = config.from_mapping({"environments": {
        "default": {"max_restarts": 5, "hang": "20m", "notify": "mail"},
        "prod": {"hang": "30m"},
        "dev": {"mode": "action", "max_restarts": 1}}})
    prod, dev, default = (cfg.environment(n) for n in ("prod", "dev", "default"))
    assert (prod.max_restarts, prod.hang, prod.notify) == (5, 1800.0, "mail")
    assert (dev.max_restarts, dev.hang, dev.mode) == (1, 1200.0, "action")
    # what default leaves unset is the built-in default everywhere
    built_in = config.EnvironmentConfig()
    assert prod.straggler_factor == dev.straggler_factor == built_in.straggler_factor
    assert default.mode == prod.mode == "monitor"
    # no [environments.default] table: the built-in defaults, as before
    assert config.from_mapping({"environments": {"x": {"hang": 60}}}).environment(
        "x").max_restarts == built_in.max_restarts


def test_an_inherited_bad_value_is_named_where_it_was_written():
    with pytest.raises(ConfigError, match=r"environments\.default\.mode"):
        config.from_mapping({"environments": {"default": {"mode": "loud"},
                                              "prod": {"hang": "1h"}}})


def test_keys_set_to_what_they_inherit_anyway_are_found():
    from recovery_agent.config.loading import inherited_anyway
    raw = {"default": {"mode": "monitor", "max_restarts": 5},
           "prod": {"mode": "monitor", "max_restarts": "5", "hang": "30m"},
           "dev": {"max_restarts": 3, "straggler_factor": 1.5}}
    assert inherited_anyway(raw) == [("prod", "mode", "monitor"), ("prod", "max_restarts", 5),
                                     ("dev", "straggler_factor", 1.5)]
    assert inherited_anyway({"default": {"mode": "monitor"}}) == []   # default's own: fine


def test_check_notes_an_inherited_key_without_failing_or_counting_it(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from recovery_agent.interfaces import check
    from recovery_agent.interfaces.ctl import main as ctl
    path = write(tmp_path, '[environments.default]\nmax_restarts = 5\n'
                           '[environments.prod]\nmax_restarts = 5\nhang = "30m"\n')
    cfg = config.load(path, environ={})
    (note,) = check.config_notes(cfg)
    assert (note.word, note.name) == ("NOTE", "config environments.prod.max_restarts")
    assert "inherits from [environments.default]" in note.detail
    monkeypatch.setattr("recovery_agent.interfaces.ctl.host.run_checks",
                        lambda cfg: [check.Result("config", True, str(path)),
                                     *check.config_notes(cfg)])
    result = CliRunner().invoke(ctl, ["check", "-c", str(path)])
    assert result.exit_code == 0, result.output
    assert "NOTE  config environments.prod.max_restarts" in result.output
    assert result.output.splitlines()[-1] == "1 of 1 checks passed"
    assert check.config_notes(config.load(EXAMPLE, environ={})) == []   # the example is clean


@pytest.mark.parametrize("var, text", [
    ("RECOVERY_HOOKS_TIMEOUT", "1.5s"), ("RECOVERY_HOOKS_TIMEOUT", " 250ms "),
    ("RECOVERY_HOOKS_XID_WINDOW", "01:30:00"), ("RECOVERY_HOOKS_XID_WINDOW", "1h30m"),
    ("RECOVERY_HOOKS_XID_WINDOW", "2-00"), ("RECOVERY_HOOKS_XID_WINDOW", "45"),
    ("RECOVERY_HOOKS_EXPECTED_GPUS", "8"), ("RECOVERY_HOOKS_PREFLIGHT", "enforce"),
    ("RECOVERY_HOOKS_AGENT_URL", "http://agent.example:8787"),
    ("RECOVERY_HOOKS_SPOOL_DIR", "/var/spool/x/{node}"),
])
def test_one_override_rule_for_the_hooks_and_the_agent(var, text):
    """What recovery-ctl show config applies (the agent's load) is what a hook
    with the same environment does (slurm_hooks.settings)."""
    from slurm_hooks import settings
    environ = {"RECOVERY_CONFIG": str(EXAMPLE), var: text}
    light = settings.load(environ)
    full = config.load(EXAMPLE, environ=environ).hooks
    assert light.problems == []
    key = var.removeprefix("RECOVERY_HOOKS_").lower()
    assert getattr(light, key) != settings.load({"RECOVERY_CONFIG": str(EXAMPLE)}).__dict__[key]
    for name in settings.DEFAULTS:
        assert getattr(light, name) == getattr(full, name), name


@pytest.mark.parametrize("var, text", [("RECOVERY_HOOKS_TIMEOUT", "soon"),
                                       ("RECOVERY_HOOKS_EXPECTED_GPUS", "eight"),
                                       ("RECOVERY_HOOKS_PREFLIGHT", "always")])
def test_an_override_the_rule_refuses_is_an_error_in_the_agent_and_logged_by_hooks(var, text):
    from slurm_hooks import settings
    environ = {"RECOVERY_CONFIG": str(EXAMPLE), var: text}
    with pytest.raises(ConfigError, match=var):
        config.load(EXAMPLE, environ=environ)
    light = settings.load(environ)
    (problem,) = light.problems
    assert problem.startswith(f"{var}: ")
    key = var.removeprefix("RECOVERY_HOOKS_").lower()
    assert getattr(light, key) == getattr(config.load(EXAMPLE, environ={}).hooks, key)


def test_proactive_section_loads_and_checks(tmp_path):
    cfg = config.load(write(tmp_path, '[proactive]\nwindow = "2h"\nsbe_per_hour = 25\n'
                                      'slowdown_reasons = 64\n'), environ={})
    assert cfg.proactive.window == 7200.0 and cfg.proactive.sbe_per_hour == 25.0
    assert cfg.proactive.slowdown_reasons == 0x40
    assert config.load(EXAMPLE, environ={}).proactive.retired_pages_limit == 64
    env = config.load(write(tmp_path, ""), environ={"RECOVERY_PROACTIVE_MIN_SPAN": "5m"})
    assert env.proactive.min_span == 300.0
    for bad, key in (('window = "0s"', "proactive.window"),
                     ('min_span = "7h"', "proactive.min_span"),
                     ("sbe_per_hour = 0", "proactive.sbe_per_hour"),
                     ("retired_pages_near = 1.5", "proactive.retired_pages_near"),
                     ("degraded_score = 0", "proactive.degraded_score"),
                     ("nonsense = 1", "proactive.nonsense")):
        with pytest.raises(ConfigError, match=key):
            config.load(write(tmp_path, f"[proactive]\n{bad}\n"), environ={})


def test_the_move_keys_load_and_check(tmp_path):
    cfg = config.load(write(tmp_path, '[proactive]\nmigrate_cooldown = "2h"\n'
                                      'checkpoint_wait = "5m"\n'
                                      '[environments.prod]\nproactive = "action"\n'
                                      '[environments.lab]\nproactive = "off"\n'), environ={})
    assert (cfg.proactive.migrate_cooldown, cfg.proactive.checkpoint_wait) == (7200.0, 300.0)
    assert cfg.environment("prod").proactive == "action"
    assert cfg.environment("lab").proactive == "off"
    assert cfg.environment("default").proactive == "monitor"   # nothing moves unless asked
    built_in = config.load(write(tmp_path, ""), environ={}).proactive
    assert (built_in.migrate_cooldown, built_in.checkpoint_wait) == (6 * 3600.0, 600.0)
    for bad, key in (('[proactive]\nmigrate_cooldown = "-1s"', "proactive.migrate_cooldown"),
                     ('[proactive]\ncheckpoint_wait = "0s"', "proactive.checkpoint_wait"),
                     ('[proactive]\ncheckpoint_wait = "2d"', "proactive.checkpoint_wait"),
                     ('[environments.prod]\nproactive = "yes"', "environments.prod.proactive")):
        with pytest.raises(ConfigError, match=key):
            config.load(write(tmp_path, bad + "\n"), environ={})
