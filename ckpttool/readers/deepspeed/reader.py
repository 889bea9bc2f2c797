"""DeepSpeed checkpoints (``engine.save_checkpoint``): ZeRO-1/2/3, bf16, pipeline stages, universal.

On disk, under ``SAVE_DIR/<tag>/`` (``SAVE_DIR/latest`` names the tag, e.g. ``global_step2``)::

    mp_rank_00_model_states.pt                    ZeRO-0/1/2 and pipeline: the module's state dict
                                                  ('module'), 'param_shapes' (one ordered {name: shape}
                                                  per optimizer param group), 'buffer_names',
                                                  'shared_params' {alias: owner}, 'frozen_param_shapes'
                                                  and 'frozen_param_fragments' (params not optimized)
    zero_pp_rank_R_mp_rank_00_model_states.pt     ZeRO-3: the same, per data-parallel rank R, with
                                                  empty placeholders in 'module'
    [bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt
                                                  per data-parallel rank R: 'optimizer_state_dict' with
                                                  the rank's fp32 master partition
    layer_XX-model_states.pt                      pipeline: the state dict of pipeline layer XX; there
                                                  mp_rank_SS is pipeline stage SS, with its own
                                                  param_shapes and optimizer files
    zero/<param name>/fp32.pt                     universal checkpoint (ds_to_universal, tag in
                                                  'latest_universal'): {'param': the whole fp32 tensor}
    layer_L_expert_E_mp_rank_00_model_states.pt   MoE (deepspeed.moe.layer.MoE): expert E's module weights;
                                                  experts have param groups and partition counts of their
                                                  own, read by :mod:`.moe` (format 'deepspeed-moe')

Pipeline parameters are named ``<layer index>.<name in the layer>``; the index is dropped when the layers'
names do not collide (layers that wrap HF modules then keep the HF names), as in the layer files.

The fp32 master weights lie in the optimizer files as flat partitions, laid out per optimizer (ZeRO-1/2,
BF16_Optimizer, ZeRO-3) as :mod:`.zero` describes and reassembles; ``partition_count`` records the
data-parallel world size, and a missing rank file leaves its region uncovered, named by the coverage check.
Every tensor is described as RAW boxes at byte offsets inside the ``.pt`` files; nothing is loaded here.

Tensor parallelism: ``mp_rank_TT`` is TP rank TT. AutoTP (``tensor_parallel.autotp_size``) records each
parameter's split in the model states, read by :mod:`.autotp`; Megatron-style ranks record none and are
refused (so is a step whose recorded ``tp_degree`` exceeds its ranks). With ``weights="master"``, a universal
checkpoint converted from the step and lying beside it is read instead, with a note (:mod:`.universal`).

``weights="module"`` takes the module's own weights (the bf16 ones under bf16) from the model states
instead; ZeRO-3 saves placeholders there, so it is refused. Pickles are read with stand-ins for the few
DeepSpeed classes they name (:data:`~ckpttool.readers.deepspeed.classes.ALLOW`); DeepSpeed is never imported.

The reader is split by what each part knows: this module holds the reader's entry points (:func:`matches`,
:func:`read`) and picks the variant; :mod:`.files` finds and loads the files of a step;
:mod:`.pieces` turns whole tensors into pieces; :mod:`.zero` reassembles ZeRO's flat fp32
partitions; :mod:`.whole` reads pipeline layer files and universal checkpoints. Every file is loaded
through this module's ``_scan``, passed down to the helpers.
"""

from __future__ import annotations

from pathlib import Path

from ckpttool.model.description import ModelInfo
from ckpttool.layout.layout import Layout
from ckpttool.errors import SourceError, SourceNotFoundError
from ckpttool.readers.base import FormatReader
from ckpttool.readers.deepspeed.autotp import is_autotp, read_autotp, recorded_tp
from ckpttool.readers.deepspeed.files import (
    LAYER_STATES, LAYER_TP_STATES, MODEL_STATES, OPTIM_STATES, ZERO3_MODEL_STATES, dp_from_optim, first_model_states, has_states, step_dir, step_rel,
)
# the two hooks every read of this reader goes through, bound here so one replacement reaches them all
from ckpttool.readers.deepspeed.files import param_shapes as _shapes
from ckpttool.readers.deepspeed.files import scan_file as _scan
from ckpttool.readers.deepspeed.moe import is_moe, read_moe
from ckpttool.readers.deepspeed.pieces import add_module, SharingBuilder, strip_layer_index
from ckpttool.readers.deepspeed.universal import choose, way_out
from ckpttool.readers.deepspeed.whole import read_layers, read_universal
from ckpttool.readers.deepspeed.zero import read_zero3, read_zero12

__all__ = ["LOOKS_FOR", "NAME", "OPTIONS", "matches", "read"]

NAME = "deepspeed"
LOOKS_FOR = "'latest' or global_step*/ with *_model_states.pt and *_optim_states.pt (DeepSpeed)"
OPTIONS = ("weights",)


def matches(root: Path) -> bool:
    """Whether ``root`` is a DeepSpeed checkpoint: a step folder, or a folder holding one (``latest``,
    ``global_step*``)."""
    try:
        step = step_dir(root)
    except SourceError:  # a 'latest' naming nothing: ours when DeepSpeed checkpoints lie beside it (read() says why)
        return any(p.is_dir() and has_states(p) for p in root.iterdir())
    return step is not None and has_states(step)


def read(root: Path, model: ModelInfo | None, weights: str = "master") -> Layout:
    """The layout of a DeepSpeed checkpoint: the fp32 master weights (``weights='master'``) or the module state
    dict (``'module'``)."""
    if weights not in ("master", "module"):
        raise SourceError(f"weights= must be 'master' or 'module', not {weights!r}")
    step = step_dir(root)
    if step is None:
        raise SourceNotFoundError(f"'{root}': no DeepSpeed checkpoint ('latest', global_step*/ or *_model_states.pt)")
    tag = step.relative_to(root).as_posix() if step != root else ""
    files = sorted(p.name for p in step.iterdir() if p.is_file())
    builder = SharingBuilder(str(root), NAME)
    universal = step if (step / "zero").is_dir() and not any(n.endswith("_optim_states.pt") for n in files) else None
    if universal is None and weights == "master" and not any(LAYER_STATES.match(n) for n in files):
        choice = choose(step, via_latest=step != root)  # a universal checkpoint of this step beside it
        if choice.path is not None:  # read from the folder holding both: the step's may be the source itself
            universal, root = choice.path, root if choice.path.is_relative_to(root) else choice.path.parent
            builder = SharingBuilder(str(root), NAME)
        for note in choice.notes:
            builder.note(note)
    if universal is not None:
        read_universal(root, universal, universal.relative_to(root).as_posix() if universal != root else "", builder,
                        scan=_scan)
        return builder.build()
    layers = sorted((int(m.group(1)), n) for n in files if (m := LAYER_STATES.match(n)))
    zero3_models = sorted((int(m.group(1)), int(m.group(2)), n) for n in files if (m := ZERO3_MODEL_STATES.match(n)))
    models = sorted((int(m.group(1)), n) for n in files if (m := MODEL_STATES.match(n)))
    optims = sorted((int(m.group(3)), int(m.group(2)), m.group(1) or "", n) for n in files if (m := OPTIM_STATES.match(n)))
    mp_ranks = sorted({r for r, _ in models} | {r for _, r, _ in zero3_models} | {r for r, _, _, _ in optims})
    pipeline = bool(layers)
    tp_layers = [n for n in files if LAYER_TP_STATES.match(n)]
    tp = 1 if pipeline else max(len(mp_ranks), 1)
    first = None if pipeline or tp_layers or not models else first_model_states(root, step, tag, models, scan=_scan)
    recorded = recorded_tp(first) if first is not None else 1  # a rank missing altogether is still tensor parallel
    if max(tp, recorded) > 1 and first is not None and is_autotp(first):  # AutoTP records each tensor's split
        read_autotp(root, step, tag, models, optims, first, builder, weights=weights, scan=_scan)
        return builder.build()
    if tp > 1 or tp_layers or recorded > 1:
        raise SourceError(
            f"'{step_rel(tag, tp_layers[0] if tp_layers else '') or root}': model-parallel ranks {mp_ranks} (tensor "
            f"parallelism{f', of {recorded} recorded' if recorded > len(mp_ranks) else ''}): these files do not "
            f"record how each tensor is split; {way_out(step)}"
        )
    if is_moe(files):  # expert parallelism: its own param groups and per-expert files (.moe)
        return read_moe(root, step, tag, files, weights, scan=_scan)
    builder.set_parallel(tp=1, pp=len(mp_ranks) if pipeline else 1, dp=1)
    if weights == "module":
        if zero3_models and not models:
            raise SourceError(
                f"'{step_rel(tag, zero3_models[0][2])}': a ZeRO-3 checkpoint keeps only empty placeholders in the "
                "module states (the weights live partitioned in the optimizer files); use weights='master'"
            )
        if pipeline:
            read_layers(root, step, tag, layers, builder, scan=_scan)
        else:
            state = first_model_states(root, step, tag, models, scan=_scan)
            add_module(state, builder, names=None, why="module weights")
            builder.note(f"module weights from '{state.rel}' (not the fp32 master weights)")
        builder.set_parallel(dp=dp_from_optim(optims))
        return builder.build()
    if not optims:
        raise SourceError(
            f"'{step_rel(tag, '')}': no *_optim_states.pt files, so no fp32 master weights; pass weights='module' to "
            "take the module's weights"
        )
    if zero3_models:
        read_zero3(root, step, tag, mp_ranks[0], optims, zero3_models, builder, scan=_scan)
        return builder.build()
    states = {r: first_model_states(root, step, tag, [m for m in models if m[0] == r], scan=_scan) for r in mp_ranks}
    # pipeline parameters are named '<layer index>.<name in the layer>'; the index goes when the names in the
    # layers do not collide (a pipeline that wraps HF modules keeps the HF names there)
    names = [n for state in states.values() for g in _shapes(state) for n in g]
    strip = pipeline and len({strip_layer_index(n) for n in names}) == len(names)
    for mp_rank, state in states.items():
        read_zero12(root, step, tag, state, [o for o in optims if o[0] == mp_rank], builder, strip_layer=strip,
                     scan=_scan)
    if pipeline:
        builder.note(f"pipeline of {len(mp_ranks)} stages (one mp_rank_XX file each)"
                             + ("; layer indices dropped from the names" if strip else ""))
    return builder.build()


READER = FormatReader(NAME, LOOKS_FOR, matches, read, OPTIONS)
