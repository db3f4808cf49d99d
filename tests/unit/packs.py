"""What the pack tests share: the shipped packs on Python's re engine (the same
verdicts as hyperscan: tests/unit/test_scanner_engines.py), the rules a set of
lines fires and the verdict attribution gives them (bare, or with the context
the lines themselves carry, as ``recovery-ctl patterns score`` judges them)."""
from __future__ import annotations

import pytest

from recovery_agent.detect.attribution import attribute
from recovery_agent.detect.context import context_from_lines
from recovery_agent.detect.evidence import all_detections
from recovery_agent.detect.patterns import load_rules
from recovery_agent.detect.scanner import Scanner


@pytest.fixture(scope="module")
def scanner() -> Scanner:
    return Scanner(load_rules(), engine="re")


def rules_of(scanner: Scanner, lines: list[str]) -> set[str]:
    return {d.rule for d in scanner.scan_lines(lines)}


def verdict_of(scanner: Scanner, lines: list[str]):
    return attribute(scanner.scan_lines(lines))


def scored_verdict(scanner: Scanner, lines: list[str]):
    """The verdict as ``patterns score`` gives it: with the lines' own context."""
    return attribute(scanner.scan_lines(lines, source="t"), context_from_lines(lines))


def fired_rules(scanner: Scanner, lines: list[str]) -> list[str]:
    """The rules that fire, in order, after the context's demotions (a teardown's
    exits, information-only lines do not fire)."""
    context = context_from_lines(lines)
    return [d.rule for d in all_detections(scanner.scan_lines(lines, source="t"), context)
            if d.severity != "info"]
