"""``recovery-ctl``: the operator's command line for slurm-recovery.

Each command is a few lines over the library; library errors become
``click.ClickException`` here, at the edge.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import click

from .detect.attribution import attribute, context_from_lines
from .detect.model import Detection, Verdict
from .detect.patterns import load_rules
from .detect.scanner import MAX_LINE, Scanner
from .errors import RecoveryError

CHUNK = 16 << 20


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Inspect and steer slurm-recovery: detections, verdicts, pattern packs.

    \b
    Example:
        recovery-ctl patterns test slurm-4410.out
    """


@main.group()
def patterns() -> None:
    """Work with the detection pattern packs (etc/patterns/*.toml and site packs).

    \b
    Example:
        recovery-ctl patterns test --patterns-dir /etc/slurm-recovery/patterns job.log
    """


@patterns.command("test")
@click.argument("files", nargs=-1, required=True,
                type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--patterns-dir", "dirs", multiple=True,
              type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="A directory of site packs, loaded after the shipped ones (repeatable).")
@click.option("--engine", type=click.Choice(["auto", "re", "hyperscan"]), default="auto",
              show_default=True, help="Matcher: hyperscan when it imports, else Python re.")
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object per input file, one per line.")
def patterns_test(files: tuple[Path, ...], dirs: tuple[Path, ...], engine: str,
                  as_json: bool) -> None:
    """Run the scanner and attribution over log files, offline.

    Prints each detection (line, rule, category, host) and the verdict for
    each file. Nothing is sent anywhere: use it to check packs against your
    own logs before the agent runs them.

    \b
    Example:
        recovery-ctl patterns test slurm-4410.out
        recovery-ctl patterns test --json logs/*.err | jq .verdict
    """
    try:
        scanner = Scanner(load_rules(dirs), engine=engine)
    except RecoveryError as exc:
        raise click.ClickException(str(exc)) from None
    for path in files:
        detections = _scan_file(scanner, path)
        verdict = attribute(detections, context_from_lines(_read_lines(path)))
        if as_json:
            click.echo(json.dumps(_as_json(path, detections, verdict)))
        else:
            _print_report(path, detections, verdict)


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
