"""``split``: the way back, from any source ckpttool reads to a sharded layout for a device mesh.

source -> the merge's coverage-checked plan (on-disk HuggingFace names, :func:`ckpttool.commands.merge.prepare`) -> the
model's in-memory tensors as slices of those (the family's rules run backwards, :func:`ckpttool.families.map_from_hf`)
-> every rank's box of each tensor on the mesh (:mod:`ckpttool.commands.meshes`) -> one plan target per box, its copies
reaching straight into the source's pieces and proven to tile it (:func:`ckpttool.plan.compose.compose`) -> the
streaming executor writes them into the target format's files, published atomically as merge publishes.

Targets (:data:`TARGETS`): ``dcp`` (PyTorch Distributed Checkpoint, :mod:`ckpttool.commands.split_dcp`, :mod:`ckpttool.writers.dcp`)
and ``megatron`` (Megatron-Core ``torch_dist`` for TP x PP x EP: the same DCP files under ``iter_0000000/`` with
Megatron's global names, :mod:`ckpttool.commands.split_megatron`, plus :mod:`ckpttool.writers.megatron_dist`'s files).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from ckpttool.execute.distributed import Group, share_out
from ckpttool.layout.layout import RAW
from ckpttool.plan.plan import Plan, plan_merge
from ckpttool.errors import ArgumentError, ConfigError, CoverageError, OutputError, SourceError
from ckpttool.commands.finish import config_dtype
from ckpttool.commands.merge import extras_search, prepare
from ckpttool.commands.meshes import MegatronMesh, Mesh, Sharding, mesh_for
from ckpttool.commands.split_result import SplitResult
from ckpttool.families.quantized import output_config
from ckpttool.families.source import Planned
from ckpttool.commands.split_dcp import NAMES, model_of, plan_dcp
from ckpttool.families.conventions.torchtitan_back import release_of
from ckpttool.commands.split_megatron import plan_megatron, training_args
from ckpttool.families.conventions.megatron_back import MODEL_TYPES as MEGATRON_TYPES, refuse_model_type
from ckpttool.model.config_file import find_config, read_config
from ckpttool.writers import dcp, megatron_dist
from ckpttool.writers.destination import SPLIT_MANIFEST, SPLIT_OUTPUT, check_destination
from ckpttool.writers.staging import Staging
from ckpttool.writers.manifest import write_manifest
from ckpttool.writers.hf import write_extras
from ckpttool.quant.formats import read_quantization

__all__ = ["MANIFEST", "TARGETS", "check_output", "split"]

log = logging.getLogger(__name__)

#: formats ``split`` writes
TARGETS = ("dcp", "megatron")
#: the manifest every split output holds: each file written, with its size (:mod:`ckpttool.writers.manifest`)
MANIFEST = SPLIT_MANIFEST


def split(
    src: str | Path,
    out: str | Path | None = None,
    *,
    to: str = "dcp",
    fsdp: int = 1,
    tp: int = 1,
    ep: int = 1,
    pp: int = 1,
    dp: int = 1,
    pp_first: int = 0,
    pp_last: int = 0,
    vpp: int = 1,
    etp: int = 0,
    make_vocab_size_divisible_by: int = 128,
    iteration: int = 0,
    names: str = "hf",
    format: str | None = None,
    config: str | Path | None = None,
    dtype: str | None = None,
    dry_run: bool = False,
    force: bool = False,
    workers: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> SplitResult:
    """Write a checkpoint sharded for a device mesh, as the parallelized model's ranks would save it.

    Args:
        src: any checkpoint ckpttool reads (HuggingFace, or a sharded format: a re-shard).
        out: the destination directory; must not exist or be empty unless ``force``. None only with ``dry_run``.
        to: the format written: ``"dcp"`` (PyTorch Distributed Checkpoint, read by ``torch.distributed.checkpoint.load``)
            or ``"megatron"`` (Megatron-Core ``torch_dist``, read by megatron-core's ``dist_checkpointing.load``: the
            iteration directory, ``common.pt``, ``metadata.json`` and the tracker file; see
            :mod:`ckpttool.commands.split_megatron`).
        fsdp: ranks FSDP2 shards every tensor over (``Shard(0)``).
        tp: tensor-parallel ranks (torch's Llama/Mixtral plans; see :mod:`ckpttool.commands.meshes`).
        ep: expert-parallel ranks for stacked experts (``Shard(0)`` of the expert dim); divides ``fsdp * tp``
            for ``dcp``; for ``megatron``, Megatron's expert-parallel size (global expert ids, consecutive per rank).
        dp: ``dcp`` only: data-parallel replicas of the ``fsdp x tp`` mesh, as FSDP2's HSDP places them
            (``Replicate()`` on an outer mesh dim; ``dp * fsdp * tp`` rank files, each chunk in one of them,
            written by the rank torch's ``dedup_save_plans`` picks).
        pp, make_vocab_size_divisible_by, iteration: ``megatron`` only: pipeline stages (equal, consecutive
            layers), the vocab padding rule (as Megatron-LM's argument: padded to a multiple of it times ``tp``;
            the padding rows are zeros) and the iteration directory written (``iter_0000000``).
        pp_first, pp_last, vpp: ``megatron`` only: the layers of the first and of the last stage (Megatron-LM's
            ``--decoder-first-pipeline-num-layers``, ``--decoder-last-pipeline-num-layers``; 0: as the others,
            the rest shared evenly by the stages between), or virtual pipeline stages (``vpp`` model chunks per
            stage, layers numbered as megatron-core numbers them: chunk ``c`` of stage ``s`` holds the
            ``(c * pp + s)``-th run of ``num_layers / (pp * vpp)`` layers); see
            :func:`ckpttool.commands.split_megatron.layer_stages`.
        etp: ``megatron`` only: the expert tensor-parallel size, 1 (every expert whole on its ranks) or ``tp``
            (0: the model's default, see :meth:`~ckpttool.commands.meshes.MegatronMesh.expert_tp`).
        names: ``dcp`` only: the tensor names written (:data:`~ckpttool.commands.split_dcp.NAMES`): ``"hf"``
            (transformers' in-memory names), ``"torchtitan"`` (torchtitan 0.3's names, Q/K rows in Meta's RoPE
            order, placed as torchtitan's plan places them: a torchtitan job resumes from it) or
            ``"torchtitan-0.2"`` (the names of torchtitan 0.2: ``attention.wq``, ``output``).
        format, config, dtype: as for :func:`ckpttool.merge`; a config is required (it names the tensors as the
            model holds them in memory).
        dry_run: plan and check only; read no tensor data, write nothing.
        force: replace a destination holding only an earlier output of a split: every file in it listed, with its
            size, in the ``.ckpttool-split.json`` each split writes (:data:`MANIFEST`). A training run's own
            ``dcp.save`` or Megatron ``torch_dist`` save is never replaced.
        workers: threads reading and writing chunks at once.
        progress: called as ``progress(bytes_just_written, total_bytes)``.

    Under ``torchrun --nproc_per_node N`` every process calls this; the rank files are shared out among them.

    Returns:
        A :class:`SplitResult`: the mesh, every tensor's placements and local shapes, the files.

    Raises:
        ArgumentError: ``to`` not in :data:`TARGETS`, a mesh size below 1 or above
            :data:`~ckpttool.commands.meshes.MAX_RANKS` (each, and all together), ``make_vocab_size_divisible_by``
            above :data:`~ckpttool.commands.meshes.MAX_DIVISIBLE_BY`, ``iteration`` above
            :data:`~ckpttool.commands.meshes.MAX_ITERATION`, ``ep`` that does not divide ``fsdp * tp``, an option
            of the other target (``dp`` above 1 for ``megatron``), ``names`` not in
            :data:`~ckpttool.commands.split_dcp.NAMES` or other than ``"hf"`` for ``megatron``, ``out`` None without
            ``dry_run``. All of these,
            and the destination (DestinationError), are checked before the source is read.
        ConfigError: no config; a quantized source (FP8, MXFP4: merge it with a dtype first; ``megatron`` with a
            ``dtype`` dequantizes FP8 block-scaled weights while splitting, in chunks that start on a block); a tensor the mesh
            cannot place (no tensor-parallel rule, experts ``ep`` does not divide, more ranks than the tensors
            have rows); the source does not fit the config; ``names="torchtitan"`` for a model torchtitan has no model of
            (:data:`~ckpttool.families.conventions.torchtitan_back.FAMILIES`) or a tensor it has no name for.
        CoverageError: a tensor is not covered exactly once by the source. DestinationError, SourceError,
            OutputError: as for merge; nothing is published.

    Example:
        >>> split("hf/llama", "dcp/llama", fsdp=2, tp=2)  # doctest: +SKIP
    """
    if to not in TARGETS:
        raise ArgumentError(f"to={to!r}: split writes {', '.join(map(repr, TARGETS))} (PyTorch Distributed Checkpoint, "
                            "Megatron-Core torch_dist)")
    _check_names(to, names)
    # every argument and the destination are checked before the source is read: a refusal costs no read
    mesh = mesh_for(to, fsdp=fsdp, tp=tp, ep=ep, pp=pp, dp=dp, divisible_by=make_vocab_size_divisible_by,
                    iteration=iteration, pp_first=pp_first, pp_last=pp_last, vpp=vpp, etp=etp)
    if out is None and not dry_run:
        raise ArgumentError("out=None: give the destination directory (only a dry run, dry_run=True, needs none)")
    root, dest = Path(src), (Path(out) if out is not None else None)
    if dest is not None:
        check_destination(dest, [root], force, SPLIT_OUTPUT)
    _refuse_by_config(root, config, isinstance(mesh, MegatronMesh), dtype)
    group = Group()
    restored, extras = None, []
    try:
        prepared = prepare(root, format=format, config=config, dtype=dtype)
        if isinstance(mesh, MegatronMesh):
            info = model_of(prepared)
            shardings, files = plan_megatron(prepared, info, mesh)
            notes: tuple[str, ...] = ()
        else:
            shardings, files, notes = plan_dcp(prepared, mesh, names)
        plan = Plan(str(root), prepared.layout.format, tuple(i.target for f in files for i in f.items), prepared.plan.notes)
        if dest is not None and not dry_run:
            total = sum(f.data_bytes for f in files)
            on_bytes = (lambda n: progress(n, total)) if progress else (lambda n: None)
            owner = share_out([f.nbytes for f in files], group.world)
            mine = [f for f, rank in zip(files, owner) if rank == group.rank]
            staging = Staging(dest, sources=[root], force=force, output=SPLIT_OUTPUT)
            entered, restored = group.on_rank0(lambda: (str(staging.open()), staging.restoration))
            path = Path(entered)
            try:
                if isinstance(mesh, MegatronMesh):  # the rank files go into the iteration directory
                    path = path / megatron_dist.iteration_name(mesh.iteration)
                    group.on_rank0(lambda: path.mkdir(exist_ok=True))
                group.on_all(lambda: dcp.write_files(root, mine, path, workers=workers, on_bytes=on_bytes))
                extras = group.on_rank0(lambda: _finish(staging, prepared, files, dtype, root, mesh, shardings))
            except BaseException as e:
                if group.rank == 0:
                    staging.abandon(e)
                raise
            log.info("wrote %d chunks (%d bytes) to %s", len(plan.targets), plan.nbytes, dest)
    finally:
        group.close()
    return SplitResult(
        source=str(root), output=str(dest) if dest is not None else None, format=prepared.layout.format, to=to,
        mesh=mesh, plan=plan, files=files, tensors=tuple(shardings),
        config=str(prepared.config_path) if prepared.config_path else None,
        adapter=(f"{prepared.adapter}; written in the Megatron-Core convention" if isinstance(mesh, MegatronMesh)
                 else f"{prepared.adapter}; written in torchtitan {release_of(names)}'s names" if names != "hf"
                 else prepared.adapter),
        dry_run=dry_run, extras=tuple(extras), workers=workers, restored=restored,
        notes=(*prepared.plan.notes, *notes),
    )


def _check_names(to: str, names: str) -> None:
    """``names`` is one of :data:`~ckpttool.commands.split_dcp.NAMES`, and other than ``"hf"`` only for ``dcp``.

    Raises:
        ArgumentError: naming the option and what it takes.
    """
    if names not in NAMES:
        raise ArgumentError(f"names={names!r}: split writes the names {', '.join(map(repr, NAMES))}")
    if names != "hf" and to != "dcp":
        raise ArgumentError(f"names={names!r} is for to='dcp' (torchtitan saves a PyTorch Distributed Checkpoint); "
                            f"to={to!r} writes its own names")


def _refuse_by_config(root: Path, config: str | Path | None, megatron: bool, dtype: str | None) -> None:
    """Refuse what the source's config alone decides, before any index of the checkpoint is read or the model
    described (on DeepSeek-V3-671B's release, 163 headers and transformers' description: 8-20 s of CPU): a quantized
    source (:func:`_refuse_quantized`), except to Megatron with a ``dtype`` for a model type it writes (FP8
    block-scaled weights are dequantized there chunk by chunk, :func:`ckpttool.plan.compose.compose`); then, to
    Megatron, a model type with no Megatron-Core form. Without a config nothing is decided here (the split then
    refuses for want of one, once the source is read).

    Raises:
        ConfigError: as :func:`_refuse_quantized` and
            :func:`~ckpttool.families.conventions.megatron_back.refuse_model_type`; the config cannot be read.
    """
    config_path = find_config(root, config)
    found = read_config(config_path) if config_path is not None else None
    if found is None:
        return
    model_type = found.get("model_type")
    if not (megatron and dtype is not None and model_type in MEGATRON_TYPES):
        _refuse_quantized(str(root), found, str(config_path))  # a quantized source of another type: the clearer message
    if megatron and isinstance(model_type, str):
        refuse_model_type(model_type)


def _refuse_quantized(root: str, config: dict[str, object], label: str) -> None:
    """A split writes the model's in-memory tensors, which a quantized source holds only as quantized bytes and
    scales (FP8 block-scaled, MXFP4): refused before anything is read, planned or written, dequantized or not.

    Raises:
        ConfigError: the source's config declares a quantization.
    """
    quant = read_quantization(config, label)
    if quant is not None:
        raise ConfigError(
            f"'{root}': a quantized source ({quant.describe()}, the quantization_config of '{label}') "
            "cannot be split yet: split writes the model's in-memory tensors, not quantized bytes and scales. Merge it "
            "with --dtype bfloat16 first (ckpttool merge SRC HF --dtype bfloat16), then split that output; nothing was "
            "written"
        )


def _finish(staging: Staging, prepared: Planned, files: tuple[dcp.DcpFile, ...], dtype: str | None, root: Path,
            mesh: Mesh | MegatronMesh, shardings: list[Sharding]) -> list[str]:
    """Once every rank file is written: ``.metadata`` (for Megatron in the iteration directory, with
    ``common.pt``, ``metadata.json`` and the tracker), config and tokenizer files, the check that the output reads
    back as planned, then the rename into place. Returns the extra files written."""
    path = checkpoint = staging.path
    if isinstance(mesh, MegatronMesh):
        checkpoint = path / megatron_dist.iteration_name(mesh.iteration)
        args = training_args(model_of(prepared), mesh, {s.name: s.shape for s in shardings})
        megatron_dist.write_common(checkpoint, args, mesh.iteration)
        megatron_dist.write_tracker(path, mesh.iteration)
    dcp.write_metadata(files, checkpoint)
    dequantized = any(t.dequant is not None for t in prepared.plan.targets)  # FP8 to --dtype: no quantization_config
    extras = write_extras(path, output_config(prepared.config, dequantized), extras_search(root, prepared.config_path),
                          config_dtype(prepared.config, prepared.plan, cast=dtype is not None))
    check_output(checkpoint, files)
    write_manifest(path, MANIFEST, SPLIT_OUTPUT.command)  # last: it lists every file above, so --force knows this output for ours
    staging.publish()
    return extras


def check_output(path: Path, files: tuple[dcp.DcpFile, ...]) -> None:
    """Read the written checkpoint back as ckpttool reads any DCP checkpoint (metadata, every item's archive
    located in place) and prove it holds every planned tensor, with its shape and dtype, covered exactly once.

    Raises:
        OutputError: it does not; nothing is published.
    """
    from ckpttool.readers import read_layout

    planned = {i.fqn: (i.global_shape, i.target.dtype) for f in files for i in f.items}
    try:
        layout = read_layout(path, format="dcp")
        plan_merge(layout)
    except (SourceError, CoverageError) as e:
        raise OutputError(f"the written checkpoint does not read back: {e}; nothing was published") from None
    found = {n: (t.global_shape, t.dtype) for n, t in layout.tensors.items()}
    unlocated = sorted({p.file for t in layout.tensors.values() for p in t.pieces if p.encoding != RAW})
    if found != planned or unlocated:
        wrong = sorted(n for n in planned.keys() | found.keys() if planned.get(n) != found.get(n))
        raise OutputError(f"the written checkpoint does not read back as planned (tensors {wrong[:5]}, archives not "
                          f"located in {unlocated[:5]}); nothing was published")
