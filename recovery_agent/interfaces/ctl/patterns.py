"""``recovery-ctl patterns``: the pattern packs over log files and labelled
incidents, offline."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import click

from ...detect.attribution import attribute
from ...detect.context import context_from_lines, read_node_addresses, with_host
from ...detect.evidence import all_detections
from ...detect.model import Detection, Verdict
from ...detect.patterns import load_rules
from ...detect.scanner import MAX_LINE, Scanner
from ...detect.score import as_dict as score_dict
from ...detect.score import read_labels, render, score
from ...errors import RecoveryError

CHUNK = 16 << 20


@click.group()
def patterns() -> None:
    """Work with the detection pattern packs (etc/patterns/*.toml and site packs).

    \b
    Example:
        recovery-ctl patterns test --patterns-dir /etc/slurm-recovery/patterns job.log
    """


def _packs_and_files(command):
    """The arguments ``patterns test`` and ``patterns score`` share: the files,
    site pack directories and the matcher."""
    for option in reversed([
            click.argument("files", nargs=-1, required=True,
                           type=click.Path(exists=True, dir_okay=False, path_type=Path)),
            click.option("--patterns-dir", "dirs", multiple=True,
                         type=click.Path(exists=True, file_okay=False, path_type=Path),
                         help="A directory of site packs, loaded after the shipped ones "
                              "(repeatable)."),
            click.option("--engine", type=click.Choice(["auto", "re", "hyperscan"]),
                         default="auto", show_default=True,
                         help="Matcher: hyperscan when it imports, else Python re.")]):
        command = option(command)
    return command


@patterns.command("test")
@_packs_and_files
@click.option("--node", metavar="NAME",
              help="The node the logs came from (a node's kernel log, one node's job "
                   "output): lines that name no node are that node's.")
@click.option("--nodes-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Node names and the addresses the logs may name them by, one node a "
                   "line: 'name address...' (IPs, hostnames), or scontrol's "
                   "'NodeName=... NodeAddr=... NodeHostName=...'.")
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object per input file, one per line.")
def patterns_test(files: tuple[Path, ...], dirs: tuple[Path, ...], engine: str,
                  node: str | None, nodes_file: Path | None, as_json: bool) -> None:
    """Run the scanner and attribution over log files, offline.

    Prints each detection (line, rule, category, host) and the verdict for
    each file. Hosts come from the lines' prefixes (syslog, journald, dmesg,
    NCCL, srun, pdsh...), ranks through the layout the log states (SLURM_*
    node lists, srun --label, NCCL init lines), peer addresses through
    --nodes-file. Nothing is sent anywhere: use it to check packs against
    your own logs before the agent runs them.

    \b
    Example:
        recovery-ctl patterns test slurm-4410.out
        recovery-ctl patterns test --node gpu07 gpu07-kern.log
        recovery-ctl patterns test --nodes-file nodes.txt --json logs/*.err | jq .verdict
    """
    try:
        scanner = Scanner(load_rules(dirs), engine=engine)
    except RecoveryError as exc:
        raise click.ClickException(str(exc)) from None
    addresses = {}
    if nodes_file is not None:
        try:
            addresses = read_node_addresses(nodes_file.read_text(encoding="utf-8",
                                                                 errors="replace"))
        except OSError as exc:
            raise click.ClickException(f"{nodes_file}: {exc.strerror or exc}") from None
    for path in files:
        detections = _scan_file(scanner, path)
        if node:
            detections = with_host(detections, node)
        context = context_from_lines(_read_lines(path), addresses=addresses)
        verdict = attribute(detections, context)
        shown = all_detections(detections, context)[:len(detections)]
        if as_json:
            click.echo(json.dumps(_as_json(path, shown, verdict)))
        else:
            _print_report(path, shown, verdict)


@patterns.command("score")
@_packs_and_files
@click.option("--json", "as_json", is_flag=True, help="One JSON object with every figure.")
def patterns_score(files: tuple[Path, ...], dirs: tuple[Path, ...], engine: str,
                   as_json: bool) -> None:
    """Score the packs on labelled incidents: your own, before action mode.

    FILES are JSON lines, one incident a line, in the corpus format:
    {"id", "lines": [...], "category", "expected_action", "node_attributable"}
    (category: gpu_hardware, interconnect, nccl_timeout_hang, cuda_error, oom,
    system_software, application, segfault or benign; expected_action:
    requeue_exclude_node, requeue, stop or none). Each incident's lines are
    judged as `patterns test` judges a log. Printed: category and coarse action
    accuracy (overall, per labelled category, per labelled action), both
    confusion matrices, how often the node is named where the text names it,
    benign incidents on which a rule fired, and every miss with the rule that
    decided it. A row that is not well formed is named (line and field) and
    left out; the rest are scored. Exit 0 whatever the score; 1 when no row
    could be scored.

    \b
    Example:
        recovery-ctl patterns score incidents.jsonl
        recovery-ctl patterns score --json incidents.jsonl | jq .action
    """
    try:
        scanner = Scanner(load_rules(dirs), engine=engine)
    except RecoveryError as exc:
        raise click.ClickException(str(exc)) from None
    rows, problems = [], []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            raise click.ClickException(f"{path}: {exc.strerror or exc}") from None
        found, bad = read_labels(text)
        rows += found
        problems += [f"{path}: {p}" for p in bad]
    result = score(scanner, rows, problems)
    if as_json:
        click.echo(json.dumps(score_dict(result), indent=1))
    else:
        click.echo(render(result, title=", ".join(str(f) for f in files)), nl=False)
    for problem in problems:
        click.echo(f"left out: {problem}", err=True)
    if not rows:
        raise click.ClickException("no row could be scored")


def _scan_file(scanner: Scanner, path: Path) -> list[Detection]:
    """The scanner over a file read in chunks (any size, any bytes)."""
    stream = scanner.stream(str(path))
    detections: list[Detection] = []
    try:
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(CHUNK), b""):
                detections.extend(stream.feed_bytes(chunk))
    except OSError as exc:
        raise click.ClickException(f"{path}: {exc.strerror or exc}") from None
    return detections + stream.flush()


def _read_lines(path: Path) -> Iterator[str]:
    """A log file's lines, leniently decoded, each cut to MAX_LINE bytes."""
    try:
        with open(path, "rb") as fh:
            while True:
                raw = fh.readline(MAX_LINE)
                if not raw:
                    return
                if not raw.endswith(b"\n"):
                    while True:   # drop the rest of an over-long line
                        rest = fh.readline(1 << 20)
                        if not rest or rest.endswith(b"\n"):
                            break
                yield raw.decode("utf-8", "replace")
    except OSError as exc:
        raise click.ClickException(f"{path}: {exc.strerror or exc}") from None


def _as_json(path: Path, detections: list[Detection], verdict: Verdict) -> dict:
    return {"file": str(path),
            "detections": [{"rule": d.rule, "category": d.category, "line": d.line,
                            "host": d.host} for d in detections],
            "verdict": {"category": verdict.category, "action": verdict.action,
                        "nodes": list(verdict.nodes)}}


def _print_report(path: Path, detections: list[Detection], verdict: Verdict) -> None:
    click.secho(str(path), bold=True)
    if not detections:
        click.echo("  no detections")
    for d in detections:
        click.echo(f"  line {d.line or '-':>6}  {d.rule:<32} {d.category:<18} "
                   f"host={d.host or '-'}")
    where = "".join(f" {name}={','.join(values)}" for name, values in
                    (("nodes", verdict.nodes), ("gpus", verdict.gpus), ("links", verdict.links))
                    if values)
    click.echo(f"  verdict: category={verdict.category or '-'} action={verdict.action} "
               f"blame={verdict.blame}{where} confidence={verdict.confidence:.2f}")
    if verdict.reason:
        click.echo(f"           {verdict.reason}")
