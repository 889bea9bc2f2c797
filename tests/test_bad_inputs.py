"""The bad-input corpus: every kind of broken source or destination a user meets, through the command line.

Each case builds its damaged input in a temporary directory and names what the message must contain: the file,
the tensor where there is one, and what was expected. Every case must then give exit code 1, no traceback, no
checkpoint (and no staging directory) at the destination, and leave the source byte for byte as it was.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from ckpttool.io.sidecar import PieceSpec, save_shard
from conftest import FIXTURES, fixture_dir, tree_digest
from test_errors import SHARD1, SHARD2, edit_header, edit_metadata, edit_sharding_info, raw_header, storage_of

EMBED = "model.embed_tokens.weight"


@dataclass
class Case:
    """A damaged input: the source to merge, what stderr must say, extra CLI arguments, the destination."""

    src: Path
    says: tuple[str, ...]
    args: tuple[str, ...] = ()
    out: Path | None = None
    digests: dict[Path, dict[str, str]] = field(default_factory=dict)


CASES: dict[str, Callable[[Path], Case]] = {}


def case(fn: Callable[[Path], Case]) -> Callable[[Path], Case]:
    CASES[fn.__name__] = fn
    return fn


def dcp_copy(tmp: Path, name: str = "llama_tp2_dcp") -> Path:
    shutil.copytree(fixture_dir(name), tmp / name, ignore=shutil.ignore_patterns("reference"))
    return tmp / name / "checkpoint"


def hf_copy(tmp: Path, shards: int = 1) -> Path:
    """The Llama reference as an HF directory: one file, or ``shards`` files with an index."""
    from safetensors.torch import load_file, save_file

    ref = fixture_dir("llama_fsdp2_dcp") / "reference"
    hf = tmp / "hf-src"
    hf.mkdir()
    shutil.copy(ref / "config.json", hf / "config.json")
    if shards == 1:
        shutil.copy(ref / "model.safetensors", hf / "model.safetensors")
        return hf
    tensors = load_file(ref / "model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in names[i::shards]}, str(hf / file))
        weight_map.update(dict.fromkeys(names[i::shards], file))
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return hf


def sidecar_source(tmp: Path, steps: tuple[int | None, int | None] = (None, None)) -> Path:
    src = tmp / "sidecar-src"
    for rank in range(2):
        save_shard(
            {"embed": torch.randn(6, 4), "norm": torch.ones(4)},
            {"embed": PieceSpec.split((12, 4), dim=0, index=rank, count=2, true_size=11), "norm": PieceSpec.replicated((4,))},
            src, rank=rank, world_size=2, step=steps[rank],
        )
    return src


def edit_json(path: Path, change) -> None:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


def truncate(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


# ------------------------------------------------------------------------------------ no checkpoint at all


@case
def empty_directory(tmp):
    (tmp / "empty").mkdir()
    return Case(tmp / "empty", ("no checkpoint format recognised. Looked for:", ".metadata"))


@case
def unrelated_files(tmp):
    (tmp / "misc").mkdir()
    (tmp / "misc" / "notes.txt").write_text("hello")
    (tmp / "misc" / "weights.bin").write_bytes(b"\0" * 64)
    return Case(tmp / "misc", ("no checkpoint format recognised", "model.safetensors or model.safetensors.index.json"))


# -------------------------------------------------------------------------------------------------- DCP


@case
def dcp_missing_rank_file(tmp):
    src = dcp_copy(tmp)
    (src / "__1_0.distcp").unlink()
    return Case(src, (f"'{EMBED}': rows 501..1001 covered by no piece", "'__1_0.distcp', which is missing"))


@case
def dcp_truncated_metadata(tmp):
    src = dcp_copy(tmp)
    truncate(src / ".metadata", 200)
    return Case(src, ("'.metadata': cannot read the metadata pickle (UnpicklingError: pickle data was truncated)",))


@case
def dcp_truncated_distcp(tmp):
    src = dcp_copy(tmp)
    truncate(src / "__0_0.distcp", 5000)
    return Case(src, ("'__0_0.distcp'", "but the file has 5000; it is truncated"))


def move_chunk(md, old_row: int, new_row: int) -> None:
    """Move the embedding's chunk at ``old_row`` (and its storage entry) to start at ``new_row``."""
    for chunk in md.state_dict_metadata[EMBED].chunks:
        if chunk.offsets[0] == old_row:
            chunk.offsets = torch.Size([new_row, 0])
    for index, info in storage_of(md, EMBED):
        if index.offset[0] == old_row:
            del md.storage_data[index]
            md.storage_data[type(index)(fqn=EMBED, offset=torch.Size([new_row, 0]), index=index.index)] = info


@case
def dcp_chunk_outside_global_shape(tmp):
    src = dcp_copy(tmp)
    edit_metadata(src, lambda md: move_chunk(md, 501, 900))
    return Case(src, (f"'{EMBED}': piece in '__1_0.distcp' at offsets [900, 0] with sizes [500, 32] lies outside "
                      "the global shape [1001, 32]",))


@case
def dcp_negative_global_shape(tmp):
    src = dcp_copy(tmp)

    def negative(md):
        md.state_dict_metadata[EMBED].size = torch.Size([-1001, 32])
    edit_metadata(src, negative)
    return Case(src, (f"'{EMBED}': negative global shape [-1001, 32] in '.metadata'",))


@case
def dcp_absurd_chunk_size(tmp):
    src = dcp_copy(tmp)

    def absurd(md):
        md.state_dict_metadata[EMBED].size = torch.Size([10**12, 32])
        md.state_dict_metadata[EMBED].chunks[1].sizes = torch.Size([10**12 - 501, 32])
    edit_metadata(src, absurd)
    return Case(src, (f"'__1_0.distcp': '{EMBED}' chunk of sizes [999999999499, 32] needs at least 127999999935872 "
                      "bytes, but its storage entry holds",))


@case
def dcp_two_pieces_claim_one_region(tmp):
    src = dcp_copy(tmp)
    edit_metadata(src, lambda md: move_chunk(md, 501, 500))
    return Case(src, (f"'{EMBED}': rows 500..501 covered twice, by '__0_0.distcp' and '__1_0.distcp'",))


@case
def dcp_piece_dtype_disagrees_with_metadata(tmp):
    src = dcp_copy(tmp)

    def as_half(md):
        md.state_dict_metadata[EMBED].properties.dtype = torch.float16
    edit_metadata(src, as_half)
    return Case(src, (f"'__0_0.distcp': '{EMBED}' holds F32 [501, 32] but the metadata records F16 [501, 32]",))


@case
def dcp_absolute_storage_path(tmp):
    src = dcp_copy(tmp)

    def absolute(md):
        for info in md.storage_data.values():
            info.relative_path = "/etc/passwd"
    edit_metadata(src, absolute)
    return Case(src, ("'.metadata' names the absolute path '/etc/passwd'",))


@case
def dcp_storage_path_leaving_the_checkpoint(tmp):
    src = dcp_copy(tmp)

    def escape(md):
        for info in md.storage_data.values():
            info.relative_path = "../../secret.distcp"
    edit_metadata(src, escape)
    return Case(src, ("'.metadata' names '../../secret.distcp', which leads outside the checkpoint directory",))


@case
def dcp_storage_path_with_a_nul_byte(tmp):  # found by tests/test_fuzz.py: os.path raised ValueError
    src = dcp_copy(tmp)

    def nul(md):
        for info in md.storage_data.values():
            info.relative_path = "__0_0.distcp\0.txt"
    edit_metadata(src, nul)
    return Case(src, ("'.metadata' names a path with a NUL byte ('__0_0.distcp\\x00.txt'); no file can have that name",))


@case
def dcp_malicious_metadata_pickle(tmp):
    src = dcp_copy(tmp)
    marker = tmp / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))
    import pickle

    (src / ".metadata").write_bytes(pickle.dumps(Payload()))
    return Case(src, ("'.metadata': refused to unpickle: it asks for 'posix.system', which is not on ckpttool's "
                      "allow-list of metadata classes (nothing was executed)",))


@case
def dcp_malicious_distcp_item(tmp):
    src = dcp_copy(tmp)
    marker = tmp / "pwned"

    class Payload:  # as large as the real piece, so only the pickle check can refuse it
        def __reduce__(self):
            return (os.system, (f"touch {marker} #{'x' * 70_000}",))
    buffer = io.BytesIO()
    torch.save(Payload(), buffer)
    evil = buffer.getvalue()
    path = src / "__0_0.distcp"
    offset = path.stat().st_size
    path.write_bytes(path.read_bytes() + evil)

    def point_at_payload(md):
        for index, info in storage_of(md, EMBED):
            if info.relative_path == "__0_0.distcp":
                info.offset, info.length = offset, len(evil)
    edit_metadata(src, point_at_payload)
    return Case(src, (f"'__0_0.distcp': '{EMBED}' was refused unread: its pickle asks for posix.system, which is not a "
                      "tensor or plain data; loading it could run code",))


@case
def dcp_metadata_of_garbage_bytes(tmp):
    src = dcp_copy(tmp)
    (src / ".metadata").write_bytes(b"\xa2" + os.urandom(63))
    return Case(src, ("'.metadata': cannot read the metadata pickle (UnpicklingError: invalid load key",))


# -------------------------------------------------------------------------- transformers distributed


@case
def hf_distributed_missing_rank_file(tmp):
    src = dcp_copy(tmp, "llama_hf_tp2")
    (src / SHARD2).unlink()
    return Case(src, (f"'{EMBED}': rows 501..1001 covered by no piece", f"'{SHARD1}'"))


@case
def hf_distributed_truncated_shard(tmp):
    src = dcp_copy(tmp, "llama_hf_tp2")
    truncate(src / SHARD1, 1000)
    return Case(src, (f"'{SHARD1}': safetensors header length 2784 runs past the end of the file (1000 bytes)",))


@case
def hf_distributed_sharding_info_out_of_shape(tmp):
    src = dcp_copy(tmp, "llama_hf_tp2")

    def shift(info):
        info[EMBED]["saved_offsets"] = [900, 0]
    edit_sharding_info(src / SHARD2, shift)
    return Case(src, (f"'{EMBED}': piece in '{SHARD2}'", "lies outside the global shape [1001, 32]"))


@case
def hf_distributed_without_config(tmp):
    src = dcp_copy(tmp, "llama_hf_tp2")
    (src / "config.json").unlink()
    return Case(src, ("transformers distributed checkpoints record no global shapes; ckpttool takes them from the model "
                      "config. Put config.json in or next to the checkpoint, or pass --config.",))


# ---------------------------------------------------------------------------------------------- sidecar


@case
def sidecar_missing_rank(tmp):
    src = sidecar_source(tmp)
    (src / "rank-00001-of-00002.ckpttool.json").unlink()
    (src / "rank-00001-of-00002.safetensors").unlink()
    return Case(src, ("'embed': rows 6..11 covered by no piece", "'rank-00001-of-00002.ckpttool.json'"))


@case
def sidecar_missing_data_file(tmp):
    src = sidecar_source(tmp)
    (src / "rank-00000-of-00002.safetensors").unlink()
    return Case(src, ("'rank-00000-of-00002.ckpttool.json' describes 'rank-00000-of-00002.safetensors', which does not exist",))


@case
def sidecar_unknown_version(tmp):
    src = sidecar_source(tmp)
    edit_json(src / "rank-00000-of-00002.ckpttool.json", lambda d: d.update(version=7))
    return Case(src, ("'rank-00000-of-00002.ckpttool.json': sidecar version 7 is not supported", "upgrade ckpttool"))


@case
def sidecar_dtype_disagreement(tmp):
    src = sidecar_source(tmp)
    (src / "rank-00001-of-00002.ckpttool.json").unlink()
    (src / "rank-00001-of-00002.safetensors").unlink()
    save_shard({"embed": torch.randn(6, 4, dtype=torch.float64), "norm": torch.ones(4)},
               {"embed": PieceSpec.split((12, 4), dim=0, index=1, count=2, true_size=11), "norm": PieceSpec.replicated((4,))},
               src, rank=1, world_size=2)
    return Case(src, ("'embed': pieces disagree on the dtype: F32 in 'rank-00000-of-00002.ckpttool.json' but F64 in "
                      "'rank-00001-of-00002.ckpttool.json'",))


@case
def sidecar_global_shape_disagreement(tmp):
    src = sidecar_source(tmp)
    edit_json(src / "rank-00001-of-00002.ckpttool.json", lambda d: d["pieces"][0].update(global_shape=[14, 4]))
    return Case(src, ("'embed': pieces disagree on the global shape: [12, 4] in 'rank-00000-of-00002.ckpttool.json' but "
                      "[14, 4] in 'rank-00001-of-00002.ckpttool.json'",))


@case
def sidecar_sizes_disagree_with_data_file(tmp):
    src = sidecar_source(tmp)
    edit_json(src / "rank-00000-of-00002.ckpttool.json", lambda d: d["pieces"][0].update(sizes=[5, 4]))
    return Case(src, ("'rank-00000-of-00002.safetensors': 'embed' is F32 [6, 4] but 'rank-00000-of-00002.ckpttool.json' "
                      "records F32 [5, 4]",))


@case
def sidecar_world_size_disagreement(tmp):
    src = sidecar_source(tmp)
    edit_json(src / "rank-00001-of-00002.ckpttool.json", lambda d: d.update(world_size=4))
    return Case(src, ("sidecars disagree on world_size ([2, 4])",))


@case
def sidecar_data_file_outside(tmp):
    src = sidecar_source(tmp)
    edit_json(src / "rank-00000-of-00002.ckpttool.json", lambda d: d.update(file="../elsewhere.safetensors"))
    return Case(src, ("'rank-00000-of-00002.ckpttool.json' names '../elsewhere.safetensors', which leads outside",))


@case
def sidecar_mixed_steps(tmp):
    src = sidecar_source(tmp, steps=(100, 200))
    return Case(src, ("sidecars of different training steps are mixed ('rank-00000-of-00002.ckpttool.json' is step 100, "
                      "'rank-00001-of-00002.ckpttool.json' is step 200)",))


@case
def sidecar_garbage(tmp):
    src = sidecar_source(tmp)
    (src / "rank-00000-of-00002.ckpttool.json").write_text("{rank: 0")
    return Case(src, ("'rank-00000-of-00002.ckpttool.json': not valid JSON",))


# -------------------------------------------------------------------------------------- HF safetensors


@case
def hf_truncated_safetensors(tmp):
    src = hf_copy(tmp)
    truncate(src / "model.safetensors", 4096)
    return Case(src, ("'model.safetensors': tensor 'lm_head.weight' data_offsets [0, 128128] run past the end of the "
                      "data (1952 bytes); the file is truncated",))


@case
def hf_header_length_past_the_end(tmp):
    src = hf_copy(tmp)
    data = bytearray((src / "model.safetensors").read_bytes())
    data[:8] = struct.pack("<Q", len(data) * 2)
    (src / "model.safetensors").write_bytes(bytes(data))
    return Case(src, ("'model.safetensors': safetensors header length", "runs past the end of the file"))


@case
def hf_header_garbage_json(tmp):
    src = hf_copy(tmp)
    header, data = raw_header(src / "model.safetensors")
    text = b"{garbage" + b" " * 8
    (src / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + data)
    return Case(src, ("'model.safetensors': safetensors header is not valid JSON",))


@case
def hf_overlapping_data_offsets(tmp):
    src = hf_copy(tmp)

    def overlap(header):
        header["model.norm.weight"]["data_offsets"] = header[EMBED]["data_offsets"][:1] + [header[EMBED]["data_offsets"][0] + 128]
    edit_header(src / "model.safetensors", overlap)
    return Case(src, ("'model.safetensors': tensors 'model.norm.weight' and 'model.embed_tokens.weight' overlap in the "
                      "data buffer",))


@case
def hf_data_offsets_outside_the_file(tmp):
    src = hf_copy(tmp)

    def outside(header):
        begin = 10**9
        header["model.norm.weight"]["data_offsets"] = [begin, begin + 128]
    edit_header(src / "model.safetensors", outside)
    return Case(src, ("'model.safetensors': tensor 'model.norm.weight' data_offsets [1000000000, 1000000128] run past "
                      "the end of the data",))


@case
def hf_header_over_100_mb(tmp):
    src = hf_copy(tmp)
    data = bytearray((src / "model.safetensors").read_bytes())
    data[:8] = struct.pack("<Q", 200_000_000)
    (src / "model.safetensors").write_bytes(bytes(data))
    return Case(src, ("'model.safetensors': safetensors header of 200000000 bytes exceeds the 100000000 limit",))


@case
def hf_negative_shape(tmp):
    src = hf_copy(tmp)
    edit_header(src / "model.safetensors", lambda h: h["model.norm.weight"].update(shape=[-32]))
    return Case(src, ("'model.safetensors': tensor 'model.norm.weight' has an invalid shape [-32]",))


@case
def hf_absurd_shape(tmp):
    src = hf_copy(tmp)
    edit_header(src / "model.safetensors", lambda h: h["model.norm.weight"].update(shape=[10**15, 10**15]))
    return Case(src, ("'model.safetensors': tensor 'model.norm.weight' holds 128 bytes but shape "
                      "[1000000000000000, 1000000000000000] of F32 needs 4000000000000000000000000000000",))


@case
def hf_index_naming_a_missing_file(tmp):
    src = hf_copy(tmp, shards=2)
    edit_json(src / "model.safetensors.index.json", lambda d: d["weight_map"].update({"model.norm.weight": "gone.safetensors"}))
    return Case(src, ("'model.safetensors.index.json' puts 'model.norm.weight' in 'gone.safetensors', which does not exist",))


@case
def hf_index_naming_a_parent_path(tmp):
    src = hf_copy(tmp, shards=2)
    shutil.copy(src / "model-00001-of-00002.safetensors", tmp / "outside.safetensors")
    edit_json(src / "model.safetensors.index.json", lambda d: d["weight_map"].update({"model.norm.weight": "../outside.safetensors"}))
    return Case(src, ("'model.safetensors.index.json' names '../outside.safetensors', which leads outside the checkpoint",))


@case
def hf_index_naming_an_absolute_path(tmp):
    src = hf_copy(tmp, shards=2)
    edit_json(src / "model.safetensors.index.json", lambda d: d["weight_map"].update({"model.norm.weight": "/etc/passwd"}))
    return Case(src, ("'model.safetensors.index.json' names the absolute path '/etc/passwd'",))


@case
def hf_index_naming_a_symlink_out(tmp):
    src = hf_copy(tmp, shards=2)
    shutil.copy(src / "model-00001-of-00002.safetensors", tmp / "outside.safetensors")
    (src / "link.safetensors").symlink_to(tmp / "outside.safetensors")
    edit_json(src / "model.safetensors.index.json", lambda d: d["weight_map"].update({"model.norm.weight": "link.safetensors"}))
    return Case(src, ("'model.safetensors.index.json' names 'link.safetensors', which leads outside the checkpoint",))


@case
def hf_index_not_json(tmp):
    src = hf_copy(tmp, shards=2)
    (src / "model.safetensors.index.json").write_text("{weight_map")
    return Case(src, ("'model.safetensors.index.json': cannot read",))


@case
def hf_index_naming_a_tensor_its_file_lacks(tmp):
    src = hf_copy(tmp, shards=2)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    other = next(f for f in set(index["weight_map"].values()) if f != index["weight_map"]["model.norm.weight"])
    edit_json(src / "model.safetensors.index.json", lambda d: d["weight_map"].update({"model.norm.weight": other}))
    return Case(src, (f"'model.safetensors.index.json' puts 'model.norm.weight' in '{other}', but that file has no such tensor",))


NOT_COVERED = "the safetensors library refuses a file whose tensors do not cover its data exactly"


@case
def hf_bytes_after_the_last_tensor(tmp):
    src = hf_copy(tmp)
    path = src / "model.safetensors"
    header, data = raw_header(path)
    last = max(header, key=lambda k: header[k]["data_offsets"][1] if k != "__metadata__" else -1)
    path.write_bytes(path.read_bytes() + b"\0" * 8)
    return Case(src, (f"'model.safetensors': 8 bytes after the last tensor '{last}' belong to no tensor (data offsets "
                      f"{len(data)}..{len(data) + 8}); {NOT_COVERED}",))


@case
def hf_bytes_between_tensors(tmp):
    src = hf_copy(tmp)
    path = src / "model.safetensors"
    header, data = raw_header(path)
    ordered = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
    before, moved = ordered[-2], ordered[-1]
    begin, end = header[moved]["data_offsets"]
    header[moved]["data_offsets"] = [begin + 8, end + 8]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[:begin] + b"\0" * 8 + data[begin:])
    return Case(src, (f"'model.safetensors': 8 bytes after tensor '{before}' belong to no tensor (data offsets "
                      f"{begin}..{begin + 8}, before tensor '{moved}'); {NOT_COVERED}",))


@case
def hf_header_with_a_key_twice(tmp):
    src = hf_copy(tmp)
    path = src / "model.safetensors"
    header, data = raw_header(path)
    record = json.dumps(header["model.norm.weight"]).encode()
    text = json.dumps(header).encode()[:-1] + b', "model.norm.weight": ' + record + b"}"
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return Case(src, ("'model.safetensors': safetensors header refused: the key 'model.norm.weight' appears twice in one "
                      "object",))


DEEP = "[" * 100_000 + "]" * 100_000
TOO_DEEP = "nested too deeply (more levels of arrays and objects than ckpttool parses)"


@case
def hf_header_nested_too_deeply(tmp):
    src = hf_copy(tmp)
    path = src / "model.safetensors"
    text = ('{"__metadata__": ' + DEEP + "}").encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text)
    return Case(src, (f"'model.safetensors': safetensors header refused: {TOO_DEEP}",))


@case
def hf_index_nested_too_deeply(tmp):
    src = hf_copy(tmp, shards=2)
    (src / "model.safetensors.index.json").write_text('{"weight_map": ' + DEEP + "}")
    return Case(src, (f"'model.safetensors.index.json': cannot read: {TOO_DEEP}",))


@case
def sidecar_nested_too_deeply(tmp):
    src = sidecar_source(tmp)
    (src / "rank-00000-of-00002.ckpttool.json").write_text('{"pieces": ' + DEEP + "}")
    return Case(src, (f"'rank-00000-of-00002.ckpttool.json': not valid JSON ({TOO_DEEP})",))


@case
def config_nested_too_deeply(tmp):
    src = dcp_copy(tmp)
    (src.parent / "config.json").write_text('{"model_type": "llama", "rope_scaling": ' + DEEP + "}")
    return Case(src, (f"'{src.parent / 'config.json'}': cannot read the config: {TOO_DEEP}",))


@case
def megatron_metadata_json_nested_too_deeply(tmp):
    shutil.copytree(FIXTURES / "megatron_tp2_pp2" / "torch_dist", tmp / "torch_dist")
    src = tmp / "torch_dist"
    (src / "iter_0000010" / "metadata.json").write_text('{"sharded_backend": ' + DEEP + "}")
    return Case(src, (f"'{src / 'iter_0000010' / 'metadata.json'}': cannot read it: {TOO_DEEP}",))


@case
def colossalai_index_nested_too_deeply(tmp):
    shutil.copytree(fixture_dir("colossalai_llama_pp2_bin"), tmp / "colossal", ignore=shutil.ignore_patterns("reference"))
    src = tmp / "colossal" / "checkpoint"
    index = next(p for p in src.glob("*.index.json"))
    doc = json.loads(index.read_text())
    index.write_text(json.dumps(doc)[:-1] + ', "metadata": ' + DEEP + "}")
    return Case(src, (f"'{index.name}': cannot read the index: {TOO_DEEP}",))


@case
def hf_distributed_sharding_info_nested_too_deeply(tmp):
    src = dcp_copy(tmp, "llama_hf_tp2")
    edit_header(src / SHARD2, lambda h: h["__metadata__"].update(DCP_SHARDING_INFO='{"x": ' + DEEP + "}"))
    return Case(src, (f"'{SHARD2}': DCP_SHARDING_INFO metadata is not valid JSON",))


@case
def verl_fsdp_config_nested_too_deeply(tmp):
    src = dcp_copy(tmp, "verl_llama_fsdp4")
    (src / "fsdp_config.json").write_text('{"world_size": ' + DEEP + "}")
    return Case(src, (f"'fsdp_config.json': cannot read it: {TOO_DEEP}",))


@case
def two_checkpoints_of_different_formats(tmp):
    """A DCP checkpoint and a sidecar set in one folder: merging one would silently drop the other."""
    src = dcp_copy(tmp)
    for rank in range(2):
        save_shard({"embed": torch.randn(6, 4)}, {"embed": PieceSpec.split((12, 4), dim=0, index=rank, count=2)},
                   src, rank=rank, world_size=2)
    return Case(src, (
        f"'{src}': holds checkpoints of 2 formats:\n"
        "  - sidecar: 'rank-00000-of-00002.ckpttool.json', 'rank-00001-of-00002.ckpttool.json'\n"
        "  - dcp: '.metadata', '__0_0.distcp', '__1_0.distcp'\n"
        "Merging one would silently leave out the other. Pass --format NAME with the one you mean (sidecar or dcp), "
        "or move the other checkpoint to a folder of its own.",
    ))


# ------------------------------------------------------------------------------------------------ config


@case
def config_not_json(tmp):
    src = dcp_copy(tmp)
    (src.parent / "config.json").write_text("{not json")
    return Case(src, (f"'{src.parent / 'config.json'}': cannot read the config",))


@case
def config_of_another_vocab(tmp):
    src = dcp_copy(tmp)
    edit_json(src.parent / "config.json", lambda d: d.update(vocab_size=2002))
    return Case(src, (f"'{EMBED}': shape [1001, 32], but the config gives [2002, 32] (1001 rows is one of 2 TP pieces",))


@case
def config_linking_out_of_the_checkpoint(tmp):
    src = dcp_copy(tmp)
    (tmp / "elsewhere").mkdir()
    shutil.copy(src.parent / "config.json", tmp / "elsewhere" / "config.json")
    (src / "config.json").symlink_to(tmp / "elsewhere" / "config.json")
    return Case(src, (f"'{src / 'config.json'}' is a symlink to '{tmp / 'elsewhere' / 'config.json'}', outside '{src}'",))


@case
def hub_cache_snapshot_linking_out_of_its_repository(tmp):
    from test_links import SHARDS, hub_snapshot, outside_copy, relink

    src = hub_snapshot(tmp / "hub")
    relink(src / SHARDS[1], outside_copy(src / SHARDS[1], tmp / "elsewhere"))
    return Case(src, (f"'model.safetensors.index.json' names '{SHARDS[1]}', which leads outside the checkpoint directory "
                      "and its hub cache folder",))


# ---------------------------------------------------------------------- hostile input (never hangs, never echoes)


@case
def pickled_dag_in_a_megatron_rank_file(tmp):  # 2**61 nodes as a tree: minutes of walking before the bound
    from test_pickle_bounds import megatron_legacy

    src, named = megatron_legacy(tmp)
    return Case(src, (f"{named}: refused: its pickled objects refer to shared parts so often",))


@case
def fifo_named_like_a_sidecar(tmp):  # reading it would block forever
    src = sidecar_source(tmp)
    (src / "rank-00001-of-00002.ckpttool.json").unlink()
    os.mkfifo(src / "rank-00001-of-00002.ckpttool.json")
    return Case(src, ("'rank-00001-of-00002.ckpttool.json': not a regular file (a FIFO); ckpttool reads only regular files",))


@case
def config_of_200000_layers(tmp):  # transformers would build the layers for minutes
    src = dcp_copy(tmp)
    edit_json(src.parent / "config.json", lambda d: d.update(num_hidden_layers=200_000))
    return Case(src, (f"'{src.parent / 'config.json'}': num_hidden_layers 200000, but the checkpoint holds 21 tensors",))


@case
def deepspeed_latest_linking_to_a_secret(tmp):  # its content is never shown
    src = tmp / "ds"
    shutil.copytree(fixture_dir("deepspeed_zero2") / "checkpoint", src)
    (tmp / "secret").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (src / "latest").unlink()
    (src / "latest").symlink_to(tmp / "secret")
    return Case(src, (f"'{src / 'latest'}': not a valid checkpoint tag",))


# ------------------------------------------------------------------------------------------- destination


@case
def destination_not_empty(tmp):
    out = tmp / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    return Case(dcp_copy(tmp), (f"destination '{out}' exists and is not empty; pass --force to replace it",), out=out)


@case
def destination_inside_the_source(tmp):
    src = dcp_copy(tmp)
    return Case(src, (f"destination '{src / 'hf'}' lies inside the source '{src}'; ckpttool never writes there",), out=src / "hf")


@case
def destination_is_a_file(tmp):
    out = tmp / "file"
    out.write_text("mine")
    return Case(dcp_copy(tmp), (f"destination '{out}' exists and is not a directory",), out=out)


@case
def destination_parent_missing(tmp):
    out = tmp / "no" / "such" / "hf"
    return Case(dcp_copy(tmp), (f"its parent directory '{out.parent}' does not exist",), out=out)


@case
def a_folder_holding_checkpoints_in_subfolders(tmp):
    src = tmp / "run"
    shutil.copytree(FIXTURES / "megatron_tp2_pp2", src, ignore=shutil.ignore_patterns("reference", "logits.safetensors"))
    return Case(src, ("no checkpoint here, but these subfolders hold one; give one of them as the source:",
                      f"  - '{src / 'legacy'}' (megatron-legacy)", f"  - '{src / 'torch_dist'}' (megatron-dist)"))


@case
def deepspeed_tensor_parallel_beside_its_universal_form(tmp):
    src = tmp / "ds"
    shutil.copytree(FIXTURES / "deepspeed_zero2" / "checkpoint", src)
    shutil.copy(src / "global_step2" / "mp_rank_00_model_states.pt", src / "global_step2" / "mp_rank_01_model_states.pt")
    shutil.copytree(FIXTURES / "deepspeed_universal" / "checkpoint" / "global_step2_universal", src / "global_step2_universal")
    return Case(src, ("model-parallel ranks [0, 1] (tensor parallelism)",
                      f"'{src / 'global_step2_universal'}' (converted from another step: its model states differ "
                      "from this step's)"))


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input(name, cli, tmp_path):
    made = CASES[name](tmp_path)
    out = made.out or tmp_path / "out"
    watched = {made.src: tree_digest(made.src)}
    if out.is_dir() and not made.src.is_relative_to(out):
        watched[out] = tree_digest(out)
    before_file = out.read_bytes() if out.is_file() else None
    result = cli("merge", made.src, out, *made.args)
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert "internal error" not in result.stderr, result.stderr  # a foreseen error, not the CLI's report of a bug
    for needle in made.says:
        assert needle in result.stderr, f"{needle!r} not in:\n{result.stderr}"
    for path, digest in watched.items():
        assert tree_digest(path) == digest, f"{path} was modified"
    if before_file is not None:
        assert out.read_bytes() == before_file
    elif out not in watched:
        assert not out.exists(), "a checkpoint was left at the destination"
    if out.parent.exists():
        assert not list(out.parent.glob(f".{out.name}.ckpttool-partial-*")), "a staging directory was left"
    assert not (tmp_path / "pwned").exists(), "a pickle payload ran"


def test_the_corpus_has_at_least_forty_kinds():
    assert len(CASES) >= 40


# ------------------------------------------------------------------------------------------- a full disk


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs (root and a kernel that allows it); skipped elsewhere, where test_errors injects ENOSPC."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_full_disk_on_a_real_small_file_system(cli, small_disk):
    src = fixture_dir("llama_tp2_dcp") / "checkpoint"
    before = tree_digest(src)
    out = small_disk / "hf"
    result = cli("merge", src, out)  # 323 KiB of weights into 256 KiB
    assert result.exit_code == 1
    assert "Error: 'model.safetensors': cannot write: No space left on device; nothing was published" in result.stderr
    assert not out.exists() and list(small_disk.iterdir()) == []
    assert tree_digest(src) == before
