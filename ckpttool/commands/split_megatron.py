"""``split --to megatron``: Megatron-Core ``torch_dist`` for TP x PP x EP, planned as the DCP target is.

The global tensors and where every HuggingFace element goes are the family layer's
(:func:`ckpttool.families.conventions.megatron_back.megatron_tensors`: Megatron-Core's cut run backwards, a
transform undone where the cut has one: gpt-oss's experts), and so are their
tensor-parallel placements (:data:`~ckpttool.families.conventions.megatron_back.TP_RULES`) and the ``_extra_state``
modules. Here each is placed on Megatron's ranks, ordered ``tp`` fastest, then ``ep``, then ``pp`` (megatron-core's
default ``tp-cp-ep-dp-pp`` with one data-parallel rank per expert group), with :class:`~ckpttool.commands.meshes.Sharding` over the mesh dims
``(pp, ep, tp)``:

- stacked layer tensors: the layer axis ``Shard(0)`` over ``pp`` (each stage its consecutive layers; uneven or
  virtual stages layer by layer, :func:`layer_stages`); a model whose layers are saved under their own numbers
  (DeepSeek-V3's, :mod:`ckpttool.families.conventions.megatron_back_mla`) has each on its stage's ranks;
- experts: the expert axis ``Shard(1)`` over ``ep`` (global expert ids, each rank consecutive ones), and their
  weights tensor-parallel like the dense ones (``expert_tensor_parallel_size`` = ``tp``, megatron-core's default),
  or whole on every TP rank (``--etp 1``; gpt-oss's default, one chunk per layer and expert). gpt-oss's fc1 is
  HuggingFace's interleaved columns taken apart: at expert TP = tp a rank's gate chunk and its up chunk are each one
  part of the rank's contiguous HuggingFace columns (:func:`~ckpttool.plan.transforms.within_part`), read whole for
  each of the two (twice the read of those columns, no more memory than the chunk's);
- tensor parallel: ``linear_qkv`` rows (whole query groups) and the vocab rows ``Shard``, ``linear_proj`` and
  ``linear_fc2`` columns ``Shard``, a SwiGLU ``linear_fc1`` ``[gate; up]`` as each rank's ``[gate_r; up_r]``
  (``_StridedShard`` with split factor 2), norms, router and shared-expert gate replicated.

Chunks are cut as megatron-core saves them: one per layer (and per expert) of a rank's box, the two halves of
``linear_fc1`` apart; a chunk several ranks hold is written once (:func:`ckpttool.writers.dcp.share_items`).
Vocab rows past the true vocab are zeros.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from ckpttool.model.description import ModelInfo
from ckpttool.io.dtypes import itemsize
from ckpttool.plan.compose import SliceIndex, compose
from ckpttool.layout.layout import Box
from ckpttool.plan.plan import Target
from ckpttool.plan.transforms import Transform, within_part
from ckpttool.errors import ConfigError, CoverageError
from ckpttool.families.conventions import megatron_back
from ckpttool.families.conventions import megatron_back_args, megatron_back_hybrid, megatron_back_mla
from ckpttool.families.conventions.megatron_back import (EXPERT_TENSORS, EXTRA_STATE, VOCAB, expert_axis,
                                                         hf_vocab, megatron_tensors, padded_vocab)
from ckpttool.families import mtp
from ckpttool.commands.meshes import REPLICATE, MegatronMesh, Sharding
from ckpttool.layout.placements import Placement
from ckpttool.families.source import Planned
from ckpttool.writers import dcp

def plan_megatron(prepared: Planned, info: ModelInfo, mesh: MegatronMesh) -> tuple[list[Sharding], tuple[dcp.DcpFile, ...]]:
    """Every rank's chunks of every Megatron-Core global tensor, each a target proven to tile its box (padding
    rows aside: zeros), laid out in the rank files. Reads no tensor data.

    Raises:
        ConfigError: a model (``info``, the source's config) with no Megatron-Core form, or sizes the mesh cannot split (listed);
        CoverageError: a chunk not covered exactly once.
    """
    vocab = hf_vocab(info)
    targets = {t.name: t for t in prepared.plan.targets}
    mtp_layers = len(mtp.held(targets, mtp.expected(info)))
    tensors = megatron_tensors(info, padded_vocab(vocab, mesh.divisible_by, mesh.tp), mtp_layers)
    _check_sizes(info.config, {name: shape for name, shape, *_ in tensors}, mesh, info.model_type)
    stages = layer_stages(int(info.config.get("num_hidden_layers") or 0), mesh)
    shardings = [_place(name, shape, mesh, info.model_type, stages) for name, shape, *_ in tensors]
    if not mtp_layers:  # (an MTP stage builds the embedding too: any stage's ranks may write it, as before)
        shardings = [_on_vocab_stage(s, mesh) for s in shardings]
    weight = {name: math.prod(shape) * next((itemsize(targets[s.source].dtype) for s in slices if s.source in targets), 1)
              for name, shape, slices, *_ in tensors}
    held: list[list[tuple[str, Box, int]]] = [[] for _ in range(mesh.world)]
    layers = len(stages) - _MTP_MOST
    for s in shardings:  # each rank's in state-dict order; only the ranks that hold it (8192 at TP8 x PP16 x EP64)
        layer = megatron_back_mla.layer_of(s.name, layers)
        for rank, chunks in _held_chunks(s, mesh, stages, layer, weight[s.name]):
            held[rank].extend(chunks)
    by_name = {name: (shape, slices, true_rows, transform) for name, shape, slices, true_rows, transform in tensors}
    indexes: dict[str, SliceIndex] = {}
    per_rank, problems = [], []
    cut_experts = _stated_etp(mesh) > 1
    for written in dcp.share_items(held):
        items = []
        for name, box in written:
            shape, slices, true_rows, transform = by_name[name]
            if transform is None:  # only the slices that meet the chunk: one expert's of a layer's 256
                index = indexes.get(name) or indexes.setdefault(name, SliceIndex(slices, targets))
                slices = index.meeting(box)
            # one part of a de-interleave only where the args written say experts are cut (common.pt's expert TP)
            parts = cut_experts and name in EXPERT_TENSORS
            target, found = _compose(name, box, slices, targets, true_rows, transform, shape, parts)
            if found:
                problems.extend(p for p in found if p not in problems)
            if target is not None:
                items.append((name, shape, box, target))
        per_rank.append(items)
    if problems:
        raise CoverageError(problems)
    shapes = {name: shape for name, shape, *_ in tensors}
    return shardings, dcp.lay_out(per_rank, _extra_states(shapes, mesh, stages, info.model_type))


def layer_stages(layers: int, mesh: MegatronMesh) -> list[int]:
    """The pipeline stage of every global layer, then of every MTP layer after them (the last stage, as
    megatron-core places them). As megatron-core's ``get_transformer_layer_offset`` numbers them: each stage its
    consecutive ``layers / pp`` layers; with ``pp_first`` / ``pp_last`` those on the first / last stage and the
    rest shared evenly by the stages between; with ``vpp`` model chunks of ``layers / (pp * vpp)`` layers, chunk
    ``c`` of stage ``s`` the ``(c * pp + s)``-th run of them.

    Raises:
        ConfigError: :func:`stage_problem`'s, the layers do not fit the stages.
    """
    problem = stage_problem(layers, mesh)
    if problem is not None:
        raise ConfigError(f"the mesh {mesh.describe()} does not fit the model: {problem}")
    if mesh.vpp > 1:
        run = layers // (mesh.pp * mesh.vpp)
        return [(layer // run) % mesh.pp for layer in range(layers)] + [mesh.pp - 1] * _MTP_MOST
    counts = _stage_counts(layers, mesh)
    return [stage for stage, n in enumerate(counts) for _ in range(n)] + [mesh.pp - 1] * _MTP_MOST


def stage_problem(layers: int, mesh: MegatronMesh) -> str | None:
    """Why ``layers`` do not fit the mesh's pipeline stages (every stage at least one layer, every chunk the same),
    or None."""
    if mesh.vpp > 1:
        if layers % (mesh.pp * mesh.vpp) or layers < mesh.pp * mesh.vpp:
            return (f"pp={mesh.pp} x vpp={mesh.vpp} does not split the {layers} layers (num_hidden_layers) into "
                    f"{mesh.pp * mesh.vpp} equal model chunks")
        return None
    if not (mesh.pp_first or mesh.pp_last):
        if mesh.pp > layers or layers % mesh.pp:
            return f"pp={mesh.pp} does not split the {layers} layers (num_hidden_layers) into equal stages"
        return None
    counts = _stage_counts(layers, mesh)
    if sum(counts) != layers or min(counts) < 1:
        given = " + ".join(f"{n} ({what})" for n, what in ((mesh.pp_first, "pp_first"), (mesh.pp_last, "pp_last")) if n)
        between = mesh.pp - bool(mesh.pp_first) - bool(mesh.pp_last)
        return (f"{given} leave {layers - mesh.pp_first - mesh.pp_last} of the {layers} layers (num_hidden_layers) for "
                f"the {between} stage{'s' if between != 1 else ''} between, which "
                f"{'do' if between != 1 else 'does'} not share them evenly with at least one layer each")
    return None


def _stage_counts(layers: int, mesh: MegatronMesh) -> list[int]:
    """Layers per stage without virtual stages (a list that does not sum to ``layers`` when they do not fit)."""
    between = mesh.pp - bool(mesh.pp_first) - bool(mesh.pp_last)
    rest = layers - mesh.pp_first - mesh.pp_last
    per = rest // between if between > 0 and rest % between == 0 else 0
    counts = [per] * mesh.pp
    if mesh.pp_first:
        counts[0] = mesh.pp_first
    if mesh.pp_last:
        counts[-1] = mesh.pp_last
    return counts


#: the most MTP layers :func:`layer_stages` places (a bound: a release has one)
_MTP_MOST = 64


def _extra_states(shapes: dict[str, tuple[int, ...]], mesh: MegatronMesh, stages: list[int],
                  model_type: str = "") -> list[list[tuple[str, bytes]]]:
    """The ``_extra_state`` objects megatron-core saves for its linear layers (``[None]`` in the local spec): one per
    layer (``shard_{layer}_{L}``), and per expert (``shard_{layer}.{expert}_{L}.{E}``), each written by the TP rank 0
    of the stage (and expert rank) holding it; a layer saved under its own number (DeepSeek-V3's) has one
    ``shard_0_1``, its experts ``shard_{expert}_{E}``; a hybrid ``MambaModel``'s
    (:func:`.megatron_back_hybrid.extra_state_modules`) one ``shard_0_1`` each, its output layer's too. Megatron-LM's
    ``load_checkpoint`` asks for them."""
    import pickle

    from ckpttool.writers.torch_archive import object_archive

    empty = pickle.dumps([None], protocol=2)
    per_rank: list[list[tuple[str, bytes]]] = [[] for _ in range(mesh.world)]

    def put(key: str, stage: int, ep_rank: int) -> None:
        per_rank[(stage * mesh.ep + ep_rank) * mesh.tp].append((key, object_archive(empty, key)))

    if model_type in megatron_back_hybrid.MODEL_TYPES:
        for module, layer, experts in megatron_back_hybrid.extra_state_modules(shapes):
            stage = mesh.pp - 1 if layer is None else stages[layer]
            for e in range(experts) if experts else (None,):
                where = "0_1" if e is None else f"{e}_{experts}"
                put(f"{module}._extra_state/shard_{where}", stage, 0 if e is None else e // (experts // mesh.ep))
        return per_rank
    stacked = shapes.get("decoder.layers.self_attention.linear_qkv.weight")
    layers = stacked[0] if stacked else 0
    for module in EXTRA_STATE if stacked else ():
        weight = shapes.get(f"decoder.layers.{module}.weight")
        if weight is None:
            continue
        experts = weight[1] if module.startswith("mlp.experts.") else 0
        for layer in range(layers):
            stage = stages[layer]
            for e in range(experts) if experts else (None,):
                ep_rank = 0 if e is None else e // (experts // mesh.ep)
                where = f"{layer}_{layers}" if e is None else f"{layer}.{e}_{layers}.{experts}"
                put(f"decoder.layers.{module}._extra_state/shard_{where}", stage, ep_rank)
    total = len(stages) - _MTP_MOST
    for name, shape in shapes.items():
        layer = megatron_back_mla.layer_of(name, total)
        module = name.removesuffix(".weight")
        if layer is None or not name.endswith(".weight") or not module.endswith(megatron_back_mla.EXTRA_STATE):
            continue
        if megatron_back.expert_axis(name) is None:
            put(f"{module}._extra_state/shard_0_1", stages[layer], 0)
            continue
        for e in range(shape[0]):
            put(f"{module}._extra_state/shard_{e}_{shape[0]}", stages[layer], e // (shape[0] // mesh.ep))
    return per_rank


def _stated_etp(mesh: MegatronMesh) -> int:
    """The expert TP size the user stated, when it decides a placement (tp > 1); 0: the model's own rules."""
    return mesh.etp if mesh.tp > 1 else 0


def _place(name: str, shape: tuple[int, ...], mesh: MegatronMesh, model_type: str, stages: list[int]) -> Sharding:
    """``name`` over the mesh ``(pp, ep, tp)``; a tensor saved per layer only on its stage's ranks, a stacked one's
    layers over the stages by ``Shard(0)`` (uneven or virtual stages: by :func:`_chunks`, layer by layer)."""
    tp = megatron_back.tp_placement(name, model_type, _stated_etp(mesh))  # at tp=1 too: fc1's halves are two chunks
    if _stated_etp(mesh) == 1 and expert_axis(name) is not None:
        tp = REPLICATE  # expert TP 1: every expert whole (each chunk one expert's gate, up or down)
    layer = megatron_back_mla.layer_of(name, len(stages) - _MTP_MOST)
    stacked = name.startswith("decoder.layers.") and layer is None
    even = mesh.vpp == 1 and not (mesh.pp_first or mesh.pp_last)
    pp = Placement("shard", 0) if stacked and even else REPLICATE
    axis = expert_axis(name)
    ep = Placement("shard", axis) if axis is not None else REPLICATE
    per_stage = mesh.ep * mesh.tp
    ranks = None if layer is None else (stages[layer] * per_stage, (stages[layer] + 1) * per_stage)
    return Sharding(name, shape, (("pp", mesh.pp), ("ep", mesh.ep), ("tp", mesh.tp)), (pp, ep, tp), ranks)


def _on_vocab_stage(sharding: Sharding, mesh: MegatronMesh) -> Sharding:
    """The word embedding held by the first stage's ranks only, the output layer by the last's, as megatron-core
    builds them (``pre_process`` / ``post_process``), so each chunk is written by a rank of the stage that saves it;
    every other tensor as it is."""
    per_stage = mesh.ep * mesh.tp
    stage = {VOCAB[0]: 0, VOCAB[1]: mesh.pp - 1}.get(sharding.name)
    if stage is None or mesh.pp == 1:
        return sharding
    return Sharding(sharding.name, sharding.shape, sharding.dims, sharding.placements,
                    (stage * per_stage, (stage + 1) * per_stage))


def _held_chunks(sharding: Sharding, mesh: MegatronMesh, stages: list[int], layer: int | None,
                 weight: int) -> Iterator[tuple[int, list[tuple[str, Box, int]]]]:
    """Every rank holding part of ``sharding`` with its ``(name, chunk, weight)`` s (:func:`_chunks`), in rank order.
    A rank's chunks depend on its coordinates along the mesh dims that cut the tensor (and on its stage) only: they
    are cut once per such coordinate and shared by the ranks that replicate them (a layer's norm: 512 ranks of its
    stage at TP8 x EP64)."""
    cut_ep, cut_tp = (p.kind != "replicate" for p in sharding.placements[1:])
    per_stage, memo = mesh.ep * mesh.tp, {}
    for rank in range(*(sharding.ranks or (0, mesh.world))):
        key = (rank // per_stage, (rank // mesh.tp) % mesh.ep if cut_ep else 0, rank % mesh.tp if cut_tp else 0)
        chunks = memo.get(key)
        if chunks is None:
            chunks = memo[key] = [(sharding.name, box, weight) for box in _chunks(sharding, rank, stages, layer)]
        yield rank, chunks


def _chunks(sharding: Sharding, rank: int, stages: list[int], layer: int | None) -> list[Box]:
    """A rank's boxes cut as megatron-core saves them: one chunk per layer, and per expert; a tensor saved per
    layer (DeepSeek-V3's; ``layer``: :func:`.megatron_back_mla.layer_of`'s) only on the stage holding its layer
    (``stages``: :func:`layer_stages`)."""
    axis = expert_axis(sharding.name)
    if layer is not None:
        per = 0 if axis is None else 1
    else:
        per = (2 if axis is not None else 1) if sharding.name.startswith("decoder.layers.") else 0
    out = []
    stacked = layer is None and per
    for box in sharding.boxes(rank):
        for lead in _indices(box, per):
            if stacked and stages[lead[0]] != sharding.coordinate(rank)[0]:
                continue
            offsets = (*lead, *box.offsets[per:])
            out.append(Box(offsets, (*(1 for _ in lead), *box.sizes[per:])))
    return out


def _indices(box: Box, dims: int) -> list[tuple[int, ...]]:
    if not dims:
        return [()]
    return [(i, *rest) for i in range(box.offsets[0], box.ends[0])
            for rest in _indices(Box(box.offsets[1:], box.sizes[1:]), dims - 1)]


def _compose(name: str, box: Box, slices, targets, true_rows: int | None, transform: Transform | None = None,
             shape: tuple[int, ...] | None = None, parts: bool = False) -> tuple[Target | None, list[str]]:
    """:func:`compose` (through ``transform`` of what ``slices`` make, a tensor of ``shape``, when it has one), but
    rows from ``true_rows`` on (vocab padding) are no copy's: the executor writes zeros. With ``parts``, a box
    that is one part of the transform's de-interleave (:func:`within_part`) is composed as a box of that part."""
    if transform is not None:
        if true_rows is not None:
            return None, [f"'{name}': a padded tensor made through a transform ({transform.name}) is not written yet"]
        bound = transform.bound(shape, name) if parts and shape is not None else None
        part = within_part(bound, shape, box) if bound is not None and bound.pre_box(shape, box) is None else None
        if part is not None:  # a rank's gate (or up) rows: a box of that part, its columns read with the other's
            taken, part_shape, inner = part
            return compose(name, inner, slices, targets, taken, part_shape)
        return compose(name, box, slices, targets, transform, shape)
    if true_rows is None or box.ends[0] <= true_rows:
        return compose(name, box, slices, targets)
    rows = max(0, true_rows - box.offsets[0])
    if rows:
        inner, problems = compose(name, Box(box.offsets, (rows, *box.sizes[1:])), slices, targets)
        if inner is None:
            return None, problems
        if inner.transform is not None:  # its map covers its own rows, not the padding below them
            return None, [f"'{name}': vocab padding rows below a transformed tensor ({inner.transform.name}) are not "
                          "written yet; merge it first, then split that output"]
        return Target(name, box.sizes, inner.dtype, inner.source_dtype, inner.copies, inner.sources), []
    source = targets.get(slices[0].source) if slices else None
    if source is None:
        return None, [f"'{name}': is made of tensors the source does not hold"]
    return Target(name, box.sizes, source.dtype, source.dtype, (), ()), []


def _check_sizes(config, shapes: dict[str, tuple[int, ...]], mesh: MegatronMesh, model_type: str = "") -> None:
    """Every size the mesh splits, split evenly, or the list of those that are not."""
    heads = int(config.get("num_attention_heads") or 0)
    groups = int(config.get("num_key_value_heads") or heads)
    layers = int(config.get("num_hidden_layers") or 0)
    problems = []
    if heads % mesh.tp or groups % mesh.tp:
        problems.append(f"tp={mesh.tp} does not divide the {heads} attention heads and {groups} query groups "
                        "(num_attention_heads, num_key_value_heads): megatron-core gives each rank whole groups")
    for name, dim, what in (("decoder.layers.mlp.linear_fc1.weight", 1, "intermediate_size"),
                            ("decoder.layers.mlp.shared_experts.linear_fc1.weight", 1, "shared expert FFN"),
                            (EXPERT_TENSORS[0], 2, "expert FFN")):
        cut = (name in shapes and megatron_back.tp_placement(name, model_type, _stated_etp(mesh)).kind != "replicate"
               and not (name == EXPERT_TENSORS[0] and _stated_etp(mesh) == 1))
        if cut and (shapes[name][dim] // 2) % mesh.tp:
            problems.append(f"tp={mesh.tp} does not divide the {what} {shapes[name][dim] // 2} of '{name}'")
    fc1 = next((name for name in shapes if name.endswith(EXPERT_TENSORS[0].removeprefix("decoder.layers."))), None)
    if mesh.ep > 1 and fc1 is None:
        problems.append(f"ep={mesh.ep}: the model has no experts to place over ep ranks")
    elif fc1 is not None and shapes[fc1][expert_axis(fc1)] % mesh.ep:
        experts = shapes[fc1][expert_axis(fc1)]
        problems.append(f"ep={mesh.ep} does not divide the {experts} experts; choose an ep that divides {experts}")
    problems += _per_layer_cuts(shapes, mesh, model_type)
    if model_type in megatron_back_hybrid.MODEL_TYPES:
        problems += megatron_back_hybrid.mesh_problems(config, mesh.tp, mesh.vpp)
    stages = stage_problem(layers, mesh)
    if stages is not None:
        problems.append(stages)
    if problems:
        raise ConfigError(f"the mesh {mesh.describe()} does not fit the model ({len(problems)} problem"
                          f"{'s' if len(problems) != 1 else ''}):\n" + "\n".join(f"  - {p}" for p in problems))


def _per_layer_cuts(shapes: dict[str, tuple[int, ...]], mesh: MegatronMesh, model_type: str) -> list[str]:
    """Every dim tensor parallelism cuts of a tensor saved per layer (DeepSeek-V3's MLA projections, FFNs) that
    ``tp`` does not divide, once per tensor kind (the first layer that has it)."""
    problems, seen = [], set()
    for name, shape in shapes.items():
        match = megatron_back_mla.PER_LAYER.match(name)
        if match is None or mesh.tp == 1:
            continue
        kind = name[match.end():]
        placement = megatron_back.tp_placement(name, model_type)
        if kind in seen or placement.kind == "replicate" or (_stated_etp(mesh) == 1 and expert_axis(name) is not None):
            continue
        seen.add(kind)
        parts = placement.split_factor if placement.kind == "strided" else 1
        size = shape[placement.dim] // parts
        if shape[placement.dim] % parts or size % mesh.tp:
            what = f"{size} rows of each of its {parts} halves" if parts > 1 else f"{size} (dim {placement.dim})"
            problems.append(f"tp={mesh.tp} does not divide the {what} of '{name}'")
    return problems


def training_args(info: ModelInfo, mesh: MegatronMesh, shapes: dict[str, tuple[int, ...]]) -> dict[str, object]:
    """The Megatron-LM training arguments ``common.pt`` records for this model and mesh
    (:func:`ckpttool.families.conventions.megatron_back_args.training_args`)."""
    mtp_layers = len({name.split(".")[2] for name in shapes if name.startswith("mtp.layers.")})
    experts = any(expert_axis(name) is not None for name in shapes)
    args = megatron_back_args.training_args(info, shapes, tp=mesh.tp, pp=mesh.pp, ep=mesh.ep,
                                            divisible_by=mesh.divisible_by, iteration=mesh.iteration,
                                            mtp_layers=mtp_layers,
                                            etp=mesh.expert_tp(info.model_type) if experts else 0)
    layers = int(info.config.get("num_hidden_layers") or 0)
    args.update(decoder_first_pipeline_num_layers=mesh.pp_first or None,
                decoder_last_pipeline_num_layers=mesh.pp_last or None,
                virtual_pipeline_model_parallel_size=mesh.vpp if mesh.vpp > 1 else None,
                num_layers_per_virtual_pipeline_stage=layers // (mesh.pp * mesh.vpp) if mesh.vpp > 1 else None)
    return args
