"""The --recovery directive parser, on the cases the SPANK plugin must agree with."""
from __future__ import annotations

import json

import pytest

from slurm_hooks import spec
from tests.conftest import FIXTURES

CASES = json.loads((FIXTURES / "spec_cases.json").read_text())


@pytest.mark.parametrize("case", CASES, ids=[c["spec"][:40] or "<empty>" for c in CASES])
def test_shared_cases(case):
    if case["ok"]:
        parsed = spec.parse(case["spec"])
        assert parsed.canonical() == case["canonical"]
        assert spec.parse(parsed.canonical()) == parsed  # the normal form parses to itself
    else:
        with pytest.raises(spec.SpecError) as info:
            spec.parse(case["spec"])
        message = str(info.value)
        assert case["error"] in message
        assert "\n" not in message and len(message) < 200


def test_fields():
    parsed = spec.parse("prod:action,max-restarts=3,hang=20m,ckpt=/c,notify=mail")
    assert parsed.as_dict() == {"env": "prod", "mode": "action", "max_restarts": 3,
                                "hang": 1200, "ckpt": "/c", "notify": "mail",
                                "ckpt_signal": None, "proactive": None}
    keyed = spec.parse("prod,ckpt-signal=B:USR1,proactive=no")
    assert (keyed.ckpt_signal, keyed.proactive) == ("B:USR1", False)
    assert spec.parse("prod,proactive=yes").proactive is True
    assert spec.parse("prod,ckpt-signal=none").ckpt_signal == "none"   # said: no convention


def test_the_new_keys_are_named_in_the_unknown_key_message():
    with pytest.raises(spec.SpecError, match="ckpt-signal, proactive"):
        spec.parse("prod,signal=USR1")


def test_defaults_from_the_plugstack():
    assert spec.parse("", default_env="lab", default_mode="monitor") == \
        spec.RecoverySpec(env="lab", mode="monitor")
    assert spec.parse("(null)").env == "default"  # SPANK's text for a flag without value
    assert spec.parse("prod").mode is None  # the environment's mode applies


@pytest.mark.parametrize("comment, expected", [
    ("recovery=prod:action", "prod:action"),
    ("owner=ml; recovery=prod,max-restarts=2", "prod,max-restarts=2"),
    ("nightly run recovery=", ""),
    ("norecovery=prod", None),
    ("", None),
    (None, None),
])
def test_comment_fallback(comment, expected):
    assert spec.from_comment(comment) == expected


def test_environment_sources():
    assert spec.from_environ({}) == (None, "")
    assert spec.from_environ({"SLURM_JOB_COMMENT": "recovery=prod"}) == \
        ("prod", "SLURM_JOB_COMMENT")
    both = {"SLURM_JOB_COMMENT": "recovery=prod", spec.SPANK_ENV: "lab:action"}
    assert spec.from_environ(both) == ("lab:action", spec.SPANK_ENV)
