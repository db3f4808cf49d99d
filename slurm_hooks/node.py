"""Where a hook runs: the node's name and its per-node paths (spool, log file),
and the hooks' log set up for it; shared by the hooks and the spool's replayer."""
from __future__ import annotations

import logging
import socket
import sys
from collections.abc import Mapping
from pathlib import Path

from . import settings

log = logging.getLogger("slurm_hooks")


def node_path(template: str, node: str) -> str:
    return template.replace("{node}", node) if template else ""


def node_name(environ: Mapping[str, str]) -> str:
    return environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def setup_logging(cfg: settings.Settings, node: str) -> None:
    handler: logging.Handler
    path = node_path(cfg.log_file, node)
    try:
        if not path:
            raise OSError("no log file configured")
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(path)
    except OSError:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s {node} %(process)d %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
