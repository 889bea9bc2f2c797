"""``merge``: source checkpoint -> layout -> coverage-checked plan -> HuggingFace safetensors, atomically.

:func:`merge` runs its steps in order: the quantize options checked (:func:`_quantize_options`, from the config
alone), the plan prepared (:func:`prepare_and_adapter`) and its adapters attached (:func:`_attach_adapters`), the
files assigned and the destination checked, then, unless a dry run, the weights written in a staging directory and
the output finished there and published (:func:`_write`, :mod:`ckpttool.commands.finish`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from ckpttool.model.config_file import find_config, read_config
from ckpttool.execute.distributed import Group, share_out
from ckpttool.io.dtypes import cast_dtype
from ckpttool.plan.plan import Plan
from ckpttool.errors import ArgumentError, Interrupted, SourceError
from ckpttool.families.quantize import MXFP4_DTYPE, quantize_block, refuse_requantizing
from ckpttool.families.quantize_packed import PackScheme
from ckpttool.families.quantize_release import Release, check_method
from ckpttool.commands.finish import finish_output
from ckpttool.commands.merge_result import MergeResult
from ckpttool.commands.release import read_release
from ckpttool.quant.formats import MXFP4, read_quantization
from ckpttool.findings import Report
from ckpttool.commands.source import plan_source_and_adapter
from ckpttool.readers.dcp import locating_deferred
from ckpttool.families.source import Planned
from ckpttool.quant.encode import RoundTrip
from ckpttool.lora.adapter import read_adapter
from ckpttool.lora.attach import attach_to_family
from ckpttool.lora.embedded import Embedded, source_adapter
from ckpttool.families.registry import adapter_for
from ckpttool.writers.destination import check_destination
from ckpttool.writers.staging import Staging
from ckpttool.writers.files import OutputFile
from ckpttool.writers.hf import assign_files, find_extras, write_weights
from ckpttool.writers.journal import clean_staging, plan_id

__all__ = ["extras_search", "merge", "prepare", "prepare_and_adapter"]

log = logging.getLogger(__name__)


def prepare(
    src: str | Path, *, format: str | None = None, config: str | Path | None = None, dtype: str | None = None,
    weights: str | None = None, quantize: tuple[int, int] | str | PackScheme | None = None, drop: Sequence[str] = (),
) -> Planned:
    """Read the source's layout and the config, and build the coverage-checked plan. Reads no tensor data.

    With a config that transformers knows, targets get the on-disk HuggingFace names of its family's adapter and
    are checked against the architecture; without one (or for an unknown architecture), the merge is generic:
    tensor names are kept as the source recorded them, and a note says so (see :mod:`ckpttool.families.source`).

    Raises:
        ConfigError: tensors that do not fit the config; CoverageError: targets not covered exactly once.
    """
    return prepare_and_adapter(src, format=format, config=config, dtype=dtype, weights=weights, quantize=quantize,
                               drop=drop)[0]


def prepare_and_adapter(
    src: str | Path, *, format: str | None = None, config: str | Path | None = None, dtype: str | None = None,
    weights: str | None = None, quantize: tuple[int, int] | str | None = None, drop: Sequence[str] = (),
) -> tuple[Planned, Embedded | None]:
    """:func:`prepare`, and the LoRA adapter the source holds with its base (:mod:`ckpttool.lora.embedded`), or None."""
    root = Path(src)
    cast = cast_dtype(dtype)  # checked before anything is read
    planned, embedded = plan_source_and_adapter(root, format=format, config=config, dtype=cast, weights=weights,
                                                quantize=quantize, drop=drop)
    planned.refuse()
    skipped = find_extras(extras_search(root, planned.config_path))[1].values()  # files not copied, and why
    return replace(planned, plan=replace(planned.plan, notes=(*planned.plan.notes, *skipped))), embedded


def _refuse_requantizing(root: Path, config: str | Path | None, quantizing: tuple[int, int] | str | PackScheme) -> None:
    """A merge that quantizes a source whose config declares a quantization is refused from the config alone, before
    any index of the checkpoint is read or the model described (see :func:`ckpttool.families.quantize.refuse_requantizing`)."""
    config_path = find_config(root, config)
    if config_path is not None:
        refuse_requantizing(quantizing, read_quantization(read_config(config_path), str(config_path)), str(root))


def extras_search(root: Path, config_path: Path | None) -> list[Path]:
    """Where tokenizer and generation files are looked for: beside the config, then in the source."""
    return list(dict.fromkeys([*([config_path.parent] if config_path is not None else []), root]))


def merge(
    src: str | Path,
    out: str | Path | None = None,
    *,
    format: str | None = None,
    config: str | Path | None = None,
    dtype: str | None = None,
    max_shard_size: str | int = "5GB",
    dry_run: bool = False,
    force: bool = False,
    audit: bool = True,
    resume: bool = False,
    verify: bool = False,
    workers: int = 1,
    progress: Callable[[int, int], None] | None = None,
    weights: str | None = None,
    quantize: str | None = None,
    block: int | tuple[int, int] | None = None,
    verify_forward: bool = False,
    raw_names: bool = False,
    drop: Sequence[str] = (),
    adapters: Sequence[str | Path] = (),
    adapter_config: str | Path | None = None,
    group: int | None = None,
    scales_from: str | Path | None = None,
) -> MergeResult:
    """Merge a sharded checkpoint into a HuggingFace-loadable safetensors directory.

    Args:
        src: the checkpoint directory (any supported format).
        out: the destination directory; must not exist or be empty unless ``force``. May be None only with
            ``dry_run`` (to see the plan before choosing where it goes).
        format: reader name; detected when None.
        config: ``config.json`` or a directory holding it; found in or next to ``src`` when None.
        dtype: cast floating-point tensors to ``"bfloat16"``, ``"float16"`` or ``"float32"`` (aliases ``"bf16"``,
            ``"fp16"``, ``"fp32"``); integer tensors are never cast; ``config.json`` names the dtype written.
        max_shard_size: largest output file, e.g. ``"5GB"`` (decimal units) or bytes.
        dry_run: plan and check only; read no tensor data, write nothing.
        force: replace a non-empty destination.
        audit: audit what was written (headers, names and shapes against the config, index, dtypes), write
            the report to ``ckpttool-audit.json`` beside it, and refuse to publish when it finds errors.
        resume: continue an interrupted merge of the same plan: output files it finished are kept once their
            digest is checked again (chunks copied file to file against their source); the rest are written.
        verify: read every written file back from disk and compare its digest with the bytes written.
        workers: threads reading and writing chunks at once.
        progress: called as ``progress(bytes_just_written, total_bytes)`` after each tensor.
        weights: for formats holding both, ``"master"`` (fp32 optimizer master weights, the default) or
            ``"module"`` (the module's own weights).
        quantize: ``"fp8"``: write the Linear weights of the decoder layers as FP8 E4M3 with float32
            ``weight_scale_inv`` per ``block`` (see :mod:`ckpttool.families.quantize`), and a
            ``quantization_config``; the round trip of each is in :attr:`MergeResult.round_trips`.
            ``"mxfp4"`` (gpt-oss): its experts as the release's MXFP4 ``_blocks`` and ``_scales``, everything
            else in ``dtype`` (bfloat16 when None, the release's), and the release's ``quantization_config``.
            ``"int4"`` / ``"int4-asym"``: the same weights as FP8 does, packed as compressed-tensors
            ``pack-quantized`` INT4 (W4A16) in ``group``s, bit for bit what compressed-tensors' observer and
            compressor write (:mod:`ckpttool.quant.pack_encode`), and its ``quantization_config``; ``"nvfp4"``:
            the same weights as compressed-tensors ``nvfp4-pack-quantized``.
        block: the FP8 block size, rows and columns (an int for both; default 128x128).
        group: the INT4 group size, values per scale along a row (default 32; 0: one scale per row).
        scales_from: with ``quantize="int4"`` (``"int4-asym"``, ``"nvfp4"``), a packed release (a HuggingFace
            folder) whose own scales, zero points and global scales the weights are re-packed with, the weights it
            packs and its ``quantization_config``: values on its grid (a dequantized release, a QAT model) give
            its bytes back; a value off the grid beyond rounding is refused (:mod:`ckpttool.quant.on_grid`).
        verify_forward: before publishing, load the output with transformers strictly and run a forward
            (:func:`ckpttool.verify.forward.check_output`); a problem stops the publish. Needs a config.
        raw_names: for a source named in a convention of its own (Megatron-Core, Megatron legacy, DeepSpeed
            MoE) that no config maps to HuggingFace names: write its names as it recorded them (transformers
            loads none of them; :attr:`MergeResult.raw_names` names the convention). Without it such a merge
            is refused.
        drop: tensors to leave out, each a name or a regular expression matched against the whole HuggingFace
            name (a tensor the architecture does not have is otherwise an error); each must match one. The
            model's non-persistent buffers (``rotary_emb.inv_freq``), which some savers write, are dropped
            without asking, with a note.
        adapters: PEFT LoRA adapter folders to fuse into the weights, in order (see :mod:`ckpttool.lora`): each
            targeted weight is written as ``W + scaling * B @ A`` computed as PEFT 0.21's ``merge_and_unload``
            computes it, chunk by chunk; the plan's notes name each adapter and the tensors it changed.
            A source that holds a LoRA adapter with its base (a PEFT-wrapped model saved by FSDP2 / DCP or verl:
            ``base_layer`` and ``lora_A`` / ``lora_B`` names) has it fused first, by default
            (:attr:`MergeResult.embedded` says so).
        adapter_config: that adapter's ``adapter_config.json`` (its scaling); by default the one beside ``src``.

    Under ``torchrun --nproc_per_node N`` every process calls this; output files are shared out among them
    by bytes (see :mod:`ckpttool.execute.distributed`) and every process returns the same result.

    Returns:
        A :class:`MergeResult` describing the output.

    Raises:
        CoverageError: a tensor is not covered exactly once (missing rank file, overlap).
        AuditError: the written checkpoint has audit errors (``audit=True``); nothing was published.
        ForwardError: the written checkpoint fails its forward check (``verify_forward=True``); nothing was published.
        SourceError, ConfigError, DestinationError: bad input, config or destination; nothing is written.
            ConfigError too, without ``raw_names``, for a source whose names are not HuggingFace's and that no
            config maps.
        SourceError: too for an adapter that cannot be read or fused (a module not in the base, shapes that do
            not fit, DoRA); the message names its file and tensor. And for a source holding an adapter with its
            base but no ``adapter_config.json`` beside it and none given (the scaling is only there).
        ArgumentError: ``dtype`` is not one ckpttool casts to, or ``out`` is None without ``dry_run``; ``quantize``
            unknown, ``"fp8"``, ``"int4"`` or ``"nvfp4"`` given with ``dtype``, ``"mxfp4"`` or ``"int4"`` with
            ``block``, ``group`` without ``"int4"`` or out of range.

    Example:
        >>> merge("fixtures/llama_fsdp2_dcp/checkpoint", "out/llama")  # doctest: +SKIP
    """
    if out is None and not dry_run:
        raise ArgumentError("out=None: give the destination directory (only a dry run, dry_run=True, needs none)")
    root, dest = Path(src), (Path(out) if out is not None else None)
    quantizing, release, dtype = _quantize_options(root, config, dtype, quantize, block, group, scales_from)
    round_trips: dict[str, RoundTrip] = {}
    processes = Group()
    try:
        with locating_deferred(dry_run):  # a dry run reads no byte: DCP items are located by the run that reads them
            prepared, embedded = prepare_and_adapter(root, format=format, config=config, dtype=dtype, weights=weights,
                                                     quantize=quantizing, drop=drop)
        if not raw_names:
            prepared.refuse_raw_names()
        plan, own_note = _attach_adapters(root, prepared, embedded, adapters, adapter_config,
                                          quantize if quantizing is not None else None)
        if not plan.targets:
            raise SourceError(f"'{root}': the checkpoint holds no model tensors ({'; '.join(plan.notes)})")
        files = tuple(assign_files(plan, max_shard_size))
        if dest is not None:
            check_destination(dest, [root, *map(Path, adapters), *([Path(release.root)] if release else [])], force)
        extras: list[str] = []
        report, kept, restored = None, 0, None
        if dest is not None and not dry_run:
            extras, report, kept, restored = _write(
                root, dest, prepared, plan, files, processes, adapters=adapters, force=force, resume=resume,
                progress=progress, verify=verify, workers=workers, round_trips=round_trips, dtype=dtype, audit=audit,
                verify_forward=verify_forward,
            )
    finally:
        processes.close()
    return MergeResult(
        source=str(root),
        output=str(dest) if dest is not None else None,
        format=prepared.layout.format,
        parallel=dict(prepared.layout.parallel),
        plan=plan,
        files=files,
        extras=tuple(extras),
        config=str(prepared.config_path) if prepared.config_path else None,
        dry_run=dry_run,
        audit=report,
        kept_files=kept,
        workers=workers,
        restored=restored,
        generic=prepared.generic,
        adapter=prepared.adapter,
        round_trips=round_trips,
        raw_names=prepared.raw_names,
        embedded=own_note,
    )


def _quantize_options(
    root: Path, config: str | Path | None, dtype: str | None, quantize: str | None, block: int | tuple[int, int] | None,
    group: int | None, scales_from: str | Path | None,
) -> tuple[tuple[int, int] | str | PackScheme | None, Release | None, str | None]:
    """What ``quantize`` (with ``block``, ``group``, ``scales_from``) asks, checked before the checkpoint is read:
    the quantization, the release re-packed to (or None) and the dtype written (gpt-oss's MXFP4 release keeps
    everything but its experts in bfloat16). A source whose config declares a quantization is refused from the
    config alone."""
    quantizing = quantize_block(quantize, block, group)
    release = None
    if scales_from is not None:
        if not isinstance(quantizing, PackScheme):
            raise ArgumentError(f"scales_from='{scales_from}' re-packs to a release's own grid: give quantize='int4', "
                                "'int4-asym' or 'nvfp4' (the release's format) too")
        release = read_release(scales_from)
        check_method(str(quantize), group, release)
        quantizing = replace(quantizing, release=release)
    if quantizing == MXFP4:  # the release's layout: everything but the experts in bfloat16, unless told otherwise
        dtype = dtype or MXFP4_DTYPE
    elif quantizing is not None and dtype is not None:
        what = {"fp8": "FP8", "nvfp4": "NVFP4"}.get(str(quantize), "packed INT4")
        raise ArgumentError(f"quantize={quantize!r} and dtype={dtype!r} together: quantize writes {what} weights and "
                            "keeps every other tensor's dtype. Give one of them (cast first with a merge given dtype=, then quantize)")
    if quantizing is not None:  # the config alone decides it: refused before the checkpoint is read
        _refuse_requantizing(root, config, quantizing)
    return quantizing, release, dtype


def _attach_adapters(
    root: Path, prepared: Planned, embedded: Embedded | None, adapters: Sequence[str | Path],
    adapter_config: str | Path | None, quantize: str | None,
) -> tuple[Plan, str | None]:
    """The plan with the LoRA adapters fused into its targets: the source's own (``embedded``) first, then
    ``adapters`` in order; and the note of the source's own, or None. ``quantize`` (None when not quantizing)
    refuses any adapter: a fuse and a quantization are two merges."""
    own = source_adapter(root, embedded, adapter_config)
    read = [*own, *map(read_adapter, adapters)]
    if read and quantize is not None:
        raise ArgumentError(f"quantize={quantize!r} with adapters: fuse first (a merge given adapters=), then quantize")
    plan = attach_to_family(prepared.plan, read, adapter_for(prepared.model) if prepared.model is not None else None)
    # attach_adapters appends one note per adapter, in order: the source's own comes first
    return plan, plan.notes[len(plan.notes) - len(read)] if own else None


def _write(
    root: Path, dest: Path, prepared: Planned, plan: Plan, files: tuple[OutputFile, ...], group: Group, *,
    adapters: Sequence[str | Path], force: bool, resume: bool, progress: Callable[[int, int], None] | None,
    verify: bool, workers: int, round_trips: dict[str, RoundTrip], dtype: str | None, audit: bool,
    verify_forward: bool,
) -> tuple[list[str], Report | None, int, str | None]:
    """Write the weights files in a staging directory beside ``dest`` (this process's share of them), then on rank 0
    finish the output there and publish it; on any failure the staging directory is abandoned (kept for a resume
    when interrupted). Returns the extra files written, the audit report, the files a resume kept and what was
    restored at the destination."""
    total = plan.nbytes  # once: a sum over every target, and on_bytes is called per chunk (90k and more)
    on_bytes = (lambda n: progress(n, total)) if progress else (lambda n: None)
    owner = share_out([f.nbytes for f in files], group.world)
    mine = [f for f, rank in zip(files, owner) if rank == group.rank]
    identity = plan_id(plan, files)
    staging = Staging(dest, sources=[root, *map(Path, adapters)], force=force, resume=resume)
    entered, restored = group.on_rank0(lambda: _enter(staging, identity))
    path = Path(entered)
    try:
        kept = sum(group.on_all(lambda: write_weights(
            plan, mine, path, identity, on_bytes, verify=verify, workers=workers, rank=group.rank,
            round_trips=round_trips,
        )))

        extras, report = group.on_rank0(lambda: finish_output(
            staging, plan, files, config=prepared.config, model=prepared.model,
            config_label=str(prepared.config_path) if prepared.config_path else None,
            search=extras_search(root, prepared.config_path), dtype=dtype, audit=audit,
            verify_forward=verify_forward,
        ))
    except BaseException as e:
        if group.rank == 0:
            staging.abandon(e)
            if isinstance(e, KeyboardInterrupt) and staging.kept is not None:
                raise Interrupted(str(staging.kept)) from None
        raise
    log.info("wrote %d tensors (%d bytes) to %s", len(plan.targets), plan.nbytes, dest)
    return extras, report, kept, restored


def _enter(staging: Staging, identity: str) -> tuple[str, str | None]:
    """Lock the destination, create (or, with resume, take up) the staging directory and clear what no journal
    of this plan holds. Returns its path and what was restored at the destination, if anything."""
    path = staging.open()
    try:
        clean_staging(path, identity)
    except BaseException:
        staging.release()  # the staging directory stays as it is: a resume refused it untouched
        raise
    return str(path), staging.restoration
