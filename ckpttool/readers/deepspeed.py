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

Pipeline parameters are named ``<layer index>.<name in the layer>``; the index is dropped when the layers'
names do not collide (layers that wrap HF modules then keep the HF names), as in the layer files.

Where the fp32 master weights are, per optimizer:

- ZeRO-1/2 (``zero_stage`` 1 or 2): ``single_partition_of_fp32_groups[g]`` is rank R's slice of group g's
  flat buffer. The flat buffer is the group's parameters in ``param_shapes`` order, each followed by
  ``param_alignment_paddings[g][i]`` elements, then padding up to an equal split; each rank saves its slice
  less the padding it holds (``group_paddings[g]``), so the slices laid end to end are exactly the
  parameters and their alignment paddings. A parameter may straddle two ranks.
- BF16_Optimizer (bf16 with ZeRO-1 and fp32 gradient accumulation; no ``zero_stage``): the same keys, but
  slices are saved whole, parameters are back to back, and ``group_paddings`` counts the padding at the end
  (non-zero on the last rank only).
- ZeRO-3 (``zero_stage`` 3): ``fp32_flat_groups`` of rank R, laid end to end, hold for every parameter in
  ``param_shapes`` order its elements ``R*p .. (R+1)*p`` with ``p = ceil(numel / world)`` (the last rank's
  share padded with zeros).

``partition_count`` records the data-parallel world size; it must equal the number of rank files. The flat
buffers must be consumed exactly; a missing rank file leaves its region uncovered, and the coverage check
names the file. Every tensor is described as RAW boxes at byte offsets inside the ``.pt`` files
(:func:`ckpttool.layout.range_boxes` cuts a flat range of a parameter into boxes); nothing is loaded here.

``weights="module"`` takes the module's own weights (the bf16 ones under bf16) from the model states
instead; ZeRO-3 saves placeholders there, so it is refused. Pickles are read with stand-ins for the few
DeepSpeed classes they name (:data:`ALLOW`); DeepSpeed is never imported.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import torch_save
from ..dtypes import itemsize
from ..errors import SourceError, SourceNotFoundError
from ..layout import RAW, Box, Layout, LayoutBuilder, Piece, range_boxes
from ..models import ModelInfo
from ..paths import inside, open_source, read_tag
from .deepspeed_universal import universal_instead, way_out
from ..pickle_bounds import EnumStandIn
from ..safe_pickle import Record
from ..torch_save import StoredTensor
from ..validate import dims, expect, field, integer

NAME = "deepspeed"
LOOKS_FOR = "'latest' or global_step*/ with *_model_states.pt and *_optim_states.pt (DeepSpeed)"
OPTIONS = ("weights",)

_MODEL = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_ZERO3_MODEL = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_OPTIM = re.compile(r"^(bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_LAYER = re.compile(r"^layer_(\d+)-model_states\.pt$")
#: a pipeline layer saved per tensor-parallel rank ('layer_01-model_00-model_states.pt')
_LAYER_TP = re.compile(r"^layer_(\d+)-(.+)-model_states\.pt$")
_UNIVERSAL_WEIGHT = "fp32.pt"


class _Record(Record):
    kind = "DeepSpeed"


#: the exact non-tensor classes DeepSpeed's checkpoints pickle, as inert stand-ins (nothing is imported):
#: the ZeRO stage enum, the loss scalers (static; dynamic under fp16), the param slice mappings of the optimizer
#: state, and the training args Megatron-DeepSpeed adds to the model states
ALLOW: Mapping[tuple[str, str], Any] = {
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"): EnumStandIn(  # ZeroStageEnum(2) -> 2
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        {"disabled": 0, "optimizer_states": 1, "gradients": 2, "weights": 3, "max_stage": 3},
    ),
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"): _Record,
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"): _Record,
    ("deepspeed.utils.tensor_fragment", "fragment_address"): _Record,
    ("argparse", "Namespace"): _Record,
}


@dataclass(frozen=True, slots=True)
class _Loaded:
    """A scanned ``.pt`` file: its path relative to the layout's root and its object tree."""

    rel: str
    obj: Any


def matches(root: Path) -> bool:
    try:
        step = _step_dir(root)
    except SourceError:  # a 'latest' naming nothing: ours when DeepSpeed checkpoints lie beside it (read() says why)
        return any(p.is_dir() and _has_states(p) for p in root.iterdir())
    return step is not None and _has_states(step)


def read(root: Path, model: ModelInfo | None, weights: str = "master") -> Layout:
    if weights not in ("master", "module"):
        raise SourceError(f"weights= must be 'master' or 'module', not {weights!r}")
    step = _step_dir(root)
    if step is None:
        raise SourceNotFoundError(f"'{root}': no DeepSpeed checkpoint ('latest', global_step*/ or *_model_states.pt)")
    tag = step.relative_to(root).as_posix() if step != root else ""
    files = sorted(p.name for p in step.iterdir() if p.is_file())
    builder = _Builder(str(root), NAME)
    if (step / "zero").is_dir() and not any(n.endswith("_optim_states.pt") for n in files):
        _read_universal(root, step, tag, builder)
        return builder.build()
    layers = sorted((int(m.group(1)), n) for n in files if (m := _LAYER.match(n)))
    zero3_models = sorted((int(m.group(1)), int(m.group(2)), n) for n in files if (m := _ZERO3_MODEL.match(n)))
    models = sorted((int(m.group(1)), n) for n in files if (m := _MODEL.match(n)))
    optims = sorted((int(m.group(3)), int(m.group(2)), m.group(1) or "", n) for n in files if (m := _OPTIM.match(n)))
    mp_ranks = sorted({r for r, _ in models} | {r for _, r, _ in zero3_models} | {r for r, _, _, _ in optims})
    pipeline = bool(layers)
    tp_layers = [n for n in files if _LAYER_TP.match(n)]
    tp = 1 if pipeline else max(len(mp_ranks), 1)
    if tp > 1 or tp_layers:
        raise SourceError(
            f"'{_rel(tag, tp_layers[0] if tp_layers else '') or root}': model-parallel ranks {mp_ranks} (tensor "
            f"parallelism): these files do not record how each tensor is split; {way_out(step)}"
        )
    builder.parallel = {"tp": 1, "pp": len(mp_ranks) if pipeline else 1, "dp": 1}
    if weights == "module":
        if zero3_models and not models:
            raise SourceError(
                f"'{_rel(tag, zero3_models[0][2])}': a ZeRO-3 checkpoint keeps only empty placeholders in the "
                "module states (the weights live partitioned in the optimizer files); use weights='master'"
            )
        if pipeline:
            _read_layers(root, step, tag, layers, builder)
        else:
            state = _model_states(root, step, tag, models)
            _add_module(state, builder, names=None, why="module weights")
            builder.notes.append(f"module weights from '{state.rel}' (not the fp32 master weights)")
        builder.parallel["dp"] = _dp_from_optim(optims)
        return builder.build()
    if not optims:
        raise SourceError(
            f"'{_rel(tag, '')}': no *_optim_states.pt files, so no fp32 master weights; pass weights='module' to "
            "take the module's weights"
        )
    if zero3_models:
        _read_zero3(root, step, tag, mp_ranks[0], optims, zero3_models, builder)
        return builder.build()
    states = {r: _model_states(root, step, tag, [m for m in models if m[0] == r]) for r in mp_ranks}
    # pipeline parameters are named '<layer index>.<name in the layer>'; the index goes when the names in the
    # layers do not collide (a pipeline that wraps HF modules keeps the HF names there)
    names = [n for state in states.values() for g in _shapes(state) for n in g]
    strip = pipeline and len({_strip(n) for n in names}) == len(names)
    for mp_rank, state in states.items():
        _read_zero12(root, step, tag, state, [o for o in optims if o[0] == mp_rank], builder, strip_layer=strip)
    if pipeline:
        builder.notes.append(f"pipeline of {len(mp_ranks)} stages (one mp_rank_XX file each)"
                             + ("; layer indices dropped from the names" if strip else ""))
    return builder.build()


# ---------------------------------------------------------------------------------------------- discovery

def _step_dir(root: Path) -> Path | None:
    """The directory holding the rank files: ``root`` itself, the tag ``root/latest`` names, or the only
    ``global_step*`` directory."""
    if not root.is_dir():
        return None
    if _has_states(root):
        return root
    latest = root / "latest"
    if not latest.is_file() and (root / "latest_universal").is_file():
        latest = root / "latest_universal"  # ds_to_universal's tag file
    if latest.is_file():
        tag = read_tag(latest)
        if tag is None or "/" in tag or "\\" in tag or tag in (".", ".."):  # its content is never shown
            raise SourceError(f"'{latest}': not a valid checkpoint tag (DeepSpeed writes the name of one step's "
                              "folder there, such as 'global_step100')")
        step = inside(root, tag, named_by=latest.name)  # a symlink out of the checkpoint is refused
        if not step.is_dir():
            raise SourceError(f"'{latest}' names the checkpoint {tag!r}, but '{step}' is not a directory")
        return step
    steps = sorted(p for p in root.iterdir() if p.is_dir() and _has_states(p))
    if len(steps) == 1:
        return steps[0]
    if len(steps) > 1:
        raise SourceError(
            f"'{root}': {len(steps)} checkpoints ({', '.join(p.name for p in steps[:6])}) and no 'latest' file; "
            "give the directory of the one to merge"
        )
    return None


def _has_states(path: Path) -> bool:
    return any(n.name.endswith(("_model_states.pt", "_optim_states.pt")) for n in path.iterdir() if n.is_file())


def _rel(tag: str, name: str) -> str:
    return f"{tag}/{name}" if tag else name


def _scan(root: Path, rel: str) -> _Loaded:
    """``rel``'s object tree, tensors as :class:`StoredTensor` (``torch_save.scan`` with :data:`ALLOW`)."""
    path = root / rel
    if not path.is_file():
        raise SourceNotFoundError(f"'{rel}': missing")
    with open_source(path, rel) as f:
        return _Loaded(rel, torch_save.scan(f, label=rel, allow=ALLOW))


def _model_states(root: Path, step: Path, tag: str, models: list[tuple[int, str]]) -> _Loaded:
    if not models:
        raise SourceNotFoundError(f"'{_rel(tag, 'mp_rank_00_model_states.pt')}': missing (the model states: "
                                  "parameter names and shapes)")
    return _states(root, _rel(tag, models[0][1]))


def _states(root: Path, rel: str) -> _Loaded:
    """A model states file, scanned: a dict."""
    state = _scan(root, rel)
    if not isinstance(state.obj, dict):
        raise SourceError(f"'{state.rel}': not a DeepSpeed model states file (no dict inside)")
    return state


def _dp_from_optim(optims: list[tuple[int, int, str, str]]) -> int:
    return max((r for _, r, _, _ in optims), default=-1) + 1 or 1


def _shapes(state: _Loaded) -> list[dict[str, tuple[int, ...]]]:
    groups = state.obj.get("param_shapes")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise SourceError(f"'{state.rel}': no 'param_shapes' (is it a ZeRO checkpoint? else use weights='module')")
    out = []
    for group in groups:
        shapes = {}
        for name, shape in group.items():
            if not isinstance(shape, tuple) or not all(isinstance(n, int) and n >= 0 for n in shape):
                raise SourceError(f"'{state.rel}': '{name}' has the shape {shape!r} in param_shapes")
            shapes[expect(name, str, "param_shapes: a parameter name", state.rel)] = shape
        out.append(shapes)
    return out


def _names(state: _Loaded, key: str) -> set[str]:
    """A list of names in the model states (``buffer_names``); absent: none."""
    names = field(state.obj, key, list, state.rel, default=None) or []
    return {expect(n, str, f"{key}: an entry", state.rel) for n in names}


# ------------------------------------------------------------------------------------------------ pieces

def _whole_piece(rel: str, key: str, tensor: StoredTensor) -> Piece:
    offset = tensor.required_offset(rel, key)
    return Piece(rel, key, Box.whole(tensor.shape), tensor.dtype, RAW, offset, tensor.numel * itemsize(tensor.dtype))


def _add_module(state: _Loaded, builder: LayoutBuilder, names: set[str] | None, why: str,
                strip_layer: bool = False) -> None:
    """Tensors of the module state dict (all of them, or ``names``) as whole pieces."""
    module = state.obj.get("module")
    if not isinstance(module, dict):
        raise SourceError(f"'{state.rel}': no 'module' state dict ({why})")
    for key, tensor in module.items():
        if names is not None and key not in names:
            continue
        if not isinstance(tensor, StoredTensor):
            continue
        key = expect(key, str, "module: a tensor name", state.rel)
        name = _strip(key) if strip_layer else key
        if builder.declare(name, tensor.shape, tensor.dtype, where=f"'{state.rel}'"):
            builder.add(name, _whole_piece(state.rel, f"module.{key}", tensor))


def _strip(name: str) -> str:
    """A pipeline parameter's name less its layer index ('3.model.norm.weight' -> 'model.norm.weight')."""
    head, _, rest = name.partition(".")
    return rest if head.isdigit() and rest else name


class _Flat:
    """A rank's (or all ranks') flat fp32 slices laid end to end, to be cut into parameter pieces."""

    def __init__(self) -> None:
        #: (start in the flat buffer, numel, file, byte offset of element 0 in it, dp rank)
        self.slices: list[tuple[int, int, str, int, int]] = []

    def add(self, start: int, numel: int, rel: str, byte_offset: int, rank: int) -> None:
        self.slices.append((start, numel, rel, byte_offset, rank))

    def cut(self, builder: LayoutBuilder, name: str, shape: tuple[int, ...], at: int, first: int, stop: int,
            missing: set[str]) -> None:
        """Pieces for the parameter's elements ``first..stop``, which sit from ``at`` on in this buffer."""
        end = at + stop - first
        for start, numel, rel, base, rank in self.slices:
            a, b = max(at, start), min(end, start + numel)
            if a >= b:
                continue
            lo = first + a - at
            for box, k in range_boxes(shape, lo, lo + b - a):
                piece = Piece(rel, name, box, "F32", RAW, base + (a - start + k) * 4, box.numel * 4,
                              (("dp_rank", rank),))
                builder.add(name, piece, present=rel not in missing)


class _Builder(LayoutBuilder):
    """A layout builder that remembers what it was given, so a shared parameter can reuse its owner's pieces."""

    def __init__(self, root: str, fmt: str) -> None:
        super().__init__(root, fmt)
        self.given: dict[str, list[tuple[Piece, bool]]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}

    def declare(self, fqn: str, global_shape: Any, dtype: str, **kwargs: Any) -> bool:  # type: ignore[override]
        ok = super().declare(fqn, global_shape, dtype, **kwargs)
        if ok:
            self.shapes.setdefault(fqn, tuple(global_shape))
        return ok

    def add(self, fqn: str, piece: Piece, *, present: bool = True) -> None:
        self.given.setdefault(fqn, []).append((piece, present))
        super().add(fqn, piece, present=present)


def _optim_dict(loaded: _Loaded) -> dict:
    osd = loaded.obj.get("optimizer_state_dict") if isinstance(loaded.obj, dict) else None
    if not isinstance(osd, dict):
        raise SourceError(f"'{loaded.rel}': no 'optimizer_state_dict'; not a DeepSpeed optimizer states file")
    return osd


def _read_ranks(root: Path, tag: str, group: list[tuple[int, int, str, str]]) -> tuple[
        dict[int, tuple[_Loaded, dict]], int, str, str]:
    """Scan every rank's optimizer file; check their number against the recorded partition count.

    Returns the present ranks, the partition count, the file-name prefix and the mp rank's name template.
    """
    present = {rank: _scan(root, _rel(tag, name)) for _, rank, _, name in group}
    prefixes = sorted({prefix for _, _, prefix, _ in group})
    if len(prefixes) > 1:
        raise SourceError(f"'{_rel(tag, '')}': optimizer files of different kinds ({', '.join(p or 'fp32' for p in prefixes)}) "
                          "side by side; is it two checkpoints in one directory?")
    ranks = {rank: (loaded, _optim_dict(loaded)) for rank, loaded in present.items()}
    counts = {}
    for rank, (loaded, osd) in ranks.items():
        count = osd.get("partition_count")
        if isinstance(count, list):
            values = dims(count, "partition_count", loaded.rel)
            if len(set(values)) > 1:
                raise SourceError(f"'{loaded.rel}': partition_count {count} differs between param groups "
                                  "(expert data parallelism); ckpttool does not read MoE ZeRO checkpoints yet"
                                  + universal_instead(root / tag if tag else root))
            count = values[0] if values else count
        if not isinstance(count, int) or count < 1:
            raise SourceError(f"'{loaded.rel}': partition_count is {count!r}")
        counts[rank] = count
    if len(set(counts.values())) != 1:
        listed = ", ".join(f"{count} in '{ranks[r][0].rel}'" for r, count in sorted(counts.items()))
        raise SourceError(f"the optimizer files disagree on partition_count: {listed}")
    count = next(iter(counts.values()))
    if count > 64 * len(ranks):  # each missing rank's region is named: not for a count no save could make
        raise SourceError(f"partition_count is {count} (in '{ranks[min(ranks)][0].rel}'), but {len(ranks)} optimizer "
                          f"files were found; expected {count} files for ranks 0..{count - 1}")
    mp_rank = group[0][0]
    extra = sorted(r for r in ranks if r >= count)
    if extra:
        raise SourceError(
            f"partition_count is {count} (in '{ranks[min(ranks)][0].rel}'), but {len(ranks)} optimizer files were "
            f"found, among them rank {extra[0]} ('{ranks[extra[0]][0].rel}'); expected {count} files for ranks "
            f"0..{count - 1}. Is it a mix of two checkpoints?"
        )
    return ranks, count, prefixes[0], f"{prefixes[0]}zero_pp_rank_{{rank}}_mp_rank_{mp_rank:02d}_optim_states.pt"


def _flat_tensor(loaded: _Loaded, value: Any, what: str) -> StoredTensor:
    if not isinstance(value, StoredTensor) or len(value.shape) != 1 or value.dtype != "F32":
        raise SourceError(f"'{loaded.rel}': {what} is not a flat fp32 tensor ({value!r:.80})")
    value.required_offset(loaded.rel, what)
    return value


# ------------------------------------------------------------------------------------------------ ZeRO-1/2

def _read_zero12(root: Path, step: Path, tag: str, state: _Loaded, group: list[tuple[int, int, str, str]],
                 builder: LayoutBuilder, strip_layer: bool) -> None:
    shapes = _shapes(state)
    ranks, count, prefix, template = _read_ranks(root, tag, group)
    builder.parallel["dp"] = count
    some = ranks[min(ranks)][1]
    bf16_optimizer = "zero_stage" not in some
    kind = "BF16_Optimizer" if bf16_optimizer else f"ZeRO-{some.get('zero_stage')}"
    note = f"fp32 master weights of a {kind} checkpoint over {count} data-parallel rank{'s' if count > 1 else ''}"
    if note not in builder.notes:
        builder.notes.append(note)
    if not bf16_optimizer and some.get("zero_stage") not in (1, 2):
        raise SourceError(f"'{ranks[min(ranks)][0].rel}': zero_stage {some.get('zero_stage')!r} with "
                          "single_partition_of_fp32_groups; expected 1 or 2")
    # per rank and group: (saved slice, padding stripped from it before saving)
    slices: dict[int, list[tuple[StoredTensor, int]]] = {}
    for rank, (loaded, osd) in ranks.items():
        groups = osd.get("single_partition_of_fp32_groups")
        paddings = osd.get("group_paddings")
        if not isinstance(groups, list) or not isinstance(paddings, list) or len(groups) != len(paddings):
            raise SourceError(f"'{loaded.rel}': no single_partition_of_fp32_groups/group_paddings of equal length")
        if len(groups) != len(shapes):
            raise SourceError(
                f"'{loaded.rel}': {len(groups)} fp32 param groups, but '{state.rel}' records param_shapes for "
                f"{len(shapes)}"
            )
        slices[rank] = [
            (_flat_tensor(loaded, g, f"single_partition_of_fp32_groups[{i}]"),
             integer(p, f"group_paddings[{i}]", loaded.rel))
            for i, (g, p) in enumerate(zip(groups, paddings))
        ]
    aligns = some.get("param_alignment_paddings")
    for g, group_shapes in enumerate(shapes):
        pads = aligns[g] if isinstance(aligns, list) and g < len(aligns) else [0] * len(group_shapes)
        pads = dims(pads, f"param_alignment_paddings[{g}]", ranks[min(ranks)][0].rel)
        if len(pads) != len(group_shapes):
            raise SourceError(f"'{ranks[min(ranks)][0].rel}': param_alignment_paddings[{g}] has {len(pads)} entries "
                              f"for {len(group_shapes)} parameters")
        needed = sum(math.prod(s) for s in group_shapes.values()) + sum(pads)
        # every rank's whole slice has the same length; a missing rank's region follows from a present one
        full = {r: s[g][0].numel + (0 if bf16_optimizer else s[g][1]) for r, s in slices.items()}
        if len(set(full.values())) != 1:
            listed = ", ".join(f"{n} in '{ranks[r][0].rel}'" for r, n in sorted(full.items()))
            raise SourceError(f"param group {g}: the ranks' fp32 partitions differ in size: {listed}")
        size = next(iter(full.values()))
        flat, missing, found = _Flat(), set(), 0
        for rank in range(count):
            if rank in slices:
                tensor, padding = slices[rank][g]
                saved = tensor.numel - (padding if bf16_optimizer else 0)
                flat.add(rank * size, max(saved, 0), ranks[rank][0].rel, tensor.byte_offset() or 0, rank)
                found += tensor.numel
            else:  # its region: what a whole slice would hold of the parameters
                rel = _rel(tag, template.format(rank=rank))
                flat.add(rank * size, max(0, min(size, needed - rank * size)), rel, 0, rank)
                missing.add(rel)
        if not missing:
            trailing = slices[count - 1][g][1] if bf16_optimizer else 0
            if found - trailing != needed:
                what = "short" if found - trailing < needed else "longer than the parameters"
                raise SourceError(
                    f"param group {g}: the flat fp32 buffers are {what}: the parameters in param_shapes of "
                    f"'{state.rel}' need {needed} elements (with {sum(pads)} alignment padding), the {count} "
                    f"'{prefix}zero_pp_rank_*' files hold {found - trailing}"
                    + (f" after {trailing} padding" if trailing else "")
                )
        offset = 0
        for (name, shape), pad in zip(group_shapes.items(), pads):
            target = _strip(name) if strip_layer else name
            numel = math.prod(shape)
            if builder.declare(target, shape, "F32", where=f"'{state.rel}' param_shapes"):
                flat.cut(builder, target, shape, offset, 0, numel, missing)
            offset += numel + int(pad)
    _add_extras(state, builder, strip_layer)


def _add_extras(state: _Loaded, builder: LayoutBuilder, strip_layer: bool) -> None:
    """Buffers, frozen parameters (saved whole under ZeRO-1/2) and shared (tied) parameters."""
    buffers = _names(state, "buffer_names")
    if buffers:
        _add_module(state, builder, names=buffers, why="buffers", strip_layer=strip_layer)
    frozen = field(state.obj, "frozen_param_fragments", dict, state.rel, default=None) or {}
    for key, tensor in frozen.items():
        if isinstance(tensor, StoredTensor):
            key = expect(key, str, "frozen_param_fragments: a parameter name", state.rel)
            name = _strip(key) if strip_layer else key
            if builder.declare(name, tensor.shape, tensor.dtype, where=f"'{state.rel}' frozen_param_fragments"):
                builder.add(name, _whole_piece(state.rel, f"frozen_param_fragments.{key}", tensor))
    _add_shared(state, builder)


def _add_shared(state: _Loaded, builder: _Builder) -> None:
    shared = state.obj.get("shared_params") or {}
    if not isinstance(shared, dict):
        return
    declared = set(builder.declared)
    for alias, owner in shared.items():
        expect(alias, str, "shared_params: a parameter name", state.rel)
        expect(owner, str, f"shared_params: the owner of '{alias}'", state.rel)
        if alias in declared or owner not in declared:
            continue
        builder.notes.append(f"'{alias}' is shared with '{owner}' (shared_params): written with the same weights")
        if builder.declare(alias, builder.shapes[owner], builder.dtype_of(owner), where=f"'{state.rel}' shared_params"):
            for piece, present in list(builder.given.get(owner, ())):
                builder.add(alias, piece, present=present)


# ------------------------------------------------------------------------------------------------ ZeRO-3

def _read_zero3(root: Path, step: Path, tag: str, mp_rank: int, group: list[tuple[int, int, str, str]],
                models: list[tuple[int, int, str]], builder: LayoutBuilder) -> None:
    if not models or models[0][0] != 0:
        raise SourceNotFoundError(
            f"'{_rel(tag, f'zero_pp_rank_0_mp_rank_{mp_rank:02d}_model_states.pt')}': missing (rank 0's model "
            "states hold the parameter names and shapes)"
        )
    state = _states(root, _rel(tag, models[0][2]))
    shapes = [s for g in _shapes(state) for s in g.items()]
    ranks, count, _prefix, template = _read_ranks(root, tag, group)
    builder.parallel["dp"] = count
    builder.notes.append(f"fp32 master weights of a ZeRO-3 checkpoint over {count} data-parallel ranks")
    needed = sum(-(-math.prod(shape) // count) for _, shape in shapes)
    # each rank: its flat groups end to end
    flats: dict[int, _Flat] = {}
    missing: set[str] = set()
    for rank in range(count):
        flat = flats[rank] = _Flat()
        if rank not in ranks:
            rel = _rel(tag, template.format(rank=rank))
            flat.add(0, needed, rel, 0, rank)
            missing.add(rel)
            continue
        loaded, osd = ranks[rank]
        if osd.get("zero_stage") != 3:
            raise SourceError(f"'{loaded.rel}': zero_stage {osd.get('zero_stage')!r}, but the model states are "
                              "ZeRO-3's (zero_pp_rank_*_model_states.pt)")
        groups = osd.get("fp32_flat_groups")
        if not isinstance(groups, list):
            raise SourceError(f"'{loaded.rel}': no fp32_flat_groups")
        start = 0
        for i, g in enumerate(groups):
            tensor = _flat_tensor(loaded, g, f"fp32_flat_groups[{i}]")
            flat.add(start, tensor.numel, loaded.rel, tensor.byte_offset() or 0, rank)
            start += tensor.numel
        if start != needed:
            what = "short" if start < needed else "longer than the parameters"
            raise SourceError(
                f"'{loaded.rel}': the flat fp32 buffer is {what}: the {len(shapes)} parameters in param_shapes "
                f"of '{state.rel}' need {needed} elements per rank (each padded to a multiple of {count}), "
                f"fp32_flat_groups hold {start}"
            )
    offset = 0
    for name, shape in shapes:
        numel = math.prod(shape)
        per_rank = -(-numel // count)
        if builder.declare(name, shape, "F32", where=f"'{state.rel}' param_shapes"):
            for rank in range(count):
                lo, hi = rank * per_rank, min((rank + 1) * per_rank, numel)
                if lo < hi:
                    flats[rank].cut(builder, name, shape, offset, lo, hi, missing)
        offset += per_rank
    _add_extras_zero3(root, tag, state, models, count, builder)


def _add_extras_zero3(root: Path, tag: str, state: _Loaded, models: list[tuple[int, int, str]], count: int,
                      builder: LayoutBuilder) -> None:
    """Buffers (whole, in rank 0's module) and frozen parameters (each rank's padded partition)."""
    buffers = _names(state, "buffer_names")
    if buffers:
        _add_module(state, builder, names=buffers, why="buffers")
    frozen_shapes = field(state.obj, "frozen_param_shapes", dict, state.rel, default=None) or {}
    if frozen_shapes:
        per_rank_states = {rank: (_states(root, _rel(tag, name)) if rank else state) for rank, _, name in models}
        for name, shape in frozen_shapes.items():
            expect(name, str, "frozen_param_shapes: a parameter name", state.rel)
            shape = dims(shape, f"frozen_param_shapes: '{name}'", state.rel)
            numel = math.prod(shape)
            per_rank = -(-numel // count)
            first = None
            for rank in range(count):
                loaded = per_rank_states.get(rank)
                fragments = loaded and field(loaded.obj, "frozen_param_fragments", dict, loaded.rel, default=None)
                fragment = (fragments or {}).get(name)
                if fragment is None:
                    continue
                expect(fragment, StoredTensor, f"frozen_param_fragments: '{name}'", loaded.rel)
                if first is None:
                    if not builder.declare(name, shape, fragment.dtype, where=f"'{state.rel}' frozen_param_shapes"):
                        break
                    first = fragment
                lo, hi = rank * per_rank, min((rank + 1) * per_rank, numel)
                size = itemsize(fragment.dtype)
                for box, k in range_boxes(tuple(shape), lo, max(lo, hi)):
                    base = fragment.byte_offset()
                    if base is None:
                        raise SourceError(f"'{loaded.rel}': frozen '{name}' is not stored contiguously in place")
                    builder.add(name, Piece(loaded.rel, name, box, fragment.dtype, RAW, base + k * size,
                                            box.numel * size, (("dp_rank", rank),)))
    _add_shared(state, builder)


# ------------------------------------------------------------------------------------------------ pipeline

def _read_layers(root: Path, step: Path, tag: str, layers: list[tuple[int, str]], builder: LayoutBuilder) -> None:
    """Module weights of a pipeline checkpoint: one state dict per layer file."""
    loaded = [(index, _scan(root, _rel(tag, name))) for index, name in layers]
    names: dict[str, list[str]] = {}
    for index, layer in loaded:
        if not isinstance(layer.obj, dict):
            raise SourceError(f"'{layer.rel}': not a state dict")
        for key in layer.obj:
            names.setdefault(key, []).append(layer.rel)
    # the layers' own names when they do not collide (the HF names, in a pipeline that wraps HF modules),
    # else '<layer index>.<name>' as the PipelineModule names its parameters
    unique = all(len(v) == 1 for v in names.values())
    for index, layer in loaded:
        for key, tensor in layer.obj.items():
            if not isinstance(tensor, StoredTensor):
                continue
            name = key if unique else f"{index}.{key}"
            if builder.declare(name, tensor.shape, tensor.dtype, where=f"'{layer.rel}'"):
                builder.add(name, _whole_piece(layer.rel, key, tensor))
    builder.notes.append(f"module weights from {len(loaded)} pipeline layer files"
                         + ("" if unique else " (names prefixed with the layer index: they collide)"))


# ------------------------------------------------------------------------------------------------ universal

def _read_universal(root: Path, step: Path, tag: str, builder: LayoutBuilder) -> None:
    """A universal checkpoint (``ds_to_universal``): ``zero/<param name>/fp32.pt`` holds the whole fp32
    parameter as ``{'param': tensor, ...}``."""
    zero = step / "zero"
    count = 0
    for directory in sorted(p for p in zero.iterdir() if p.is_dir()):
        rel = _rel(tag, f"zero/{directory.name}/{_UNIVERSAL_WEIGHT}")
        if not (root / rel).is_file():
            raise SourceNotFoundError(f"'{rel}': missing (the fp32 weights of '{directory.name}')")
        loaded = _scan(root, rel)
        tensor = loaded.obj.get("param") if isinstance(loaded.obj, dict) else loaded.obj
        if not isinstance(tensor, StoredTensor):
            raise SourceError(f"'{rel}': no 'param' tensor")
        if builder.declare(directory.name, tensor.shape, tensor.dtype, where=f"'{rel}'"):
            builder.add(directory.name, _whole_piece(rel, "param", tensor))
            count += 1
    if not count:
        raise SourceError(f"'{_rel(tag, 'zero')}': no parameter directories")
    builder.parallel = {"tp": 1, "pp": 1, "dp": 1}
    builder.notes.append(f"universal checkpoint: {count} fp32 parameters from zero/<name>/fp32.pt")
