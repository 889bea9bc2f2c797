"""DeepSpeed MoE checkpoints: ``deepspeed.moe.layer.MoE`` with expert parallelism, under ZeRO-1/2 or BF16_Optimizer.

What DeepSpeed 0.19.8 saves (``engine._save_moe_checkpoint``, ``_save_zero_checkpoint``), under ``<tag>/``::

    mp_rank_00_model_states.pt          by data-parallel rank 0: 'module' less the experts (the router
                                        '<moe>.deepspeed_moe.gate.wg.weight' stays), 'param_shapes' of rank 0's
                                        param groups, 'num_experts' (per MoE layer), 'ds_config'
    layer_L_expert_E_mp_rank_00_model_states.pt
                                        the module weights (fp32; bf16 under bf16) of expert E of the L-th MoE module
                                        (``named_modules`` order) as '<moe>.deepspeed_moe.experts.deepspeed_experts.
                                        E.<param>'; E is global: EP rank e's expert-data-parallel rank 0 writes its
                                        local expert j as ``e * local + j``
    [bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt
                                        per data-parallel rank R (the global rank here): the fp32 partitions
    expp_rank_P_mp_rank_00_optim_states.pt
                                        only without ZeRO: a plain optimizer state (no weights; not read)

Before 0.19 (0.14.5, 0.16.9 and 0.18.0 of the fixture matrix) the MoE model states hold no 'param_shapes', 'buffer_names',
'ds_config' or 'ds_version', and ``expp_rank_P`` files (``{'optimizer': None}`` under ZeRO) are written beside the
ZeRO ones: the param groups are then read from the optimizer files' ``param_slice_mappings`` (every file needed),
the shapes from the module and the per-expert files, the topology from the optimizer files' 'ds_config'.

Expert parameters live in their own optimizer param groups (``split_params_into_different_moe_groups_for_optimizer``:
``moe=True``, named by the layer's ``expert_group_name`` ``ep_size_<P>``, both kept in the base optimizer state's
``param_groups``). ZeRO partitions each group over its own data-parallel group (``stage_1_and_2.
_configure_moe_settings``): a dense group over the D ranks (``partition_count`` D), a MoE group over the expert-data-
parallel group of D/P ranks (``partition_count`` D/P). A rank's MoE group holds its own EP rank's experts under
*local* names: ``param_shapes`` (rank 0's) calls them ``deepspeed_experts.0 .. local-1``, and every EP rank's group
has those shapes. Which ranks share an EP rank (``groups._create_expert_and_data_parallel``): by default (E + D) EP
groups are consecutive ranks, ``ep_rank = R % P``, expert-data-parallel rank ``R // P``; with
``use_data_before_expert_parallelism`` in ``ds_config`` (D + E) the expert-data-parallel groups are consecutive,
``ep_rank = R // (D/P)``, rank ``R % (D/P)`` in its group. For EP rank e, its ranks' files in expert-data-parallel
order, laid end to end, are the group's flat buffer, cut as any ZeRO group (:func:`.zero.cut_group`);
local expert j becomes global expert ``e * local + j``.

Every per-expert file must be there (a missing one is named), and the renumbered optimizer experts must be exactly
the experts those files name: the renumbering is checked against DeepSpeed's own. ``weights="module"`` reads the
files with the module states instead of the optimizer files. The layout keeps DeepSpeed's names, global expert ids
and all, as format ``deepspeed-moe``; the families (:mod:`ckpttool.families.conventions.deepspeed_moe`) name them for HF.

DeepSpeed's ``zero_to_fp32`` does not read these checkpoints: it takes the expert files for ZeRO model states and
refuses them ('... is not a model state checkpoint'); without them it concatenates every rank's MoE partition as one
group and fails ('consumed 18432 numels out of 36864'). ``ds_to_universal`` converts AutoEP experts only.
Refused with the reason: tensor or pipeline parallelism next to MoE, ZeRO-3 (DeepSpeed refuses native MoE under
ZeRO-3 itself), frozen expert parameters under ``weights="master"`` (rank 0 records only its own).
"""

from __future__ import annotations

import re
from pathlib import Path

from ckpttool.layout.layout import Layout
from ckpttool.errors import SourceError, SourceNotFoundError
from ckpttool.io.torch_save import StoredTensor
from ckpttool.readers.validate import dims, field, integer, shown
from ckpttool.readers.deepspeed.files import (
    LAYER_STATES,
    MODEL_STATES,
    OPTIM_STATES,
    ZERO3_MODEL_STATES,
    Scan,
    Loaded,
    first_model_states,
    optimizer_state_dict,
    step_rel,
    param_shapes,
)
from ckpttool.readers.deepspeed.pieces import add_module, SharingBuilder, whole_piece
from ckpttool.readers.deepspeed.slices import shapes_from_mappings
from ckpttool.readers.deepspeed.zero import add_extras, alignment_pads, cut_group, FlatPart

#: the layout format of a DeepSpeed MoE checkpoint (the families map its names)
FORMAT = "deepspeed-moe"
_EXPERT_FILE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
#: an expert parameter: (MoE module, expert id, parameter in the expert)
_EXPERT = re.compile(r"^(.+)\.deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.(.+)$")
_GROUP_NAME = re.compile(r"^ep_size_(\d+)$")


def is_moe(files: list[str]) -> bool:
    """Whether a step's files are a DeepSpeed MoE checkpoint (per-expert model states)."""
    return any(_EXPERT_FILE.match(n) for n in files)


def read_moe(root: Path, step: Path, tag: str, files: list[str], weights: str, *, scan: Scan) -> Layout:
    """The layout of a DeepSpeed MoE step: fp32 master weights from the optimizer files (``weights="master"``)
    or the module weights from the model states and the per-expert files (``"module"``), under DeepSpeed's names
    with global expert ids."""
    builder = SharingBuilder(str(root), FORMAT)
    if any(LAYER_STATES.match(n) or ZERO3_MODEL_STATES.match(n) for n in files):
        what = "pipeline layer files" if any(LAYER_STATES.match(n) for n in files) else "ZeRO-3 model states"
        raise SourceError(f"'{step_rel(tag, '')}': a DeepSpeed MoE checkpoint with {what}; ckpttool reads MoE "
                          "checkpoints of ZeRO-1/2 and BF16_Optimizer without pipeline stages")
    state = first_model_states(root, step, tag, sorted((int(m.group(1)), n) for n in files if (m := MODEL_STATES.match(n))),
                          scan=scan)
    experts = _expert_files(root, tag, files, state, scan=scan)
    if weights == "module":
        add_module(state, builder, names=None, why="module weights")
        _add_expert_files(experts, builder, names=None)
        builder.set_parallel(tp=1, pp=1)
        builder.note(f"module weights from '{state.rel}' and {len(experts)} per-expert files (not the fp32 "
                     "master weights)")
        return builder.build()
    optims = sorted((int(m.group(2)), m.group(1) or "", n) for n in files if (m := OPTIM_STATES.match(n)))
    if not optims:
        raise SourceError(f"'{step_rel(tag, '')}': no *_optim_states.pt files, so no fp32 master weights; pass "
                          "weights='module' to take the module's weights (the per-expert files)")
    _read_master(root, tag, state, optims, experts, builder, scan=scan)
    frozen = field(state.obj, "frozen_param_shapes", dict, state.rel, default=None) or {}
    if any(isinstance(n, str) and _EXPERT.match(n) for n in frozen):
        raise SourceError(f"'{state.rel}': frozen expert parameters, which rank 0 records under its own local "
                          "expert ids only; use weights='module' (the per-expert files hold every expert)")
    add_extras(state, builder, strip_layer=False)
    _against_expert_files(experts, builder)
    return builder.build()


def _against_expert_files(experts: dict[str, Loaded], builder: SharingBuilder) -> None:
    """Check the renumbered optimizer experts against DeepSpeed's own numbering, the per-expert files: every
    optimizer expert is in them, and every expert they hold is in the optimizer (a different count means another
    expert-parallel size); what the files hold beyond the parameters (an expert's buffers) is taken from them."""
    trained = set(builder.declared)
    named = {key for loaded in experts.values() for key in loaded.obj}
    strays = sorted(n for n in trained - named if _EXPERT.match(n))
    if strays:
        raise SourceError(f"the optimizer's expert parameters, renumbered to global ids, are not all in the "
                          f"per-expert files: {', '.join(repr(s) for s in strays[:4])}"
                          f"{f' and {len(strays) - 4} more' if len(strays) > 4 else ''} (the files hold "
                          f"{len(named)} expert tensors); is it a mix of two checkpoints?")
    optimized = {_expert_of(n) for n in trained if _EXPERT.match(n)}
    untrained = sorted({_expert_of(n) for n in named} - optimized)
    if untrained and optimized:
        module, expert = untrained[0]
        raise SourceError(f"expert {expert} of '{module}' has a per-expert file but no fp32 master weights in any "
                          f"optimizer file (the optimizer holds {len(optimized)} experts, the files "
                          f"{len(optimized) + len(untrained)}); do the partition counts match the expert-parallel "
                          "size?")
    rest = named - trained  # an expert's buffers: saved whole in its file, no optimizer state
    if rest:
        _add_expert_files(experts, builder, names=rest)
        builder.note(f"{len(rest)} expert tensors without optimizer state taken from the per-expert files")


def _expert_of(name: str) -> tuple[str, int]:
    m = _EXPERT.match(name)
    return (m.group(1), int(m.group(2))) if m else (name, -1)


# ---------------------------------------------------------------------------------------------- expert files

def _expert_files(root: Path, tag: str, files: list[str], state: Loaded, *, scan: Scan) -> dict[str, Loaded]:
    """Every ``layer_L_expert_E`` file, scanned and checked: the ids its names carry are its own, one MoE module
    per layer, and no expert of a layer is missing (``num_experts`` in the model states)."""
    found: dict[int, dict[int, str]] = {}
    for name in files:
        if m := _EXPERT_FILE.match(name):
            if int(m.group(3)) != 0:
                raise SourceError(f"'{step_rel(tag, name)}': expert files of model-parallel rank {int(m.group(3))}: "
                                  "ckpttool reads DeepSpeed MoE checkpoints without tensor parallelism")
            found.setdefault(int(m.group(1)), {})[int(m.group(2))] = name
    recorded = field(state.obj, "num_experts", list, state.rel, default=None)
    counts = dims(recorded, "num_experts", state.rel) if recorded else tuple(max(found.get(layer, {0: ""})) + 1
                                                                             for layer in range(max(found) + 1))
    stray = sorted((layer, n) for layer, have in found.items() for e, n in have.items()
                   if layer >= len(counts) or e >= counts[layer])
    if stray:
        layer, name = stray[0]
        raise SourceError(f"'{step_rel(tag, name)}': an expert file beyond the experts '{state.rel}' records "
                          f"(num_experts {list(counts)}: {len(counts)} MoE layers, expert ids 0..n-1 in each)")
    loaded: dict[str, Loaded] = {}
    missing: list[str] = []
    for layer, total in enumerate(counts):
        have = found.get(layer, {})
        module = None
        for expert in sorted(have):
            item = loaded[have[expert]] = scan(root, step_rel(tag, have[expert]))
            module = _check_expert_file(item, expert, module)
        where = f"MoE layer {layer}" + (f", '{module}'" if module else "")
        missing.extend(f"'{step_rel(tag, f'layer_{layer}_expert_{e}_mp_rank_00_model_states.pt')}' (expert {e} of the "
                       f"{total} of {where})" for e in range(total) if e not in have)
    if missing:
        raise SourceNotFoundError(
            f"{len(missing)} per-expert file{'s' if len(missing) > 1 else ''} missing: " + "; ".join(missing[:6])
            + (f"; and {len(missing) - 6} more" if len(missing) > 6 else "") + ". DeepSpeed saves one per expert "
            "(its module weights, named with its global id); is the checkpoint complete?")
    return loaded


def _check_expert_file(item: Loaded, expert: int, module: str | None) -> str:
    """The MoE module an expert file belongs to; every tensor in it must be named for that module and expert."""
    if not isinstance(item.obj, dict) or not item.obj:
        raise SourceError(f"'{item.rel}': not a DeepSpeed expert state dict (no dict of tensors inside)")
    for key, tensor in item.obj.items():
        m = _EXPERT.match(key) if isinstance(key, str) else None
        if m is None or int(m.group(2)) != expert or not isinstance(tensor, StoredTensor):
            what = repr(key) if isinstance(key, str) else shown(key)
            raise SourceError(f"'{item.rel}': {what} is not a tensor of expert {expert} "
                              "('<moe module>.deepspeed_moe.experts.deepspeed_experts.<expert>.<param>')")
        if module is not None and m.group(1) != module:
            raise SourceError(f"'{item.rel}': '{key}' belongs to '{m.group(1)}', the layer's other experts to "
                              f"'{module}'")
        module = m.group(1)
    return module or ""


def _add_expert_files(experts: dict[str, Loaded], builder: SharingBuilder, names: set[str] | None) -> None:
    for item in experts.values():
        for key, tensor in item.obj.items():
            if (names is None or key in names) and builder.declare(key, tensor.shape, tensor.dtype,
                                                                   where=f"'{item.rel}'"):
                builder.add(key, whole_piece(item.rel, key, tensor))


# ---------------------------------------------------------------------------------------------- master weights

def _read_master(root: Path, tag: str, state: Loaded, optims: list[tuple[int, str, str]], experts: dict[str, Loaded],
                 builder: SharingBuilder, *, scan: Scan) -> None:
    """The fp32 master weights: every param group cut from the ranks that partition it."""
    prefixes = sorted({p for _, p, _ in optims})
    if len(prefixes) > 1:
        raise SourceError(f"'{step_rel(tag, '')}': optimizer files of different kinds "
                          f"({', '.join(p or 'fp32' for p in prefixes)}) side by side; is it two checkpoints in one "
                          "directory?")
    template = f"{prefixes[0]}zero_pp_rank_{{rank}}_mp_rank_00_optim_states.pt"
    ranks = {rank: scan(root, step_rel(tag, name)) for rank, _, name in optims}
    osds = {rank: optimizer_state_dict(loaded) for rank, loaded in ranks.items()}
    first = min(ranks)
    recorded = "param_shapes" in state.obj
    shapes = param_shapes(state) if recorded else shapes_from_mappings(state, ranks, osds, experts, _EXPERT)
    counts = _partition_counts(ranks, osds, len(shapes))
    if not recorded:  # the order of a group's parameters is read from every file that holds a part of it
        absent = [r for r in range(max(counts)) if r not in ranks]
        if absent:
            raise SourceNotFoundError(
                f"'{step_rel(tag, template.format(rank=absent[0]))}': missing; '{state.rel}' records no param_shapes "
                "(DeepSpeed before 0.19 saves none with MoE), so the parameters' order is read from every optimizer "
                "file's param_slice_mappings, and each one is needed")
    moe = [_is_moe_group(g, group, osds[first], ranks[first].rel, state.rel) for g, group in enumerate(shapes)]
    world = max(counts)
    extra = sorted(r for r in ranks if r >= world)
    if extra:
        raise SourceError(f"partition_count is {counts} (in '{ranks[first].rel}'), a data-parallel size of {world}, "
                          f"but '{ranks[extra[0]].rel}' is rank {extra[0]}. Is it a mix of two checkpoints?")
    some = osds[first]
    bf16_optimizer = "zero_stage" not in some
    if not bf16_optimizer and some.get("zero_stage") not in (1, 2):
        raise SourceError(f"'{ranks[first].rel}': zero_stage {some.get('zero_stage')!r}; a DeepSpeed MoE checkpoint "
                          "is read from ZeRO-1/2 or BF16_Optimizer partitions")
    config = (field(state.obj, "ds_config", dict, state.rel, default=None)  # before 0.19: in the optimizer files only
              or field(ranks[first].obj, "ds_config", dict, ranks[first].rel, default=None) or {})
    data_first = config.get("use_data_before_expert_parallelism", False) is True
    files = f"'{prefixes[0]}zero_pp_rank_*' files"
    eps: set[int] = set()

    def part(rank: int, g: int) -> FlatPart:
        if rank not in ranks:
            return FlatPart(rank, step_rel(tag, template.format(rank=rank)), None, 0)
        groups, paddings = osds[rank].get("single_partition_of_fp32_groups"), osds[rank].get("group_paddings")
        if not (isinstance(groups, list) and isinstance(paddings, list) and len(groups) == len(paddings) == len(shapes)):
            raise SourceError(f"'{ranks[rank].rel}': single_partition_of_fp32_groups/group_paddings do not hold the "
                              f"{len(shapes)} param groups of '{state.rel}'")
        tensor = groups[g]
        if not isinstance(tensor, StoredTensor) or len(tensor.shape) != 1 or tensor.dtype != "F32":
            raise SourceError(f"'{ranks[rank].rel}': single_partition_of_fp32_groups[{g}] is not a flat fp32 tensor")
        tensor.required_offset(ranks[rank].rel, f"single_partition_of_fp32_groups[{g}]")
        return FlatPart(rank, ranks[rank].rel, tensor, integer(paddings[g], f"group_paddings[{g}]", ranks[rank].rel))

    for g, group in enumerate(shapes):
        pads = alignment_pads(some, g, group, ranks[first].rel)
        if not moe[g]:
            if counts[g] != world:
                raise SourceError(f"'{ranks[first].rel}': partition_count {counts}: param group {g}, which holds no "
                                  f"experts, is partitioned over {counts[g]} ranks, another over {world}; a group "
                                  "without experts is partitioned over every data-parallel rank")
            cut_group(builder, f"param group {g}", group, pads, [part(r, g) for r in range(world)],
                       bf16_optimizer=bf16_optimizer, state=state, files=files)
            continue
        ep = _ep_size(g, counts, world, some, ranks[first].rel)
        eps.add(ep)
        local = _local_experts(group, g, state.rel)
        edp = world // ep
        for e in range(ep):
            members = ([e * edp + k for k in range(edp)] if data_first else [k * ep + e for k in range(edp)])
            renamed = {_global(n, e, local): s for n, s in group.items()}
            cut_group(builder, f"param group {g} (the experts of EP rank {e})", renamed, pads,
                       [part(r, g) for r in members], bf16_optimizer=bf16_optimizer, state=state, files=files)
    kind = "BF16_Optimizer" if bf16_optimizer else f"ZeRO-{some.get('zero_stage')}"
    topology = "D + E: expert-data-parallel groups of consecutive ranks" if data_first else \
        "E + D: expert-parallel groups of consecutive ranks"
    builder.set_parallel(tp=1, pp=1, dp=world, **({"ep": max(eps)} if eps else {}))
    builder.note(f"fp32 master weights of a DeepSpeed MoE {kind} checkpoint over {world} data-parallel ranks, "
                 f"expert parallel size {', '.join(map(str, sorted(eps))) or 'none'} ({topology}); local experts "
                 "renumbered to global ids (ep_rank * local + j), as the per-expert files name them")


def _partition_counts(ranks: dict[int, Loaded], osds: dict[int, dict], groups: int) -> list[int]:
    """``partition_count`` (one per param group), the same in every optimizer file."""
    seen: dict[tuple[int, ...], str] = {}
    for rank, osd in osds.items():
        seen.setdefault(dims(osd.get("partition_count"), "partition_count", ranks[rank].rel), ranks[rank].rel)
    if len(seen) > 1:
        listed = ", ".join(f"{list(c)} in '{rel}'" for c, rel in seen.items())
        raise SourceError(f"the optimizer files disagree on partition_count: {listed}")
    counts = list(next(iter(seen)))
    if len(counts) != groups or not all(counts):
        raise SourceError(f"'{next(iter(seen.values()))}': partition_count {counts} for {groups} param groups")
    return counts


def _is_moe_group(g: int, group: dict[str, tuple[int, ...]], osd: dict, rel: str, states: str) -> bool:
    """Whether param group ``g`` holds experts: all its names are expert parameters, and the base optimizer
    state's ``param_groups`` (where recorded) agree (``moe=True``)."""
    experts = [bool(_EXPERT.match(n)) for n in group]
    if any(experts) and not all(experts):
        raise SourceError(f"'{states}': param group {g} mixes expert and other parameters; DeepSpeed keeps experts "
                          "in their own groups (split_params_into_different_moe_groups_for_optimizer)")
    recorded = _recorded_group(osd, g)
    if recorded is not None and bool(recorded.get("moe")) != all(experts) and group:
        raise SourceError(f"'{rel}': param group {g} is {'' if recorded.get('moe') else 'not '}marked moe, but its "
                          f"parameters in '{states}' are {'' if all(experts) else 'not '}experts")
    return bool(group) and all(experts)


def _recorded_group(osd: dict, g: int) -> dict | None:
    base = osd.get("base_optimizer_state")
    groups = base.get("param_groups") if isinstance(base, dict) else None
    return groups[g] if isinstance(groups, list) and g < len(groups) and isinstance(groups[g], dict) else None


def _ep_size(g: int, counts: list[int], world: int, osd: dict, rel: str) -> int:
    """The expert-parallel size of MoE group ``g``: the data-parallel size over the group's own partition count,
    and the group's name (``ep_size_<P>``) where recorded must agree."""
    if world % counts[g]:
        raise SourceError(f"'{rel}': partition_count {counts}: the expert group {g}'s {counts[g]} does not divide "
                          f"the data-parallel size {world}")
    ep = world // counts[g]
    recorded = _recorded_group(osd, g)
    m = _GROUP_NAME.match(str(recorded.get("name"))) if recorded is not None else None
    if m is not None and int(m.group(1)) != ep:
        raise SourceError(f"'{rel}': param group {g} is named '{recorded['name']}', but partition_count {counts} gives "
                          f"an expert-parallel size of {world} / {counts[g]} = {ep}")
    return ep


def _local_experts(group: dict[str, tuple[int, ...]], g: int, rel: str) -> dict[str, int]:
    """The number of local experts of each MoE module in a group (their ids must be ``0 .. n-1``)."""
    ids: dict[str, set[int]] = {}
    for name in group:
        module, expert = _expert_of(name)
        ids.setdefault(module, set()).add(expert)
    for module, have in ids.items():
        if have != set(range(len(have))):
            raise SourceError(f"'{rel}': param group {g}: the local experts of '{module}' are {sorted(have)}; "
                              f"expected 0..{len(have) - 1}")
    return {module: len(have) for module, have in ids.items()}


def _global(name: str, ep_rank: int, local: dict[str, int]) -> str:
    """A local expert parameter's name with its global id, ``ep_rank * local + j``."""
    m = _EXPERT.match(name)
    if m is None:  # not an expert: _is_moe_group let only experts into the group
        return name
    expert = ep_rank * local[m.group(1)] + int(m.group(2))
    return f"{m.group(1)}.deepspeed_moe.experts.deepspeed_experts.{expert}.{m.group(3)}"
