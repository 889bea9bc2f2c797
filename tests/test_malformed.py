"""Malformed framework metadata is the input's fault: a ckpttool error naming the file, what was read, what was
expected and what was found. A bug in ckpttool is not bad input: it is reported as an internal error."""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import ckpttool
from ckpttool.errors import SourceError
from ckpttool.layout.layout import Layout, TensorLayout
from ckpttool.layout.builder import LayoutBuilder
from ckpttool.model.description import ModelInfo
from ckpttool.families.conventions import megatron_core
from ckpttool.readers.deepspeed import reader as deepspeed
from ckpttool.io.torch_save import scan
from conftest import FIXTURES, assert_failed_cleanly, fixture_dir
from test_errors import edit_metadata, storage_of
from test_verl import _edit_pickle

INTERNAL = "internal error in ckpttool"


def failed(result, out: Path, *needles: str) -> None:
    assert_failed_cleanly(result, out, *needles)
    assert INTERNAL not in result.stderr  # not the CLI's report of a bug


# ------------------------------------------------------------------------------------ a bug is not bad input


def _a_bug(monkeypatch) -> None:
    def trips(state):
        return {}["param_shapes"]  # what an unchecked lookup in a reader raises

    monkeypatch.setattr(deepspeed, "_shapes", trips)


def test_a_bug_in_a_reader_is_an_internal_error_without_a_traceback(cli, copy_fixture, tmp_path, monkeypatch):
    src = copy_fixture("deepspeed_zero2")
    _a_bug(monkeypatch)
    out = tmp_path / "out"
    result = cli("merge", src, out)
    assert_failed_cleanly(result, out, "Error: internal error in ckpttool (KeyError: 'param_shapes'); rerun with "
                                       "CKPTTOOL_DEBUG=1 and report it")
    assert "malformed" not in result.stderr  # not blamed on the checkpoint


def test_a_bug_in_a_reader_shows_its_traceback_with_ckpttool_debug(cli, copy_fixture, tmp_path, monkeypatch):
    src = copy_fixture("deepspeed_zero2")
    _a_bug(monkeypatch)
    monkeypatch.setenv("CKPTTOOL_DEBUG", "1")
    result = cli("merge", src, tmp_path / "out")
    assert result.exit_code == 1
    assert "Traceback" in result.stderr and "in trips" in result.stderr and "KeyError: 'param_shapes'" in result.stderr
    assert f"Error: {INTERNAL} (KeyError: 'param_shapes')" in result.stderr
    assert not (tmp_path / "out").exists()


def test_a_bug_reaches_the_python_api_as_itself(copy_fixture, tmp_path, monkeypatch):
    _a_bug(monkeypatch)
    with pytest.raises(KeyError, match="param_shapes") as caught:
        ckpttool.merge(copy_fixture("deepspeed_zero2"), tmp_path / "out")
    assert not isinstance(caught.value, ckpttool.CkptError)


def test_a_bug_in_a_conventions_cut_into_huggingface_tensors_is_an_internal_error(cli, tmp_path, monkeypatch):
    fixture = FIXTURES / "megatron_tp2_pp2"

    def cut(layout, info):
        return [][0]

    monkeypatch.setattr(megatron_core, "to_hf", cut)
    out = tmp_path / "out"
    result = cli("merge", fixture / "legacy", out, "--config", fixture / "config.json")
    assert_failed_cleanly(result, out, f"Error: {INTERNAL} (IndexError: list index out of range)")


def test_an_absurd_size_in_a_pickle(tmp_path):
    class Infinite:
        def __reduce__(self):
            return (torch.Size, ([float("inf")],))

    buffer = io.BytesIO()
    torch.save({"w": torch.ones(2), "junk": Infinite()}, buffer)
    buffer.seek(0)
    with pytest.raises(SourceError, match=r"'rank.pt': cannot read it as a torch.save archive \(UnpicklingError: a size that is not a sequence of integers\)"):
        scan(buffer, label="rank.pt")


def test_a_deepspeed_tag_leading_outside_the_checkpoint(cli, tmp_path):
    src = tmp_path / "ckpt"
    shutil.copytree(fixture_dir("deepspeed_zero2") / "checkpoint", src)
    outside = tmp_path / "elsewhere"
    shutil.move(src / "global_step2", outside)
    os.symlink(outside, src / "step")
    (src / "latest").write_text("step")
    failed(cli("merge", src, tmp_path / "out"), tmp_path / "out", "'latest' names 'step', which leads outside the checkpoint directory")


def test_a_megatron_tracker_with_a_number_that_is_not_ascii(cli, tmp_path):
    fixture = Path(__file__).parent.parent / "fixtures" / "megatron_tp2_pp2"
    src = tmp_path / "legacy"
    shutil.copytree(fixture / "legacy", src)
    (src / "latest_checkpointed_iteration.txt").write_text("\u00b2")
    failed(cli("merge", src, tmp_path / "out", "--format", "megatron-legacy",
               "--config", fixture / "config.json"), tmp_path / "out",
           "'latest_checkpointed_iteration.txt': not an iteration number or 'release'")


def test_a_colossalai_ep_rank_numbered_from_zero(cli, copy_fixture, tmp_path):
    src = copy_fixture("colossalai_mixtral_pp2_ep2")
    for path in src.glob("*-00002-shard-*"):
        path.rename(path.with_name(path.name.replace("-00002-shard", "-00000-shard")))
    index = json.loads((src / "pytorch_model.bin.index.json").read_text())
    index["weight_map"] = {k: v.replace("-00002-shard", "-00000-shard") for k, v in index["weight_map"].items()}
    (src / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    failed(cli("merge", src, tmp_path / "out"), tmp_path / "out",
           "EP rank number 0 in the file name; ColossalAI numbers them from 1")


# ------------------------------------------------------- every value a reader reads is checked, one table

STEP = "global_step1"
STATES = f"{STEP}/mp_rank_00_model_states.pt"
OPTIM0 = f"{STEP}/zero_pp_rank_0_mp_rank_00_optim_states.pt"
MP00 = "iter_0000010/mp_rank_00/model_optim_rng.pt"


def deepspeed_zero2(tmp: Path, model: dict | None = None, optim: dict | None = None) -> Path:
    """A ZeRO-2 checkpoint of one parameter 'w' (2 x 3) over two ranks, its states changed by ``model``/``optim``."""
    root = tmp / "ds"
    (root / STEP).mkdir(parents=True)
    (root / "latest").write_text(STEP)
    torch.save({"module": {"w": torch.zeros(2, 3)}, "param_shapes": [{"w": torch.Size([2, 3])}], "buffer_names": [],
                **(model or {})}, root / STATES)
    flat = torch.arange(6.0)
    for rank in range(2):
        osd = {"zero_stage": 2, "partition_count": [2], "single_partition_of_fp32_groups": [flat[3 * rank:][:3].clone()],
               "group_paddings": [0], "param_alignment_paddings": [[0]], **(optim or {})}
        torch.save({"optimizer_state_dict": osd}, root / STEP / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    return root


def megatron_legacy_ckpt(tmp: Path, tp: int = 1, pp: int = 1, model: dict | None = None, args: object = None,
                         **changed: object) -> Path:
    """A Megatron-LM legacy checkpoint (one norm, or ``model``) over ``tp`` x ``pp`` rank directories; its args
    changed by ``changed``, or replaced by ``args``."""
    root = tmp / "mg"
    for t in range(tp):
        for p in range(pp):
            directory = root / "iter_0000010" / (f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else ""))
            directory.mkdir(parents=True)
            namespace = argparse.Namespace(**{"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                                              "num_layers": 2, "swiglu": True, **changed})
            torch.save({"args": namespace if args is None else args, "iteration": 10,
                        "model": model or {"decoder.final_layernorm.weight": torch.ones(4)}},
                       directory / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("10")
    return root


def megatron_dist_common(tmp: Path, common: dict) -> Path:
    root = tmp / "torch_dist"
    shutil.copytree(FIXTURES / "megatron_tp2_pp2" / "torch_dist", root)
    torch.save(common, root / "iter_0000010" / "common.pt")
    return root


def dcp_edited(tmp: Path, change) -> Path:
    root = tmp / "dcp"
    shutil.copytree(fixture_dir("llama_tp2_dcp") / "checkpoint", root)
    edit_metadata(root, change)
    return root


def _storage(md, fqn: str = "model.norm.weight"):
    return storage_of(md, fqn)[0][1]


def _rename_tensor(md) -> None:
    md.state_dict_metadata[5] = md.state_dict_metadata.pop("model.norm.weight")


def verl_edited(fixture: str, old: bytes, new: bytes):
    def build(tmp: Path) -> Path:
        root = tmp / "verl"
        shutil.copytree(fixture_dir(fixture) / "checkpoint", root)
        _edit_pickle(root / "model_world_size_4_rank_0.pt", old, new)
        return root

    return build


#: name -> (build the source in a temporary directory, what stderr must say)
MALFORMED = {
    "deepspeed None paddings": (
        lambda tmp: deepspeed_zero2(tmp, optim={"group_paddings": [None]}),
        f"'{OPTIM0}': malformed group_paddings[0]: expected an integer >= 0, found None (a NoneType)"),
    "deepspeed string partition count": (
        lambda tmp: deepspeed_zero2(tmp, optim={"partition_count": ["2"]}),
        f"'{OPTIM0}': malformed partition_count: expected a list of non-negative integers, found ['2'] (a list)"),
    "deepspeed partition count no save could make": (
        lambda tmp: deepspeed_zero2(tmp, optim={"partition_count": [10**6]}),
        f"partition_count is 1000000 (in '{OPTIM0}'), but 2 optimizer files were found; expected 1000000 files"),
    "deepspeed alignment paddings": (
        lambda tmp: deepspeed_zero2(tmp, optim={"param_alignment_paddings": [["1"]]}),
        f"'{OPTIM0}': malformed param_alignment_paddings[0]: expected a list of non-negative integers, found ['1']"),
    "deepspeed a string where the list of buffers belongs": (
        lambda tmp: deepspeed_zero2(tmp, model={"buffer_names": "buf"}),
        f"'{STATES}': malformed buffer_names: expected a list, found 'buf' (a str)"),
    "deepspeed a buffer name that is a list": (
        lambda tmp: deepspeed_zero2(tmp, model={"buffer_names": [["buf"]]}),
        f"'{STATES}': malformed buffer_names: an entry: expected a string, found ['buf'] (a list)"),
    "deepspeed a list where a dict belongs": (
        lambda tmp: deepspeed_zero2(tmp, model={"frozen_param_fragments": [torch.ones(2)]}),
        f"'{STATES}': malformed frozen_param_fragments: expected a dict, found [StoredTensor(dtype='F32', shape=(2,)"),
    "deepspeed a shared parameter's owner": (
        lambda tmp: deepspeed_zero2(tmp, model={"shared_params": {"tied": 3}}),
        f"'{STATES}': malformed shared_params: the owner of 'tied': expected a string, found 3 (an int)"),
    "deepspeed a parameter name": (
        lambda tmp: deepspeed_zero2(tmp, model={"param_shapes": [{7: torch.Size([2, 3])}]}),
        f"'{STATES}': malformed param_shapes: a parameter name: expected a string, found 7 (an int)"),
    "megatron string parallel size": (
        lambda tmp: megatron_legacy_ckpt(tmp, tensor_model_parallel_size="1"),
        f"'{MP00}': malformed args.tensor_model_parallel_size: expected an integer >= 1, found '1' (a str)"),
    "megatron zero parallel size": (
        lambda tmp: megatron_legacy_ckpt(tmp, expert_model_parallel_size=0),
        f"'{MP00}': malformed args.expert_model_parallel_size: expected an integer >= 1, found 0 (an int)"),
    "megatron parallel sizes no save could make": (
        lambda tmp: megatron_legacy_ckpt(tmp, tensor_model_parallel_size=4096),
        f"'{MP00}': its args say tp=4096 pp=1 ep=1, that is 4096 rank directories"),
    "megatron args that are a list": (
        lambda tmp: megatron_legacy_ckpt(tmp, args=["--tensor-model-parallel-size", "2"]),
        f"'{MP00}': malformed args (the training arguments): expected a record of named fields or a dict, found "
        "['--tensor-model-parallel-size', '2'] (a list)"),
    "megatron string layer count": (
        lambda tmp: megatron_legacy_ckpt(tmp, num_layers="2"),
        f"'{MP00}': malformed args.num_layers: expected an integer >= 0, found '2' (a str)"),
    "megatron string first stage": (
        lambda tmp: megatron_legacy_ckpt(tmp, pp=2, decoder_first_pipeline_num_layers="1"),
        "malformed args.decoder_first_pipeline_num_layers: expected an integer >= 0, found '1' (a str)"),
    "megatron zero-row linear_fc1": (
        lambda tmp: megatron_legacy_ckpt(tmp, tp=2, model={"decoder.layers.0.mlp.linear_fc1.weight": torch.zeros(0, 4)}),
        f"'{MP00}': 'decoder.layers.0.mlp.linear_fc1.weight' has 0 rows, not a SwiGLU [gate; up] pair"),
    "megatron-dist args that are a list": (
        lambda tmp: megatron_dist_common(tmp, {"args": ["tp", 2]}),
        "'common.pt': malformed args (the training arguments): expected a record of named fields or a dict"),
    "megatron-dist string parallel size": (
        lambda tmp: megatron_dist_common(tmp, {"args": argparse.Namespace(tensor_model_parallel_size="2")}),
        "'iter_0000010/common.pt': malformed args.tensor_model_parallel_size: expected an integer >= 1, found '2'"),
    "dcp a storage offset of None": (  # torch pickles _StorageInfo without its None fields
        lambda tmp: dcp_edited(tmp, lambda md: setattr(_storage(md), "offset", None)),
        "'.metadata': malformed 'model.norm.weight' storage offset: expected an integer, found nothing"),
    "dcp a negative storage length": (
        lambda tmp: dcp_edited(tmp, lambda md: setattr(_storage(md), "length", -1)),
        "'.metadata': malformed 'model.norm.weight' storage length: expected an integer >= 0, found -1 (an int)"),
    "dcp a storage path that is a number": (
        lambda tmp: dcp_edited(tmp, lambda md: setattr(_storage(md), "relative_path", 5)),
        "'.metadata': malformed 'model.norm.weight' storage relative_path: expected a string, found 5 (an int)"),
    "dcp chunk sizes": (
        lambda tmp: dcp_edited(tmp, lambda md: setattr(md.state_dict_metadata["model.norm.weight"].chunks[0], "sizes",
                                                       (None,))),
        "'.metadata': malformed 'model.norm.weight' chunk sizes: expected a list of non-negative integers, found (None,)"),
    "dcp a dict where a chunk record belongs": (
        lambda tmp: dcp_edited(tmp, lambda md: md.state_dict_metadata["model.norm.weight"].chunks.__setitem__(
            0, {"offsets": [0], "sizes": [32]})),
        "'.metadata': malformed 'model.norm.weight' chunk: expected a record of named fields, found {'offsets'"),
    "dcp a tensor name that is a number": (
        lambda tmp: dcp_edited(tmp, _rename_tensor),
        "'.metadata': malformed state_dict_metadata: a tensor name: expected a string, found 5 (an int)"),
    "verl a shard dim that is a string": (
        verl_edited("verl_llama_fsdp4", b"dimqRK\x00", b"dimqRX\x01\x00\x00\x000"),  # Shard(dim='0')
        "'model_world_size_4_rank_0.pt': malformed '", "placement Shard's dim: expected an integer >= 0, found '0'"),
    "verl a split factor that is a string": (
        verl_edited("verl_dtensor_strided", b"split_factorqYK\x02", b"split_factorqYX\x01\x00\x00\x002"),
        "placement's split_factor: expected an integer >= 1, found '2' (a str)"),
    "verl a split factor beyond the mesh": (
        verl_edited("verl_dtensor_strided", b"split_factorqYK\x02", b"split_factorqYJ\x00\x00\x00\x01"),
        "placement _StridedShard(0, sf=16777216): expected a split_factor of at most 4 (the mesh's size), found "
        "16777216 (an int)"),
    "megatron string vocab multiple": (
        lambda tmp: megatron_legacy_ckpt(tmp, model={"embedding.word_embeddings.weight": torch.zeros(1024, 32)},
                                         num_layers=4, make_vocab_size_divisible_by="128"),
        f"'{MP00}': malformed args.make_vocab_size_divisible_by: expected an integer >= 0, found '128' (a str)",
        "--format", "megatron-legacy", "--config", FIXTURES / "megatron_tp2_pp2" / "config.json"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_metadata_is_named(name, cli, tmp_path):
    build, *says = MALFORMED[name]
    options = says[says.index("--format"):] if "--format" in says else []
    src = build(tmp_path)
    failed(cli("merge", src, tmp_path / "out", *options), tmp_path / "out", *says[:len(says) - len(options)])


def test_the_hand_made_sources_of_the_table_merge_when_left_alone(tmp_path):
    for build in (deepspeed_zero2, megatron_legacy_ckpt):
        ckpttool.merge(build(tmp_path / build.__name__), tmp_path / build.__name__ / "out", audit=False, raw_names=True)


def test_a_tensor_name_or_shape_of_the_wrong_type_is_a_layout_problem():
    builder = LayoutBuilder("/ckpt", "test")
    assert not builder.declare(5, (2,), "F32", where="'rank0.pt'")  # type: ignore[arg-type]
    assert not builder.declare("w", (2, "3"), "F32", where="'rank0.pt'")
    with pytest.raises(SourceError) as caught:
        builder.build()
    assert "  - 5: a tensor name that is not a string in 'rank0.pt'" in str(caught.value)
    assert "  - 'w': global shape (2, '3') in 'rank0.pt' is not a list of integers" in str(caught.value)


@pytest.mark.parametrize("fqn, shape, says", [
    ("decoder.layers.mlp.linear_fc1.weight", (10**12, 8, 4), "1000000000000 stacked layers, expected at most 2 (the "
     "config's num_hidden_layers)"),
    ("decoder.layers.mlp.experts.linear_fc2.weight", (2, 10**12, 4, 4), "1000000000000 stacked experts, expected at most "
     "4 (the config's number of experts)"),
])
def test_megatron_stacked_layers_and_experts_beyond_the_config_are_not_looped_over(fqn, shape, says):
    layout = Layout("", "megatron-dist", {fqn: TensorLayout(fqn, shape, "F32", ())})
    config = {"num_attention_heads": 2, "num_key_value_heads": 2, "hidden_size": 4, "num_hidden_layers": 2,
              "num_local_experts": 4}
    _, _, problems = megatron_core.to_hf(layout, ModelInfo("mixtral", config, {}, {}))
    assert problems == [(fqn, f"'{fqn}': {says}")]


def test_a_negative_size_in_a_pickle(tmp_path):
    path = tmp_path / "rank.pt"
    torch.save({"w": torch.ones(2)}, path)
    _edit_pickle(path, b"QK\x00K\x02\x85", b"QK\x00J\xfe\xff\xff\xff\x85")  # shape (2,) -> (-2,)
    with open(path, "rb") as f, pytest.raises(SourceError, match=r"'rank.pt': cannot read it as a torch.save archive "
                                              r"\(UnpicklingError: a tensor of shape \[-2\] at storage offset 0\)"):
        scan(f, label="rank.pt")


def test_an_unreadable_file_is_named_not_an_internal_error(cli, copy_fixture, tmp_path, monkeypatch):
    src = copy_fixture("deepspeed_zero2")

    def denied(root, rel):
        raise PermissionError(13, "Permission denied", str(root / rel))

    monkeypatch.setattr(deepspeed, "_scan", denied)
    failed(cli("merge", src, tmp_path / "out"), tmp_path / "out", f"'{src}/global_step2/",
           "': cannot read it: Permission denied")
