"""The docs cover every config key and every command, match what their generator
writes now, and link only to files that exist."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from recovery_devtools import configref
from slurm_hooks import settings as hook_settings

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
CONFIG_REF = DOCS / "reference-config.md"
CLI_REF = DOCS / "reference-cli.md"

_FENCE = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1[ \t]*$", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`+[^`]*`+")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def links(markdown: str) -> list[str]:
    """Link targets of a Markdown text, outside code blocks and code spans."""
    prose = _CODE_SPAN.sub("", _FENCE.sub("", markdown))
    return _LINK.findall(prose)


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors for the headings of a Markdown text."""
    seen: dict[str, int] = {}
    out = set()
    for line in _FENCE.sub("", markdown).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def test_config_reference_is_current():
    assert CONFIG_REF.read_text() == configref.config_reference(), (
        f"docs/reference-config.md is stale; regenerate it: {configref.CONFIG_COMMAND}")


def test_cli_reference_is_current():
    assert CLI_REF.read_text() == configref.cli_reference(), (
        f"docs/reference-cli.md is stale; regenerate it: {configref.CLI_COMMAND}")


def test_every_config_key_is_in_the_reference():
    text = CONFIG_REF.read_text()
    keys = configref.config_keys()
    assert "environments.NAME.mode" in keys and "hooks.agent_url" in keys
    missing = [key for key in keys if f"`{key}`" not in text]
    assert not missing, (f"undocumented config keys {missing}; regenerate: "
                         f"{configref.CONFIG_COMMAND}")


def test_every_hooks_setting_is_explained_and_documented():
    undocumented = sorted(set(hook_settings.DEFAULTS) - set(configref.HOOK_USAGE))
    assert not undocumented, (f"[hooks] settings {undocumented} need a line in "
                              "tools/recovery_devtools/configref.py HOOK_USAGE")
    assert not set(configref.HOOK_USAGE) - set(hook_settings.DEFAULTS), \
        "HOOK_USAGE explains a setting the hooks no longer read"
    text = CONFIG_REF.read_text()
    assert all(f"`hooks.{key}`" in text for key in hook_settings.DEFAULTS)


def test_generator_refuses_an_unexplained_hooks_setting(monkeypatch):
    monkeypatch.setitem(hook_settings.DEFAULTS, "new_setting", "")
    with pytest.raises(SystemExit, match="new_setting"):
        configref.config_reference()


def test_every_environment_variable_form_is_listed():
    text = CONFIG_REF.read_text()
    for key in configref.config_keys():
        section, _, name = key.partition(".")
        if section != "environments":
            assert f"`{configref.env_var(section, name)}`" in text, key


@pytest.mark.parametrize("program", ["recovery-ctl", "recovery-agent",
                                     "recovery-devcluster"])
def test_every_command_is_in_the_cli_reference(program):
    text = CLI_REF.read_text()
    paths = configref.cli_commands(program)
    assert paths and paths[0] == program
    missing = [path for path in paths
               if not re.search(rf"^#{{2,3}} {re.escape(path)}$", text, re.MULTILINE)]
    assert not missing, (f"commands missing from docs/reference-cli.md: {missing}; "
                         f"regenerate: {configref.CLI_COMMAND}")


def test_ctl_commands_cover_the_known_verbs():
    paths = set(configref.cli_commands("recovery-ctl"))
    for verb in ("show jobs", "show job", "show nodes", "show node", "show recommendations",
                 "show config", "mode", "exclude", "include", "ack", "cancel", "audit",
                 "report", "check", "watchdog", "patterns test"):
        assert f"recovery-ctl {verb}" in paths, verb


def test_every_ctl_command_has_help_with_an_example():
    import click
    lacking = [path for path, cmd, _ in configref.walk(
        dict(configref._programs())["recovery-ctl"], "recovery-ctl")
        if not isinstance(cmd, click.Group) and "Example" not in (cmd.help or "")]
    assert not lacking, f"commands without help and an example: {lacking}"


def test_link_finder_skips_code():
    text = ("[a](install.md) `[b](nope.md)` ![c](img.png)\n"
            "```\n[d](nope2.md)\n```\n[e](https://x.org) [f](#top)\n")
    assert links(text) == ["install.md", "img.png", "https://x.org", "#top"]
    assert anchors("# Top\n## recovery-ctl show jobs\n## Top\n") == {
        "top", "recovery-ctl-show-jobs", "top-1"}


def test_relative_links_in_docs_resolve():
    pages = sorted(DOCS.glob("*.md"))
    assert {"install.md", "rollout.md", "users.md", "operations.md", "extending.md",
            "reference-config.md", "reference-cli.md"} <= {p.name for p in pages}
    broken = []
    for page in pages:
        text = page.read_text()
        for target in links(text):
            if _SCHEME.match(target):
                continue
            path, _, fragment = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif fragment and dest.suffix == ".md" and fragment not in anchors(
                    dest.read_text()):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, "broken links in docs/: " + "; ".join(broken)


_TEST_REF = re.compile(r"`(tests/[\w/]+\.py)?(::[\w]+(?:\[[^\]`]*\])?)?`")


def test_every_test_the_threat_model_names_exists():
    """docs/security.md names the test that holds each boundary: each must exist
    (``tests/x.py::test_y``, or ``::test_y`` after a file named before it)."""
    text = (DOCS / "security.md").read_text()
    current, missing, named = None, [], 0
    for match in _TEST_REF.finditer(text):
        path, name = match.group(1), match.group(2)
        if path:
            current = REPO / path
            if not current.is_file():
                missing.append(path)
                continue
        if name and current is not None and current.is_file():
            named += 1
            func = name[2:].split("[", 1)[0]
            if not re.search(rf"^(?:async )?def {func}\(", current.read_text(), re.M):
                missing.append(f"{current.relative_to(REPO)}::{func}")
    assert named >= 40, "the threat model should name its tests"
    assert not missing, f"docs/security.md names tests that do not exist: {missing}"


def test_accuracy_report_is_current():
    """docs/accuracy.md is the held-out score of the packs as they are now."""
    from recovery_devtools import accuracy
    assert (DOCS / "accuracy.md").read_text() == accuracy.report(), \
        "regenerate: python -m recovery_devtools.accuracy > docs/accuracy.md"


def test_coverage_index_is_current():
    """docs/coverage.md's index lists exactly the shipped rules, as they are."""
    from recovery_devtools import accuracy
    text = (DOCS / "coverage.md").read_text()
    assert accuracy.INDEX_MARK in text
    assert text == accuracy.coverage_page(text), \
        "regenerate: python -m recovery_devtools.accuracy --coverage"


def test_the_skip_list_is_the_held_out_sources_and_no_tune_one(capsys):
    """What a rule author or research helper skips: every held-out row's
    source once, none of the tune half's (the halves are split by source)."""
    import json
    from recovery_devtools import accuracy
    listed = accuracy.heldout_sources()
    rows = [json.loads(line) for line in accuracy.HELDOUT.read_text().splitlines()
            if line.strip()]
    assert set(listed) == {r["source"].strip() for r in rows} and len(listed) == len(set(listed))
    tune = accuracy.CORPUS / "public_tune.jsonl"
    assert not set(listed) & {json.loads(line)["source"].strip()
                              for line in tune.read_text().splitlines() if line.strip()}
    assert accuracy.main(["--skip-list"]) == 0
    assert capsys.readouterr().out.splitlines() == listed
    # a mistyped option says so, and writes nothing
    assert accuracy.main(["--skiplist"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "unknown arguments: --skiplist" in out.err


def test_coverage_names_only_real_rules():
    from recovery_agent.detect.patterns import load_rules
    ids = {rule.id for rule in load_rules()}
    packs = {rule.id.split(".")[0] for rule in load_rules()}
    head = (DOCS / "coverage.md").read_text().split("<!-- every rule", 1)[0]
    named = {n for n in re.findall(r"`([a-z0-9]+\.[a-z0-9_]+)`", head)
             if n.split(".")[0] in packs}
    assert named and named <= ids, sorted(named - ids)
