"""Megatron-LM checkpoints of FP8 training, as megatron-core 0.16.1 with Transformer Engine 2.9-2.11 writes them.

``fixtures/megatron_fp8_tp2`` (``fixtures/make_megatron_fp8.py``) is a torch_dist checkpoint saved by megatron-core
0.16.1 itself (TP=2, gloo) whose contents follow what an ``--fp8-format hybrid --fp8-recipe delayed
--fp8-param-gather`` run leaves, reproduced from the sources because Transformer Engine does not run on a CPU:

- the weights of ``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2`` are stored dequantized in their
  nominal dtype, ``float32(fp8) * scale_inv`` with one E4M3 scale per TP piece: Megatron's torch_dist writer calls
  ``tensor.to("cpu")`` (``megatron/core/dist_checkpointing/strategies/filesystem_async.py``,
  ``FileSystemWriterAsync.preload_tensors``, core_v0.16.1) and TE v2.9's ``QuantizedTensor.__torch_dispatch__``
  (``transformer_engine/pytorch/tensor/quantized_tensor.py`` lines 513-518; ``Float8Tensor`` only warns for
  ``_to_copy``, ``float8_tensor.py`` lines 630-639) dequantizes on that copy; v2.10 and v2.11 are the same (TE 2.17
  first keeps the subclass there, outside core 0.16.1's pin ``<2.12``);
- each of those modules' ``_extra_state`` holds TE's ``get_extra_state()`` bytes (TE v2.9
  ``transformer_engine/pytorch/module/base.py`` lines 842-901: a pickle of the ``DelayedScaling`` recipe, amax
  histories and scales), as the ShardedObject ``make_sharded_tensors_for_checkpoint`` makes of it
  (``megatron/core/transformer/utils.py`` lines 120-125, 151-175) and the torch_dist strategy saves as bytes
  (``megatron/core/dist_checkpointing/strategies/torch.py`` lines 320-325);
- ``common.pt`` args record ``fp8``, ``fp8_recipe``, ``fp8_param_gather``.

Its ``legacy/`` (``--ckpt-format torch``) is the same run without ``--fp8-param-gather``: plain weights and the same TE
``_extra_state`` bytes as uint8 tensors in the model dict (what ``torch.save`` of ``state_dict_for_save_checkpoint()``
holds with TE 2.9's ``get_extra_state``).

The merge equals what Megatron itself loads from the checkpoint (``reference/``), says what it did with the FP8 state,
and the audit passes. A legacy (``--ckpt-format torch``) file that pickles TE's ``Float8Tensor`` (what
``torch.save`` of such parameters writes: ``Float8Tensor.__reduce_ex__``, TE v2.9 ``float8_tensor.py`` lines 641-669)
is refused, naming the class and the way out.
"""

from __future__ import annotations

import argparse
import enum
import io
import sys
import types

import pytest
import torch
from conftest import FIXTURES, load_output

import ckpttool
from ckpttool.errors import UnsafePickleError
from ckpttool.readers.megatron.fp8 import dcp_extra_states, notes

FIXTURE = FIXTURES / "megatron_fp8_tp2"
NOTE = ("trained in FP8 (fp8='hybrid', fp8_recipe='delayed', fp8_param_gather): the weights are stored in their "
        "training dtype (F32) (FP8 parameters dequantized by Megatron-Core's torch_dist writer) and merged as stored, "
        "not as FP8 (--quantize fp8 writes FP8); its 8 Transformer Engine _extra_state entries (FP8 scaling state: "
        "recipe, amax history, scales) are training state, skipped")


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron_fp8") / "out"
    return ckpttool.merge(FIXTURE / "torch_dist", out, config=FIXTURE / "config.json"), out


def test_the_merge_is_what_megatron_loads_bit_for_bit(merged):
    result, out = merged
    got, want = load_output(out), load_output(FIXTURE / "reference")
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype == torch.float32 and torch.equal(got[name], tensor), name
    assert result.audit is not None and result.audit.ok


def test_the_legacy_format_merges_to_the_same_weights_and_says_so(tmp_path):
    result = ckpttool.merge(FIXTURE / "legacy", tmp_path / "out", config=FIXTURE / "config.json")
    assert result.format == "megatron-legacy" and result.audit.ok
    got, want = load_output(tmp_path / "out"), load_output(FIXTURE / "reference")
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
    assert ("trained in FP8 (fp8='hybrid', fp8_recipe='delayed'): the weights are stored in their training dtype "
            "(F32) and merged as stored, not as FP8 (--quantize fp8 writes FP8)") in result.plan.notes
    assert "skipped 18 non-weight entries (_extra_state)" in result.plan.notes


def test_the_stored_weights_are_fp8_values_times_a_scale_per_tp_piece():
    """What makes the fixture an FP8 run's: each TP piece of a quantized weight is E4M3-exact at its own scale."""
    tensors = load_output(FIXTURE / "reference")
    for name in ("model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        for piece in tensors[name].chunk(2, dim=1):  # linear_proj and linear_fc2 are split on their columns
            scale_inv = torch.tensor(float(piece.abs().max()) / 448.0, dtype=torch.float32)
            assert torch.equal((piece / scale_inv).to(torch.float8_e4m3fn).to(torch.float32) * scale_inv, piece), name
    norm = tensors["model.layers.0.input_layernorm.weight"]  # not a TE Linear weight: not quantized
    scale_inv = torch.tensor(float(norm.abs().max()) / 448.0)
    assert not torch.equal((norm / scale_inv).to(torch.float8_e4m3fn).to(torch.float32) * scale_inv, norm)


def test_the_te_fp8_state_is_on_disk_as_bytes_naming_tes_recipe():
    from torch.distributed.checkpoint import FileSystemReader

    directory = FIXTURE / "torch_dist" / "iter_0000010"
    metadata = FileSystemReader(str(directory)).read_metadata()
    keys = sorted(k for k in metadata.state_dict_metadata if "_extra_state" in k)
    assert len(keys) == 8 and "decoder.layers.self_attention.linear_qkv._extra_state/shard_1_2" in keys
    index = next(i for i in metadata.storage_data if i.fqn == keys[0])
    info = metadata.storage_data[index]
    with open(directory / info.relative_path, "rb") as f:
        f.seek(info.offset)
        (state,) = torch.load(io.BytesIO(f.read(info.length)), weights_only=True)
    raw = state.numpy().tobytes()
    for name in (b"transformer_engine.common.recipe", b"DelayedScaling", b"amax_history_fwd", b"scale_fwd"):
        assert name in raw


def test_the_merge_says_what_it_did_with_the_fp8_state(merged):
    result, _ = merged
    assert NOTE in result.plan.notes


def test_the_audit_reports_it_and_passes(tmp_path):
    report = ckpttool.audit(FIXTURE / "torch_dist", config=FIXTURE / "config.json")
    assert report.ok
    assert any(NOTE in f.message for f in report.findings)


def test_without_fp8_in_the_args_nothing_is_said():
    assert notes({"fp8": None, "fp8_recipe": None, "fp8_param_gather": False}, {"BF16"}, 3) == []
    assert notes({"fp8": "e4m3"}, {"BF16"}, 0) == [
        "trained in FP8 (fp8='e4m3'): the weights are stored in their training dtype (BF16) and merged as stored, not "
        "as FP8 (--quantize fp8 writes FP8)"]
    assert dcp_extra_states(None) == 0


# ---- legacy: TE's Float8Tensor pickled in model_optim_rng.pt ------------------------------------------------------

TE_FLOAT8 = "transformer_engine.pytorch.tensor.float8_tensor"


class Float8Tensor:
    """Pickles as TE v2.9's ``Float8Tensor``: ``__reduce_ex__`` -> ``(Float8Tensor._make_in_reduce_ex, (data,
    fp8_dtype, scale_inv, dtype, shape))`` (float8_tensor.py lines 641-669)."""

    def __init__(self, data: torch.Tensor, scale_inv: torch.Tensor) -> None:
        self.data, self.scale_inv = data, scale_inv

    @classmethod
    def _make_in_reduce_ex(cls, *args):  # pragma: no cover (never called: ckpttool refuses before)
        raise AssertionError("ckpttool must not rebuild a Float8Tensor")

    def __reduce_ex__(self, protocol: int):
        return (Float8Tensor._make_in_reduce_ex,
                (self.data.view(torch.uint8), DType.kFloat8E4M3, self.scale_inv, torch.float32, self.data.shape))


class DType(enum.IntEnum):
    """Stands for ``transformer_engine_torch.DType`` (its C++ enum); never reached: the class before it is refused."""

    kFloat8E4M3 = 7


def _make_float8_tensor_in_reduce_ex(*args):  # pragma: no cover (never called: ckpttool refuses before)
    raise AssertionError("ckpttool must not rebuild a Float8Tensor")


class Float8TensorV216(Float8Tensor):
    """Pickles as TE 2.16+'s ``Float8Tensor``: ``__reduce_ex__`` -> ``(_make_float8_tensor_in_reduce_ex, (data,
    fp8_dtype, scale_inv, dtype, shape))``, a module-level function (TE v2.17 float8_tensor.py lines 907-919, 1006)."""

    def __reduce_ex__(self, protocol: int):
        return (_make_float8_tensor_in_reduce_ex,
                (self.data.view(torch.uint8), DType.kFloat8E4M3, self.scale_inv, torch.bfloat16, self.data.shape))


def _as_te(monkeypatch) -> list[str]:
    """Register the stand-ins under TE's module names (pickle imports a class's module, and its parents, to name
    it); the names, for the test to remove once the file is written: ckpttool imports nothing of TE's."""
    parts = TE_FLOAT8.split(".")
    names = [".".join(parts[:n]) for n in range(1, len(parts) + 1)] + ["transformer_engine_torch"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    for owner, value in ((TE_FLOAT8, Float8Tensor), (TE_FLOAT8, _make_float8_tensor_in_reduce_ex),
                         ("transformer_engine_torch", DType)):
        setattr(sys.modules[owner], value.__name__, value)
        monkeypatch.setattr(value, "__module__", owner)
    return names


def test_a_legacy_file_pickling_tes_float8tensor_is_refused_naming_it(tmp_path, monkeypatch):
    names = _as_te(monkeypatch)
    args = argparse.Namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, num_layers=1,
                              fp8="hybrid", fp8_recipe="delayed", fp8_param_gather=True)
    weight = (torch.randn(16, 32) * 8).to(torch.float8_e4m3fn)
    state = {"args": args, "checkpoint_version": 3.0, "iteration": 10,
             "model": {"decoder.layers.0.self_attention.linear_proj.weight": Float8Tensor(weight, torch.tensor([0.01]))}}
    src = tmp_path / "legacy"
    (src / "iter_0000010" / "mp_rank_00").mkdir(parents=True)
    (src / "latest_checkpointed_iteration.txt").write_text("10")
    torch.save(state, src / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt")
    for name in names:
        monkeypatch.delitem(sys.modules, name)
    want = ("'iter_0000010/mp_rank_00/model_optim_rng.pt': holds Transformer Engine quantized parameters (its pickle "
            f"asks for '{TE_FLOAT8}.Float8Tensor'): Megatron-LM wrote FP8 weights as TE's own tensors, as "
            "--fp8-param-gather does with --ckpt-format torch. ckpttool runs none of TE's code to rebuild them (nothing "
            "was executed). Save the checkpoint with --ckpt-format torch_dist, where Megatron-Core writes these "
            "weights dequantized to their training dtype, and merge that")
    with pytest.raises(UnsafePickleError) as e:
        ckpttool.merge(src, tmp_path / "out", format="megatron-legacy")
    assert str(e.value) == want
    assert not (tmp_path / "out").exists()


def test_a_torch_dist_item_pickling_tes_float8tensor_is_refused_before_planning(tmp_path, monkeypatch):
    """TE 2.16+ keeps a Float8Tensor quantized on its copy to the host (quantized_tensor.py's ``_to_copy`` branch), so
    torch_dist would torch.save TE's class: reproduced by writing one chunk's item as that pickle (appended to its
    .distcp file, the .metadata storage entry pointed at it)."""
    import dataclasses
    import pickle
    import shutil

    from torch.distributed.checkpoint import FileSystemReader

    names = _as_te(monkeypatch)
    src = tmp_path / "torch_dist"
    shutil.copytree(FIXTURE / "torch_dist", src)
    iteration = src / "iter_0000010"
    metadata = FileSystemReader(str(iteration)).read_metadata()
    key = "decoder.layers.self_attention.linear_proj.weight"
    index = next(i for i in metadata.storage_data if i.fqn == key)
    chunk = next(c for c in metadata.state_dict_metadata[key].chunks if c.offsets == index.offset)
    item = io.BytesIO()
    torch.save(Float8TensorV216(torch.randn(*chunk.sizes).to(torch.float8_e4m3fn), torch.tensor([0.01])), item)
    info = metadata.storage_data[index]
    path = iteration / info.relative_path
    start = path.stat().st_size
    path.write_bytes(path.read_bytes() + item.getvalue())
    metadata.storage_data[index] = dataclasses.replace(info, offset=start, length=len(item.getvalue()))
    (iteration / ".metadata").write_bytes(pickle.dumps(metadata))
    for name in names:
        monkeypatch.delitem(sys.modules, name)
    want = (f"'iter_0000010/{info.relative_path}': '{key}' is a Transformer Engine quantized tensor (its pickle asks "
            f"for '{TE_FLOAT8}._make_float8_tensor_in_reduce_ex'): torch_dist saved TE's own class, not the "
            "dequantized values it writes with Transformer Engine 2.9-2.15 (megatron-core 0.16.1 supports 2.9-2.11; "
            "from 2.16, TE keeps FP8 parameters quantized when they are copied to the host for saving). ckpttool runs "
            "none of TE's code (nothing was executed); save with Transformer Engine before 2.16, or without "
            "--fp8-param-gather")
    with pytest.raises(UnsafePickleError) as e:
        ckpttool.merge(src, tmp_path / "out", config=FIXTURE / "config.json", dry_run=True)
    assert str(e.value) == want
