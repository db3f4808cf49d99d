"""What every external source shares: the errors a source raises, each with a
``kind`` for counters and health.

The rest of the plumbing lives beside it: :mod:`.http` (credentials, the HTTP
client with timeouts and bounded retries, the health tracker), :mod:`.query`
(quoting, RE2 escaping, the pattern prefilter, RFC 3339 times) and :mod:`.feed`
(cursors, log lines, paging and the log-source base class). Nothing here knows
Prometheus, Loki or VictoriaLogs; their modules build on these.
"""
from __future__ import annotations

from ...errors import RecoveryError


class SourceError(RecoveryError):
    """A source could not answer usefully. ``kind`` names the failure for counters."""

    kind = "error"


class SourceUnavailable(SourceError):
    """Connection refused, DNS failure, or 5xx answers after the retries."""

    kind = "unavailable"


class SourceTimeout(SourceError):
    """The source did not answer within the timeout."""

    kind = "timeout"


class SourceRateLimited(SourceError):
    """429 answers after the retries, or a Retry-After longer than we wait."""

    kind = "rate_limited"


class SourceAuthError(SourceError):
    """401/403: the credentials are missing, wrong or not allowed to read."""

    kind = "auth"


class SourceResponseError(SourceError):
    """An answer we cannot use: not JSON, the wrong shape, an error status, cut off."""

    kind = "malformed"


class LabelSchemaError(SourceError):
    """The data lacks the labels (fields) the configuration expects."""

    kind = "labels"

