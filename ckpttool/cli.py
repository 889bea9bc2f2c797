"""The ``ckpttool`` command line: parse options, call the API, hand the result to one output sink.

Data goes to stdout, progress and logs to stderr; ``--json`` prints exactly one JSON document and turns
progress off. Exit codes: 0 ok, 1 error, 2 usage, 3 audit found errors.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import click

from .errors import CkptError
from .findings import Report
from .merge import MergeResult, merge
from .readers import READERS
from .split import TARGETS, SplitResult, split
from .terminal import Bar, Group, escaped, shown
from .terminal import size_text as _size
from .version import __version__
from .writers.hf import predict_peak_bytes

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_AUDIT = 0, 1, 2, 3
FORMATS = click.Choice(list(READERS))
#: what --dtype casts floating-point tensors to (ckpttool.dtypes.CAST_DTYPES); integer tensors are never cast
DTYPES = click.Choice(["bfloat16", "float16", "float32", "bf16", "fp16", "fp32"], case_sensitive=False)
DEFAULT_WORKERS = min(8, os.cpu_count() or 1)


def _speaks() -> bool:
    """Under torchrun only rank 0 prints; the others' failures reach it and it names them."""
    return os.environ.get("RANK", "0") == "0"


def _fail(message: str, as_json: bool) -> None:
    if not _speaks():
        sys.exit(EXIT_ERROR)
    if as_json:
        click.echo(json.dumps({"status": "error", "error": message}))
    click.echo(f"Error: {escaped(message, lines=True)}", err=True)
    sys.exit(EXIT_ERROR)


#: the API's arguments, as library errors name them, and the options that set them on the command line
_FLAGS = {
    "force=True": "--force", "audit=False": "--no-audit", "weights='master'": "--weights master",
    "weights='module'": "--weights module", "format='NAME'": "--format NAME", "dtype= asks": "--dtype asks",
    "config='PATH'": "--config PATH",
}


def _as_flags(message: str) -> str:
    """A library error worded for the command line: API arguments become the options that set them."""
    for argument, flag in _FLAGS.items():
        message = message.replace(argument, flag)
    return message


def _run(as_json: bool, call: Callable[[], Any], bar: Bar | None = None) -> Any:
    """Call the API; expected errors become a message and exit 1, anything else too (traceback on request).
    The progress ``bar`` is erased before any message, so no stale bar stays above it."""
    try:
        try:
            return call()
        except BaseException:
            if bar is not None:
                bar.close(clear=True)
            raise
    except CkptError as e:
        if os.environ.get("CKPTTOOL_DEBUG") == "1":
            traceback.print_exc()
        _fail(_as_flags(str(e)), as_json)
    except KeyboardInterrupt:
        _fail("interrupted; nothing was published (merge --resume continues an interrupted merge)", as_json)
    except Exception as e:  # bad input is a CkptError: anything else is a bug in ckpttool; no traceback unless asked
        if os.environ.get("CKPTTOOL_DEBUG") == "1":
            traceback.print_exc()
        _fail(f"internal error in ckpttool ({type(e).__name__}: {e}); rerun with CKPTTOOL_DEBUG=1 and report it",
              as_json)


def _setup_logging(verbose: int, quiet: bool) -> None:
    level = logging.WARNING if quiet else (logging.DEBUG if verbose > 1 else logging.INFO if verbose else logging.WARNING)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("ckpttool").setLevel(level)


def _check_size(ctx: click.Context, param: click.Parameter, value: str) -> str:
    from .writers.hf import parse_size

    try:
        parse_size(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    return value


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ckpttool")
def main() -> None:
    """Merge sharded training checkpoints into HuggingFace safetensors, and prove them right."""


@main.command("merge")
@click.argument("src", type=click.Path(path_type=str))
@click.argument("out", type=click.Path(path_type=str), required=False)
@click.option("--format", "fmt", type=FORMATS, help="Source format (detected by default).")
@click.option("--config", type=click.Path(path_type=str), help="config.json, or an HF directory holding one (default: in or next to SRC).")
@click.option("--dtype", type=DTYPES, help="Cast floating-point tensors (integer tensors are never cast); config.json follows. "
              "On an FP8 or MXFP4 checkpoint: dequantize its weights (without --dtype they stay quantized).")
@click.option("--max-shard-size", default="5GB", show_default=True, callback=_check_size, help="Largest output file: 5GB, 500MB (decimal), 5GiB, 500MiB (binary), or bytes.")
@click.option("--weights", type=click.Choice(["master", "module"]), help="Where both are saved (DeepSpeed): fp32 master weights (default) or the module's weights.")
@click.option("--dry-run", is_flag=True, help="Print the plan and its coverage verdict; read no tensor data, write nothing.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists and is not empty.")
@click.option("--no-audit", is_flag=True, help="Do not audit the output (by default audit errors stop the publish).")
@click.option("--resume", is_flag=True, help="Continue an interrupted merge: keep the output files it finished (sha256 checked).")
@click.option("--verify", is_flag=True, help="Read every written file back from disk and compare its digest.")
@click.option("--workers", type=click.IntRange(1, 256), default=DEFAULT_WORKERS, show_default=True, help="Threads reading and writing at once.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout; no progress bar.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar, warnings only.")
@click.option("-v", "--verbose", count=True, help="More logging (-vv for debug); with --dry-run, list every tensor.")
def merge_command(
    src: str, out: str | None, fmt: str | None, config: str | None, dtype: str | None, max_shard_size: str, weights: str | None,
    dry_run: bool, force: bool, no_audit: bool, resume: bool, verify: bool, workers: int, as_json: bool, quiet: bool,
    verbose: int,
) -> None:
    """Merge the checkpoint in SRC into a HuggingFace safetensors directory OUT.

    With --dry-run, OUT may be left out: the plan is printed and nothing is written.
    """
    if out is None and not dry_run:
        raise click.UsageError("Missing argument 'OUT' (only --dry-run runs without one).")
    quiet = quiet or not _speaks()
    _setup_logging(verbose, quiet or as_json)
    bar = Bar() if not (as_json or quiet or dry_run) else None
    try:
        result: MergeResult = _run(as_json, lambda: merge(
            src, out, format=fmt, config=config, dtype=dtype, max_shard_size=max_shard_size, dry_run=dry_run,
            force=force, audit=not no_audit, resume=resume, verify=verify, workers=workers, progress=bar, weights=weights,
        ), bar)
    finally:
        if bar is not None:
            bar.close()
    if not _speaks():
        return
    if result.restored:
        click.echo(f"note: {result.restored}", err=True)
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
        return
    _print_result(result, verbose)
    if result.generic:
        click.echo(f"warning: {_generic_warning(result)}", err=True)
    if result.audit is not None and not quiet:
        _print_summary(result.audit, f" (report: {result.output}/ckpttool-audit.json)")


@main.command("audit")
@click.argument("src", type=click.Path(path_type=str))
@click.option("--format", "fmt", type=FORMATS, help="Source format (detected by default).")
@click.option("--config", type=click.Path(path_type=str), help="config.json, or an HF directory holding one (default: in or next to SRC).")
@click.option("--no-data", is_flag=True, help="Read headers and metadata only: no NaN/zero/expert/outlier checks.")
@click.option("--strict", is_flag=True, help="Treat warnings as errors.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON document on stdout.")
@click.option("--html", "html_path", type=click.Path(path_type=str), help="Also write a self-contained HTML report to this file.")
@click.option("-q", "--quiet", is_flag=True, help="Print only the verdict and the errors.")
@click.option("-v", "--verbose", count=True, help="More logging.")
def audit_command(
    src: str, fmt: str | None, config: str | None, no_data: bool, strict: bool, as_json: bool,
    html_path: str | None, quiet: bool, verbose: int,
) -> None:
    """Audit the checkpoint in SRC (any format merge reads). Exit 0: no errors; 3: errors found; 1: unreadable."""
    from .audit import audit

    _setup_logging(verbose, quiet or as_json)
    bar = Bar("audit") if not (as_json or quiet or no_data) else None
    try:
        report: Report = _run(as_json, lambda: audit(src, config=config, format=fmt, data=not no_data, progress=bar), bar)
    finally:
        if bar is not None:
            bar.close()
    if strict:
        report = report.strict()
    if html_path is not None:
        from .audit.report_html import render

        try:
            with open(html_path, "w", encoding="utf-8") as f:
                f.write(render(report))
        except OSError as e:
            _fail(f"'{html_path}': cannot write the HTML report: {e.strerror or e}", as_json)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    else:
        _print_report(report, quiet)
    sys.exit(EXIT_OK if report.ok else EXIT_AUDIT)


@main.command("diff")
@click.argument("a", type=click.Path(path_type=str))
@click.argument("b", type=click.Path(path_type=str))
@click.option("--config", type=click.Path(path_type=str), help="config.json for A (and B); default: each side's own.")
@click.option("--config-b", type=click.Path(path_type=str), help="config.json for B when it differs from --config.")
@click.option("--format-a", type=FORMATS, help="Format of A (detected by default).")
@click.option("--format-b", type=FORMATS, help="Format of B (detected by default).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
def diff_command(
    a: str, b: str, config: str | None, config_b: str | None, format_a: str | None, format_b: str | None,
    as_json: bool, quiet: bool,
) -> None:
    """Compare two checkpoints of any formats and shardings. Exit 0: equal; 3: different; 1: unreadable."""
    from .diff import DiffResult, diff

    _setup_logging(0, quiet or as_json)
    bar = Bar("diff") if not (as_json or quiet) else None
    try:
        result: DiffResult = _run(as_json, lambda: diff(
            a, b, config=config, config_b=config_b, format_a=format_a, format_b=format_b, progress=bar,
        ), bar)
    finally:
        if bar is not None:
            bar.close()
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
    else:
        for d in result.differences:
            click.echo(f"  {shown(d.name)}: {escaped(d.describe())}")
        verdict = "equal" if result.equal else f"different ({len(result.differences)} tensors)"
        click.echo(f"{verdict}: {len(result.fingerprints)} tensors identical")
    sys.exit(EXIT_OK if result.equal else EXIT_AUDIT)


@main.command("split")
@click.argument("src", type=click.Path(path_type=str))
@click.argument("out", type=click.Path(path_type=str), required=False)
@click.option("--to", "to", type=click.Choice(TARGETS), required=True, help="Format to write: dcp (PyTorch Distributed Checkpoint).")
@click.option("--fsdp", type=click.IntRange(1), default=1, show_default=True, help="Ranks FSDP2 shards every tensor over (Shard(0)).")
@click.option("--tp", type=click.IntRange(1), default=1, show_default=True, help="Tensor-parallel ranks (torch's Llama/Mixtral plans).")
@click.option("--ep", type=click.IntRange(1), default=1, show_default=True, help="Expert-parallel ranks: Shard(0) of stacked experts; divides fsdp x tp.")
@click.option("--format", "fmt", type=FORMATS, help="Source format (detected by default).")
@click.option("--config", type=click.Path(path_type=str), help="config.json, or an HF directory holding one (default: in or next to SRC).")
@click.option("--dtype", type=DTYPES, help="Cast floating-point tensors (integer tensors are never cast).")
@click.option("--dry-run", is_flag=True, help="Print the plan, placements and local shapes; read no tensor data, write nothing.")
@click.option("--force", is_flag=True, help="Replace OUT if it holds only an earlier output of a split.")
@click.option("--workers", type=click.IntRange(1, 256), default=DEFAULT_WORKERS, show_default=True, help="Threads reading and writing at once.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout; no progress bar.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar, warnings only.")
@click.option("-v", "--verbose", count=True, help="More logging; with -v or --dry-run, every tensor's placements.")
def split_command(
    src: str, out: str | None, to: str, fsdp: int, tp: int, ep: int, fmt: str | None, config: str | None,
    dtype: str | None, dry_run: bool, force: bool, workers: int, as_json: bool, quiet: bool, verbose: int,
) -> None:
    """Write the checkpoint in SRC sharded for a device mesh into OUT (--to dcp: one file per rank).

    With --dry-run, OUT may be left out: the plan is printed and nothing is written.
    """
    if out is None and not dry_run:
        raise click.UsageError("Missing argument 'OUT' (only --dry-run runs without one).")
    quiet = quiet or not _speaks()
    _setup_logging(verbose, quiet or as_json)
    bar = Bar("split") if not (as_json or quiet or dry_run) else None
    try:
        result: SplitResult = _run(as_json, lambda: split(
            src, out, to=to, fsdp=fsdp, tp=tp, ep=ep, format=fmt, config=config, dtype=dtype, dry_run=dry_run,
            force=force, workers=workers, progress=bar,
        ), bar)
    finally:
        if bar is not None:
            bar.close()
    if not _speaks():
        return
    if result.restored:
        click.echo(f"note: {result.restored}", err=True)
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
        return
    for line in result.lines(verbose=bool(verbose)):
        click.echo(line)


def _print_result(result: MergeResult, verbose: int) -> None:
    plan = result.plan
    verb = "would write" if result.dry_run else "wrote"
    click.echo(f"source:   {shown(result.source)} ({result.format})")
    if result.parallel:
        click.echo(f"parallel: {' '.join(f'{k}={v}' for k, v in result.parallel.items())}")
    click.echo(f"config:   {result.config or '(none: generic merge)'}")
    click.echo(f"family:   {result.adapter}")
    click.echo(f"coverage: ok, {len(plan.targets)} tensors each covered exactly once")
    output = shown(result.output) if result.output is not None else "(none given)"
    click.echo(f"output:   {output} ({verb} {_size(plan.nbytes)} in {len(result.files)} file{'s' if len(result.files) != 1 else ''})")
    for f in result.files:
        click.echo(f"  {f.name}  {len(f.targets)} tensors  {_size(f.nbytes)}")
    if result.extras:
        click.echo(f"  + {', '.join(result.extras)}")
    if result.kept_files:
        click.echo(f"resumed:  kept {result.kept_files} of {len(result.files)} files of the interrupted merge (sha256 checked)")
    if result.dry_run:
        click.echo(f"peak memory: at most {_size(predict_peak_bytes(plan, result.workers))} with {result.workers} "
                   f"worker{'s' if result.workers != 1 else ''} (largest tensor {_size(plan.largest_target_bytes())})")
    for note in plan.notes:
        click.echo(f"note: {escaped(note)}")
    if result.dry_run or verbose:
        for t in plan.targets:
            shape = "x".join(str(n) for n in t.shape) or "scalar"
            pieces = f"{len(t.copies)} piece{'s' if len(t.copies) != 1 else ''}"
            click.echo(f"  {shown(t.name)}  {t.dtype} [{shape}]  <- {', '.join(map(shown, t.sources))} ({pieces})")


def _print_report(report: Report, quiet: bool) -> None:
    """A table of findings (errors only with ``quiet``) and the verdict."""
    listed = report.errors if quiet else report.findings
    if listed:
        width = min(max(len(f.code) for f in listed), 28)
        for f in listed:
            where = shown(f.tensor or f.file or "")
            click.echo(f"{f.severity:<7}  {f.code:<{width}}  {where}")
            click.echo(f"         {escaped(f.message)}")
    if report.adapter and not quiet:
        click.echo(f"family: {report.adapter}")
    _print_summary(report, "", err=False)


def _generic_warning(result: MergeResult) -> str:
    """The line a generic merge prints on stderr: nothing was checked, and without a config nothing loads it."""
    unchecked = "tensor names are kept as the source recorded them and nothing was checked against an architecture"
    if result.config is None:
        where = f"'{result.output}'" if result.output is not None else "the output"
        return (f"generic merge (no config.json found): {unchecked}; transformers cannot load {where} without a "
                "config.json (merge again with --config)")
    return f"generic merge (transformers has no causal LM for the config '{result.config}'): {unchecked}"


def _print_summary(report: Report, suffix: str, err: bool = True) -> None:
    s = report.summary()
    checked = "data and headers" if report.data_checked else "headers only"
    verdict = "PASS WITH WARNINGS" if report.ok and s["warnings"] else str(s["verdict"]).upper()
    click.echo(
        f"audit: {verdict}, {s['errors']} errors, {s['warnings']} warnings, {s['info']} info "
        f"({report.tensors} tensors, {checked}){suffix}",
        err=err,
    )


if __name__ == "__main__":
    main()
