"""What the commands print on a terminal: a merge's result, an audit's causes and its verdict line.

Data goes to stdout and warnings to stderr, as :mod:`ckpttool.cli` decides; this module only words them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from ckpttool.console.terminal import escaped, shown
from ckpttool.console.words import counted
from ckpttool.console.terminal import size_text as _size

if TYPE_CHECKING:
    from ckpttool.findings import Report
    from ckpttool.commands.merge_result import MergeResult


def print_result(result: MergeResult, verbose: int) -> None:
    plan = result.plan
    verb = "would write" if result.dry_run else "wrote"
    click.echo(f"source:   {shown(result.source)} ({result.format})")
    if result.parallel:
        click.echo(f"parallel: {' '.join(f'{k}={v}' for k, v in result.parallel.items())}")
    click.echo(f"config:   {result.config or '(none: generic merge)'}")
    click.echo(f"family:   {result.adapter}")
    click.echo(f"coverage: ok, {counted(len(plan.targets), 'tensor')} each covered exactly once")
    output = shown(result.output) if result.output is not None else "(none given)"
    click.echo(f"output:   {output} ({verb} {_size(plan.nbytes)} in {counted(len(result.files), 'file')})")
    for f in result.files:
        click.echo(f"  {f.name}  {counted(len(f.targets), 'tensor')}  {_size(f.nbytes)}")
    if result.extras:
        click.echo(f"  + {', '.join(result.extras)}")
    if result.kept_files:
        click.echo(f"resumed:  kept {result.kept_files} of {counted(len(result.files), 'file')} of the interrupted merge "
                   "(each checked again)")
    worst = result.worst_round_trip()
    if worst is not None:
        name, trip = worst
        dtype = next((t.dtype for t in plan.targets if t.name == name), None)  # what the weight was packed to
        method = "mxfp4" if name.endswith("_blocks") else {"I32": "int4", "U8": "nvfp4"}.get(str(dtype), "fp8")
        click.echo(f"{method + ':':<10}{counted(len(result.round_trips), 'weight')} quantized; worst round trip {shown(name)}: max |error| "
                   f"{trip.max_abs_error:.3g} (|weight| up to {trip.source_max:.3g}), relative RMS error "
                   f"{trip.relative_error:.3g}")
    if result.dry_run:
        from ckpttool.writers.hf import predict_peak_bytes
        click.echo(f"peak memory: at most {_size(predict_peak_bytes(plan, result.workers))} with "
                   f"{counted(result.workers, 'worker')} (largest tensor {_size(plan.largest_target_bytes())})")
    for note in plan.notes:
        if result.generic and note.startswith(GENERIC_NOTE):  # said once, by the command's warning (generic_warning)
            continue
        click.echo(f"note: {escaped(note)}")
    if result.dry_run or verbose:
        shapes: dict[tuple[int, ...], str] = {}  # a checkpoint has few shapes and 90k tensors
        lines = []
        for t in plan.targets:
            dims = t.shape if type(t.shape) is tuple else tuple(t.shape)
            shape = shapes.get(dims)
            if shape is None:
                shape = shapes[dims] = "x".join(map(str, dims)) or "scalar"
            pieces = counted(len(t.copies), "piece")
            through = f", {escaped(t.transform.name)}" if t.transform is not None else ""  # an index map of its pieces
            if t.lora:  # a fused target: which adapters change it
                through += "".join(f", + LoRA of '{shown(d.adapter)}'" for d in t.lora)
            lines.append(f"  {shown(t.name)}  {t.dtype} [{shape}]  <- {', '.join(map(shown, t.sources))} ({pieces}{through})")
            if len(lines) == ECHO_LINES:
                click.echo("\n".join(lines))
                lines.clear()
        if lines:
            click.echo("\n".join(lines))


#: how the plan's note of a generic merge begins (ckpttool.families.source.plan_layout); the warning says it instead
GENERIC_NOTE = "generic merge ("

#: the tensor lines of a dry run are printed this many at a time (one write each)
ECHO_LINES = 4096


#: tensors listed under a cause in the terminal; ``--json`` lists them all
CAUSE_LINES = 5


def print_report(report: Report, quiet: bool) -> None:
    """A table of causes, each with its first tensors (errors only with ``quiet``), and the verdict."""
    listed = [c for c in report.causes if c.severity == "error" or not quiet]
    width = min(max((len(c.code) for c in listed), default=0), 28)
    for c in listed:
        if len(c.findings) == 1:  # a cause of its own: the finding as it is
            f = c.findings[0]
            click.echo(f"{f.severity:<7}  {f.code:<{width}}  {shown(f.tensor or f.file or '')}")
            click.echo(f"         {escaped(f.message)}")
            continue
        click.echo(f"{c.severity:<7}  {c.code:<{width}}  {escaped(c.cause)}")
        click.echo(f"         e.g. {escaped(c.findings[0].message)}")
        for name in c.tensors[:CAUSE_LINES]:
            click.echo(f"         - {shown(name)}")
        if len(c.tensors) > CAUSE_LINES:
            click.echo(f"         ... and {len(c.tensors) - CAUSE_LINES} more (--json lists them all)")
    if report.adapter and not quiet:
        click.echo(f"family: {report.adapter}")
    print_summary(report, "", err=False)


def generic_warning(result: MergeResult) -> str:
    """The line a generic merge prints on stderr: nothing was checked, and without a config nothing loads it."""
    unchecked = "tensor names are kept as the source recorded them and nothing was checked against an architecture"
    if result.raw_names is not None:  # a convention's own names: no config.json copied beside them makes them loadable
        why = "no config.json found" if result.config is None else f"transformers has no causal LM for the config '{result.config}'"
        where = f"'{result.output}'" if result.output is not None else "the output"
        return (f"generic merge ({why}): the {result.raw_names} {unchecked}; transformers cannot load {where} (merge "
                "again with --config path/to/config.json of the HuggingFace model for its names)")
    if result.config is None:
        where = f"'{result.output}'" if result.output is not None else "the output"
        return (f"generic merge (no config.json found): {unchecked}; transformers cannot load {where} without a "
                "config.json (merge again with --config)")
    return f"generic merge (transformers has no causal LM for the config '{result.config}'): {unchecked}"


def print_summary(report: Report, suffix: str, err: bool = True) -> None:
    s = report.summary()
    checked = "data and headers" if report.data_checked else "headers only"
    verdict = "PASS WITH WARNINGS" if report.ok and s["warnings"] else str(s["verdict"]).upper()
    click.echo(
        f"audit: {verdict}, {report.counts()} ({counted(report.tensors, 'tensor')}, {checked}){suffix}",
        err=err,
    )
