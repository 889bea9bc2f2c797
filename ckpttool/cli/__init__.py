"""The ``ckpttool`` command line: parse options, call the API, hand the result to one output sink.

Data goes to stdout, progress and logs to stderr; ``--json`` prints exactly one JSON document and turns
progress off. How a command runs (its errors worded for the command line, exit codes, Ctrl-C, JSON, logging):
:mod:`ckpttool.cli.running`.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

import click

from ckpttool.cli.choices import FORMAT_NAMES, SPLIT_NAMES, SPLIT_TARGETS
from ckpttool.cli.running import EXIT_AUDIT, EXIT_OK, fail, printed_as_json, run, setup_logging, speaks
from ckpttool.cli.show import generic_warning, print_report, print_result, print_summary
from ckpttool.commands.meshes import MAX_DIVISIBLE_BY, MAX_ITERATION, MAX_RANKS
from ckpttool.fast.jsontext import dumps as json_text
from ckpttool.console.terminal import Bar, Group, escaped, shown
from ckpttool.version import __version__

if TYPE_CHECKING:  # the commands import the API when they run: --help stays torch-free (tests/test_startup.py)
    from ckpttool.findings import Report
    from ckpttool.commands.merge_result import MergeResult

FORMATS = click.Choice(list(FORMAT_NAMES))
#: what --dtype casts floating-point tensors to (ckpttool.io.dtypes.CAST_DTYPES); integer tensors are never cast
DTYPES = click.Choice(["bfloat16", "float16", "float32", "bf16", "fp16", "fp32"], case_sensitive=False)
DEFAULT_WORKERS = min(8, os.cpu_count() or 1)


def merge(*args: Any, **kwargs: Any) -> MergeResult:
    """:func:`ckpttool.merge`, imported when a merge runs (torch with it); tests replace this name."""
    from ckpttool.commands.merge import merge as api

    return api(*args, **kwargs)


def _check_size(ctx: click.Context, param: click.Parameter, value: str) -> str:
    from ckpttool.writers.hf import parse_size

    try:
        parse_size(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    return value


def _check_block(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, int] | None:
    if value is None:
        return None
    parts = value.lower().split("x")
    if len(parts) > 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise click.BadParameter(f"{value!r}: give the FP8 block size as 128 or ROWSxCOLS, e.g. 128x128")
    return int(parts[0]), int(parts[-1])


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
@click.option("--quantize", type=click.Choice(["fp8", "mxfp4", "int4", "int4-asym", "nvfp4"]), help="fp8: write the Linear "
              "weights of the decoder layers as FP8 E4M3 with a float32 weight_scale_inv per block, and a "
              "quantization_config; norms, embeddings, lm_head, routers and biases are kept. mxfp4 (gpt-oss): its "
              "experts as the release's _blocks and _scales, everything else in bfloat16 (or --dtype). int4, "
              "int4-asym: the same weights packed as compressed-tensors pack-quantized INT4 (W4A16), symmetric or "
              "with zero points, one bfloat16 scale per --group values; nvfp4: as compressed-tensors "
              "nvfp4-pack-quantized. Reports each weight's round-trip error.")
@click.option("--block", callback=_check_block, help="FP8 block size for --quantize: 128 (the default, 128x128) or ROWSxCOLS.")
@click.option("--group", type=click.IntRange(0, 1 << 16), help="INT4 group size for --quantize int4: values per scale "
              "along a row (default 32, Kimi K2's; 0: one scale per row).")
@click.option("--scales-from", type=click.Path(path_type=str), metavar="RELEASE", help="With --quantize int4, "
              "int4-asym or nvfp4: re-pack with the scales (zero points, global scales) of this packed release, its "
              "packed weights and its quantization_config, so values on its grid (a dequantized release, a QAT model) "
              "give its bytes back; a value off its grid is refused.")
@click.option("--max-shard-size", default="5GB", show_default=True, callback=_check_size, help="Largest output file: 5GB, 500MB (decimal), 5GiB, 500MiB (binary), or bytes.")
@click.option("--weights", type=click.Choice(["master", "module"]), help="Where both are saved (DeepSpeed): fp32 master weights (default) or the module's weights.")
@click.option("--dry-run", is_flag=True, help="Print the plan and its coverage verdict; read no tensor data, write nothing.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists and is not empty.")
@click.option("--no-audit", is_flag=True, help="Do not audit the output (by default audit errors stop the publish).")
@click.option("--resume", is_flag=True, help="Continue an interrupted merge: keep the output files it finished (each checked again).")
@click.option("--verify", is_flag=True, help="Read every written file back from disk and compare its digest.")
@click.option("--verify-forward", is_flag=True, help="Before publishing, load OUT with transformers strictly and run a "
              "forward (see ckpttool verify); a problem stops the publish.")
@click.option("--raw-names", is_flag=True, help="With no config to name them for HuggingFace, write the tensor names of a "
              "Megatron or DeepSpeed MoE source as it recorded them (transformers cannot load them); refused without it.")
@click.option("--drop", multiple=True, metavar="NAME|REGEX", help="Leave out the tensors this name or regular expression "
              "matches (whole HuggingFace names; repeatable), e.g. an extra tensor the architecture lacks.")
@click.option("--adapter", "adapters", multiple=True, metavar="ADAPTER", type=click.Path(path_type=str),
              help="Fuse this PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors or .bin) into "
              "the weights, as PEFT's merge_and_unload does (repeatable: fused in the order given).")
@click.option("--adapter-config", type=click.Path(path_type=str), help="The adapter_config.json of a LoRA adapter SRC "
              "holds with its base (a PEFT model saved by FSDP2/DCP or verl), fused by default (default: the one "
              "beside SRC).")
@click.option("--adapter-only", is_flag=True, help="Write only the LoRA adapter SRC holds with its base, as a PEFT "
              "adapter folder OUT (adapter_config.json + adapter_model.safetensors) that PeftModel.from_pretrained "
              "loads.")
@click.option("--workers", type=click.IntRange(1, 256), default=DEFAULT_WORKERS, show_default=True, help="Threads reading and writing at once.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout; no progress bar.")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing on success: no progress bar, no summary; warnings and errors "
              "still go to stderr.")
@click.option("-v", "--verbose", count=True, help="More logging (-vv for debug); with --dry-run, list every tensor.")
def merge_command(
    src: str, out: str | None, fmt: str | None, config: str | None, dtype: str | None, max_shard_size: str, weights: str | None,
    dry_run: bool, force: bool, no_audit: bool, resume: bool, verify: bool, workers: int, as_json: bool, quiet: bool,
    verbose: int, quantize: str | None = None, block: tuple[int, int] | None = None, verify_forward: bool = False,
    raw_names: bool = False, drop: tuple[str, ...] = (), adapters: tuple[str, ...] = (),
    adapter_config: str | None = None, adapter_only: bool = False, group: int | None = None,
    scales_from: str | None = None,
) -> None:
    """Merge the checkpoint in SRC into a HuggingFace safetensors directory OUT.

    With --dry-run, OUT may be left out: the plan is printed and nothing is written.
    """
    if out is None and not dry_run:
        raise click.UsageError("Missing argument 'OUT' (only --dry-run runs without one).")
    if adapter_only:
        _export_adapter(src, out, fmt, config, adapter_config, force, dry_run, as_json, quiet, verbose,
                        dtype=dtype, quantize=quantize, adapters=adapters, drop=drop)
        return
    if block is not None and quantize is None:
        raise click.UsageError("--block is the FP8 block size of --quantize fp8; give --quantize fp8 too.")
    if block is not None and quantize == "mxfp4":
        raise click.UsageError("--block is the FP8 block size of --quantize fp8; MXFP4 scales groups of 32 values.")
    if block is not None and quantize in ("int4", "int4-asym", "nvfp4"):
        raise click.UsageError("--block is the FP8 block size of --quantize fp8; INT4 scales --group values of a row, "
                               "NVFP4 16.")
    if group is not None and quantize not in ("int4", "int4-asym"):
        raise click.UsageError("--group is the INT4 group size of --quantize int4; give --quantize int4 too.")
    if scales_from is not None and quantize not in ("int4", "int4-asym", "nvfp4"):
        raise click.UsageError("--scales-from re-packs with a release's scales; give --quantize int4, int4-asym or "
                               "nvfp4 (the release's format) too.")
    if quantize in ("fp8", "int4", "int4-asym", "nvfp4") and dtype is not None:
        raise click.UsageError(f"--quantize and --dtype are exclusive: --quantize writes {quantize.upper()} weights and keeps "
                               "every other tensor's dtype (cast first with a merge given --dtype, then quantize).")
    quiet = quiet or not speaks()
    setup_logging(verbose, quiet or as_json)
    bar = Bar() if not (as_json or quiet or dry_run) else None
    result: MergeResult = run(as_json, lambda: merge(
        src, out, format=fmt, config=config, dtype=dtype, max_shard_size=max_shard_size, dry_run=dry_run,
        force=force, audit=not no_audit, resume=resume, verify=verify, workers=workers, progress=bar, weights=weights,
        quantize=quantize, block=block, verify_forward=verify_forward, raw_names=raw_names, drop=drop,
        **({"adapters": adapters} if adapters else {}),
        **({"adapter_config": adapter_config} if adapter_config else {}),
        **({"group": group} if group is not None else {}),
        **({"scales_from": scales_from} if scales_from is not None else {}),
    ), bar)
    if result.embedded is not None and not quiet:  # the output is not the base alone: say so, whatever the mode
        click.echo(f"note: {result.embedded}, as it was saved with the base", err=True)
    if printed_as_json(result, as_json):
        return
    if not quiet:  # -q: nothing on success but a warning (errors never reach here)
        print_result(result, verbose)
    if result.generic:
        click.echo(f"warning: {generic_warning(result)}", err=True)
    if result.audit is not None and not quiet:
        print_summary(result.audit, f" (report: {result.output}/ckpttool-audit.json)")


def _export_adapter(src: str, out: str | None, fmt: str | None, config: str | None, adapter_config: str | None,
                    force: bool, dry_run: bool, as_json: bool, quiet: bool, verbose: int, **others: object) -> None:
    """``merge --adapter-only``: the options that do not apply are usage errors; then the API's export."""
    given = [f"--{name.replace('_', '-')}" for name, value in others.items() if value] + ["--dry-run"] * dry_run
    if given:
        raise click.UsageError(f"--adapter-only writes the adapter SRC holds as it was saved; {', '.join(given)} "
                               "does not apply to it.")
    from ckpttool.commands.adapter_only import export_adapter

    setup_logging(verbose, quiet or as_json)
    result = run(as_json, lambda: export_adapter(src, out, format=fmt, config=config, adapter_config=adapter_config,
                                                  force=force), None)
    if printed_as_json(result, as_json):
        return
    if not quiet:
        click.echo(f"wrote the LoRA adapter of '{src}' ({result.modules} modules, rank {result.ranks}) to '{out}': "
                   f"{', '.join(result.files)}")


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
    from ckpttool.audit import audit

    setup_logging(verbose, quiet or as_json)
    bar = Bar("audit") if not (as_json or quiet or no_data) else None
    report: Report = run(as_json, lambda: audit(src, config=config, format=fmt, data=not no_data, progress=bar), bar)
    if strict:
        report = report.strict()
    if html_path is not None:
        from ckpttool.audit.report_html import render

        try:
            with open(html_path, "w", encoding="utf-8") as f:
                f.write(render(report))
        except OSError as e:
            fail(f"'{html_path}': cannot write the HTML report: {e.strerror or e}", as_json)
        click.echo(f"HTML report written to {shown(html_path)}", err=True)  # a message: stdout keeps the data
    if as_json:
        click.echo(json_text(report.to_json()))
    else:
        print_report(report, quiet)
    sys.exit(EXIT_OK if report.ok else EXIT_AUDIT)


@main.command("diff")
@click.argument("a", type=click.Path(path_type=str))
@click.argument("b", type=click.Path(path_type=str))
@click.option("--config", type=click.Path(path_type=str), help="config.json for A (and B); default: each side's own.")
@click.option("--config-b", type=click.Path(path_type=str), help="config.json for B when it differs from --config.")
@click.option("--format-a", type=FORMATS, help="Format of A (detected by default).")
@click.option("--format-b", type=FORMATS, help="Format of B (detected by default).")
@click.option("--dequantize", is_flag=True, help="Compare float32 values, FP8/MXFP4 weights dequantized (default: stored bytes).")
@click.option("--adapter", "adapters", multiple=True, metavar="ADAPTER", type=click.Path(path_type=str),
              help="Fuse this PEFT LoRA adapter folder into B on the fly, as merge --adapter fuses it (repeatable), "
              "and compare A with the fuse: is A base B + ADAPTER?")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
def diff_command(
    a: str, b: str, config: str | None, config_b: str | None, format_a: str | None, format_b: str | None,
    as_json: bool, quiet: bool, dequantize: bool = False, adapters: tuple[str, ...] = (),
) -> None:
    """Compare two checkpoints of any formats and shardings. Exit 0: equal; 3: different; 1: unreadable."""
    from ckpttool.commands.diff import DiffResult, diff

    setup_logging(0, quiet or as_json)
    bar = Bar("diff") if not (as_json or quiet) else None
    result: DiffResult = run(as_json, lambda: diff(
        a, b, config=config, config_b=config_b, format_a=format_a, format_b=format_b, progress=bar,
        dequantize=dequantize, adapters=adapters,
    ), bar)
    if as_json:
        click.echo(json_text(result.to_json()))
    else:
        for note in result.fused:
            click.echo(f"B: {escaped(note)}")
        for d in result.differences:
            click.echo(f"  {shown(d.name)}: {escaped(d.describe())}")
        click.echo(result.summary())
    sys.exit(EXIT_OK if result.equal else EXIT_AUDIT)


@main.command("verify")
@click.argument("out", type=click.Path(path_type=str))
@click.option("--against", "ref", metavar="REF", type=click.Path(path_type=str), help="Reference to compare logits with: an HF directory or any format merge reads.")
@click.option("--tokens", metavar="N", type=click.IntRange(1, 4096), help="Feed N fixed token ids instead of the tokenizer's fixed sentence (at most 4096, ckpttool.verify.MAX_TOKENS).")
@click.option("--text", metavar="FILE", type=click.Path(path_type=str), help="Feed this text file, tokenized by the checkpoint's tokenizer (at most 1 MiB and 4096 tokens).")
@click.option("--tolerance", metavar="REL", type=click.FloatRange(0, min_open=True), help="Largest |Δlogit| relative to the reference's logit scale (default by dtype: float32 1e-5, bfloat16 3e-2).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")
def verify_command(out: str, ref: str | None, tokens: int | None, text: str | None, tolerance: float | None,
                   as_json: bool) -> None:
    """Load OUT with transformers as a user will (strictly) and run a forward; with --against, compare the logits.

    Never runs code shipped in a checkpoint: a config or tokenizer config with an auto_map is refused.

    Exit 0: loads, logits sound (and equal to REF's within tolerance); 3: a check fails; 1: cannot run.
    """
    from ckpttool.commands.verify import verify

    if tokens is not None and text is not None:
        raise click.UsageError("--tokens and --text are exclusive: feed fixed ids or a text, not both.")
    setup_logging(0, as_json)
    result = run(as_json, lambda: verify(out, against=ref, tokens=tokens, text=text,
                                          tolerance=tolerance))
    if as_json:
        click.echo(json_text(result.to_json()))
    else:
        for line in result.lines():
            click.echo(escaped(line))
    sys.exit(EXIT_OK if result.ok else EXIT_AUDIT)


@main.command("split")
@click.argument("src", type=click.Path(path_type=str))
@click.argument("out", type=click.Path(path_type=str), required=False)
@click.option("--to", "to", type=click.Choice(SPLIT_TARGETS), required=True, help="Format to write: dcp (PyTorch Distributed Checkpoint) or megatron (Megatron-Core torch_dist).")
@click.option("--fsdp", type=click.IntRange(1, MAX_RANKS), default=1, show_default=True, help="Ranks FSDP2 shards every tensor over (Shard(0)).")
@click.option("--tp", type=click.IntRange(1, MAX_RANKS), default=1, show_default=True, help="Tensor-parallel ranks (torch's Llama/Mixtral plans).")
@click.option("--ep", type=click.IntRange(1, MAX_RANKS), default=1, show_default=True, help="Expert-parallel ranks: Shard(0) of stacked experts; divides fsdp x tp.")
@click.option("--pp", type=click.IntRange(1, MAX_RANKS), default=1, show_default=True, help="--to megatron: pipeline stages (equal, consecutive layers unless --pp-first, --pp-last or --vpp).")
@click.option("--pp-first", "pp_first", type=click.IntRange(1, MAX_RANKS * MAX_RANKS), default=None, help="--to megatron: layers of the first pipeline stage (Megatron-LM's --decoder-first-pipeline-num-layers); the stages between share the rest evenly.")
@click.option("--pp-last", "pp_last", type=click.IntRange(1, MAX_RANKS * MAX_RANKS), default=None, help="--to megatron: layers of the last pipeline stage (--decoder-last-pipeline-num-layers).")
@click.option("--vpp", type=click.IntRange(1, MAX_RANKS), default=1, show_default=True, help="--to megatron: virtual pipeline stages per stage (--virtual-pipeline-model-parallel-size), layers numbered as megatron-core does.")
@click.option("--dp", type=click.IntRange(1, MAX_RANKS), default=1, show_default=True, help="--to dcp: data-parallel replicas (FSDP2 HSDP: Replicate() over dp; each chunk saved once).")
@click.option("--etp", type=click.IntRange(1, MAX_RANKS), help="--to megatron: expert tensor-parallel size, 1 or --tp (default: --tp; 1 for gpt-oss).")
@click.option("--make-vocab-size-divisible-by", "divisible_by", type=click.IntRange(1, MAX_DIVISIBLE_BY), default=128, show_default=True, help="--to megatron: pad the vocab to a multiple of this x tp (zeros), as Megatron-LM's argument.")
@click.option("--iteration", type=click.IntRange(0, MAX_ITERATION), default=0, show_default=True, help="--to megatron: the iteration directory written (iter_0000000).")
@click.option("--names", type=click.Choice(SPLIT_NAMES), default="hf", show_default=True, help="--to dcp: the tensor names "
              "written: transformers' in-memory ones, or torchtitan's (0.3; torchtitan-0.2: attention.wq, output) with Q/K in "
              "Meta's RoPE order and torchtitan's placements, so a torchtitan job resumes from it.")
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
    src: str, out: str | None, to: str, fsdp: int, tp: int, ep: int, pp: int, dp: int, divisible_by: int, iteration: int,
    fmt: str | None, config: str | None, dtype: str | None, dry_run: bool, force: bool, workers: int, as_json: bool,
    quiet: bool, verbose: int, names: str = "hf", pp_first: int | None = None, pp_last: int | None = None,
    vpp: int = 1, etp: int | None = None,
) -> None:
    """Write the checkpoint in SRC sharded for a device mesh into OUT (--to dcp: one file per rank; --to megatron:
    a Megatron-Core torch_dist iteration directory for --tp x --pp x --ep).

    With --dry-run, OUT may be left out: the plan is printed and nothing is written. --force replaces only an
    earlier split's output, every file as its .ckpttool-split.json lists it.
    """
    from pathlib import Path

    from ckpttool.commands.meshes import check_target_options, mesh_for
    from ckpttool.errors import ArgumentError
    from ckpttool.writers.destination import SPLIT_OUTPUT, check_destination

    if out is None and not dry_run:
        raise click.UsageError("Missing argument 'OUT' (only --dry-run runs without one).")
    stages = dict(pp_first=pp_first or 0, pp_last=pp_last or 0, vpp=vpp, etp=etp or 0)
    try:  # an option of the other target is a usage error
        check_target_options(to, fsdp=fsdp, dp=dp, pp=pp, divisible_by=divisible_by, iteration=iteration, **stages)
    except ArgumentError as e:
        raise click.UsageError(str(e)) from None
    if names != "hf" and to != "dcp":
        raise click.UsageError(f"--names {names} is for --to dcp (torchtitan saves a PyTorch Distributed Checkpoint); "
                               f"--to {to} writes its own names.")
    quiet = quiet or not speaks()
    setup_logging(verbose, quiet or as_json)
    # the mesh and OUT are checked before the split (and torch) is even imported: a refusal takes no time
    run(as_json, lambda: mesh_for(to, fsdp=fsdp, tp=tp, ep=ep, pp=pp, dp=dp, divisible_by=divisible_by,
                                   iteration=iteration, **stages))
    if out is not None:
        run(as_json, lambda: check_destination(Path(out), [Path(src)], force, SPLIT_OUTPUT))
    from ckpttool.commands.split import split
    bar = Bar("split") if not (as_json or quiet or dry_run) else None
    result = run(as_json, lambda: split(
        src, out, to=to, fsdp=fsdp, tp=tp, ep=ep, pp=pp, dp=dp, make_vocab_size_divisible_by=divisible_by,
        iteration=iteration, names=names, **stages, format=fmt, config=config, dtype=dtype, dry_run=dry_run,
        force=force, workers=workers, progress=bar,
    ), bar)
    if printed_as_json(result, as_json):
        return
    for line in result.lines(verbose=bool(verbose)):
        click.echo(line)


if __name__ == "__main__":
    main()
