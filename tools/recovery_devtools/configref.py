"""Reference docs generated from the code, so that they cannot drift.

* the config reference: every key of every section in ``config.SECTIONS``,
  every ``[environments.NAME]`` key and every ``[hooks]`` setting the node hooks
  read (``slurm_hooks.settings.DEFAULTS``), with its type, default, environment
  variable and help text;
* the CLI reference: ``--help`` of every command of ``recovery-ctl``,
  ``recovery-agent`` and ``recovery-devcluster``, by walking their click trees.

Regenerate both (``tests/unit/test_docs.py`` fails when they are stale)::

    python -m recovery_devtools.configref > docs/reference-config.md
    python -m recovery_devtools.configref --cli > docs/reference-cli.md
"""
from __future__ import annotations

import sys
import textwrap
from dataclasses import MISSING, Field, fields
from typing import Any, Iterator

import click

from recovery_agent import config
from recovery_agent.agent import main as agent
from recovery_agent.interfaces.ctl import main as ctl
from slurm_hooks import overrides
from slurm_hooks import settings as hook_settings

from .devcluster.cli import main as devcluster

CONFIG_COMMAND = "python -m recovery_devtools.configref > docs/reference-config.md"
CLI_COMMAND = "python -m recovery_devtools.configref --cli > docs/reference-cli.md"
HELP_WIDTH = 80
_TYPES = {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}

# How the node hooks use each [hooks] setting (slurm_hooks/report.py, delivery.py,
# kmsg.py, gpu.py). A setting added to slurm_hooks.settings.DEFAULTS without an
# entry here stops the generator, and so fails tests/unit/test_docs.py.
HOOK_USAGE: dict[str, str] = {
    "agent_url": "Each hook POSTs its report to `<agent_url>/v1/hooks/prolog`, "
                 "`/epilog` or `/health`; http:// and https:// are accepted. On compute "
                 "nodes this must name the agent host as they reach it, not 127.0.0.1.",
    "timeout": "Bounds the POST (connect and answer). A report the agent did not "
               "take in time is spooled, so a slow agent costs a job start at most "
               "this long.",
    "spool_dir": "One file per undelivered report, written atomically. Every hook run "
                 "first replays the spool, oldest first (at most 50 files or 2 s per "
                 "run). Unparseable files go to `corrupt/`, bodies the agent rejects "
                 "to `rejected/`; nothing is deleted before the agent stored it. "
                 "Created when needed.",
    "log_file": "One line per hook run (hook, job, attempt, GPU count, XIDs, delivery "
                "outcome) and every warning. The directory is created when needed; if "
                "the file cannot be opened the hook logs to stderr.",
    "kernel_log": "`journal` runs `journalctl -k`, `kmsg` reads `/dev/kmsg`, "
                  "`file:PATH` reads the tail of a file. An unreadable source is "
                  "logged and the report carries no XIDs.",
    "xid_window": "The epilog looks back to the job's start (noted by the prolog), "
                  "else this window; the health check uses this window. With preflight "
                  "on, the prolog scans the whole kernel log but sends only XIDs inside "
                  "this window, plus fatal ones of any age.",
    "nvml_library": "Preloaded with ctypes before pynvml initialises NVML.",
    "gpu_state_file": "Exported to the fake NVML library as `RECOVERY_FAKE_NVML_STATE`.",
    "expected_gpus": "Used only by the preflight verdict (prolog and health check): "
                     "NVML failing or showing fewer GPUs is a fault.",
    "preflight": "The prolog and the health check add a preflight verdict to their "
                 "reports: fatal XIDs, too few GPUs, a lost GPU, a row-remap failure. "
                 "With `enforce` the prolog exits 1 on a fault; every other failure "
                 "inside a hook still exits 0.",
    "munge_socket": "Reports are signed with a munge credential whose payload is the "
                    "body's SHA-256; if signing fails the report is spooled.",
}

OTHER_VARIABLES = (
    ("RECOVERY_CONFIG", "recovery-agent, recovery-ctl, the node hooks",
     "The config file, instead of /etc/slurm-recovery/recovery.toml."),
    ("RECOVERY_URL", "recovery-ctl", "The agent's API, as `--url` (reads and changes)."),
    ("RECOVERY_DEVCLUSTER_DIR", "recovery-devcluster",
     "The dev cluster's state dir, as `--state-dir`."),
)
HOOK_SCRIPTS = ("recovery-prolog", "recovery-epilog", "recovery-healthcheck")


# -- the config reference ------------------------------------------------------

def _human_duration(seconds: float) -> str:
    if seconds == 0:
        return "0"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        count = seconds / size
        if float(count).is_integer() and (count > 1 or (count == 1 and unit != "m")):
            return f"{int(seconds / size)}{unit}"
    millis = seconds * 1000
    return f"{int(millis)}ms" if float(millis).is_integer() else f"{seconds:g}s"


def _toml(value: Any, duration: bool = False) -> str:
    """``value`` as it would be written in recovery.toml."""
    if duration:
        text = _human_duration(float(value))
        return text if text == "0" else f'"{text}"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    text = str(value)
    if "\\" in text and "'" not in text and "\n" not in text:
        return f"'{text}'"
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _default(spec: Field) -> Any:
    if spec.default is not MISSING:
        return spec.default
    return spec.default_factory()  # type: ignore[misc]


def _kind(spec: Field) -> str:
    if spec.metadata.get("duration"):
        return "duration"
    return _TYPES.get(str(spec.type), str(spec.type))


def _md(text: str) -> str:
    """Help text as Markdown prose: no accidental emphasis or HTML tags."""
    return text.replace("*", "\\*").replace("<", "&lt;").replace(">", "&gt;")


def env_var(section: str, key: str) -> str:
    return overrides.variable(section, key)


def _entry(name: str, spec: Field, env: str | None, usage: str = "") -> list[str]:
    default = _toml(_default(spec), bool(spec.metadata.get("duration")))
    where = f"environment `{env}`" if env else "no environment variable"
    head = f"- **`{name}`**: {_kind(spec)}; {where}"
    lines = []
    if len(default) > 48:
        lines += [head + ". Default:", "", "  ```toml", f"  {default}", "  ```", ""]
    else:
        lines.append(f"{head}; default `{default}`.")
    lines.append(f"  {_md(spec.metadata.get('doc', '').strip())}")
    if usage:
        lines.append(f"  *In the hooks:* {usage}")
    return lines


def config_keys() -> list[str]:
    """Every documented key, dotted: ``agent.cluster``, ``environments.NAME.mode``,
    ``hooks.<setting>`` (including settings only the hooks read)."""
    keys = [f"{s}.{f.name}" for s, cls in config.SECTIONS.items() for f in fields(cls)]
    keys += [f"environments.NAME.{f.name}" for f in fields(config.EnvironmentConfig)]
    keys += [f"hooks.{k}" for k in hook_settings.DEFAULTS if f"hooks.{k}" not in keys]
    return keys


_INTRO = f"""\
# Configuration reference

<!-- Generated from recovery_agent/config/schema.py and slurm_hooks/settings.py by
     `{CONFIG_COMMAND}`.
     Do not edit by hand: tests/unit/test_docs.py fails when this file is stale. -->

One TOML file configures the agent, `recovery-ctl` and the node hooks:
`/etc/slurm-recovery/recovery.toml`, or the file named by `RECOVERY_CONFIG`. The
same file can be copied to every host; each program reads the sections it needs.
A commented example is [`etc/recovery.toml`](../etc/recovery.toml).

* **Order.** The file, then `RECOVERY_<SECTION>_<KEY>` environment variables, then
  command-line flags (`recovery-agent --bind/--port`), into one frozen object.
  Without a file (and without `RECOVERY_CONFIG`) the built-in defaults apply:
  monitor mode everywhere.
* **Strict.** An unknown section, an unknown key or a bad value stops the agent
  and `recovery-ctl` with a message that names the key. `recovery-ctl check` and
  `recovery-ctl show config` show what was loaded.
* **Durations** are a number with a unit (`500ms`, `90s`, `1.5h`, `1d`), several
  whole units largest first (`1h30m`, `2d4h`), or Slurm's time forms `MM:SS`,
  `HH:MM:SS`, `D-HH`, `D-HH:MM`, `D-HH:MM:SS` (`"01:30:00"`, `"2-00"`). A bare
  number (`90`, `0.5`) is **seconds**, as it always was here; Slurm's `--time`
  reads a bare number as minutes, so write `30m` or `"30:00"` for minutes.
* **Lists** (`api.hook_uids`, `agent.log_roots`, ...) are comma-separated strings.

## Environment variables

Every key of the sections below, except `[environments.NAME]`, can be set from the
environment as `RECOVERY_<SECTION>_<KEY>`, upper case, e.g.
`RECOVERY_SCHEDULER_BACKEND=cli` or `RECOVERY_POLICY_DECISION_TIMEOUT=90s`. Values
are parsed as in the file (`true`/`false`, `1`/`0`, `yes`/`no` for booleans) and
checked the same way; an error names the variable. Environments have no variable
form: change their mode at run time with `recovery-ctl mode ENV MODE`. The node
hooks apply `RECOVERY_HOOKS_*` by the same rule (`slurm_hooks/overrides.py`), so
`recovery-ctl show config` run with a hook's environment shows what that hook does.
Slurm starts the hooks with an environment of its own making, so such a variable
reaches them only from their wrapper (`prolog.sh`, `epilog.sh`, `healthcheck.sh`):
a job's environment never does. A hook logs a variable it cannot read, and keeps
the file's value.

| variable | read by | meaning |
|---|---|---|
""" + "".join(f"| `{v}` | {who} | {what} |\n" for v, who, what in OTHER_VARIABLES)

_SECTION_NOTES = {
    "hooks": """\
Read by `recovery-prolog`, `recovery-epilog` and `recovery-healthcheck` on the
compute nodes, with a reader of their own (`slurm_hooks/settings.py`) that keeps
the job start path light. It fails open: a missing file gives the defaults, and
an unknown key or a bad value is logged in the hook log and replaced by its
default, never fatal. The agent and `recovery-ctl check` validate the same
section strictly. The `RECOVERY_HOOKS_*` variables below apply to the hooks as
to the agent (set them in the hook wrappers). `{node}` in a path is replaced by
the node's name (e.g. `spool_dir = "/var/spool/slurm-recovery/{node}"` on a
shared file system).
""",
    "sources": """\
External stores (Prometheus/VictoriaMetrics with DCGM-exporter series, Grafana
Loki, VictoriaLogs). An empty URL leaves that source off. Credentials are read
from the named files, never written in this file. `recovery-ctl check --sources`
probes every configured source against the cluster's nodes and running jobs.
""",
}

_ENVIRONMENTS = """\
## `[environments.NAME]`

An environment is a named policy; a job names one in its directive
(`--recovery=prod:action`, see [users.md](users.md)). Names match
`[A-Za-z0-9_-]{1,64}`. `[environments.default]` always exists; a job naming an
environment the file does not define gets `default`.

* **Inheritance.** `[environments.default]` starts from the built-in defaults
  below. Every other `[environments.NAME]` starts from `[environments.default]`
  as the file sets it, then the built-in defaults: set a key once in `default`
  and only what differs in the others. With `default` setting `max_restarts = 5`
  and `[environments.prod]` setting only `hang = "30m"`, prod has
  `max_restarts = 5`. `recovery-ctl show config` prints each environment whole;
  `recovery-ctl check` prints a NOTE (never a failure) for a key set to the value
  it would inherit from `default` anyway, since such a key no longer follows a
  later change of `default`.
* **Run-time mode.** `recovery-ctl mode NAME MODE` overrides `mode` at run time
  (stored by the agent, audited with who, when and why); it wins over the file
  until `recovery-ctl mode NAME --clear` gives the file's back. `recovery-ctl
  show config` says where each environment's mode comes from.
"""


def config_reference() -> str:
    """docs/reference-config.md."""
    missing = sorted(set(hook_settings.DEFAULTS) - set(HOOK_USAGE))
    if missing:
        raise SystemExit(f"configref: document the hooks setting(s) {', '.join(missing)} "
                         "in tools/recovery_devtools/configref.py HOOK_USAGE")
    out = [_INTRO]
    for section, cls in config.SECTIONS.items():
        out += [f"## `[{section}]`", ""]
        if section in _SECTION_NOTES:
            out += [_SECTION_NOTES[section]]
        specs = {f.name: f for f in fields(cls)}
        for name, spec in specs.items():
            usage = HOOK_USAGE.get(name, "") if section == "hooks" else ""
            out += _entry(f"{section}.{name}", spec, env_var(section, name), usage)
        if section == "hooks":
            for name in hook_settings.DEFAULTS:
                if name not in specs:   # read by the hooks only
                    out += [f"- **`hooks.{name}`**: default "
                            f"`{_toml(hook_settings.DEFAULTS[name])}`; read by the "
                            "hooks only.", f"  {HOOK_USAGE[name]}"]
        out.append("")
    out += [_ENVIRONMENTS]
    for spec in fields(config.EnvironmentConfig):
        out += _entry(f"environments.NAME.{spec.name}", spec, None)
    return "\n".join(out).rstrip() + "\n"


# -- the CLI reference ---------------------------------------------------------

def _programs() -> list[tuple[str, click.Command]]:
    return [("recovery-ctl", ctl), ("recovery-agent", agent),
            ("recovery-devcluster", devcluster)]


def walk(command: click.Command, name: str, parent: click.Context | None = None
         ) -> Iterator[tuple[str, click.Command, click.Context]]:
    """(full command path, command, context) for a command and all below it."""
    settings = dict(command.context_settings) if parent is None else {}
    ctx = click.Context(command, info_name=name, parent=parent,
                        terminal_width=HELP_WIDTH, max_content_width=HELP_WIDTH, **settings)
    yield ctx.command_path, command, ctx
    if isinstance(command, click.Group):
        for sub in command.list_commands(ctx):
            yield from walk(command.commands[sub], sub, ctx)


def cli_commands(program: str = "recovery-ctl") -> list[str]:
    """Every command path of one program: ``recovery-ctl show jobs``, ..."""
    command = dict(_programs())[program]
    return [path for path, _, _ in walk(command, program)]


def cli_reference() -> str:
    """docs/reference-cli.md."""
    out = ["# Command-line reference", "",
           f"<!-- Generated from the click commands by `{CLI_COMMAND}`.",
           "     Do not edit by hand: tests/unit/test_docs.py fails when this file is "
           "stale. -->", "",
           _fill("Every command of `recovery-ctl` (operators), `recovery-agent` (the "
                 "service) and `recovery-devcluster` (a local test cluster), with its "
                 "`--help`. Most `recovery-ctl` commands read from the store file "
                 "(`--db`, or the config's store when readable) or from the agent's API "
                 "(`--url`); changes go to the API signed with munge. See "
                 "[operations.md](operations.md) and [rollout.md](rollout.md) for how "
                 "they fit together."), ""]
    programs = _programs()
    for program, command in programs:
        paths = [path for path, _, _ in walk(command, program)]
        out.append(f"- `{program}`: " + ", ".join(f"[`{p}`](#{_anchor(p)})"
                                                   for p in paths))
    out += [f"- `{name}`: run by Slurm, see [Node hooks](#node-hooks)" for name in HOOK_SCRIPTS]
    out.append("")
    for program, command in programs:
        for path, cmd, ctx in walk(command, program):
            level = "##" if path == program else "###"
            out += [f"{level} {path}", "", "```text", cmd.get_help(ctx).rstrip(), "```", ""]
    out += ["## Node hooks", "",
            _fill("`" + "`, `".join(HOOK_SCRIPTS) + "` take no arguments. Slurm runs them "
            "as `Prolog`, `Epilog` and `HealthCheckProgram` (see "
            "[install.md](install.md)); they read `[hooks]` from `RECOVERY_CONFIG` or "
            "/etc/slurm-recovery/recovery.toml and the job from Slurm's environment. "
            "The prolog and epilog return at once for a job that did not opt in. "
            "Each exits 0 whatever fails inside, except the prolog on a preflight fault "
            "with `hooks.preflight = \"enforce\"` (exit 1: Slurm drains the node and "
            "requeues the job)."), ""]
    return "\n".join(out).rstrip() + "\n"


def _fill(text: str) -> str:
    return textwrap.fill(text, width=88, break_long_words=False, break_on_hyphens=False)


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading made of words, spaces and dashes."""
    return heading.lower().replace(" ", "-")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args not in ([], ["--cli"]):
        print("usage: python -m recovery_devtools.configref [--cli]", file=sys.stderr)
        return 2
    sys.stdout.write(cli_reference() if args else config_reference())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
