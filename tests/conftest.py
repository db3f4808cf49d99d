"""Shared test helpers: where the recorded Slurm output lives."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
SLURM_VERSIONS = ("22.05", "24.11", "26.05")


def slurm_fixture(version: str, name: str) -> dict:
    return json.loads((FIXTURES / "slurm" / version / name).read_text())


@pytest.fixture(params=SLURM_VERSIONS)
def slurm_version(request) -> str:
    return request.param
