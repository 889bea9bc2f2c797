"""Error paths: every bad input gives a message naming the file and the tensor, and nothing at the destination.

The project rule is "every error path has a test asserting its message". This file holds the error paths that no
other test file covers. Each one is triggered through the most natural public entry: the CLI, ``ckpttool.merge``
or ``ckpttool.read_layout``. The inputs are realistic damage done to copies of the committed fixtures.
"""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import shutil
import struct
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckpttool
from ckpttool.errors import CkptError, CoverageError, SourceError
from conftest import assert_failed_cleanly as failed_cleanly, fixture_dir, load_output

SHARD1 = "shard-00001-model-00001-of-00001.safetensors"
SHARD2 = "shard-00002-model-00001-of-00001.safetensors"


# --------------------------------------------------------------------------------------------- helpers


def not_unexpected(result) -> None:
    """The error was foreseen (a CkptError), not the CLI's catch-all for bugs."""
    assert "internal error" not in result.stderr and "report it" not in result.stderr, result.stderr


def edit_metadata(src: Path, change) -> None:
    """Rewrite a DCP ``.metadata`` (our own fixture, trusted, so plain pickle may load it in the test)."""
    metadata = pickle.loads((src / ".metadata").read_bytes())
    change(metadata)
    (src / ".metadata").write_bytes(pickle.dumps(metadata))


def storage_of(metadata, fqn: str) -> list:
    """The ``(MetadataIndex, _StorageInfo)`` pairs of one tensor, in file order."""
    return sorted(((i, s) for i, s in metadata.storage_data.items() if i.fqn == fqn), key=lambda p: tuple(p[0].offset))


def raw_header(path: Path) -> tuple[dict, bytes]:
    """The JSON header of a safetensors file (key order kept) and its data buffer."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def edit_header(path: Path, change) -> None:
    """Rewrite the header of a safetensors file, keeping its data buffer."""
    header, data = raw_header(path)
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def edit_sharding_info(path: Path, change) -> None:
    """Change the ``DCP_SHARDING_INFO`` JSON of a transformers distributed shard file."""

    def apply(header: dict) -> None:
        info = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
        change(info)
        header["__metadata__"]["DCP_SHARDING_INFO"] = json.dumps(info)

    edit_header(path, apply)


def dcp_save(state: dict, directory: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving in a single process"
        dcp.save(state, checkpoint_id=str(directory))
    return directory


def write_config(tmp_path: Path, **changes) -> Path:
    """The llama fixtures' config.json with ``changes`` applied, written to ``tmp_path/bad-config.json``."""
    config = json.loads((fixture_dir("llama_tp2_dcp") / "config.json").read_text())
    config.update(changes)
    path = tmp_path / "bad-config.json"
    path.write_text(json.dumps(config))
    return path


# --------------------------------------------------------------------------------------------- readers/__init__.py


def test_source_that_is_a_file_asks_for_the_directory(cli, tmp_path):
    src = tmp_path / "model.safetensors"
    shutil.copyfile(fixture_dir("llama_tp2_dcp") / "reference" / "model.safetensors", src)
    out = tmp_path / "hf"
    failed_cleanly(cli("merge", src, out), out, f"'{src}': not a directory; give the checkpoint's directory")


def test_unknown_format_name_lists_the_known_ones():
    with pytest.raises(SourceError) as excinfo:
        ckpttool.read_layout(fixture_dir("llama_tp2_dcp") / "checkpoint", format="nemo")
    message = str(excinfo.value)
    assert message.startswith("format='nemo' is not a format ckpttool reads; known: sidecar, ")
    assert message.removeprefix("format='nemo' is not a format ckpttool reads; known: ").split(", ") == list(ckpttool.READERS)


def test_forced_format_on_a_missing_directory(cli, tmp_path):
    src, out = tmp_path / "nowhere", tmp_path / "hf"
    failed_cleanly(cli("merge", src, out, "--format", "dcp"), out, f"'{src}': no such file or directory")


def test_forced_format_on_a_file_says_it_is_not_a_directory(cli, tmp_path):
    src = tmp_path / "model.safetensors"
    shutil.copyfile(fixture_dir("llama_tp2_dcp") / "reference" / "model.safetensors", src)
    out = tmp_path / "hf"
    failed_cleanly(cli("merge", src, out, "--format", "hf"), out, f"'{src}': not a directory")


# --------------------------------------------------------------------------------------------- readers/dcp.py


def test_dcp_shards_without_their_metadata_file(cli, copy_fixture, tmp_path):
    src = copy_fixture("llama_tp2_dcp")
    (src / ".metadata").unlink()  # a copy that forgot the hidden file
    out = tmp_path / "hf"
    failed_cleanly(cli("merge", src, out, "--format", "dcp"), out, f"'{src}': no .metadata file")


def test_metadata_file_of_another_tool_is_not_dcp_metadata(cli, copy_fixture, tmp_path):
    src = copy_fixture("llama_tp2_dcp")
    (src / ".metadata").write_bytes(pickle.dumps({"step": 1000, "loss": 1.5}))
    out = tmp_path / "hf"
    failed_cleanly(cli("merge", src, out), out, "'.metadata': not DCP metadata (no state_dict_metadata/storage_data)")


def test_metadata_pickle_that_is_not_a_mapping_is_not_dcp_metadata(cli, copy_fixture, tmp_path):
    src = copy_fixture("llama_tp2_dcp")
    (src / ".metadata").write_bytes(pickle.dumps(["model.embed_tokens.weight", "lm_head.weight"]))
    out = tmp_path / "hf"
    result = cli("merge", src, out)
    failed_cleanly(result, out, "'.metadata': not DCP metadata")
    not_unexpected(result)


def test_tensor_without_global_size(cli, copy_fixture, tmp_path):
    src = copy_fixture("llama_tp2_dcp")

    def drop_size(md):
        md.state_dict_metadata["model.norm.weight"].size = None

    edit_metadata(src, drop_size)
    out = tmp_path / "hf"
    failed_cleanly(cli("merge", src, out), out, "'.metadata': 'model.norm.weight' has no global size")


def test_negative_global_size_is_inconsistent_metadata(cli, copy_fixture, tmp_path):
    src = copy_fixture("llama_tp2_dcp")

    def negate(md):
        md.state_dict_metadata["model.norm.weight"].size = torch.Size([-32])

    edit_metadata(src, negate)
    out = tmp_path / "hf"
    failed_cleanly(
        cli("merge", src, out), out,
        "the checkpoint's metadata is inconsistent:",
        "'model.norm.weight': negative global shape [-32] in '.metadata'",
    )


def test_chunk_without_storage_entry(cli, copy_fixture, tmp_path):
    src = copy_fixture("llama_tp2_dcp")

    def drop_storage(md):
        index, _ = storage_of(md, "model.layers.1.self_attn.o_proj.weight")[1]  # the chunk at columns 16..32
        del md.storage_data[index]

    edit_metadata(src, drop_storage)
    out = tmp_path / "hf"
    failed_cleanly(
        cli("merge", src, out), out,
        "'.metadata': 'model.layers.1.self_attn.o_proj.weight' chunk at offsets [0, 16] has no storage entry",
    )


def test_chunk_stored_with_transforms_is_refused(cli, copy_fixture, tmp_path):
    src = copy_fixture("llama_tp2_dcp")

    def compress(md):
        for _, info in storage_of(md, "model.norm.weight"):
            info.transform_descriptors = ["zstd"]

    edit_metadata(src, compress)
    out = tmp_path / "hf"
    failed_cleanly(
        cli("merge", src, out), out,
        "'__1_0.distcp': 'model.norm.weight' is stored with transforms ['zstd'], which ckpttool does not decode yet",
    )


def test_truncated_distcp_file_names_the_tensor_and_byte_range(cli, copy_fixture, tmp_path):
    src = copy_fixture("llama_tp2_dcp")
    path = src / "__1_0.distcp"
    size = path.stat().st_size
    os.truncate(path, size - 100)  # an interrupted copy: the last item is cut short
    metadata = pickle.loads((src / ".metadata").read_bytes())
    index, info = max(
        ((i, s) for i, s in metadata.storage_data.items() if s.relative_path == "__1_0.distcp"),
        key=lambda p: p[1].offset,
    )
    assert info.offset + info.length == size
    out = tmp_path / "hf"
    failed_cleanly(
        cli("merge", src, out), out,
        f"'__1_0.distcp': '{index.fqn}' needs bytes {info.offset}..{size} but the file has {size - 100}; "
        "it is truncated",
    )


def test_absolute_storage_path_is_refused(cli, copy_fixture, tmp_path):
    src = copy_fixture("llama_tp2_dcp")

    def absolute(md):
        for info in md.storage_data.values():
            info.relative_path = "/etc/passwd"

    edit_metadata(src, absolute)
    out = tmp_path / "hf"
    failed_cleanly(
        cli("merge", src, out), out,
        "'.metadata' names the absolute path '/etc/passwd'; files must lie inside the checkpoint",
    )


def test_dcp_tensor_of_unsupported_dtype_names_file_and_tensor(cli, tmp_path):
    src = dcp_save({"rotary.freqs_cis": torch.zeros(4, dtype=torch.complex64)}, tmp_path / "ckpt")
    out = tmp_path / "hf"
    failed_cleanly(cli("merge", src, out), out, "'.metadata'", "'rotary.freqs_cis'", "complex64")


def test_dcp_tensor_of_uint16_names_the_tensor_not_an_unsafe_pickle(cli, tmp_path):
    src = dcp_save({"token_ids": torch.zeros(4, dtype=torch.uint16)}, tmp_path / "ckpt")
    out = tmp_path / "hf"
    result = cli("merge", src, out)
    failed_cleanly(result, out, "'token_ids'", "uint16")
    assert "refused to unpickle" not in result.stderr


def test_chunk_with_offsets_and_sizes_of_different_rank_names_file_and_tensor(cli, copy_fixture, tmp_path):
    src = copy_fixture("llama_tp2_dcp")

    def reshape_chunk(md):
        md.state_dict_metadata["model.norm.weight"].chunks[0].sizes = torch.Size([32, 1])

    edit_metadata(src, reshape_chunk)
    out = tmp_path / "hf"
    failed_cleanly(cli("merge", src, out), out, "'.metadata'", "'model.norm.weight'")


# --------------------------------------------------------------------------------------------- executor.py


def test_distcp_item_holding_another_shape_than_the_metadata(cli, copy_fixture, tmp_path):
    src = copy_fixture("llama_tp2_dcp")
    metadata = pickle.loads((src / ".metadata").read_bytes())
    _, info = storage_of(metadata, "model.layers.0.self_attn.o_proj.weight")[0]  # a [32, 16] column block
    path = src / info.relative_path
    raw = path.read_bytes()
    item = raw[info.offset:info.offset + info.length]
    piece = torch.load(io.BytesIO(item), weights_only=True)
    assert tuple(piece.shape) == (32, 16)
    buffer = io.BytesIO()
    torch.save(piece.t().contiguous(), buffer)  # same bytes, transposed shape [16, 32]
    assert len(buffer.getvalue()) == info.length  # so no byte range moves and only reading the item can tell
    path.write_bytes(raw[:info.offset] + buffer.getvalue() + raw[info.offset + info.length:])
    out = tmp_path / "hf"
    failed_cleanly(
        cli("merge", src, out), out,
        f"'{info.relative_path}': 'model.layers.0.self_attn.o_proj.weight' holds F32 [16, 32] but the "
        "metadata records F32 [32, 16]",
    )


def _merge_damaging_after_first_tensor(src: Path, out: Path, damage) -> CkptError:
    """Merge ``src``, running ``damage()`` after the first tensor is written (a file changing under the merge)."""
    written = []

    def progress(n: int, total: int) -> None:
        written.append(n)
        if len(written) == 1:
            damage()

    with pytest.raises(CkptError) as excinfo:
        ckpttool.merge(src, out, progress=progress)
    assert written, "the damage was never done"
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}.ckpttool-partial-*"))
    return excinfo.value


def test_source_file_deleted_during_the_merge_is_read_from_its_open_handle(copy_fixture, tmp_path):
    src = copy_fixture("llama_tp2_dcp")
    deleted = []

    def progress(n: int, total: int) -> None:
        if not deleted:
            (src / "__1_0.distcp").unlink()  # every source file is open by the first chunk: the bytes stay readable
            deleted.append(True)

    ckpttool.merge(src, tmp_path / "hf", progress=progress)
    assert deleted
    reference = load_output(fixture_dir("llama_tp2_dcp") / "reference")
    got = load_output(tmp_path / "hf")
    assert all(torch.equal(got[k], reference[k]) for k in reference)


def test_source_file_truncated_during_the_merge(copy_fixture, tmp_path):
    src = copy_fixture("llama_tp2_dcp")
    piece = ckpttool.read_layout(src).tensors["model.embed_tokens.weight"].pieces[1]
    assert piece.file == "__1_0.distcp" and piece.encoding == "raw"  # located inside its torch.save item
    error = _merge_damaging_after_first_tensor(src, tmp_path / "hf", lambda: os.truncate(src / "__1_0.distcp", 1000))
    assert isinstance(error, SourceError)
    assert str(error) == (
        f"'__1_0.distcp': 'model.embed_tokens.weight' needs {piece.byte_length} bytes at offset {piece.byte_offset} "
        f"but only {max(0, 1000 - piece.byte_offset)} are there; the file is truncated"
    )


# --------------------------------------------------------------------------------------------- merge.py


def test_checkpoint_holding_only_optimizer_state(cli, tmp_path):
    src = dcp_save({"optim": {"state": {"w.exp_avg": torch.zeros(3)}, "step": torch.tensor(5)}}, tmp_path / "ckpt")
    out = tmp_path / "hf"
    failed_cleanly(
        cli("merge", src, out), out,
        f"'{src}': the checkpoint holds no model tensors (skipped 2 optimizer/training-state tensors; ",
    )


# --------------------------------------------------------------------------------------------- readers/hf.py


def test_forced_hf_format_without_weights(cli, tmp_path):
    src, out = fixture_dir("llama_tp2_dcp") / "checkpoint", tmp_path / "hf"
    failed_cleanly(
        cli("merge", src, out, "--format", "hf"), out,
        f"'{src}': neither model.safetensors.index.json nor model.safetensors found",
    )


def _hf_sharded_source(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A HuggingFace directory with one shard of the llama reference weights and its weight map."""
    src = tmp_path / "hf-in"
    src.mkdir()
    shard = "model-00001-of-00001.safetensors"
    shutil.copyfile(fixture_dir("llama_tp2_dcp") / "reference" / "model.safetensors", src / shard)
    header, _ = raw_header(src / shard)
    return src, {key: shard for key in header if key != "__metadata__"}


def test_hf_index_that_is_not_json(cli, tmp_path):
    src, _ = _hf_sharded_source(tmp_path)
    (src / "model.safetensors.index.json").write_text('{"weight_map": {"lm_head.weight": ')  # cut short
    out = tmp_path / "hf"
    failed_cleanly(cli("merge", src, out), out, "'model.safetensors.index.json': cannot read: Expecting value")


def test_hf_index_without_weight_map(cli, tmp_path):
    src, _ = _hf_sharded_source(tmp_path)
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 123}}))
    out = tmp_path / "hf"
    failed_cleanly(
        cli("merge", src, out), out, "'model.safetensors.index.json': no 'weight_map' of tensor names to file names",
    )


def test_hf_index_naming_a_tensor_its_file_lacks(cli, tmp_path):
    src, weight_map = _hf_sharded_source(tmp_path)
    weight_map["lm_head.bias"] = "model-00001-of-00001.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    out = tmp_path / "hf"
    failed_cleanly(
        cli("merge", src, out), out,
        "'model.safetensors.index.json' puts 'lm_head.bias' in 'model-00001-of-00001.safetensors', "
        "but that file has no such tensor",
    )


# --------------------------------------------------------------------------------------------- readers/hf_distributed.py


def test_sharding_info_that_is_not_json(cli, copy_fixture, tmp_path):
    src = copy_fixture("llama_hf_tp2")

    def garble(header):
        header["__metadata__"]["DCP_SHARDING_INFO"] = header["__metadata__"]["DCP_SHARDING_INFO"][:-7]

    edit_header(src / SHARD2, garble)
    out = tmp_path / "hf"
    failed_cleanly(cli("merge", src, out), out, f"'{SHARD2}': DCP_SHARDING_INFO metadata is not valid JSON")


def test_sharding_info_that_is_not_an_object(cli, copy_fixture, tmp_path):
    src = copy_fixture("llama_hf_tp2")

    def null(header):
        header["__metadata__"]["DCP_SHARDING_INFO"] = "null"

    edit_header(src / SHARD1, null)
    out = tmp_path / "hf"
    result = cli("merge", src, out)
    failed_cleanly(result, out, f"'{SHARD1}': DCP_SHARDING_INFO")
    not_unexpected(result)


def test_saved_offsets_of_the_wrong_length(cli, copy_fixture, tmp_path):
    src = copy_fixture("llama_hf_tp2")

    def shorten(info):
        info["lm_head.weight"]["saved_offsets"] = [501]

    edit_sharding_info(src / SHARD2, shorten)
    out = tmp_path / "hf"
    failed_cleanly(cli("merge", src, out), out, f"'{SHARD2}': 'lm_head.weight' needs saved_offsets of 2 non-negative integers, found [501]")


def test_saved_offsets_that_are_not_integers(cli, copy_fixture, tmp_path):
    src = copy_fixture("llama_hf_tp2")

    def stringify(info):
        info["lm_head.weight"]["saved_offsets"] = ["501", 0]

    edit_sharding_info(src / SHARD2, stringify)
    out = tmp_path / "hf"
    result = cli("merge", src, out)
    failed_cleanly(result, out, f"'{SHARD2}': 'lm_head.weight' needs saved_offsets of 2 non-negative integers, found ['501', 0]")
    not_unexpected(result)


def test_tensor_the_configs_model_does_not_have(cli, copy_fixture, tmp_path):
    src = copy_fixture("llama_hf_tp2")
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = 1  # the config of a smaller run
    (src / "config.json").write_text(json.dumps(config))
    out = tmp_path / "hf"
    failed_cleanly(
        cli("merge", src, out), out,
        f"'{SHARD1}': tensor 'model.layers.1.mlp.down_proj.weight' is not a parameter of the llama model the "
        "config describes",
    )


def test_ranks_disagreeing_on_the_dtype_name_both_files(cli, copy_fixture, tmp_path):
    src = copy_fixture("llama_hf_tp2")

    def to_half(header):  # same bytes read as F16: twice the elements
        entry = header["model.layers.0.self_attn.q_proj.weight"]
        entry["dtype"], entry["shape"] = "F16", [entry["shape"][0] * 2, entry["shape"][1]]

    edit_header(src / SHARD2, to_half)
    out = tmp_path / "hf"
    failed_cleanly(
        cli("merge", src, out), out,
        f"'model.layers.0.self_attn.q_proj.weight': pieces disagree on the dtype: F32 in '{SHARD1}' but F16 in '{SHARD2}'",
    )


def test_forced_hf_distributed_format_without_shard_files(cli, tmp_path):
    src = tmp_path / "ckpt"
    src.mkdir()
    shutil.copyfile(fixture_dir("llama_hf_tp2") / "checkpoint" / "config.json", src / "config.json")
    out = tmp_path / "hf"
    result = cli("merge", src, out, "--format", "hf-distributed")
    failed_cleanly(result, out, f"'{src}'", "shard-")
    not_unexpected(result)


# --------------------------------------------------------------------------------------------- readers/sidecar.py


def test_forced_sidecar_format_without_sidecars(cli, tmp_path):
    src, out = fixture_dir("llama_tp2_dcp") / "checkpoint", tmp_path / "hf"
    failed_cleanly(cli("merge", src, out, "--format", "sidecar"), out, f"'{src}': no *.ckpttool.json sidecar")


def test_sidecars_disagreeing_on_padding_name_both(cli, tmp_path):
    src = tmp_path / "ckpt"
    for rank, true_size in ((0, 1001), (1, 1000)):
        ckpttool.save_shard(
            {"model.embed_tokens.weight": torch.zeros(502, 8)},
            {"model.embed_tokens.weight": ckpttool.PieceSpec.split((1004, 8), dim=0, index=rank, count=2, true_size=true_size)},
            src, rank=rank, world_size=2,
        )
    out = tmp_path / "hf"
    failed_cleanly(
        cli("merge", src, out), out,
        "'model.embed_tokens.weight': pieces disagree on padding: 'rank-00000-of-00002.ckpttool.json' vs "
        "'rank-00001-of-00002.ckpttool.json'",
    )


def test_sidecar_of_binary_garbage_is_not_valid_json(cli, tmp_path):
    src = tmp_path / "ckpt"
    side = ckpttool.save_shard({"w": torch.zeros(4)}, {"w": ckpttool.PieceSpec.replicated((4,))}, src, rank=0, world_size=1)
    side.write_bytes(b"\xff\xfe\x00\x00\x89PNG garbage")
    out = tmp_path / "hf"
    result = cli("merge", src, out)
    failed_cleanly(result, out, "'rank-00000-of-00001.ckpttool.json': not valid JSON")
    not_unexpected(result)


# --------------------------------------------------------------------------------------------- architecture and families


def test_config_that_is_not_json(cli, tmp_path):
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "llama", "vocab_size": 1001,')  # cut short
    out = tmp_path / "hf"
    failed_cleanly(
        cli("merge", fixture_dir("llama_tp2_dcp") / "checkpoint", out, "--config", config), out,
        f"'{config}': cannot read the config: Expecting property name enclosed in double quotes",
    )


def test_config_that_is_not_an_object(cli, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps([{"model_type": "llama"}]))
    out = tmp_path / "hf"
    failed_cleanly(
        cli("merge", fixture_dir("llama_tp2_dcp") / "checkpoint", out, "--config", config), out,
        f"'{config}': the config is not a JSON object",
    )


def test_config_without_model_type(cli, tmp_path):
    config = json.loads((fixture_dir("llama_tp2_dcp") / "config.json").read_text())
    del config["model_type"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    out = tmp_path / "hf"
    failed_cleanly(
        cli("merge", fixture_dir("llama_tp2_dcp") / "checkpoint", out, "--config", path), out,
        f"'{path}': no model_type; is it a transformers config?",
    )


def test_config_transformers_cannot_build(cli, tmp_path):
    config = write_config(tmp_path, hidden_act="swiglu-typo")
    out = tmp_path / "hf"
    failed_cleanly(
        cli("merge", fixture_dir("llama_tp2_dcp") / "checkpoint", out, "--config", config), out,
        f"'{config}': transformers cannot build a llama model from it: 'swiglu-typo'",
    )


def test_config_transformers_rejects_names_the_config(cli, tmp_path):
    config = write_config(tmp_path, num_attention_heads=5)
    out = tmp_path / "hf"
    result = cli("merge", fixture_dir("llama_tp2_dcp") / "checkpoint", out, "--config", config)
    failed_cleanly(result, out, f"'{config}'", "not a multiple of the number of attention heads")
    not_unexpected(result)


def test_stacked_experts_that_cannot_be_split_into_gate_and_up(cli, copy_fixture, tmp_path):
    src = copy_fixture("mixtral_fsdp2_dcp")

    def odd_rows(md):
        tensor = md.state_dict_metadata["model.layers.0.mlp.experts.gate_up_proj"]
        tensor.size = torch.Size([4, 95, 32])
        for chunk in tensor.chunks:
            chunk.sizes = torch.Size([chunk.sizes[0], 95, 32])

    edit_metadata(src, odd_rows)
    out = tmp_path / "hf"
    failed_cleanly(
        cli("merge", src, out, "--dry-run"), out,
        "'model.layers.0.mlp.experts.gate_up_proj': shape [4, 95, 32] cannot be split into 2 per-expert parts "
        "along dim 1",
    )


def test_flat_stacked_experts_tensor_cannot_be_split(cli, copy_fixture, tmp_path):
    src = copy_fixture("mixtral_fsdp2_dcp")
    fqn = "model.layers.0.mlp.experts.down_proj"  # [4, 32, 48], dim 0 split 2 + 2 over the ranks
    numel = 32 * 48

    def flatten(md):
        tensor = md.state_dict_metadata[fqn]
        tensor.size = torch.Size([4 * numel])
        for chunk in tensor.chunks:
            chunk.offsets, chunk.sizes = torch.Size([chunk.offsets[0] * numel]), torch.Size([chunk.sizes[0] * numel])
        for index, info in storage_of(md, fqn):
            del md.storage_data[index]
            md.storage_data[type(index)(fqn=fqn, offset=torch.Size([index.offset[0] * numel]), index=index.index)] = info

    edit_metadata(src, flatten)
    out = tmp_path / "hf"
    result = cli("merge", src, out, "--dry-run")
    failed_cleanly(result, out, f"'{fqn}': shape [{4 * numel}] cannot be split")
    not_unexpected(result)


def test_more_than_forty_problems_are_counted(cli, tmp_path):
    config = write_config(tmp_path, num_hidden_layers=7)  # 45 tensors of layers 2..6 are not in the checkpoint
    out = tmp_path / "hf"
    result = cli("merge", fixture_dir("llama_tp2_dcp") / "checkpoint", out, "--config", config, "--dry-run")
    failed_cleanly(
        result, out,
        "does not match its llama config (45 problems):",
        "'model.layers.2.self_attn.k_proj.weight': expected by the config but not in the checkpoint",
        "  ... and 5 more",
    )
    assert result.stderr.count("  - '") == 40  # the 41st problem on are only counted


@pytest.mark.parametrize(("vocab_size", "hint"), [
    (1000, "(lm_head.weight and model.embed_tokens.weight both have 1001 rows: the config's vocab_size 1000 looks wrong)"),
    (1200, "(lm_head.weight and model.embed_tokens.weight both have 1001 rows: the config's vocab_size 1200 looks wrong)"),
])
def test_vocab_size_disagreeing_with_the_checkpoint_is_explained(cli, tmp_path, vocab_size, hint):
    config = write_config(tmp_path, vocab_size=vocab_size)
    out = tmp_path / "hf"
    failed_cleanly(
        cli("merge", fixture_dir("llama_tp2_dcp") / "checkpoint", out, "--config", config), out,
        f"'model.embed_tokens.weight': shape [1001, 32], but the config gives [{vocab_size}, 32] {hint}",
        f"'lm_head.weight': shape [1001, 32], but the config gives [{vocab_size}, 32] {hint}",
    )


# --------------------------------------------------------------------------------------------- writer.py


def test_destination_parent_that_is_not_writable(cli, tmp_path, monkeypatch):
    parent = tmp_path / "readonly"
    parent.mkdir()
    parent.chmod(0o555)
    if os.geteuid() == 0:  # root may write anywhere: make os.access answer as for an ordinary user
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == parent and mode & os.W_OK else real_access(p, mode, **kw))
    out = parent / "hf"
    try:
        failed_cleanly(
            cli("merge", fixture_dir("llama_tp2_dcp") / "checkpoint", out), out,
            f"cannot create '{out}': '{parent}' is not writable",
        )
    finally:
        parent.chmod(0o755)


def _wrap_write_file(monkeypatch, after) -> None:
    """Run ``after(path)`` on each output file once the executor has written it (a fault on the way to disk)."""
    import ckpttool.writers.hf

    real = ckpttool.writers.hf.stream_file

    def write_file(path, *args, **kwargs):
        digest = real(path, *args, **kwargs)
        after(path)
        return digest

    monkeypatch.setattr(ckpttool.writers.hf, "stream_file", write_file)


def test_output_file_shorter_than_planned_is_caught(cli, tmp_path, monkeypatch):
    sizes = {}

    def lose_the_tail(path):
        sizes[path.name] = path.stat().st_size
        os.truncate(path, sizes[path.name] - 4)

    _wrap_write_file(monkeypatch, lose_the_tail)
    out = tmp_path / "hf"
    result = cli("merge", fixture_dir("llama_tp2_dcp") / "checkpoint", out, "-q")
    size = sizes["model.safetensors"]
    failed_cleanly(result, out, f"'model.safetensors': wrote {size - 4} bytes, expected {size}; is the disk full?")


def test_output_header_differing_from_the_plan_is_caught(cli, tmp_path, monkeypatch):
    def rename_in_header(path):
        raw = path.read_bytes()
        assert raw.count(b'"lm_head.weight"') == 1
        path.write_bytes(raw.replace(b'"lm_head.weight"', b'"lm_head.weighX"'))

    _wrap_write_file(monkeypatch, rename_in_header)
    out = tmp_path / "hf"
    result = cli("merge", fixture_dir("llama_tp2_dcp") / "checkpoint", out, "-q")
    failed_cleanly(result, out, "'model.safetensors': 'lm_head.weight' was not written as planned")


def test_full_disk_names_the_output_file(cli, tmp_path, monkeypatch):
    def no_space(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", no_space)
    out = tmp_path / "hf"
    result = cli("merge", fixture_dir("llama_tp2_dcp") / "checkpoint", out, "-q")
    failed_cleanly(result, out, "'model.safetensors'", os.strerror(errno.ENOSPC))
    not_unexpected(result)


def test_tokenizer_file_that_cannot_be_copied(cli, copy_fixture, tmp_path, monkeypatch):
    src = copy_fixture("llama_fsdp2_dcp")
    tokenizer = src / "tokenizer.json"
    tokenizer.chmod(0o000)
    real_copyfileobj = shutil.copyfileobj

    def copyfileobj(source, dest, *args, **kwargs):  # the copy writes a file it created (O_EXCL | O_NOFOLLOW)
        if Path(getattr(source, "name", "")) == tokenizer and os.geteuid() == 0:  # root reads mode-000 files
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(tokenizer))
        return real_copyfileobj(source, dest, *args, **kwargs)

    monkeypatch.setattr(shutil, "copyfileobj", copyfileobj)
    out = tmp_path / "hf"
    try:
        failed_cleanly(
            cli("merge", src, out, "-q"), out, f"'{tokenizer}': cannot copy: {os.strerror(errno.EACCES)}",
        )
    finally:
        tokenizer.chmod(0o644)


# --------------------------------------------------------------------------------------------- dtypes.py


def test_torch_dtype_safetensors_cannot_store():
    from ckpttool.io.dtypes import dtype_name

    with pytest.raises(SourceError) as excinfo:
        dtype_name(torch.complex64)
    assert str(excinfo.value) == "dtype torch.complex64 cannot be stored in safetensors by ckpttool"


def test_save_shard_of_an_unstorable_tensor_names_it(tmp_path):
    with pytest.raises(ValueError) as excinfo:
        ckpttool.save_shard({"rotary.freqs_cis": torch.zeros(4, dtype=torch.complex64)},
                            {"rotary.freqs_cis": ckpttool.PieceSpec.replicated((4,))}, tmp_path, rank=0, world_size=1)
    assert "complex64" in str(excinfo.value)
    assert "'rotary.freqs_cis'" in str(excinfo.value)


# --------------------------------------------------------------------------------------------- errors.py, cli.py


def test_coverage_error_shows_twenty_problems_and_counts_the_rest(copy_fixture, tmp_path):
    src = copy_fixture("llama_tp2_dcp")
    (src / "__1_0.distcp").unlink()  # half of every split tensor and all five norms
    with pytest.raises(CoverageError) as excinfo:
        ckpttool.merge(src, tmp_path / "hf")
    problems = excinfo.value.problems
    assert len(problems) == 21
    lines = str(excinfo.value).splitlines()
    assert lines[0] == "the checkpoint does not cover its tensors exactly (21 problems):"
    assert lines[1:21] == [f"  - {p}" for p in problems[:20]]
    assert lines[21:] == ["... and 1 more"]
    assert not (tmp_path / "hf").exists()


def test_interrupted_merge_says_nothing_was_written(cli, tmp_path, monkeypatch):
    import ckpttool.cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpttool.cli, "merge", interrupted)
    out = tmp_path / "hf"
    result = cli("merge", fixture_dir("llama_tp2_dcp") / "checkpoint", out)
    assert result.exit_code == 130  # Ctrl-C: 128 + SIGINT; --resume is named only when something was kept
    assert "Error: interrupted; nothing was published\n" in result.stderr and "--resume" not in result.stderr
    assert not out.exists()
