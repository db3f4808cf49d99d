"""The proactive move's pure decision (recovery_agent.decide.proactive): one
test per safety rule, each next to the same job moved when the rule does not
apply, so every refusal is shown to come from its rule."""
from __future__ import annotations

from dataclasses import replace

import pytest

from recovery_agent.decide.policy import BudgetState, drain_budget
from recovery_agent.decide.proactive import (EnvRules, MoveLimits, NodeCondition, Room,
                                             RunningJob, checkpoint_signal, drain_text,
                                             plan_node)

NOW = 1_800_000_000.0
DEGRADED = NodeCondition("node3", "degraded", 1.0, (
    {"rule": "row_remap_pending", "gpu": "0", "weight": 1.0, "detail": "a remap waits"},
    {"rule": "sbe_rate", "gpu": "1", "weight": 0.5, "detail": "140/h"}))
ACTION = {"default": EnvRules(mode="action", proactive="action")}
ROOM = Room(healthy=("node1", "node2", "node3", "node4"))
LIMITS = MoveLimits(cooldown=6 * 3600, checkpoint_wait=600)
JOB = RunningJob("41", nodes=("node3",), ckpt_signal="USR1")


def move(job=JOB, condition=DEGRADED, envs=ACTION, room=ROOM, limits=LIMITS, now=NOW):
    plan = plan_node(condition, [job], envs, room, limits, now)
    assert plan is not None
    (answer,) = plan.jobs
    return answer


def test_a_job_with_a_convention_on_a_degraded_node_is_moved():
    plan = plan_node(DEGRADED, [JOB], ACTION, ROOM, LIMITS, NOW)
    (answer,) = plan.jobs
    assert answer.moves and answer.rule == "degraded" and answer.mode == "action"
    assert (answer.signal, answer.target, answer.checkpoint_wait) == ("USR1", "steps", 600)
    assert answer.exclude == ("node3",)
    assert answer.drain_reason == "degraded, not failed: row_remap_pending on 0, sbe_rate on 1"
    assert plan.drain and plan.drain_mode == "action"
    assert "row_remap_pending" in answer.reason and "SIGUSR1" in answer.reason


@pytest.mark.parametrize("level", ["ok", "watch"])
def test_a_node_not_degraded_gets_no_plan(level):
    assert plan_node(replace(DEGRADED, level=level), [JOB], ACTION, ROOM, LIMITS, NOW) is None


# -- no checkpoint convention --------------------------------------------------

def test_no_ckpt_signal_and_no_slurm_signal_is_refused():
    answer = move(replace(JOB, ckpt_signal=None, slurm_signal=""))
    assert not answer.moves and answer.rule == "no_convention"
    assert "no ckpt-signal=" in answer.reason and "node3" in answer.reason


def test_ckpt_signal_none_is_refused_even_with_a_slurm_signal():
    answer = move(replace(JOB, ckpt_signal="none", slurm_signal="USR1"))
    assert (answer.action, answer.rule) == ("none", "no_convention")


def test_the_jobs_own_signal_is_the_default_convention():
    answer = move(replace(JOB, ckpt_signal=None, slurm_signal="B:USR2"))
    assert answer.moves and (answer.signal, answer.target) == ("USR2", "batch")


@pytest.mark.parametrize("given, slurm, expected", [
    ("USR1", "TERM", ("USR1", "steps", "")),        # the directive wins
    ("B:TERM", "", ("TERM", "batch", "")),
    (None, "12", ("USR2", "steps", "")),             # a number, as --signal=12 gives it
    (None, "SIGUSR1", ("USR1", "steps", "")),
])
def test_checkpoint_signal(given, slurm, expected):
    job = replace(JOB, ckpt_signal=given, slurm_signal=slurm)
    assert checkpoint_signal(job) == expected


def test_a_slurm_signal_that_is_no_checkpoint_signal_is_refused():
    # --signal=INT (or KILL) asks the job to stop, not to save: never sent as a request
    answer = move(replace(JOB, ckpt_signal=None, slurm_signal="INT"))
    assert answer.rule == "no_convention" and "--signal=INT" in answer.reason


# -- too few healthy nodes -----------------------------------------------------

def test_too_few_healthy_nodes_is_refused():
    two_node_job = replace(JOB, nodes=("node3", "node4"))
    # node1, node2 are down or degraded elsewhere: only node3 (itself) and node4 count
    tight = Room(healthy=("node3", "node4"))
    answer = move(two_node_job, room=tight)
    assert answer.rule == "too_few_nodes" and "1 healthy node(s) remain" in answer.reason
    assert move(two_node_job, room=Room(healthy=("node3", "node4", "node5"))).moves


def test_the_jobs_own_exclusions_do_not_count_as_room():
    excluded = replace(JOB, excluded=("node1", "node2"))
    assert move(excluded, room=Room(healthy=("node1", "node2", "node3"))).rule == \
        "too_few_nodes"
    assert move(excluded, room=Room(healthy=("node1", "node2", "node3", "node4"))).moves


# -- the drain budget ----------------------------------------------------------

def test_over_the_drain_budget_is_refused():
    spent = drain_budget(("gpu",), BudgetState(drains_last_hour=4), 4, 10.0)
    assert spent
    answer = move(room=replace(ROOM, drain_refusal=spent))
    assert answer.rule == "drain_budget" and "drain budget spent" in answer.reason
    plan = plan_node(DEGRADED, [JOB], ACTION, replace(ROOM, drain_refusal=spent), LIMITS, NOW)
    assert not plan.drain


# -- the cooldown --------------------------------------------------------------

def test_a_second_move_within_the_cooldown_is_refused():
    answer = move(replace(JOB, last_migration=NOW - 2 * 3600))
    assert answer.rule == "cooldown" and "2h ago" in answer.reason and "6h" in answer.reason
    assert move(replace(JOB, last_migration=NOW - 6 * 3600 - 1)).moves


def test_a_move_stamped_in_the_future_is_within_the_cooldown():
    # a clock stepped back must not free the job for another move
    assert move(replace(JOB, last_migration=NOW + 60)).rule == "cooldown"


# -- opting out, the environment's proactive, the modes -----------------------

def test_proactive_no_opts_the_job_out():
    answer = move(replace(JOB, proactive=False))
    assert answer.rule == "opted_out" and "proactive=no" in answer.reason
    assert move(replace(JOB, proactive=True)).moves


def test_an_environment_with_proactive_off_moves_nothing():
    answer = move(envs={"default": EnvRules(mode="action", proactive="off")})
    assert answer.rule == "proactive_off"


def test_an_environment_with_proactive_monitor_records_would_have_only():
    answer = move(envs={"default": EnvRules(mode="action", proactive="monitor")})
    assert answer.moves and answer.mode == "monitor"


def test_an_environment_in_monitor_mode_records_would_have_only():
    answer = move(envs={"default": EnvRules(mode="monitor", proactive="action")})
    assert answer.moves and answer.mode == "monitor"


def test_the_jobs_own_monitor_mode_lowers_the_move():
    assert move(replace(JOB, job_mode="monitor")).mode == "monitor"


def test_an_unknown_environment_gets_defaults():
    other = replace(JOB, env="nosuch")
    assert move(other).mode == "action"           # default's rules
    assert move(other, envs={}).mode == "monitor"  # nothing configured: the safe defaults


def test_an_open_recommendation_blocks_a_move():
    answer = move(replace(JOB, open_recommendation=12))
    assert answer.rule == "busy" and "#12" in answer.reason


# -- several jobs, one node ----------------------------------------------------

def test_each_job_gets_its_own_answer_and_the_node_drains_once_one_moves():
    jobs = [JOB, replace(JOB, job_id="42", ckpt_signal=None),
            replace(JOB, job_id="43", job_mode="monitor")]
    plan = plan_node(DEGRADED, jobs, ACTION, ROOM, LIMITS, NOW)
    assert [(m.job_id, m.action, m.mode) for m in plan.jobs] == [
        ("41", "migrate", "action"), ("42", "none", "monitor"), ("43", "migrate", "monitor")]
    assert plan.drain and plan.drain_mode == "action"


def test_no_job_moved_means_no_drain():
    plan = plan_node(DEGRADED, [replace(JOB, proactive=False)], ACTION, ROOM, LIMITS, NOW)
    assert not plan.drain and plan.jobs[0].rule == "opted_out"


def test_drain_text_without_evidence():
    assert drain_text(replace(DEGRADED, evidence=())) == "degraded, not failed"
