"""The checked-in OpenAPI document is the one the agent serves, and it is a
complete contract: security, request bodies, typed answers, every status code
served, cursor paging, the package's version."""
from __future__ import annotations

import json
from importlib import metadata
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


# -- issue 17: a complete contract ----------------------------------------------------
LIVE = openapi_spec()
OPERATIONS = [(path, method, op) for path, ops in LIVE["paths"].items()
              for method, op in ops.items()]


def _resolve(spec: dict, schema: dict) -> dict:
    ref = schema.get("$ref", "")
    return spec["components"]["schemas"][ref.rsplit("/", 1)[1]] if ref else schema


def test_the_version_is_the_packages():
    assert LIVE["info"]["version"] == metadata.version("slurm-recovery")
    assert json.loads(SPEC.read_text())["info"]["version"] == LIVE["info"]["version"]


def test_security_schemes_and_each_operations_security():
    schemes = LIVE["components"]["securitySchemes"]
    assert schemes["munge"] == {**schemes["munge"], "type": "http", "scheme": "munge"}
    assert schemes["bearer"] == {**schemes["bearer"], "type": "http", "scheme": "bearer"}
    for path, method, op in OPERATIONS:
        assert "security" in op, (method, path)
        if method == "post":
            assert op["security"] == [{"munge": []}], path   # signed over the body
    reads = LIVE["paths"]["/v1/jobs"]["get"]["security"]
    assert {"bearer": []} in reads and {"munge": []} in reads
    assert LIVE["paths"]["/healthz"]["get"]["security"] == []


def test_every_post_documents_its_body():
    posts = [(path, op) for path, method, op in OPERATIONS if method == "post"]
    assert len(posts) == 8
    for path, op in posts:
        schema = op["requestBody"]["content"]["application/json"]["schema"]
        assert _resolve(LIVE, schema)["type"] == "object", path
    complete = LIVE["paths"]["/v1/recommendations/{rec_id}/complete"]["post"]
    body = _resolve(LIVE, complete["requestBody"]["content"]["application/json"]["schema"])
    assert body["required"] == ["outcome"]
    assert body["properties"]["outcome"]["enum"] == ["done", "failed"]
    assert "detail" in body["properties"]
    for path, field in (("/v1/nodes/{name}/exclude", "reason"),
                        ("/v1/environments/{env}/mode", "mode"),
                        ("/v1/environments/{env}/mode", "reason"),
                        ("/v1/environments/{env}/mode/clear", "reason"),
                        ("/v1/nodes/{name}/include", "reason"),
                        ("/v1/recommendations/{rec_id}/ack", "reason"),
                        ("/v1/recommendations/{rec_id}/cancel", "reason")):
        schema = LIVE["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert field in _resolve(LIVE, schema["schema"])["properties"], path


def test_every_operation_has_a_typed_answer():
    for path, method, op in OPERATIONS:
        ok = op["responses"].get("200") or op["responses"]["201"]
        ((media, content),) = ok["content"].items()
        schema = _resolve(LIVE, content["schema"])
        assert schema and schema != {"type": "object"}, (method, path)
        if media == "application/json":
            assert schema.get("properties") or schema.get("anyOf"), (method, path)
    metrics = LIVE["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    node = LIVE["components"]["schemas"]["Node"]["properties"]
    assert node["strikes"]["type"] == "array" and node["drained_by_us"]["type"] == "boolean"
    assert node["health"]["enum"] == ["ok", "suspect", "drained", "excluded"]


STATUS_CODES = {
    ("/v1/jobs", "get"): {200, 401, 422, 503},
    ("/v1/jobs/{job_id}", "get"): {200, 401, 403, 404, 503},
    ("/v1/nodes/{name}", "get"): {200, 401, 404, 503},
    ("/v1/nodes/{name}/exclude", "post"): {200, 400, 401, 403, 413, 503},
    ("/v1/environments/{env}/mode", "post"): {200, 400, 401, 403, 404, 413, 503},
    ("/v1/environments/{env}/mode/clear", "post"): {200, 400, 401, 403, 404, 413, 503},
    ("/v1/audit", "get"): {200, 401, 404, 422, 503},
    ("/v1/recommendations", "get"): {200, 400, 401, 404, 422, 503},
    ("/v1/recommendations/{rec_id}/ack", "post"): {200, 400, 401, 403, 404, 409, 413, 422,
                                                   503},
    ("/v1/recommendations/{rec_id}/complete", "post"): {200, 400, 401, 403, 404, 409, 413,
                                                        422, 503},
    ("/v1/recommendations/{rec_id}/cancel", "post"): {200, 400, 401, 403, 404, 409, 413,
                                                      422, 503},
    ("/v1/hooks/{hook}", "post"): {200, 201, 400, 401, 403, 404, 413, 503},
    ("/metrics", "get"): {200, 401, 503},
    ("/healthz", "get"): {200, 503},
}


def test_the_status_codes_each_operation_serves_are_listed():
    for (path, method), codes in STATUS_CODES.items():
        listed = {int(c) for c in LIVE["paths"][path][method]["responses"]}
        assert codes <= listed, (method, path, codes - listed)
    for path, method, op in OPERATIONS:
        for code, answer in op["responses"].items():
            if code in ("401", "403", "404", "409", "413") and path.startswith("/v1/") \
                    and path != "/v1/hooks/{hook}":
                schema = answer["content"]["application/json"]["schema"]
                assert _resolve(LIVE, schema)["required"] == ["detail"], (method, path, code)


def test_lists_page_by_cursor():
    for path, key in (("/v1/jobs", "JobList"), ("/v1/recommendations", "RecommendationList")):
        params = {p["name"] for p in LIVE["paths"][path]["get"]["parameters"]}
        assert {"cursor", "limit"} <= params
        assert "next_cursor" in LIVE["components"]["schemas"][key]["properties"]
