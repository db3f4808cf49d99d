"""The shared source plumbing: HTTP retries and errors against a real local
server, credentials that never leak, atomic cursors, the pushed-down prefilter."""
from __future__ import annotations

import base64
import json
import logging
import re
import time

import pytest

from recovery_agent import config
from recovery_agent.detect.patterns import load_rules
from recovery_agent.errors import ConfigError
from recovery_agent.inputs.sources import query
from recovery_agent.inputs.sources.base import (SourceAuthError, SourceRateLimited,
                                                SourceResponseError, SourceTimeout,
                                                SourceUnavailable)
from recovery_agent.inputs.sources.feed import CursorStore
from recovery_agent.inputs.sources.http import (Credentials, Endpoint, Health, HttpClient,
                                                parse_retry_after, redact_url)
from tests.fixtures.sources.httpfake import FakeServer, dead_url, json_reply


@pytest.fixture
def server():
    with FakeServer() as fake:
        yield fake


def client(url, sleeps=None, **kw) -> HttpClient:
    kw.setdefault("timeout", 2.0)
    kw.setdefault("retries", 2)
    return HttpClient(Endpoint(url, **kw), sleep=(sleeps.append if sleeps is not None
                                                  else lambda s: None))


def test_429_honours_retry_after_then_succeeds(server):
    answers = iter([(429, {"Retry-After": "3"}, b"slow down"), json_reply({"ok": 1})])
    server.route("/x", lambda r: next(answers))
    sleeps: list[float] = []
    assert client(server.url, sleeps).get_json("/x", {"a": "1"}) == {"ok": 1}
    assert sleeps == [3.0]
    assert len(server.hits("/x")) == 2


def test_429_with_a_long_retry_after_gives_up_at_once(server):
    server.route("/x", lambda r: (429, {"Retry-After": "600"}, b""))
    with pytest.raises(SourceRateLimited, match="600s"):
        client(server.url, []).get_json("/x", {})
    assert len(server.hits("/x")) == 1


def test_429_retries_are_bounded(server):
    server.route("/x", lambda r: (429, {}, b"too many"))
    sleeps: list[float] = []
    with pytest.raises(SourceRateLimited, match="429"):
        client(server.url, sleeps, retries=2).get_json("/x", {})
    assert len(server.hits("/x")) == 3
    assert sleeps == [0.5, 1.0]          # backoff doubles without a Retry-After


def test_5xx_is_retried_then_reported(server):
    server.route("/x", lambda r: (503, {}, b"ingester not ready"))
    with pytest.raises(SourceUnavailable, match="HTTP 503: ingester not ready"):
        client(server.url, [], retries=1).get_json("/x", {})
    assert len(server.hits("/x")) == 2


def test_a_slow_answer_times_out_without_retry(server):
    def slow(request):
        time.sleep(1.5)
        return json_reply({})
    server.route("/slow", slow)
    started = time.monotonic()
    with pytest.raises(SourceTimeout, match="0.3s"):
        client(server.url, [], timeout=0.3, retries=3).get_json("/slow", {})
    assert time.monotonic() - started < 1.2
    assert len(server.hits("/slow")) == 1


def test_malformed_json_is_a_clear_error(server):
    server.route("/x", lambda r: (200, {}, b'{"status": "success", "data": [1, 2'))
    with pytest.raises(SourceResponseError, match="not JSON"):
        client(server.url).get_json("/x", {})


def test_4xx_is_not_retried_and_quotes_the_body(server):
    server.route("/x", lambda r: (400, {}, b"parse error at line 1, col 7: syntax error"))
    with pytest.raises(SourceResponseError, match="HTTP 400: parse error at line 1"):
        client(server.url, []).get_json("/x", {})
    assert len(server.hits("/x")) == 1


def test_refused_connection_is_unavailable():
    with pytest.raises(SourceUnavailable, match="cannot connect"):
        client(dead_url(), [], retries=1).get_json("/x", {})


def test_long_parameters_go_in_a_post_body(server):
    server.route("/x", lambda r: json_reply({"len": len(r.params["q"])}))
    assert client(server.url).get_json("/x", {"q": "a" * 5000}) == {"len": 5000}
    assert server.requests[-1].method == "POST"
    client(server.url).get_json("/x", {"q": "short"})
    assert server.requests[-1].method == "GET"


# -- credentials --------------------------------------------------------------------------

def test_bearer_token_is_sent_and_never_shown(server, tmp_path, caplog):
    token = "s3cr3t-token-value"
    path = tmp_path / "token"
    path.write_text(token + "\n")
    creds = Credentials.load("bearer", str(path))
    server.route("/x", lambda r: (401, {}, b"unauthorized"))
    http = client(server.url, [], credentials=creds)
    caplog.set_level(logging.DEBUG)
    with pytest.raises(SourceAuthError) as err:
        http.get_json("/x", {})
    assert server.requests[-1].headers["Authorization"] == f"Bearer {token}"
    shown = " ".join([repr(creds), str(creds), repr(http), repr(http.endpoint), str(err.value),
                      caplog.text, repr(http.session.headers)])
    assert token not in shown
    assert "<redacted>" in repr(creds)


def test_basic_auth_from_a_file(server, tmp_path):
    path = tmp_path / "basic"
    path.write_text("reader:pa:ss\n")
    creds = Credentials.load("basic", str(path))
    server.route("/x", lambda r: json_reply({}))
    client(server.url, credentials=creds).get_json("/x", {})
    sent = server.requests[-1].headers["Authorization"]
    assert base64.b64decode(sent.split()[1]).decode() == "reader:pa:ss"
    assert "pa:ss" not in repr(creds)


@pytest.mark.parametrize("kind,content,message", [
    ("bearer", "", "is empty"),
    ("bearer", "two words", "one token"),
    ("basic", "no-colon", "user:password"),
    ("magic", "x", "must be one of"),
])
def test_bad_credentials_files_name_the_key_not_the_content(tmp_path, kind, content, message):
    path = tmp_path / "creds"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message) as err:
        Credentials.load(kind, str(path), "sources.loki_credentials_file")
    assert str(err.value).startswith("sources.loki_credentials_file")
    if content:
        assert content not in str(err.value)


def test_missing_credentials_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        Credentials.load("bearer", str(tmp_path / "nope"))


def test_redact_url_drops_user_info_and_query():
    assert redact_url("https://u:p@loki.example:3100/x?token=1") == \
        "https://loki.example:3100/x"


def test_config_refuses_inline_credentials_and_shows_only_paths():
    with pytest.raises(ConfigError, match="sources.loki_url"):
        config.from_mapping({"sources": {"loki_url": "http://u:pw@loki:3100"}})
    cfg = config.from_mapping({"sources": {"loki_url": "http://loki:3100", "loki_auth": "bearer",
                                           "loki_credentials_file": "/etc/x/token"}})
    assert cfg.sources.loki_credentials_file == "/etc/x/token"
    with pytest.raises(ConfigError, match="sources.prometheus_credentials_file"):
        config.from_mapping({"sources": {"prometheus_auth": "basic"}})


def test_sources_config_from_the_environment():
    cfg = config.apply_env(config.Config(), {"RECOVERY_SOURCES_PROMETHEUS_URL": "http://p:9090",
                                             "RECOVERY_SOURCES_TIMEOUT": "3s"})
    assert cfg.sources.prometheus_url == "http://p:9090" and cfg.sources.timeout == 3.0


# -- health ----------------------------------------------------------------------------------

def test_health_logs_one_line_per_outage_and_counts(caplog):
    health = Health("loki", base_delay=10)
    caplog.set_level(logging.DEBUG, logger="recovery_agent.inputs.sources.http")
    for i in range(5):
        health.failed(SourceUnavailable("down"), 100.0 + i)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "carrying on without it" in warnings[0].getMessage()
    assert health.errors_total == 5 and health.errors_by_kind["unavailable"] == 5
    assert not health.up and not health.allow(105.0)
    assert health.retry_at == pytest.approx(104.0 + 160.0)   # 10 * 2**4
    health.ok(300.0)
    assert health.up and health.allow(300.0)
    assert "answering again" in caplog.records[-1].getMessage()


# -- cursors -----------------------------------------------------------------------------

def test_cursor_store_round_trip_and_atomic_write(tmp_path):
    store = CursorStore(tmp_path / "cursors", "loki")
    store.put("4242/job", {"ns": 5, "seen": ["ab"]})
    store.save()
    assert not list((tmp_path / "cursors").glob(".*"))      # no temp file left behind
    again = CursorStore(tmp_path / "cursors", "loki")
    assert again.get("4242/job") == {"ns": 5, "seen": ["ab"]}
    again.forget("4242/job")
    again.save()
    assert CursorStore(tmp_path / "cursors", "loki").get("4242/job") is None


def test_a_corrupt_cursor_file_is_not_fatal(tmp_path, caplog):
    (tmp_path / "loki.json").write_text("{not json")
    store = CursorStore(tmp_path, "loki")
    assert store.get("x") is None
    assert "unreadable" in caplog.text


# -- query language helpers ---------------------------------------------------------------

def test_re2_escape_and_quote_round_trip():
    text = 'a.b (c) [d] "e" \\f\tg'
    escaped = query.re2_escape(text)
    assert "\\ " not in escaped                      # RE2 refuses an escaped space
    assert re.fullmatch(escaped, text)
    assert json.loads(query.quote(escaped)) == escaped


def test_the_prefilter_keeps_every_example_line():
    """Every line a shipped rule must match passes the pushed-down filter, so
    filtering in the store loses nothing the scanner would have found."""
    rules = load_rules()
    regex = re.compile(query.prefilter_regex(rules))
    missed = [(r.id, line) for r in rules for line in r.examples_match
              if r.scope == "line" and not regex.search(line)]
    assert missed == []
    assert regex.search("Traceback (most recent call last):")
    assert not regex.search("step 120 loss 2.31 lr 3e-4")


def test_a_rule_without_literals_disables_the_prefilter():
    class Rule:
        id, regex, scope = "any.digit", r"\d", "line"
    assert query.prefilter_regex([Rule()]) is None


def test_rfc3339_nanoseconds():
    ns = query.parse_rfc3339_ns("2024-05-01T10:00:00.123456789Z")
    assert ns == 1714557600123456789
    assert query.format_rfc3339_ns(ns) == "2024-05-01T10:00:00.123456789Z"
    assert query.parse_rfc3339_ns("2024-05-01T12:00:00+02:00") == 1714557600 * 10**9
    with pytest.raises(ValueError):
        query.parse_rfc3339_ns("yesterday")


def test_retry_after_as_http_date():
    assert parse_retry_after("Wed, 01 May 2024 10:00:30 GMT", now=1714557600.0) == 30.0
    assert parse_retry_after("soon") is None
