"""The parsers' fast paths (issue 21, the scale benchmark) give what the plain
forms gave: each plain form is kept here as it was before, and both read the
same recorded output (Slurm's sinfo/scontrol JSON from 22.05, 24.11, 26.05;
the log lines of the tune corpus) and the same awkward cases."""
from __future__ import annotations

import json
import re
import sys
from typing import Any, Iterable, Mapping

import pytest

from recovery_agent.detect import progress, stamps
from recovery_agent.detect.context import LayoutLines
from recovery_agent.scheduler import cli_parse
from recovery_agent.scheduler.base import Node
from recovery_agent.scheduler.cli_parse import (NODE_BASE_STATES, node_from_json, parse_nodes,
                                                parse_nodes_text, split_state, timestamp)
from tests.conftest import FIXTURES

SLURM = FIXTURES / "slurm"
CORPUS = FIXTURES / "corpus" / "public_tune.jsonl"


# -- the plain forms, as they were ----------------------------------------------

def plain_node_from_json(raw: Mapping[str, Any]) -> Node:
    state, flags = split_state(raw.get("state"), NODE_BASE_STATES)
    flags = flags | frozenset(str(f).upper() for f in raw.get("state_flags") or [])
    held = cli_parse._reason_holds(state, flags)
    return Node(name=raw.get("name") or "", state=state, flags=flags,
                reason=(raw.get("reason") or "") if held else "",
                reason_user=(raw.get("reason_set_by_user") or "") if held else "",
                reason_time=timestamp(raw.get("reason_changed_at")) if held else None,
                partitions=tuple(raw.get("partitions") or ()), gres=raw.get("gres") or "",
                address=raw.get("address") or "", hostname=raw.get("hostname") or "")


def plain_host_of(line: str, nodes: Iterable[str] = ()) -> str | None:
    nodes = tuple(nodes)
    for match in progress._HOST.finditer(line):
        host = progress._known_host(match.group(1), nodes)
        if host:
            return host
    match = progress._RANK_WORLD_HOST.search(line)
    if match and match.group(3):
        return progress._known_host(match.group(3), nodes)
    return None


def plain_parse_step_time(line: str, nodes: Iterable[str] = ()):
    for pattern, convert, _literal, _blind in progress._STEP_TIMES:
        match = pattern.search(line)
        if not match:
            continue
        value = float(match.group(1))
        if convert is None:
            seconds = value / 1000.0 if match.group(2) == "ms" else value
        else:
            seconds = convert(value)
        if seconds is None or seconds <= 0:
            return None
        rank, host = progress.rank_of(line), plain_host_of(line, nodes)
        if rank is None and host is None:
            return None
        return progress.StepSample(rank, host, seconds, line=progress._clip(line))
    return None


def _rest_of_line_time(match, read_at, earliest, zone):
    """line_time after its regex matched, as it was."""
    from datetime import datetime
    year, month, day, hour, minute, second, fraction, given = match.groups()
    try:
        when = datetime(int(year), int(month), int(day), int(hour), int(minute), int(second),
                        int((fraction or "0")[:6].ljust(6, "0")))
        found = stamps._zone(given) or zone
        stamp = (when.replace(tzinfo=found) if found else when).timestamp()
    except (ValueError, OverflowError, OSError):
        return None
    if stamp > read_at + stamps.SKEW or (earliest is not None and stamp < earliest - stamps.SKEW):
        return None
    return stamp


def plain_layout_lines(lines: Iterable[str], cap: int = 2048) -> list[str]:
    kept: list[str] = []
    ranked = 0
    for text in lines:
        if len(kept) >= cap:
            break
        if any(marker in text for marker in LayoutLines.MARKERS):
            kept.append(text[:LayoutLines.LONGEST])
        elif ranked < cap // 8 and ("[rank" in text or cli_context_summary(text)):
            ranked += 1
            kept.append(text[:LayoutLines.LONGEST])
    return kept


def cli_context_summary(text: str):
    from recovery_agent.detect import context
    return context.summary_fields(text)


# -- recorded input -------------------------------------------------------------

def node_records() -> list[tuple[str, dict]]:
    """Every per-node record of the recorded listings (sinfo of 22.05, scontrol
    show node of 24.11 and 26.05, the REST answers that carry nodes)."""
    out = []
    for path in sorted(SLURM.rglob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except ValueError:
            continue
        for raw in doc.get("nodes") or [] if isinstance(doc, dict) else []:
            if isinstance(raw, dict):
                out.append((f"{path.parent.name}/{path.name}", raw))
    return out


def corpus_lines() -> list[str]:
    lines = []
    for row in CORPUS.read_text().splitlines():
        lines += json.loads(row)["lines"]
    return lines


# lines made to hit the edges of each test (no log says these; they probe the code)
EDGES = [
    "", "host", "HOST=gpu07", "hostname: gpu07.cluster", "Node: gpu3", "SLURMD_NODENAME=n1",
    "SLURM_TOPOLOGY_ADDR=ib.s1.gpu2", "rank 3/16 gpu07", "RANK 3 / 16 node2",
    "[rank0] iteration 5/ 100 | elapsed time per iteration (ms): 812.3",
    "Step Time: 0.52s rank=1", "ITER TIME = 520 ms host gpu1", "time/step 0.5 rank 2",
    "t\u0130me per step 0.4 rank 1", "step t\u0131me 0.4 rank 1",        # dotted/dotless I
    "ho\u017ft=gpu7 step_time=1.0",                                      # long s
    "\u212aank 2 step time 3s",                                          # Kelvin sign
    "train_step_timing in s=0.512 [rank3]", "0.52s/it rank 4", "3.32it/s host gpu9",
    "CurrSamplesPerSec=118.2 rank=0", "step_time=0s rank 1",
    "[2026-12-02 10:00:00,123] [INFO] rank 0 step time 0.5s",
    "x" * 118 + "-:2026-12-02T10:00:00Z", "2026-12-02T10:00:00Z" + "y" * 200,
    " " * 100 + "2026-12-02 10:00:00 later", "[2026-13-45 99:00:00] bad date",
    "NCCL INFO Bootstrap", "  rank: 3", "host: gpu4 rank 2", "[rank1]: hello",
]


# -- nodes ------------------------------------------------------------------------

def test_recorded_node_records_parse_as_before():
    records = node_records()
    assert len(records) >= 10, "the recorded fixtures must hold per-node records"
    shared: dict = {}
    for where, raw in records:
        expected = plain_node_from_json(raw)
        assert node_from_json(raw) == expected, where
        assert node_from_json(raw, shared) == expected, where


@pytest.mark.parametrize("state, state_flags", [
    (None, None), ("", []), ("idle", []), ("IDLE+DRAIN", []), ("mixed+drain+maint", ["REBOOT"]),
    (["DRAIN", "IDLE"], []), (["IDLE"], ["DRAIN"]), ([], ["NOT_RESPONDING"]),
    (["down", "not_responding"], None), ("down", ["not_responding", "drain"]),
    ("FUTURE", []), ("weird", []), ([1, "IDLE"], []), ("IDLE", [{"odd": 1}]),
    (("IDLE", "DRAIN"), ()), (["IDLE", None], []),
])
def test_odd_state_shapes_parse_as_before(state, state_flags):
    raw = {"name": "n1", "state": state, "state_flags": state_flags, "reason": "bad gpu",
           "reason_set_by_user": "root", "reason_changed_at": 1_800_000_000,
           "partitions": ["gpu", "debug"], "gres": "gpu:8", "address": "10.0.0.1"}
    assert node_from_json(raw) == plain_node_from_json(raw)
    assert node_from_json(raw, {}) == plain_node_from_json(raw)


def test_unhashable_values_are_kept_as_they_are():
    raw = {"name": "n1", "state": "idle", "partitions": [["gpu"]], "gres": "gpu:8"}
    assert node_from_json(raw, {}) == plain_node_from_json(raw)


@pytest.mark.parametrize("version", ["22.05", "24.11", "26.05"])
def test_listings_parse_as_before(version):
    text = (SLURM / version / "sinfo.json").read_text()
    doc = json.loads(text)
    got = parse_nodes_text(text.encode())
    assert got == parse_nodes(doc)
    if "nodes" in doc:
        assert got == [plain_node_from_json(raw) for raw in doc["nodes"]]


def test_nodes_of_one_state_share_their_values():
    """A big listing holds each state's flags, each address and partition
    list once (the memory the scale benchmark counts)."""
    raw = json.loads((SLURM / "22.05" / "sinfo.json").read_text())["nodes"][0]
    doc = {"nodes": [dict(raw, name=f"gpu{i}", hostname=f"gpu{i}", state="idle",
                          state_flags=["DRAIN"], reason="r", partitions=["gpu"])
                     for i in range(50)]}
    nodes = parse_nodes(doc)
    assert len({id(n.flags) for n in nodes}) == 1
    assert len({id(n.partitions) for n in nodes}) == 1
    assert len({id(n.address) for n in nodes}) == 1
    assert [n.name for n in nodes] == [f"gpu{i}" for i in range(50)]
    assert not hasattr(nodes[0], "__dict__")       # slots: no per-node dict


# -- log lines ---------------------------------------------------------------------

NODES = ("gpu07", "gpu1", "node2", "n1", "gpu3")


def test_corpus_lines_give_the_same_hosts_step_times_and_stamps():
    lines = corpus_lines() + EDGES
    assert len(lines) > 1000
    found = {"host": 0, "step": 0, "stamp": 0}
    for line in lines:
        host = progress.host_of(line, NODES)
        assert host == plain_host_of(line, NODES), line
        sample = progress.parse_step_time(line, NODES)
        assert sample == plain_parse_step_time(line, NODES), line
        when = stamps.line_time(line, 2_000_000_000.0)
        assert when == _plain_time(line), line
        found["host"] += host is not None
        found["step"] += sample is not None
        found["stamp"] += when is not None
    assert all(found.values()), found      # each parser met lines it reads


def _plain_time(line: str):
    match = stamps._STAMP.search(line, 0, stamps.HEAD)
    return None if match is None else _rest_of_line_time(match, 2_000_000_000.0, None, None)


def test_layout_lines_keep_what_they_kept():
    lines = corpus_lines() + EDGES
    kept = LayoutLines()
    for line in lines:
        kept.feed(line)
    assert kept.lines == plain_layout_lines(lines)
    assert kept.lines


def test_case_folding_keeps_every_character_a_case_blind_regex_takes():
    """The cheap test before each case-blind regex looks for its literal words
    in :func:`progress._folded` form: every character that ``re.IGNORECASE``
    takes for one of their letters must fold to that letter, or the test
    would drop a line the regex matches."""
    everything = "".join(chr(c) for c in range(sys.maxunicode + 1) if not 0xD800 <= c < 0xE000)
    for letter in set("host" "node" "topology_addr" "rank" "time"):
        for ch in set(re.findall(re.escape(letter), everything, re.IGNORECASE)):
            assert progress._folded(ch) == letter, (letter, hex(ord(ch)))
    # and the odd ones do read as their regex reads them
    assert progress.host_of("ho\u017ft gpu07") == plain_host_of("ho\u017ft gpu07") == "gpu07"
    assert progress.parse_step_time("step t\u0130me 0.4 rank 1") is not None
