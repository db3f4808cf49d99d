"""The scanner: both engines give identical detections; multi-line context;
incremental feeding; hostile input."""
from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

from recovery_agent.detect.engines import hyperscan_probe, required_literals
from recovery_agent.detect.patterns import load_rules
from recovery_agent.detect.scanner import MAX_LINE, Scanner
from recovery_agent.errors import ConfigError
from tests.benchmarks.bench_scanner import generate_log

RULES = load_rules()
DEV = Path(__file__).resolve().parents[1] / "fixtures" / "corpus" / "dev_failures.jsonl"
TUNE = Path(__file__).resolve().parents[1] / "fixtures" / "corpus" / "public_tune.jsonl"
needs_hyperscan = pytest.mark.skipif(hyperscan_probe() is not None,
                                     reason=hyperscan_probe() or "")


@pytest.fixture(scope="module")
def re_scanner() -> Scanner:
    return Scanner(RULES, engine="re")


@pytest.fixture(scope="module")
def hs_scanner() -> Scanner:
    if hyperscan_probe() is not None:
        pytest.skip(hyperscan_probe())
    return Scanner(RULES, engine="hyperscan")


def _corpus_rows() -> list[dict]:
    rows = [json.loads(line) for line in TUNE.read_text().splitlines() if line.strip()]
    if DEV.exists():
        rows += [json.loads(line) for line in DEV.read_text().splitlines() if line.strip()]
    return rows


ODD_LINES = [
    "Traceback (most recent call last):\r",
    '  File "x.py", line 1, in <module>\r',
    "KeyError: 'a'\r",
    "\x00\x01\x02 binary \udcff junk NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.",
    "ünïcödé " * 10 + "RuntimeError: CUDA error: an illegal memory access was encountered",
    "x" * (MAX_LINE - 18) + " KeyboardInterrupt",         # ends right at the cap
    "y" * (MAX_LINE - 5) + "Segmentation fault (core dumped)",   # crosses the cap
    "z" * (3 * MAX_LINE) + " CUDA out of memory",         # beyond the cap: not seen
    "Illegal instruction",
    "",
    "[rank3]: AssertionError",
]


# -- engine agreement -------------------------------------------------------------

@needs_hyperscan
def test_engines_agree_on_the_corpus(re_scanner, hs_scanner):
    rows = _corpus_rows()
    assert len(rows) >= 20
    for row in rows:
        assert re_scanner.scan_lines(row["lines"]) == hs_scanner.scan_lines(row["lines"]), \
            row["id"]


@needs_hyperscan
def test_engines_agree_on_the_tune_split_hosts_and_ranks(re_scanner, hs_scanner):
    """Real logs behind every kind of prefix: the same detections, hosts and
    ranks from either engine (the prefixes are read once a rule has fired)."""
    if not TUNE.exists():
        pytest.skip("tune split not present")
    rows = [json.loads(line) for line in TUNE.read_text().splitlines() if line.strip()]
    named = 0
    for row in rows:
        found = re_scanner.scan_lines(row["lines"])
        assert found == hs_scanner.scan_lines(row["lines"]), row["id"]
        named += any(d.host for d in found)
    assert named >= 20


@needs_hyperscan
def test_engines_agree_on_a_generated_log(re_scanner, hs_scanner):
    data = ("\n".join(generate_log(60_000, seed=3, failure_every=400)) + "\n").encode(
        "utf-8", "surrogatepass")
    found = re_scanner.scan_bytes(data)
    assert len(found) > 50
    assert found == hs_scanner.scan_bytes(data)


@needs_hyperscan
def test_engines_agree_on_odd_input(re_scanner, hs_scanner):
    expected = re_scanner.scan_lines(ODD_LINES)
    assert expected == hs_scanner.scan_lines(ODD_LINES)
    rules = [(d.rule, d.line) for d in expected]
    assert ("python.user_error", 3) in rules and ("kernel.xid", 4) in rules
    assert ("python.keyboard_interrupt", 6) in rules and ("signal.illegal_instruction", 9) in rules
    assert not any(line in (7, 8) for _, line in rules)


@needs_hyperscan
def test_bounded_repeats_count_characters_in_both_engines(re_scanner, hs_scanner):
    line = "Lustre: " + "é" * 150 + " was evicted by the server"
    assert [d.rule for d in re_scanner.scan_lines([line])] == ["fs.lustre"]
    assert hs_scanner.scan_lines([line]) == re_scanner.scan_lines([line])


def test_explicit_engine_names(re_scanner):
    assert re_scanner.engine_name == "re"
    assert Scanner(RULES).engine_name == ("hyperscan" if hyperscan_probe() is None else "re")
    with pytest.raises(ConfigError, match="engine"):
        Scanner(RULES, engine="grep")


# -- incremental use --------------------------------------------------------------

@pytest.mark.parametrize("engine", ["re", pytest.param("hyperscan", marks=needs_hyperscan)])
def test_feeding_lines_equals_scanning_them(engine):
    scanner = Scanner(RULES, engine=engine)
    lines = [line for row in _corpus_rows() for line in row["lines"]] + ODD_LINES
    stream = scanner.stream()
    fed = [d for line in lines for d in stream.feed(line)] + stream.flush()
    assert fed == scanner.scan_lines(lines)


def test_feeding_random_byte_chunks_equals_one_buffer(re_scanner):
    lines = generate_log(5_000, seed=5, failure_every=150) + ODD_LINES
    data = "\n".join(lines).encode("utf-8", "surrogatepass")
    whole = re_scanner.scan_bytes(data)
    rng = random.Random(1)
    stream, out, pos = re_scanner.stream(), [], 0
    while pos < len(data):
        step = rng.choice([1, 7, 300, 5000, 70_000])
        out += stream.feed_bytes(data[pos:pos + step])
        pos += step
    assert out + stream.flush() == whole
    assert whole == re_scanner.scan_lines(lines)


def test_line_numbers_and_sources(re_scanner):
    found = re_scanner.scan_lines(["ok", "ok", "Segmentation fault"], source="job.err",
                                  first_line=10)
    assert [(d.line, d.evidence[0].source) for d in found] == [(12, "job.err")]


# -- multi-line context -----------------------------------------------------------

def _traceback(last: str, prefix: str = "") -> list[str]:
    return [f"{prefix}Traceback (most recent call last):",
            f'{prefix}  File "/w/train.py", line 7, in <module>',
            f"{prefix}    main()",
            f"{prefix}{last}"]


@pytest.mark.parametrize("last, rule, category", [
    ("AssertionError: shapes differ", "python.assertion", "application"),
    ("ValueError: bad lr", "python.user_error", "application"),
    ("KeyError: 'x'", "python.user_error", "application"),
    ("ImportError: cannot import name 'X'", "python.import_error", "application"),
    ("torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB", "oom.cuda",
     "oom"),
    ("RuntimeError: CUDA error: unspecified launch failure", "cuda.launch_failure",
     "cuda_error"),
    ("torch.distributed.DistBackendError: NCCL error in: x.cpp:1, unhandled system error",
     "nccl.unhandled_system_error", "interconnect"),
    ("RuntimeError: something nobody anticipated", "python.runtime_error", "application"),
    ("mylib.Surprise: no rule knows this name", "python.traceback_any", "application"),
])
@pytest.mark.parametrize("prefix", ["", "[rank3]: ", "12: ", "[default0]:"])
def test_a_traceback_is_one_detection_named_by_its_exception(re_scanner, last, rule, category,
                                                             prefix):
    lines = ["step 10 loss 2.0"] + _traceback(last, prefix) + ["step 11 loss 1.9"]
    found = re_scanner.scan_lines(lines)
    assert [(d.rule, d.category, d.line) for d in found] == [(rule, category, 5)]
    assert found[0].evidence[1].line == 2 and "Traceback" in found[0].evidence[1].text


def test_frames_inside_a_traceback_do_not_fire(re_scanner):
    lines = _traceback("ValueError: x")
    lines.insert(2, '    raise RuntimeError("CUDA error: an illegal memory access")')
    assert [d.rule for d in re_scanner.scan_lines(lines)] == ["python.user_error"]


def test_a_cut_off_traceback_is_only_an_exit_report(re_scanner):
    # the log ends inside it: something failed, not said what (no stop, no category)
    found = re_scanner.scan_lines(_traceback("")[:3])
    assert [(d.rule, d.role, d.action_hint, d.line) for d in found] == [
        ("python.traceback_unfinished", "exit", "requeue", 1)]


def test_child_failed_summary_names_root_cause_host_and_rank(re_scanner):
    lines = _traceback("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ")
    lines += ["=" * 60, "train.py FAILED", "-" * 60, "Failures:",
              "[1]:", "  host      : n07", "  rank      : 9 (local_rank: 1)",
              "  exitcode  : 1 (pid: 77)", "-" * 60, "Root Cause (first observed failure):",
              "[0]:", "  time      : 2025-01-01_00:00:00", "  host      : n05",
              "  rank      : 4 (local_rank: 4)", "  exitcode  : -7 (pid: 70)",
              "  traceback : Signal 7 (SIGBUS) received by PID 70", "=" * 60, "after"]
    found = re_scanner.scan_lines(lines)
    assert [(d.rule, d.category, d.host, d.rank) for d in found] == [
        ("pytorch.elastic_sigbus", "segfault", "n05", 4)]


def test_lookback_takes_the_pci_from_a_wrapped_kernel_message(re_scanner):
    lines = ["[ 10.1] NVRM: The NVIDIA GPU 0000:b3:00.0", "  NVRM: (PCI ID: 10de:2330) is",
             "  NVRM: fallen off the bus and is not responding to commands."]
    found = re_scanner.scan_lines(lines)
    assert [(d.rule, d.pci) for d in found] == [("kernel.gpu_fallen_off_bus", "0000:b3:00")]


# -- hostile input ----------------------------------------------------------------

def test_huge_and_binary_lines_are_cheap(re_scanner):
    binary = bytes(range(256)).replace(b"\n", b"")
    junk = binary * 4096 + b"\n" + b"\xff\xfe" * 500_000 + b"\nSegmentation fault\n"
    start = time.perf_counter()
    found = re_scanner.scan_bytes(junk)
    assert time.perf_counter() - start < 5
    assert [(d.rule, d.line) for d in found] == [("signal.segfault", 3)]


@pytest.mark.parametrize("rule", [r for r in RULES if r.scope == "line"], ids=lambda r: r.id)
def test_no_rule_is_quadratic_on_repeated_text(rule):
    seed = rule.examples_match[0]
    for piece in (seed[:12] + " ", seed[:4], "x", "[ "):
        line = (piece * (MAX_LINE // len(piece) + 1))[:MAX_LINE]
        start = time.perf_counter()
        rule.compiled.search(line)
        assert time.perf_counter() - start < 1.0, (rule.id, piece)


def test_required_literals():
    assert required_literals(r"NVRM: Xid \((?:PCI:)?\d+") == (frozenset({"NVRM: Xid ("}), False)
    assert required_literals(r"(?:unhandled system error|ncclSystemError)")[0] == {
        "unhandled system error", "ncclSystemError"}
    assert required_literals(r"(?i)Transport retry") == (frozenset({"transport retry"}), True)
    assert required_literals(r"\d+\s+\w+") is None
    assert required_literals(r"ab(?:cd)?") is None    # too short to help


def _cut_rules():
    import re as _re

    from recovery_agent.detect.patterns import REGEX_FLAGS, Rule
    made = []
    for rid, regex in (("t.head_end", r"marker at the cut$"),
                       ("t.whole_end", r"tail beyond the cut$"),
                       ("t.plain", r"an ordinary failure")):
        made.append(Rule(id=rid, category="application", regex=regex, source="test",
                         action="stop", compiled=_re.compile(regex, REGEX_FLAGS)))
    return made


@pytest.mark.parametrize("engine", ["re", pytest.param("hyperscan", marks=needs_hyperscan)])
def test_a_long_line_is_matched_on_its_head_by_both_engines(engine):
    """Lines over MAX_LINE are matched on their first MAX_LINE bytes, with no
    copy of the block: a rule anchored at the end of the head fires, one that
    only the whole line satisfies does not, and the lines after keep their
    numbers (the hyperscan engine scans such heads on their own)."""
    head = b"x" * (MAX_LINE - len(b"marker at the cut")) + b"marker at the cut"
    long = head + b" and then " * 9000 + b"tail beyond the cut"
    data = b"first line\n" + long + b"\nan ordinary failure\n" + long + b"\n"
    scanner = Scanner(_cut_rules(), engine=engine)
    found = [(d.rule, d.line) for d in scanner.scan_bytes(data)]
    assert found == [("t.head_end", 2), ("t.plain", 3), ("t.head_end", 4)]
    # the same lines fed in two chunks split inside the long line
    stream = scanner.stream()
    split = len(b"first line\n") + MAX_LINE // 3
    fed = stream.feed_bytes(data[:split]) + stream.feed_bytes(data[split:]) + stream.flush()
    assert [(d.rule, d.line) for d in fed] == found
