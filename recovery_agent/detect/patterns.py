"""Pattern packs: declarative detection rules in TOML files.

A pack is one ``*.toml`` file holding ``[[rule]]`` tables. The packs shipped
with slurm-recovery live in ``etc/patterns/``; a site adds its own directories
(``recovery-ctl patterns test --patterns-dir DIR``, or the agent config). Every
rule is checked when it loads: a bad regex, an unknown key, a category or
action outside the model's lists, a duplicate id, or an embedded example that
does not behave as stated is a :class:`~recovery_agent.errors.ConfigError`
whose message starts with the file and the rule id.

Keys of one rule (``id``, ``category``, ``regex`` and ``examples.match`` are
required)::

    id          "area.what", unique over every loaded pack
    category    one of model.CATEGORIES
    severity    one of model.SEVERITIES (default "error")
    action      one of model.ACTIONS: what this evidence alone suggests
    role        one of model.ROLES (default "cause"), see attribution
    regex       Python syntax that hyperscan also accepts: no backreferences,
                lookarounds, conditionals, atomic groups or possessive repeats
    priority    integer (default 0); on one line only the hits with the highest
                priority are kept, so generic rules sit below specific ones
    scope       "line" (default) or "traceback": the rule then only classifies
                the last line of a Python traceback
    lookback    0-8 (default 0): when a hit names no pci/gpu, look for one in
                this many preceding lines (kernel messages wrapped over lines)
    action_by_xid  true: the action comes from the XID the line carries
    host_from_prefix  true: the fault is on the node that printed the line, so
                its NCCL prefix (``host:pid:tid [dev]``) names the host
    emitter     who prints the message: "job" (default: the job's own processes,
                their libraries, srun and slurmstepd writing into its output) or
                "system" (only the node's kernel, drivers and system daemons, or
                slurmctld, print it). A "system" message found in a job's own
                output proves nothing about a node: users can print anything
    description free text
    examples.match / examples.no_match   lines the regex must / must not find

Named groups a regex may use: ``host``, ``rank``, ``pci``, ``xid``, ``gpu``.
"""
from __future__ import annotations

import re
import sys
import tomllib
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from re import _constants as sre_c  # type: ignore[attr-defined]
from re import _parser as sre_parse  # type: ignore[attr-defined]
from typing import Any, Iterable

from slurm_hooks import kmsg

from ..errors import ConfigError
from .model import ACTIONS, CATEGORIES, ROLES, SEVERITIES

__all__ = ["GROUPS", "Rule", "load_rules", "load_pack", "shipped_dir", "xid_action", "xid_category"]

GROUPS = frozenset({"host", "rank", "pci", "xid", "gpu"})
SCOPES = ("line", "traceback")
REGEX_FLAGS = re.ASCII   # hyperscan's classes (\w, \d, \s, \b) are ASCII-only
_KEYS = frozenset({"id", "category", "severity", "action", "role", "regex", "priority",
                   "scope", "lookback", "action_by_xid", "host_from_prefix", "description",
                   "emitter", "examples"})
EMITTERS = ("job", "system")
_EXAMPLE_KEYS = frozenset({"match", "no_match"})
_ID = re.compile(r"^[a-z0-9][a-z0-9_]*(?:[.-][a-z0-9_]+)*$")
# Parser nodes hyperscan cannot compile (it has no backtracking).
_UNSUPPORTED = {
    sre_c.ASSERT: "lookahead/lookbehind", sre_c.ASSERT_NOT: "negative lookaround",
    sre_c.GROUPREF: "backreference", sre_c.GROUPREF_EXISTS: "conditional group",
    sre_c.ATOMIC_GROUP: "atomic group", sre_c.POSSESSIVE_REPEAT: "possessive repeat",
}

# -- XIDs ------------------------------------------------------------------------
# NVIDIA's immediate-action bucket for every XID code, as the XID catalog lists
# it (tests/fixtures/corpus/xid_catalog.jsonl, column nvidia_immediate_action;
# tests/unit/test_xid_catalog.py checks this table against it, code by code).
# Codes 162-172 have no bucket there ("").
_BUCKET_CODES = {
    "CONTACT_SUPPORT": (*range(1, 8), 9, 10, 12, *range(15, 25), *range(26, 31),
                        *range(33, 37), 42, 47, *range(49, 54), *range(55, 60), 61, 65, 73,
                        81, 87, 90, 91, *range(111, 119), *range(122, 126), 138, 142),
    "RESTART_APP": (8, 11, 13, 25, 31, 32, *range(39, 42), 60, *range(68, 73),
                    *range(75, 78), 80, *range(82, 87), 88, 89, 94, *range(96, 106),
                    *range(126, 136), 139),
    "IGNORE": (14, 37, 38, 43, 44, 63, 66, 67, 92, 93, *range(106, 109), 121, 137, 141,
               152, 153, 157, 160, 161),
    "RESET_GPU": (46, 62, 64, 95, 109, 110, 119, 120, 136, 140, 143, 155, 156, 158),
    "WORKFLOW_XID_45": (45,), "WORKFLOW_XID_48": (48,), "CHECK_MECHANICALS": (54,),
    "WORKFLOW_NVLINK_ERR": (74,), "UPDATE_SWFW": (78,), "RESTART_BM": (79,),
    "WORKFLOW_NVLINK5_ERR": tuple(range(144, 151)), "RESTART_VM": (151,), "XID_154": (154,),
    "CHECK_UVM": (159,), "": tuple(range(162, 173)),
}
XID_BUCKETS: dict[int, str] = {code: bucket for bucket, codes in _BUCKET_CODES.items()
                               for code in codes}
# What each bucket asks of the job. A reset, a reboot, a hardware or firmware
# check, or an NVLink workflow: the fault stays with the GPU, run the job
# elsewhere. RESTART_APP: the error was contained to the program's context, run
# it again. CONTACT_SUPPORT (codes NVIDIA lists as unused on current GPUs): no
# reading of the cause, so the unexplained-failure answer. IGNORE, CHECK_UVM and
# the two group workflows: nothing on their own (Xid 154 names the recovery the
# driver now wants, Xid 45 the Xid it follows: see xid_action).
BUCKET_ACTIONS = {
    "RESET_GPU": "requeue_exclude", "RESTART_BM": "requeue_exclude",
    "RESTART_VM": "requeue_exclude", "CHECK_MECHANICALS": "requeue_exclude",
    "UPDATE_SWFW": "requeue_exclude", "WORKFLOW_XID_48": "requeue_exclude",
    "WORKFLOW_NVLINK_ERR": "requeue_exclude", "WORKFLOW_NVLINK5_ERR": "requeue_exclude",
    "RESTART_APP": "requeue", "CONTACT_SUPPORT": "requeue",
    "IGNORE": "none", "CHECK_UVM": "none", "XID_154": "none", "WORKFLOW_XID_45": "none",
}
# The program's own faults that the GPU reported (catalog likely_cause "app":
# RESTART_APP or IGNORE with CHECK_APP/CUDA, the Xid 13/31 workflows, XID_137_FLOW):
# a retry repeats them.
APPLICATION_XIDS = frozenset({11, 13, 25, 31, 43, 69, 108, 137})
# Codes without a bucket: power-smoothing notices (162-165) inform, the
# confidential-computing, PCIe, WPR and DBE-detail codes (166-172) are fatal.
_UNBUCKETED_ACTIONS = {**{c: "none" for c in range(162, 166)},
                       **{c: "requeue_exclude" for c in range(166, 173)}}
XID_ACTIONS: dict[int, str] = {
    code: ("stop" if code in APPLICATION_XIDS else
           _UNBUCKETED_ACTIONS[code] if bucket == "" else BUCKET_ACTIONS[bucket])
    for code, bucket in XID_BUCKETS.items()}
# The catalog's job_recovery_action column, bucket by bucket (kmsg.FATAL_XIDS is
# its requeue_exclude_node set; CONTACT_SUPPORT codes are unassigned there).
REQUEUE_XIDS = frozenset(c for c, a in XID_ACTIONS.items()
                         if a == "requeue" and XID_BUCKETS[c] != "CONTACT_SUPPORT")
STOP_XIDS = frozenset(c for c, a in XID_ACTIONS.items() if a == "stop")
QUIET_XIDS = frozenset(c for c, a in XID_ACTIONS.items() if a == "none")
# Xid 45 (ROBUST_CHANNEL_PREEMPTIVE_REMOVAL) since driver 550 names its cause:
# "Ch 00000001 caused by previous Xid 149".
_PREVIOUS_XID = re.compile(r"\bcaused by previous Xid (\d{1,6})\b")


@dataclass(frozen=True)
class Rule:
    """One loaded, checked rule. ``compiled`` is the Python regex (re.ASCII)."""

    id: str
    category: str
    regex: str
    source: str
    severity: str = "error"
    action: str = "none"
    role: str = "cause"
    priority: int = 0
    scope: str = "line"
    lookback: int = 0
    action_by_xid: bool = False
    host_from_prefix: bool = False
    emitter: str = "job"
    description: str = ""
    examples_match: tuple[str, ...] = ()
    examples_no_match: tuple[str, ...] = ()
    compiled: re.Pattern = field(default=None, compare=False, repr=False)  # type: ignore

    @property
    def groups(self) -> frozenset[str]:
        return frozenset(self.compiled.groupindex)


_SHARED_PACKS = ("share", "slurm-recovery", "patterns")


def shipped_dir() -> Path:
    """The directory of the packs shipped with slurm-recovery.

    ``etc/patterns`` next to the source tree (a checkout or an editable
    install); else where the wheel installed them (its data files):
    ``<sys.prefix>/share/slurm-recovery/patterns`` in a virtualenv, ``make
    install`` or the .deb, or wherever the distribution's file list puts them
    (``pip install --user`` or ``--prefix``). When none exists, the
    ``sys.prefix`` path, which the loader then names in its error.
    """
    here = Path(__file__).resolve().parents[2] / "etc" / "patterns"
    if here.is_dir():
        return here
    in_prefix = Path(sys.prefix).joinpath(*_SHARED_PACKS)
    if in_prefix.is_dir():
        return in_prefix
    return _installed_packs() or in_prefix


def _installed_packs() -> Path | None:
    """The packs' directory as recorded in the installed distribution's RECORD."""
    try:
        files = metadata.distribution("slurm-recovery").files or []
    except metadata.PackageNotFoundError:
        return None
    for entry in files:
        if entry.suffix == ".toml" and entry.parts[-4:-1] == _SHARED_PACKS:
            folder = Path(entry.locate()).resolve().parent
            if folder.is_dir():
                return folder
    return None


def load_rules(site_dirs: Iterable[str | Path] = (), *, shipped: bool = True) -> list[Rule]:
    """Every rule of the shipped packs (unless ``shipped=False``), then of each
    site directory, in file-name order. Raises ConfigError on the first problem."""
    dirs = ([shipped_dir()] if shipped else []) + [Path(d) for d in site_dirs]
    rules: list[Rule] = []
    seen: dict[str, str] = {}
    for directory in dirs:
        if not directory.is_dir():
            raise ConfigError(f"{directory}: pattern directory not found")
        for path in sorted(directory.glob("*.toml")):
            for rule in load_pack(path):
                if rule.id in seen:
                    raise ConfigError(f"{path}: rule {rule.id!r}: duplicate id "
                                      f"(also in {seen[rule.id]})")
                seen[rule.id] = str(path)
                rules.append(rule)
    return rules


def load_pack(path: str | Path) -> list[Rule]:
    """The rules of one pack file, each checked (see the module docstring)."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    unknown = set(data) - {"rule", "description"}
    if unknown:
        raise ConfigError(f"{path}: unknown top-level key(s) {sorted(unknown)} "
                          "(expected [[rule]] tables)")
    raw_rules = data.get("rule", [])
    if not isinstance(raw_rules, list):
        raise ConfigError(f"{path}: 'rule' must be an array of tables ([[rule]])")
    rules, ids = [], set()
    for index, raw in enumerate(raw_rules):
        rule = _build(path, index, raw)
        if rule.id in ids:
            raise ConfigError(f"{path}: rule {rule.id!r}: duplicate id")
        ids.add(rule.id)
        rules.append(rule)
    return rules


def _build(path: Path, index: int, raw: Any) -> Rule:
    name = raw.get("id") if isinstance(raw, dict) else None
    where = f"{path}: rule {name!r}" if isinstance(name, str) else f"{path}: rule #{index + 1}"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a table")
    unknown = set(raw) - _KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}")
    for key in ("id", "category", "regex"):
        if not isinstance(raw.get(key), str) or not raw[key]:
            raise ConfigError(f"{where}: '{key}' is required and must be a string")
    if not _ID.match(raw["id"]):
        raise ConfigError(f"{where}: id must look like 'area.what' (lowercase, digits, _ . -)")
    _choice(where, raw, "category", CATEGORIES, None)
    _choice(where, raw, "severity", SEVERITIES, "error")
    _choice(where, raw, "action", ACTIONS, "none")
    _choice(where, raw, "role", ROLES, "cause")
    _choice(where, raw, "scope", SCOPES, "line")
    _choice(where, raw, "emitter", EMITTERS, "job")
    priority = _integer(where, raw, "priority", 0, -100, 100)
    lookback = _integer(where, raw, "lookback", 0, 0, 8)
    by_xid, from_prefix = _flag(where, raw, "action_by_xid"), _flag(where, raw, "host_from_prefix")
    description = raw.get("description", "")
    if not isinstance(description, str):
        raise ConfigError(f"{where}: 'description' must be a string")
    compiled = compile_rule_regex(where, raw["regex"])
    if by_xid and "xid" not in compiled.groupindex:
        raise ConfigError(f"{where}: action_by_xid needs a named group 'xid' in the regex")
    matches, misses = _examples(where, raw.get("examples"))
    rule = Rule(id=raw["id"], category=raw["category"], regex=raw["regex"], source=str(path),
                severity=raw.get("severity", "error"), action=raw.get("action", "none"),
                role=raw.get("role", "cause"), priority=priority,
                scope=raw.get("scope", "line"), lookback=lookback, action_by_xid=by_xid,
                host_from_prefix=from_prefix, emitter=raw.get("emitter", "job"),
                description=description, examples_match=matches, examples_no_match=misses,
                compiled=compiled)
    _check_examples(where, rule)
    return rule


def _choice(where: str, raw: dict, key: str, allowed: tuple, default: str | None) -> None:
    value = raw.get(key, default)
    if value not in allowed:
        raise ConfigError(f"{where}: {key} {value!r} is not one of {', '.join(allowed)}")


def _flag(where: str, raw: dict, key: str) -> bool:
    value = raw.get(key, False)
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: '{key}' must be true or false")
    return value


def _integer(where: str, raw: dict, key: str, default: int, low: int, high: int) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{where}: '{key}' must be an integer from {low} to {high}")
    return value


def compile_rule_regex(where: str, regex: str) -> re.Pattern:
    """Compile a rule's regex, refusing what hyperscan or the scanner cannot run."""
    try:
        compiled = re.compile(regex, REGEX_FLAGS)
        tree = sre_parse.parse(regex, REGEX_FLAGS)
    except re.error as exc:
        raise ConfigError(f"{where}: bad regex: {exc}") from None
    if compiled.flags & (re.MULTILINE | re.DOTALL | re.VERBOSE):
        raise ConfigError(f"{where}: bad regex: only the (?i) flag is allowed")
    problem = _unsupported(tree)
    if problem:
        raise ConfigError(f"{where}: bad regex: {problem} is not supported (hyperscan)")
    extra = set(compiled.groupindex) - GROUPS
    if extra:
        raise ConfigError(f"{where}: bad regex: unknown named group(s) {sorted(extra)} "
                          f"(allowed: {', '.join(sorted(GROUPS))})")
    if compiled.search("") is not None:
        raise ConfigError(f"{where}: bad regex: it matches an empty line")
    return compiled


def _unsupported(tree) -> str | None:
    for op, av in tree:
        if op in _UNSUPPORTED:
            return _UNSUPPORTED[op]
        for sub in _children(op, av):
            found = _unsupported(sub)
            if found:
                return found
    return None


def _children(op, av) -> list:
    """The nested sequences of one parser node (shared with the literal extractor)."""
    if op is sre_c.SUBPATTERN:
        return [av[3]]
    if op in (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT, sre_c.POSSESSIVE_REPEAT):
        return [av[2]]
    if op is sre_c.BRANCH:
        return list(av[1])
    if op in (sre_c.ASSERT, sre_c.ASSERT_NOT):
        return [av[1]]
    if op is sre_c.ATOMIC_GROUP:
        return [av]
    if op is sre_c.GROUPREF_EXISTS:
        return [x for x in av[1:] if x is not None]
    return []


def _examples(where: str, raw: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: 'examples.match' is required (lines the rule must find)")
    unknown = set(raw) - _EXAMPLE_KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) in examples: {sorted(unknown)}")
    out = []
    for key in ("match", "no_match"):
        value = raw.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where}: examples.{key} must be a list of strings")
        out.append(tuple(value))
    if not out[0]:
        raise ConfigError(f"{where}: 'examples.match' needs at least one line")
    return out[0], out[1]


def _check_examples(where: str, rule: Rule) -> None:
    for line in rule.examples_match:
        if rule.compiled.search(line) is None:
            raise ConfigError(f"{where}: example does not match: {line!r}")
    for line in rule.examples_no_match:
        if rule.compiled.search(line) is not None:
            raise ConfigError(f"{where}: no_match example matches: {line!r}")


def xid_action(xid: int, message: str = "", kind: str = "xid") -> str:
    """What an XID (or NVSwitch SXid) event alone suggests for the job.

    The catalog's bucket (:data:`XID_ACTIONS`): ``requeue_exclude`` (the fault
    stays with the GPU), ``requeue`` (contained to the program's context, or a
    code with no reading), ``stop`` (the program's own fault) or ``none``
    (informational: it matters only with a failure it explains). Codes that come
    in groups are read together: an Xid 45 that names the Xid it follows
    ("caused by previous Xid 149") is read as that one; Xid 154 asks for what its
    new recovery action says (:func:`slurm_hooks.kmsg.is_fatal`); a fatal code
    whose text says non-fatal (the NVLink5 codes 144-150) is ``none``. Codes
    beyond the catalog -> ``requeue``; SXids -> ``requeue_exclude`` when fatal,
    else ``none``.
    """
    event = {"xid": xid, "kind": kind, "message": message}
    if kind == "sxid":
        return "requeue_exclude" if kmsg.is_fatal(event) else "none"
    if xid == 45:
        named = _PREVIOUS_XID.search(message)
        if named and int(named.group(1)) != 45:
            return xid_action(int(named.group(1)))
    if kmsg.is_fatal(event):
        return "requeue_exclude"
    if xid in kmsg.FATAL_XIDS:
        return "none"
    return XID_ACTIONS.get(xid, "requeue")


def xid_category(xid: int, action: str, kind: str = "xid", default: str = "gpu_hardware") -> str:
    """The failing layer an XID event names: ``application`` for the codes whose
    catalog cause is the program (:data:`APPLICATION_XIDS`: the GPU trapped the
    program's own bad access or instruction, Xid 13, 31, 43 ...) when the event
    is read as the program's (``action`` ``stop``), else ``default`` (the GPU).
    An SXid is the NVSwitch's, never the program's."""
    if kind == "xid" and action == "stop" and xid in APPLICATION_XIDS:
        return "application"
    return default
