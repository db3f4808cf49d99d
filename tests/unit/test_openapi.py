"""The checked-in OpenAPI document is the one the agent serves."""
from __future__ import annotations

import json
from pathlib import Path

from recovery_agent.interfaces.api import openapi_spec

SPEC = Path(__file__).resolve().parents[2] / "docs" / "openapi.json"


def _operations(spec: dict) -> dict:
    """Each operation's path, method and parameter names (what clients rely on;
    the rest of the document may vary with the FastAPI version)."""
    return {(path, method): sorted(p["name"] for p in op.get("parameters", []))
            for path, ops in spec["paths"].items() for method, op in ops.items()}


def test_checked_in_spec_matches_the_app():
    assert _operations(json.loads(SPEC.read_text())) == _operations(openapi_spec()), (
        "docs/openapi.json is stale: python -m recovery_agent.interfaces.api > docs/openapi.json")


def test_spec_covers_the_advisor_contract():
    paths = json.loads(SPEC.read_text())["paths"]
    for path in ("/v1/recommendations", "/v1/recommendations/{rec_id}/ack",
                 "/v1/recommendations/{rec_id}/complete", "/v1/jobs/{job_id}/timeline",
                 "/v1/hooks/{hook}", "/metrics", "/healthz"):
        assert path in paths, path
