"""recovery-ctl patterns score: labelled incidents in, accuracy out. Rows come
from the real corpus; bad rows are named and left out, the rest scored."""
from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from recovery_agent.interfaces.ctl import main
from recovery_agent.detect.patterns import load_rules
from recovery_agent.detect.scanner import Scanner
from recovery_agent.detect.score import as_dict, read_labels, render, score

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "corpus"


def real_rows(n: int = 12) -> list[dict]:
    rows = [json.loads(line) for line in
            (CORPUS / "dev_failures.jsonl").read_text().splitlines() if line.strip()]
    return rows[:n]


def test_scores_add_up_on_real_rows():
    rows = real_rows(70)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    parsed, problems = read_labels(text)
    assert problems == [] and len(parsed) == 70
    result = score(Scanner(load_rules(), engine="re"), parsed)
    data = as_dict(result)
    assert data["rows"] == 70
    per_category = data["by_category"]
    assert sum(g["rows"] for g in per_category.values()) == 70
    # the overall share is the row-weighted mean of the groups
    weighted = sum(g["category"] * g["rows"] for g in per_category.values()) / 70
    assert abs(weighted - data["category"]) < 1e-9
    cells = sum(c["rows"] for c in data["confusion_action"]["counts"])
    assert cells == 70
    right = sum(c["rows"] for c in data["confusion_action"]["counts"]
                if c["labelled"] == c["predicted"])
    assert abs(right / 70 - data["action"]) < 1e-9
    assert {m["id"] for m in data["misses"]} == {j.row.id for j in result.misses}
    text_out = render(result, "dev")
    assert "category confusion" in text_out and "misses" in text_out


def test_a_bad_row_is_named_and_the_rest_are_scored():
    good = real_rows(3)
    bad_action = dict(good[0], id="x1", expected_action="reboot")
    no_lines = dict(good[1], id="x2", lines=[])
    not_bool = dict(good[2], id="x3", node_attributable="yes")
    text = "\n".join([json.dumps(good[0]), "{not json", json.dumps(bad_action),
                      json.dumps(no_lines), json.dumps(not_bool), json.dumps(good[1]),
                      json.dumps(good[0])])
    rows, problems = read_labels(text)
    assert [r.id for r in rows] == [good[0]["id"], good[1]["id"]]
    assert problems[0].startswith("line 2: not JSON")
    assert "line 3: x1: field 'expected_action'" in problems[1]
    assert "line 4: x2: field 'lines'" in problems[2]
    assert "line 5: x3: field 'node_attributable'" in problems[3]
    assert "line 7" in problems[4] and "twice" in problems[4]


def test_nuls_huge_lines_and_odd_bytes_are_scored_without_a_crash(tmp_path):
    row = real_rows(1)[0]
    odd = dict(row, id="odd", lines=[row["lines"][0] + "\x00\x00", "x" * (10 << 20)])
    path = tmp_path / "labels.jsonl"
    path.write_bytes(json.dumps(odd).encode() + b"\n" + b"\xff\xfe not utf-8 at all\n")
    result = CliRunner().invoke(main, ["patterns", "score", "--json", str(path)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["rows"] == 1 and len(data["problems"]) == 1
    assert "line 2" in data["problems"][0]


def test_cli_text_report_and_no_rows(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps(r) + "\n" for r in real_rows(8)))
    result = CliRunner().invoke(main, ["patterns", "score", str(good)])
    assert result.exit_code == 0
    assert "category right" in result.output and "action confusion" in result.output
    empty = tmp_path / "empty.jsonl"
    empty.write_text("{}\n")
    result = CliRunner().invoke(main, ["patterns", "score", str(empty)])
    assert result.exit_code == 1 and "no row could be scored" in result.output
