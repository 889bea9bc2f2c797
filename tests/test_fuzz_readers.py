"""Fuzzing the framework readers through what their pickles hold: DeepSpeed model and optimizer states, Megatron
args and state dicts, verl DTensors and meshes, ColossalAI shards, DCP ``.metadata`` under Megatron.

A pickle read with stand-ins can hold any plain value anywhere: ``None`` where a list of paddings belongs, a
string parallel size, a shape of ``2**63``, a key that is a number. Each example takes the object trees the
committed fixtures' files really hold, replaces a few values (or dict keys, or tensors' shapes) with such values,
or deletes them, hands the result to the reader in place of the file's, and builds the whole plan
(:func:`ckpttool.prepare`: reader, HuggingFace cut, coverage). Only a :class:`~ckpttool.errors.CkptError` may come
out; anything else is a crash in ckpttool and fails the test, with the mutation that caused it.

Examples per source: ``CKPTTOOL_HYPOTHESIS_EXAMPLES`` (default 100).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckpttool
from ckpttool.io import torch_save
from ckpttool.layout.layout import c_strides
from ckpttool.readers import colossalai, dcp
from ckpttool.readers.verl import reader as verl
from ckpttool.io.safe_pickle import Record
from ckpttool.io.torch_save import StoredTensor
from conftest import FIXTURES, HYPOTHESIS_EXAMPLES
from test_fuzz import only_ckpt_errors

FUZZ = settings(max_examples=HYPOTHESIS_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))

#: name -> (source directory, config): every framework reader, and its variants (ZeRO stages, pipeline, MoE)
SOURCES: dict[str, tuple[Path, Path | None]] = {
    **{name: (FIXTURES / name / "checkpoint", None) for name in (
        "deepspeed_zero2", "deepspeed_zero3", "deepspeed_bf16_zero1", "deepspeed_pipe", "deepspeed_universal",
        "deepspeed_autotp_zero2", "deepspeed_moe_zero2_w4_ep2",
        "verl_llama_dp2_tp2", "verl_dtensor_strided", "colossalai_mixtral_pp2_ep2", "colossalai_llama_pp2_bin")},
    **{f"{name}_{kind}": (FIXTURES / name / kind, FIXTURES / name / "config.json")
       for name in ("megatron_tp2_pp2", "megatron_ep2_moe", "megatron_pp2_vpp2") for kind in ("legacy", "torch_dist")},
}

DELETE = object()  #: a mutation that removes the value (a dict entry, a list item, an attribute)
#: the names readers look up (Megatron's args among some 600 others, DeepSpeed's partitions, DTensor specs, DCP
#: records): half the mutations land on one of these
HOT = {
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
    "virtual_pipeline_model_parallel_size", "data_parallel_size", "num_layers", "num_experts", "swiglu",
    "expert_tensor_parallel_size", "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
    "make_vocab_size_divisible_by", "padded_vocab_size", "num_query_groups", "group_query_attention",
    "num_attention_heads", "ffn_hidden_size", "moe_ffn_hidden_size", "hidden_size", "kv_channels", "args", "model",
    "param_shapes", "buffer_names", "shared_params", "frozen_param_shapes", "frozen_param_fragments", "module",
    "optimizer_state_dict", "zero_stage", "partition_count", "single_partition_of_fp32_groups", "group_paddings",
    "param_alignment_paddings", "fp32_flat_groups", "param", "_local_tensor", "_spec", "mesh", "placements", "dim",
    "split_factor", "shape", "stride", "_rank_map", "_layout", "axes", "tensor_meta", "shard_order", "tensor_dim",
    "mesh_dims", "_coordinate_on_dim", "_mesh_dim_names", "state_dict_metadata", "storage_data", "properties",
    "dtype", "size", "chunks", "offsets", "sizes", "relative_path", "offset", "length", "fqn",
    "universal_checkpoint_info", "affine_map", "params", "logical_shape", "ranks", "shard_shape", "pieces", "source",
    "dest", "locations", "scale", "tp_degree", "checkpoint_parallel_dimensions", "parameter_with_row_parallelism_patterns",
    "tp_replicated_parameter_patterns", "autotp_unsupported_parameter_patterns", "ds_config", "autotp_size",
    "base_optimizer_state", "param_groups", "moe", "name", "use_data_before_expert_parallelism",
}


# ------------------------------------------------------------------------------------------ the object trees


def _steps(obj: Any) -> Iterator[tuple[str, Any, Any]]:
    """``(kind, key, child)`` for every child of ``obj``: dict items, list/tuple items, attributes of stand-ins,
    fields of dataclasses (a StoredTensor's shape, a DTensor wrapper's size)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield "item", k, v
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield "item", i, v
    elif isinstance(obj, StoredTensor):
        return  # a leaf: its fields come from checked storage records; Reshape gives it another shape
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield "field", f.name, getattr(obj, f.name)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        for k, v in vars(obj).items():
            yield "attr", k, v


def paths(obj: Any, prefix: tuple = (), depth: int = 0) -> list[tuple]:
    """Every place in the tree, as a tuple of ``(kind, key)`` steps; the root is ``()``."""
    out = [prefix]
    if depth < 12:
        for kind, key, child in _steps(obj):
            out.extend(paths(child, (*prefix, (kind, key)), depth + 1))
    return out


def mutate(obj: Any, path: tuple, value: Any, rename: bool = False) -> Any:
    """``obj`` with the value at ``path`` replaced by ``value`` (or deleted; or, with ``rename``, a dict key
    replaced by ``value``). A path the earlier mutations removed is left alone."""
    if not path:
        if isinstance(value, Reshape):
            return dataclasses.replace(obj, shape=value.shape, stride=c_strides(value.shape)) \
                if isinstance(obj, StoredTensor) else value.shape
        return value
    (kind, key), rest = path[0], path[1:]
    if kind == "item":
        if isinstance(obj, dict) and key in obj:
            if rename and not rest:
                if value is not DELETE and _hashable(value):
                    obj = {(value if k == key else k): v for k, v in obj.items()}
                return obj
            new = mutate(obj[key], rest, value, rename)
            if new is DELETE:
                del obj[key]
            else:
                obj[key] = new
        elif isinstance(obj, (list, tuple)) and isinstance(key, int) and key < len(obj):
            items = list(obj)
            new = mutate(items[key], rest, value, rename)
            if new is DELETE:
                del items[key]
            else:
                items[key] = new
            return tuple(items) if isinstance(obj, tuple) else items
        return obj
    if kind == "field" and dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        # a stand-in's field: integer sizes stay integer sizes (the stand-in converts them)
        old = getattr(obj, key)
        new = mutate(old, rest, value, rename)
        if _ints(old) and not _ints(new):
            return obj
        return dataclasses.replace(obj, **{key: None if new is DELETE else new})
    if kind == "attr" and key in getattr(obj, "__dict__", {}):
        new = mutate(getattr(obj, key), rest, value, rename)
        if new is DELETE and isinstance(obj, Record):  # a pickle's state may lack it; other stand-ins always set it
            delattr(obj, key)
        else:
            setattr(obj, key, None if new is DELETE else new)
    return obj


def _ints(value: Any) -> bool:
    return isinstance(value, tuple) and all(isinstance(n, int) for n in value)


@dataclasses.dataclass(frozen=True)
class Reshape:
    """A mutation that gives a tensor another shape, its bytes where they were (a size as a tuple elsewhere)."""

    shape: tuple[int, ...]


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _tensor(shape: tuple[int, ...]) -> StoredTensor:
    """A stored tensor as a pickle can describe one: any integer shape, C-order strides, bytes not in place."""
    strides = tuple(1 for _ in shape)
    return StoredTensor("F32", shape, strides, "0", 0, None, 0)


VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from([2**63, -(2**31), 10**30]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=4), st.sampled_from(["2", "", "F32", "model"]),
    st.lists(st.integers(-2, 4), max_size=3), st.tuples(st.integers(-2, 2**40)), st.lists(st.none(), max_size=2),
    st.just({}), st.dictionaries(st.text(max_size=3), st.integers(-1, 3), max_size=2), st.just(DELETE),
    st.builds(Record), st.lists(st.integers(-2, 2**40), max_size=3).map(lambda s: _tensor(tuple(s))),
    st.lists(st.one_of(st.integers(-2, 70), st.sampled_from([2**31, 2**62])), max_size=4).map(lambda s: Reshape(tuple(s))),
)

# ------------------------------------------------------------------------------------------ the reader's view

_TREES: dict[str, dict[str, Any]] = {}


def _real_trees(name: str) -> dict[str, Any]:
    """label -> the object tree of every pickle the reader reads for this source (recorded once)."""
    if name not in _TREES:
        trees: dict[str, Any] = {}
        with _intercept(lambda label, obj: trees.setdefault(label, obj)):
            src, config = SOURCES[name]
            ckpttool.prepare(src, config=config)
        _TREES[name] = trees
    return _TREES[name]


@contextmanager
def _intercept(view: Callable[[str, Any], Any]) -> Iterator[None]:
    """Every pickle a reader reads goes through ``view(label, tree)`` (what it returns is what the reader gets)."""
    real_scan, real_metadata = torch_save.scan, dcp.load_metadata_pickle

    def scan(f, start=0, length=None, *, label, allow=None):
        obj = real_scan(f, start, length, label=label, allow=allow)
        return obj if label == "item" else view(label, obj)  # DCP's items are tensors, read by locate

    def metadata(data, label):
        return view(label, real_metadata(data, label))

    with mock.patch.object(torch_save, "scan", scan), mock.patch.object(verl, "scan", scan), \
            mock.patch.object(colossalai, "scan", scan), mock.patch.object(dcp, "load_metadata_pickle", metadata):
        yield


MUTATIONS = st.lists(st.tuples(st.integers(0, 2**20), st.integers(0, 2**20), VALUES, st.integers(0, 7)),
                     min_size=1, max_size=3)


@pytest.mark.parametrize("name", sorted(SOURCES))
@FUZZ
@given(mutations=MUTATIONS)
def test_a_reader_given_any_values_in_its_pickles(name, mutations):
    trees = _real_trees(name)
    labels = sorted(trees)
    chosen: dict[str, list] = {}
    for which, where, value, rename in mutations:
        label = labels[which % len(labels)]
        places = paths(trees[label])
        hot = [p for p in places if p and p[-1][1] in HOT]
        places = hot if hot and rename % 2 else places
        chosen.setdefault(label, []).append((places[where % len(places)], value, rename == 0))

    def view(label: str, obj: Any) -> Any:
        obj = copy.deepcopy(trees.get(label, obj))
        for path, value, rename in chosen.get(label, ()):
            obj = mutate(obj, path, value, rename)
        return obj

    src, config = SOURCES[name]
    with _intercept(view):
        only_ckpt_errors(lambda: ckpttool.prepare(src, config=config))
