"""The API's OpenAPI contract: the bodies each operation reads and answers, as
pydantic models, the errors it serves, and who may call it.

The models document; they do not parse. Each POST reads its raw body itself
(:func:`~recovery_agent.interfaces.api_v1.read_body`: the munge credential signs
those exact bytes, and a body over the limit is refused before it is read), and
each route answers the service's dicts as they are; the schemathesis test checks
every answer against these models. Rows keep the store's columns, so their
models allow fields they do not name (a column added by a migration is not a
breaking change).
"""
from __future__ import annotations

from typing import Any, Literal, Union

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field

from ..config import MODES
from ..store import Status
from .service import VISIBLE

Mode = Literal[MODES]   # type: ignore[valid-type]
RecStatus = Literal[tuple(s.value for s in Status)]   # type: ignore[valid-type]
Health = Literal["ok", "suspect", "drained", "excluded"]


class _Row(BaseModel):
    """A stored row: the fields named here, and any other column."""

    model_config = ConfigDict(extra="allow")


# -- errors -------------------------------------------------------------------------
class ErrorBody(BaseModel):
    """What a refused call answers (every status but 422, and the hooks')."""

    detail: str = Field(description="Why, in words an operator reads.")


class HookRefusal(BaseModel):
    """What a refused hook report answers."""

    error: str = Field(description="Why the report was not stored.")


# -- request bodies -------------------------------------------------------------------
class ExcludeBody(BaseModel):
    reason: str = Field(pattern=VISIBLE, description="Why the node is kept out of retries "
                                                  "(required; on the timeline and in "
                                                  "the node's health_detail).")
    force: bool = Field(False, description="Exclude a node Slurm does not list (or when "
                                           "Slurm cannot be asked); the answer says forced.")


class ModeBody(BaseModel):
    mode: Mode = Field(description="The environment's new mode.")
    reason: str = Field("", description="Why (kept up to 500 characters, in the audit "
                                        "trail).")


class ReasonBody(BaseModel):
    """An operator change that needs nothing more than, at most, why."""

    reason: str = Field("", description="Why (kept up to 500 characters, in the audit "
                                        "trail).")


class CompleteBody(BaseModel):
    outcome: Literal["done", "failed"] = Field(description="How the site controller's "
                                                           "action ended.")
    detail: str = Field("", description="What happened (kept up to 2000 characters; "
                                        "the recommendation's error when failed).")


class CancelBody(BaseModel):
    reason: str = Field("", description="Why (kept up to 500 characters).")


class SignedBody(BaseModel):
    """Any JSON object (recovery-ctl sends ``{}``): nothing in it is read, but
    the munge credential signs it."""

    model_config = ConfigDict(extra="allow")


class HookJob(_Row):
    job_id: str
    attempt: int = Field(ge=0)
    spec: str = ""


class HookReport(_Row):
    """A node hook's report (recovery-prolog, -epilog, -healthcheck); see
    :func:`recovery_agent.inputs.ingest.validate` for every rule."""

    version: Literal[1]
    hook: Literal["prolog", "epilog", "health"]
    report_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    node: str
    cluster: str
    created: float
    job: HookJob | None = Field(None, description="Required but for health reports.")
    gpus: dict[str, Any]
    xids: list[dict[str, Any]]
    log_lines: list[dict[str, Any]] | None = None
    exit: dict[str, Any] | None = Field(None, description="Required in epilog reports.")
    delivery: dict[str, Any] | None = None


BODIES: tuple[type[BaseModel], ...] = (ExcludeBody, ModeBody, ReasonBody, CompleteBody,
                                       CancelBody, SignedBody, HookReport)


# -- answers --------------------------------------------------------------------------
class Liveness(BaseModel):
    status: Literal["ok"]


class Readiness(BaseModel):
    status: Literal["ok", "degraded", "error"]
    store: str = Field(description="ok, failing or damaged (or the store's error).")
    last_error: Any = None
    watch_errors: int | None = None
    watch_heartbeat_age_s: float | None = None
    watching: bool | None = None


class HookStored(BaseModel):
    status: Literal["stored", "duplicate"]
    id: int = Field(description="The report's row id.")
    job: int | None = Field(description="The job's row id (none for a health report).")


class JobRecord(_Row):
    id: int = Field(description="The store's row id: what cursors page by.")
    cluster: str
    job_id: str
    submit_time: int
    numeric_id: int | None = None
    array_job_id: int | None = None
    array_task_id: int | None = None
    name: str | None = None
    user: str | None = None
    env: str | None = None
    mode: str | None = None
    spec: str | None = None
    state: str | None = None
    restart_count: int | None = None
    first_seen: float | None = None
    last_seen: float | None = None
    effective_mode: str
    category: str | None = Field(description="The category of the verdict that decided "
                                             "the job's last recommendation; the last "
                                             "detection's when it has none.")
    env_known: bool | None = Field(None, description="In a job's detail: false when its "
                                                     "directive names an environment the "
                                                     "config lacks (it runs as default).")


class JobSummary(JobRecord):
    last_detection: str | None = Field(description="The latest verdict's category, else "
                                                   "the latest detection's.")
    last_recommendation: str | None = Field(description="ACTION STATUS of the last job "
                                                        "recommendation.")


class JobList(BaseModel):
    jobs: list[JobSummary]
    next_cursor: int | None = Field(description="Pass as ?cursor= for the next page; "
                                                "null on the last one.")


class Attempt(_Row):
    id: int
    job: int
    attempt: int
    nodes: list[str]
    batch_host: str | None = None
    start_time: int | None = None
    end_time: int | None = None
    state: str | None = None
    exit_code: int | None = None
    exit_signal: int | None = None


class DetectionRow(_Row):
    id: int
    job: int | None
    attempt: int | None
    ts: float
    category: str
    pattern_id: str | None = None
    severity: str | None = None
    node: str | None = None
    gpu: str | None = None
    rank: int | None = None
    source: str | None = None
    evidence: dict[str, Any] = Field(description="lines (text, source, line, time), "
                                                 "detail, action_hint, pci, xid.")


class RecommendationRow(BaseModel):
    """One recommendation, the audit unit (``Recommendation.to_dict``)."""

    id: int
    job: int | None
    attempt: int | None
    action: str
    target_nodes: list[str]
    reason_category: str | None
    evidence: Any = Field(description="The evidence the verdict rests on: a list, or {}.")
    mode: str
    status: RecStatus
    created: float
    updated: float | None
    error: str | None
    actor: str | None
    job_id: str | None
    cluster: str | None
    env: str | None
    scope: str | None = Field(description="job or node.")
    rule: str | None
    reason: str | None
    trigger: str | None
    attribution: dict[str, Any]
    pattern_ids: list[str]
    exclude: list[str]
    restart_at: int | None
    submit_time: int | None
    parent: int | None
    tries: int | None
    next_try: float | None
    held_at: float | None
    failure_at: float | None
    detected_at: float | None
    done_at: float | None
    running_again_at: float | None
    workload: str | None
    user: str | None
    claimed_by: str | None
    claim_expires: float | None
    run_start: int | None = Field(None, description="Slurm's start time of the run this "
                                  "decides: with attempt, the run's identity (slurmctld "
                                  "may run an attempt again at the same restart count).")


class Step(_Row):
    id: int
    rec: int
    step: str
    state: str
    ts: float
    detail: str | None = None


class RecommendationDetail(RecommendationRow):
    steps: list[Step]


class AuditRecommendation(RecommendationDetail):
    kind: Literal["recommendation"]


class OperatorChange(BaseModel):
    """One operator change (recovery-ctl mode, exclude, include, ack, complete,
    cancel, or their API calls), as the audit trail records it."""

    kind: Literal["operator"]
    id: int
    created: float = Field(description="When (epoch seconds).")
    action: Literal["mode", "mode_clear", "exclude", "include", "ack", "complete", "cancel"]
    actor: str = Field(description="The Unix user munge (or the kernel, or recovery-ctl "
                                   "--db's own uid) named.")
    actor_uid: int
    role: Literal["admin", "user"] | None = Field(description="null for a change carried "
                                                          "over from before role records.")
    via: Literal["api", "store"] | None = Field(description="api: through the agent; "
                                                        "store: recovery-ctl --db.")
    target: str | None = Field(description="The environment, the node, or #REC.")
    env: str | None
    node: str | None
    rec: int | None
    job_id: str | None
    user: str | None = Field(description="The owner of the recommendation's job.")
    before: str | None = Field(description="A mode; excluded or included; a status.")
    after: str | None
    reason: str | None
    data: dict[str, Any]


class AuditList(BaseModel):
    records: list[Union[OperatorChange, AuditRecommendation]] = Field(
        description="Recommendations (with their steps) and operator changes, in time "
                    "order.")
    truncated: bool = Field(description="More records fell in the window than limit: "
                                        "these are the newest.")


class RecommendationList(BaseModel):
    recommendations: list[RecommendationRow]
    next_cursor: int | None = Field(description="Pass as ?cursor= for the next page; "
                                                "null on the last one.")


class JobDetail(BaseModel):
    job: JobRecord
    attempts: list[Attempt]
    detections: list[DetectionRow]
    recommendations: list[RecommendationRow]


class ArrayTask(BaseModel):
    job_id: str
    user: str | None
    state: str | None
    restarts: int | None
    recommendations: list[str] = Field(description="#ID ACTION STATUS of each.")


class ArrayTasks(BaseModel):
    array_job_id: int
    tasks: list[ArrayTask]


class Event(_Row):
    id: int | None
    job: int | None
    ts: float
    kind: str
    attempt: int | None = None
    source: str | None = None
    message: str | None = None
    data: Any = None


class Timeline(BaseModel):
    job: str
    events: list[Event]


class Strike(_Row):
    id: int
    node: str
    ts: float
    job: int | None = Field(description="The job's row id (null: another user's, for a "
                                        "user).")
    job_id: str | None = Field(None, description="The job's Slurm id (null as for job).")
    user: str | None
    category: str
    weight: float
    rec: int | None = None
    witnessed: int | None = None


class GpuDegradation(_Row):
    gpu: str = Field(description="The GPU's key (its UUID, else its index).")
    level: str = Field(description="ok, watch or degraded.")
    score: float
    rules: list[str] = Field(description="The rules that fired in its newest record.")
    time: float | None = Field(description="When that record's reading was made.")


class Degradation(_Row):
    """The GPU wear score (docs/proactive.md), from each GPU's newest record."""

    level: str = Field(description="The worst GPU's: ok, watch or degraded.")
    score: float
    since: float | None = Field(description="When the worst GPU's record was made; null "
                                            "when ok.")
    gpus: list[GpuDegradation]


class Node(_Row):
    """A node, the same in every answer (show node, show nodes, the API)."""

    name: str
    cluster: str
    drained_by_us: bool
    excluded_by_operator: bool
    drain_reason: str | None
    drained_at: float | None
    drain_rec: int | None
    drain_slurm_reason: str | None
    drain_slurm_user: str | None
    drain_slurm_time: int | None
    last_health: Any = Field(description="The last hook report's GPU summary, or null.")
    updated: float | None
    suspect_score: float = Field(description="The decayed lemon score.")
    strikes: list[Strike]
    strike_count: int
    health: Health
    health_detail: str = Field(description="What an operator reads: \"drained by "
                                           "recovery (xid 79)\", \"suspect (score "
                                           "0.9)\", \"excluded by operator (reason)\", "
                                           "\"ok\".")
    degradation: Degradation


class NodeList(BaseModel):
    nodes: list[Node]


class NodeExcluded(BaseModel):
    node: str
    excluded: bool
    forced: str | None = Field(None, description="Present when the exclude was forced: why "
                                                 "it would have been refused.")


class EnvironmentMode(BaseModel):
    configured: Mode = Field(description="The config file's mode.")
    mode: Mode = Field(description="The mode in effect (changed at run time or not).")
    max_restarts: int
    source: Literal["file", "operator"] = Field(
        description="Where the mode in effect comes from: the config file, or an "
                    "operator's recovery-ctl mode (until recovery-ctl mode --clear).")
    set_by: str | None = Field(description="The operator who set it (null for the file, "
                                           "or a change older than the audit records).")
    set_uid: int | None
    set_at: float | None = Field(description="When (epoch seconds).")
    reason: str | None


class Environments(BaseModel):
    environments: dict[str, EnvironmentMode]


class ModeChanged(BaseModel):
    env: str
    mode: Mode = Field(description="The mode in effect now.")
    before: Mode
    source: Literal["file", "operator"]
    cleared: bool | None = Field(None, description="For a clear: whether an operator's "
                                                   "mode was there to clear.")


class Claimed(BaseModel):
    id: int
    status: Literal["executing"]
    claimed_by: str
    claim_expires: float


class Ended(BaseModel):
    id: int
    status: Literal["done", "failed", "cancelled"]


# -- the goodput ledger (docs/goodput.md) -------------------------------------------------
GOODPUT_BY = ("env", "user", "category", "node")
GoodputBy = Literal[GOODPUT_BY]   # type: ignore[valid-type]
# Unix seconds, or a duration back from now (config.loading's duration units)
WINDOW_BOUND = r"^(?:\d{1,12}(?:\.\d{1,6})?|\d{1,9}(?:\.\d{1,3})?(?:ms|s|m|h|d))$"
SINCE = ("Where the window starts: Unix seconds, or a duration back from now (30m, 2h, "
         "30d). Default: 30 days back.")
UNTIL = ("Where the window ends, in the same forms. Default: now. A window that ends "
         "before it starts is empty.")
Seconds = Union[float, None]


class GoodputIncident(_Row):
    """One failed attempt and what followed (seconds; GPU-seconds). A figure
    the records cannot support is null, and ``unknown`` says why."""

    job_id: str
    attempt: int
    env: str
    user: str
    category: str
    nodes: list[str]
    mode: str
    action: str
    outcome: Literal["recovered", "stopped", "given_up", "unknown"]
    failure: Seconds
    detected: Seconds
    acted: Seconds
    running_again: Seconds
    gpus: int | None
    work_lost_s: Seconds
    steps_lost: int | None
    downtime_s: Seconds
    gpu_s_lost: Seconds
    plain_downtime_s: Seconds
    saved_s: Seconds
    gpu_s_saved: Seconds
    would_have: bool = Field(description="Monitor mode: saved_s is what acting would have "
                                         "saved.")
    unknown: dict[str, str] = Field(description="Each figure left null, and why.")


class GoodputGroup(_Row):
    incidents: int
    recovered: int
    stopped: int
    given_up: int
    unknown: int
    mttr_median_s: Seconds
    mttr_p95_s: Seconds
    gpu_hours_lost: float
    gpu_hours_saved: float
    would_have_gpu_hours_saved: float
    unknown_lost: int
    unknown_saved: int
    ettr: Seconds = Field(description="Productive / allocated GPU time of the group's jobs "
                                      "inside the window; null when no job's is known.")
    ettr_jobs: int
    ettr_unknown_jobs: int


class BlameCheckRow(_Row):
    rec: int
    node: str
    time: float
    action: str
    mode: str
    verdict: Literal["confirmed", "cleared", "no_evidence"]
    evidence: list[dict[str, Any]]


class BlameSummary(BaseModel):
    """The precision of node blame: each node excluded or drained in the window
    (monitor mode: would have been) against its later health reports and jobs."""

    blames: int
    nodes: int
    confirmed: int
    cleared: int
    no_evidence: int
    would_have: int
    precision: Seconds = Field(description="confirmed / (confirmed + cleared); null when "
                                           "neither.")
    detail: list[BlameCheckRow]


class StopCheckRow(_Row):
    rec: int
    job_id: str
    time: float
    mode: str
    verdict: Literal["ran_fine", "failed_again", "pending", "not_resubmitted"]
    resubmitted_as: str | None


class StopSummary(BaseModel):
    """False-stop evidence: stopped jobs their user resubmitted unchanged."""

    stops: int
    ran_fine: int
    failed_again: int
    pending: int
    not_resubmitted: int
    would_have: int
    detail: list[StopCheckRow]


class JobGoodput(BaseModel):
    """One job's totals: what ``recovery-ctl show job`` prints."""

    incidents: int
    gpu_s_lost: Seconds
    unknown_lost: int
    steps_lost: int | None
    unknown_steps: int
    saved_s: Seconds
    unknown_saved: int
    would_have: bool
    detail: list[GoodputIncident]


class GoodputReport(BaseModel):
    since: float
    until: float
    by: str
    job: str | None = Field(None, description="With ?job=: the job's id.")
    assumptions: dict[str, Any] = Field(description="What plain Slurm is assumed to do "
                                                    "(the [ledger] config section).")
    groups: dict[str, GoodputGroup]
    incidents: list[GoodputIncident]
    blame: BlameSummary | None = Field(None, description="Absent with ?job=.")
    false_stops: StopSummary | None = Field(None, description="Absent with ?job=.")
    summary: JobGoodput | None = Field(None, description="With ?job=: the totals.")


# -- who may call, and what each status means --------------------------------------------
SECURITY_SCHEMES = {
    "munge": {
        "type": "http", "scheme": "munge",
        "description": "`Authorization: Munge <credential>`: a munge credential whose "
                       "payload is the SHA-256 of the request body (of the empty body for "
                       "a GET), as recovery-ctl and the node hooks send it. It names the "
                       "caller's uid, and so their role (admin or user). An agent with "
                       "api.auth = \"none\" (tests only) reads the uid from "
                       "X-Recovery-Uid instead."},
    "bearer": {
        "type": "http", "scheme": "bearer",
        "description": "`Authorization: Bearer <token>`, the token in api.read_token_file: "
                       "a trusted reader (every job). Reads only."},
}
# a read: signed, the token, or (an agent without a token) nothing: a caller on
# this host is then the owner of its socket, one from another host trusted
READ = [{"munge": []}, {"bearer": []}, {}]
SIGNED = [{"munge": []}]
OPEN: list = []

_MEANING = {
    400: "The body is not a JSON object, or a value is refused (detail says which).",
    401: "No valid credential: a bad or expired munge credential, a missing bearer token "
         "where one is configured, or a local caller whose socket has no owner.",
    403: "The caller's role may not do this, or the object is another user's.",
    404: "No such job, node, recommendation or environment.",
    409: "The recommendation's state does not allow it (claimed, stale, ended, acting).",
    413: "The body is over the size limit.",
    503: "The store cannot answer (damaged or failing); /healthz is red too.",
}


def errors(*codes: int) -> dict[int | str, dict]:
    """The ``responses`` entries of these error statuses."""
    return {code: {"model": ErrorBody, "description": _MEANING[code]} for code in codes}


def answers(model: Any, *codes: int, description: str = "OK") -> dict[int | str, dict]:
    """``responses`` of an operation: 200 with ``model``, then its errors."""
    return {200: {"model": model, "description": description}, **errors(*codes)}


def signed(model: type[BaseModel], required: bool = True, security: list = SIGNED) -> dict:
    """``openapi_extra`` of a signed POST: its security, and the JSON request
    body the route reads itself."""
    return {"security": security, "requestBody": {
        "required": required, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


READ_EXTRA = {"security": READ}
OPEN_EXTRA = {"security": OPEN}


def install(app: FastAPI) -> None:
    """Serve the document with the request bodies' schemas and the security
    schemes in its components, and the Console's pages (a part of the app
    described elsewhere) with their security and errors."""

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        spec = get_openapi(title=app.title, version=app.version,
                           description=app.description, routes=app.routes)
        components = spec.setdefault("components", {})
        schemas = components.setdefault("schemas", {})
        for model in BODIES:
            found = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(found.pop("$defs", {}))
            schemas[model.__name__] = found
        schemas.setdefault("ErrorBody", ErrorBody.model_json_schema())
        components["securitySchemes"] = SECURITY_SCHEMES
        for path, operations in spec["paths"].items():
            if path == "/console" or path.startswith("/console/"):
                for operation in operations.values():
                    _console(operation)
        app.openapi_schema = spec
        return spec

    app.openapi = openapi   # type: ignore[method-assign]


def _console(operation: dict) -> None:
    """A Console page reads as a reader does; its own refusals are pages too."""
    operation.setdefault("security", READ)
    page = {"text/html": {"schema": {"type": "string"}}}
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
    responses = operation.setdefault("responses", {})
    for code in (403, 404):
        responses.setdefault(str(code), {"description": _MEANING[code], "content": page})
    for code in (401, 503):
        responses.setdefault(str(code), {"description": _MEANING[code], "content": error})


JobAnswer = Union[JobDetail, ArrayTasks]
