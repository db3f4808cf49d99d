"""The agent's configuration: one TOML file, then ``RECOVERY_*`` environment
variables, then command-line flags, into one frozen object.

Every key is declared once, in :mod:`.schema`, with its type, default and help
text; the example file ``etc/recovery.toml`` and the reference docs are written
from the same declarations. :mod:`.loading` reads and checks them: unknown keys
and bad values are errors naming the key.
"""
from __future__ import annotations

from . import loading, schema
from .loading import apply_env, from_mapping, load, parse_duration
from .schema import (DEFAULT_PROGRESS_PATTERN, MODES, SECTIONS, Config, EnvironmentConfig,
                     HooksConfig)

__all__ = ["DEFAULT_PROGRESS_PATTERN", "MODES", "SECTIONS", "Config", "EnvironmentConfig",
           "HooksConfig", "apply_env", "from_mapping", "load", "loading", "parse_duration",
           "schema"]
