"""Durations in Slurm's forms and in units, read alike by the directive, the
config, the hooks' settings and the CLI (slurm_hooks/durations.py)."""
from __future__ import annotations

import datetime
import time

import click
import pytest

from recovery_agent import config
from recovery_agent.errors import ConfigError
from recovery_agent.interfaces.ctl.output import _parse_time
from slurm_hooks import durations, settings, spec

SLURM_FORMS = [
    ("30:00", 1800),          # MM:SS
    ("0:90", 90),             # fields are not range-checked, as in Slurm
    ("00:30:00", 1800),       # HH:MM:SS
    ("1:02:03", 3723),
    ("2-4", 2 * 86400 + 4 * 3600),            # D-HH
    ("1-02:30", 86400 + 2 * 3600 + 30 * 60),  # D-HH:MM
    ("1-00:00:30", 86430),                    # D-HH:MM:SS
]
UNIT_FORMS = [("90s", 90), ("20m", 1200), ("1h30m", 5400), ("2d4h", 187200),
              ("1d2h3m4s", 93784)]
NOT_DURATIONS = ["", "1:2:3:4", "1-", "12:", ":30", "-5", "1-2-3", "30m1h", "1h1h", "1h30",
                 "1:30m", "UNLIMITED", "INFINITE", "-1", "123456789", "1 h", "h", "1.5h"]


@pytest.mark.parametrize("text, seconds", SLURM_FORMS + UNIT_FORMS)
def test_slurm_and_unit_forms(text, seconds):
    assert durations.seconds(text) == seconds


def test_a_bare_number_is_seconds_not_slurms_minutes():
    # the documented rule: the directive and the config always read 45 as 45 s
    assert durations.seconds("45") == 45
    assert spec.parse("prod,hang=45").hang == 45
    assert config.parse_duration("45") == 45.0 and config.parse_duration(45) == 45.0


@pytest.mark.parametrize("text", NOT_DURATIONS)
def test_not_durations(text):
    assert durations.seconds(text) is None


@pytest.mark.parametrize("text, seconds", SLURM_FORMS + UNIT_FORMS)
def test_the_directive_config_and_hooks_read_them_alike(text, seconds):
    assert spec.parse(f"prod,hang={text}").hang == seconds
    assert config.parse_duration(text, "environments.default.hang_timeout") == seconds
    assert config.parse_duration(f" {text} ") == seconds   # TOML strings may carry spaces
    assert settings._coerce("xid_window", text) == seconds


def test_config_keeps_its_decimal_and_millisecond_forms():
    assert config.parse_duration("1.5h") == 5400.0
    assert config.parse_duration("250ms") == 0.25


@pytest.mark.parametrize("text", ["1:2:3:4", "30m1h", "UNLIMITED", "1-"])
def test_config_refuses_what_is_no_duration_naming_the_key(text):
    with pytest.raises(ConfigError, match="hang_timeout: expected a duration"):
        config.parse_duration(text, "hang_timeout")
    assert settings._coerce("timeout", text) is None


def test_the_directive_bounds_hang_so_its_canonical_form_parses_again():
    assert spec.parse("prod,hang=365d").canonical() == "prod,hang=31536000s"
    with pytest.raises(spec.SpecError, match="invalid hang '366d'"):
        spec.parse("prod,hang=366d")
    with pytest.raises(spec.SpecError, match="invalid hang '00:00:00'"):
        spec.parse("prod,hang=00:00:00")


def test_cli_since_takes_the_new_forms_and_refuses_a_bare_clock_time():
    assert abs(_parse_time("1h30m") - (time.time() - 5400)) < 5
    assert abs(_parse_time("0-01:30") - (time.time() - 5400)) < 5
    assert _parse_time("2026-11-29T09:30") == \
        datetime.datetime(2026, 11, 29, 9, 30).timestamp()
    with pytest.raises(click.BadParameter, match="time of day or a duration"):
        _parse_time("09:30")   # sacct reads a time of day: never guess
