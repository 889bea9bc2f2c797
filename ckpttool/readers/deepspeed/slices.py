"""DeepSpeed MoE param groups for model states that record no ``param_shapes`` (releases before 0.19), rebuilt from
what the ZeRO optimizer files record of their own partitions (``param_slice_mappings``)."""

from __future__ import annotations

import re

from ckpttool.errors import SourceError
from ckpttool.io.torch_save import StoredTensor
from ckpttool.readers.deepspeed.files import Loaded
from ckpttool.readers.validate import field, integer, shown


def shapes_from_mappings(state: Loaded, ranks: dict[int, Loaded], osds: dict[int, dict], experts: dict[str, Loaded],
                         expert: re.Pattern[str]) -> list[dict[str, tuple[int, ...]]]:
    """The param groups as ``param_shapes`` would list them, for model states that record none (DeepSpeed's MoE save
    before 0.19: no 'param_shapes', 'buffer_names' or 'ds_config').

    Each optimizer file's ``param_slice_mappings[g]`` names the parameters of its partition of group ``g`` in flat
    order (``fragment_address(numel, start)``, start local to the partition); in rank order, each name's first
    appearance is the group's order (a parameter straddling two partitions appears in both; every EP rank's expert
    group holds the same local names). Shapes come from the module (dense) and the per-expert files (experts: every
    expert of a MoE module has the same shapes). ``expert`` matches an expert parameter's name as (MoE module, expert
    id, parameter in the expert).

    Raises:
        SourceError: an optimizer file has no ``param_slice_mappings``, the files disagree on the number of groups,
            or a mapped name is in neither the module nor the per-expert files.
    """
    module = field(state.obj, "module", dict, state.rel)
    expert_shapes: dict[tuple[str, str], tuple[int, ...]] = {}
    for item in experts.values():
        for key, tensor in item.obj.items():
            m = expert.match(key)
            expert_shapes.setdefault((m.group(1), m.group(3)), tensor.shape)
    groups: list[dict[str, tuple[int, ...]]] = []
    for rank in sorted(ranks):
        mappings = osds[rank].get("param_slice_mappings")
        if not isinstance(mappings, list) or not all(isinstance(g, dict) for g in mappings):
            raise SourceError(f"'{ranks[rank].rel}': no param_slice_mappings, and '{state.rel}' records no param_shapes: "
                              "nothing says which parameters the flat fp32 partitions hold")
        if groups and len(mappings) != len(groups):
            raise SourceError(f"'{ranks[rank].rel}': param_slice_mappings for {len(mappings)} param groups, "
                              f"'{ranks[min(ranks)].rel}' for {len(groups)}")
        groups = groups or [{} for _ in mappings]
        for g, mapping in enumerate(mappings):
            where = f"param_slice_mappings[{g}]: a start"
            starts = {name: integer(getattr(address, "get", dict().get)("start"), where, ranks[rank].rel)
                      for name, address in mapping.items()}
            for name in sorted(starts, key=starts.__getitem__):
                if name in groups[g]:
                    continue
                m = expert.match(name) if isinstance(name, str) else None
                tensor = module.get(name)
                shape = (expert_shapes.get((m.group(1), m.group(3))) if m else
                         tensor.shape if isinstance(tensor, StoredTensor) else None)
                if shape is None:
                    raise SourceError(f"'{ranks[rank].rel}': param_slice_mappings[{g}] names {shown(name)}, which "
                                      f"neither the module in '{state.rel}' nor a per-expert file holds")
                groups[g][name] = shape
    return groups
