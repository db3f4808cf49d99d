"""What the pack tests share: the shipped packs on Python's re engine (the same
verdicts as hyperscan: tests/unit/test_scanner_engines.py), the rules a set of
lines fires and the verdict attribution gives them."""
from __future__ import annotations

import pytest

from recovery_agent.detect.attribution import attribute
from recovery_agent.detect.patterns import load_rules
from recovery_agent.detect.scanner import Scanner


@pytest.fixture(scope="module")
def scanner() -> Scanner:
    return Scanner(load_rules(), engine="re")


def rules_of(scanner: Scanner, lines: list[str]) -> set[str]:
    return {d.rule for d in scanner.scan_lines(lines)}


def verdict_of(scanner: Scanner, lines: list[str]):
    return attribute(scanner.scan_lines(lines))
