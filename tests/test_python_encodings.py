"""Checkpoints from the Pythons people run: Python 3.11.0-3.11.4 (Debian 12's 3.11.2) pickle an enum member as
``getattr(<class>, "<NAME>")``, later ones as ``<class>(<value>)``. Every pickle-reading path reads both alike, and
allows ``getattr`` for exactly that form: a class ckpttool stands in for as an enum, and one of its members."""

from __future__ import annotations

import io
import json
import pickletools
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from ckpttool.errors import UnsafePickleError
from ckpttool.readers import colossalai
from ckpttool.readers.deepspeed import classes as deepspeed
from ckpttool.readers.megatron import common as megatron
from ckpttool.readers.verl import classes as verl
from ckpttool.io.safe_pickle import load_metadata_pickle
from ckpttool.io.torch_save import scan
from conftest import FIXTURES, load_output

COMMITTED = FIXTURES / "python3112"  # written by Debian's /usr/bin/python3 (3.11.2): enums by name
MEGATRON_RANK = Path("megatron_legacy/iter_0000001/mp_rank_00/model_optim_rng.pt")


@pytest.fixture(scope="module")
def encodings(tmp_path_factory) -> dict[str, Path]:
    """The committed fixture (enums by name) and the same files written now by this Python (enums by value)."""
    here = tmp_path_factory.mktemp("encodings") / "current"
    subprocess.run([sys.executable, FIXTURES / "make_other_python.py", "--out", here], check=True, capture_output=True)
    if json.loads((here / "producer.json").read_text())["enums_by_name"]:
        pytest.fail(f"Python {sys.version.split()[0]} pickles enums by name too: the by-value encoding is not tested")
    return {"by name": COMMITTED, "by value": here}


def getattr_global(data: bytes) -> bool:
    """Whether the pickle names ``builtins.getattr`` (protocol 2 writes ``__builtin__ getattr``)."""
    return any(arg in ("getattr", "__builtin__ getattr", "builtins getattr") for _, arg, _ in pickletools.genops(data))


def test_the_committed_fixture_pickles_enums_by_name():
    producer = json.loads((COMMITTED / "producer.json").read_text())
    assert producer["python"] == "3.11.2" and producer["enums_by_name"] is True
    assert getattr_global((COMMITTED / "dcp" / ".metadata").read_bytes())
    with zipfile.ZipFile(COMMITTED / MEGATRON_RANK) as archive:
        pkl = next(n for n in archive.namelist() if n.endswith("data.pkl"))
        assert getattr_global(archive.read(pkl))


@pytest.mark.parametrize("kind", ["dcp", "megatron_legacy"])
def test_merge_reads_both_encodings_alike(cli, tmp_path, encodings, kind):
    outputs = {}
    for name, root in encodings.items():
        out = tmp_path / name.replace(" ", "_")
        result = cli("merge", root / kind, out, "--raw-names")  # no config: the names as stored
        assert result.exit_code == 0, result.output
        outputs[name] = load_output(out)
    by_name, by_value = outputs["by name"], outputs["by value"]
    assert sorted(by_name) == sorted(by_value) and by_name
    assert all(by_name[k].equal(by_value[k]) for k in by_name)


@pytest.mark.parametrize("kind", ["dcp", "megatron_legacy"])
def test_audit_reads_both_encodings(cli, encodings, kind):
    for root in encodings.values():
        result = cli("audit", root / kind)
        assert result.exit_code in (0, 3) and "Error:" not in result.stderr, result.output


def test_dcp_metadata_memory_format_is_the_member_value(encodings):
    for root in encodings.values():
        md = load_metadata_pickle((root / "dcp" / ".metadata").read_bytes(), ".metadata")
        for tmd in md.get("state_dict_metadata").values():
            assert tmd.get("properties").get("memory_format") == 0  # TORCH_CONTIGUOUS_FORMAT


def test_megatron_args_give_the_enum_values(encodings):
    for root in encodings.values():
        with open(root / MEGATRON_RANK, "rb") as f:
            args = scan(f, label="rank", allow=megatron.ALLOW)["args"]
        assert megatron.arg(args, "attention_backend") == 5  # AttnBackend.auto
        assert megatron.arg(args, "model_type") == 1  # ModelType.encoder_or_decoder


def test_deepspeed_zero_stage_is_the_member_value(encodings):
    for root in encodings.values():
        with open(root / "deepspeed_zero_stage.pt", "rb") as f:
            state = scan(f, label="optim", allow=deepspeed.ALLOW)
        assert state["optimizer_state_dict"]["zero_stage"] == 2  # ZeroStageEnum.gradients


# ------------------------------------------------------------------------------------------ nothing wider


def getattr_pickle(module: str, name: str, member: str, *, default: bool = False) -> bytes:
    """``getattr(module.name, member)`` (with a third argument when ``default``), as Python 3.11.2 writes it."""
    text = member.encode()
    args = b"\x86" if not default else b"N\x87"
    return (b"\x80\x02c__builtin__\ngetattr\nc" + f"{module}\n{name}\n".encode() + b"X" + struct.pack("<I", len(text))
            + text + args + b"R.")


def archive(pkl: bytes) -> io.BytesIO:
    """A ``torch.save`` archive whose pickle is ``pkl``."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/byteorder", "little")
    buffer.seek(0)
    return buffer


DCP_ENUM = ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING")
PLANNER_ENUM = ("torch.distributed.checkpoint.planner", "WriteItemType")


def test_planner_enums_by_name_load_as_their_values():
    assert load_metadata_pickle(getattr_pickle(*PLANNER_ENUM, "SHARD"), ".metadata") == 2


@pytest.mark.parametrize(("owner", "member", "shown"), [
    (DCP_ENUM, "NOT_A_MEMBER", "getattr(torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING, 'NOT_A_MEMBER')"),
    (DCP_ENUM, "__class__", "'__class__'"),
    (("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"), "__init__", "'__init__'"),
    (("torch", "Size"), "__new__", "getattr(torch.Size, '__new__')"),
])
def test_metadata_getattr_on_anything_else_is_refused(owner, member, shown):
    with pytest.raises(UnsafePickleError, match="refused to unpickle") as refused:
        load_metadata_pickle(getattr_pickle(*owner, member), ".metadata")
    assert shown in str(refused.value) and "not a member of an enum ckpttool knows" in str(refused.value)


def test_getattr_with_a_default_is_refused():
    with pytest.raises(UnsafePickleError, match="not a member of an enum"):
        load_metadata_pickle(getattr_pickle(*DCP_ENUM, "TORCH_CONTIGUOUS_FORMAT", default=True), ".metadata")


def test_getattr_of_a_refused_class_is_refused_by_the_class():
    with pytest.raises(UnsafePickleError, match="asks for 'os.system'"):
        load_metadata_pickle(getattr_pickle("os", "system", "__call__"), ".metadata")


ALLOWS = {
    "megatron": (megatron.ALLOW, ("megatron.core.transformer.enums", "AttnBackend"), "auto",
                 ("argparse", "Namespace"), "__init__"),
    "deepspeed": (deepspeed.ALLOW, ("deepspeed.runtime.zero.config", "ZeroStageEnum"), "weights",
                  ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"), "__reduce__"),
    "verl": (verl.ALLOW, None, None, ("torch.distributed.tensor.placement_types", "Shard"), "__init__"),
    "colossalai": (None, None, None, ("collections", "OrderedDict"), "fromkeys"),
}


@pytest.mark.parametrize("path", sorted(ALLOWS))
def test_torch_save_paths_allow_exactly_enum_members(path):
    allow, enum_class, member, other, attribute = ALLOWS[path]
    assert colossalai.scan is scan  # ColossalAI's .bin shards go through scan with no allow-list
    if enum_class is not None:
        found = scan(archive(getattr_pickle(*enum_class, member)), label="f.pt", allow=allow)
        assert getattr(found, "value", found) in (5, 3)
        with pytest.raises(UnsafePickleError, match=r"getattr\(.*'no_such_member'\), which is not a member"):
            scan(archive(getattr_pickle(*enum_class, "no_such_member")), label="f.pt", allow=allow)
    with pytest.raises(UnsafePickleError, match=f"'f.pt': refused to unpickle: it asks for getattr.*'{attribute}'"):
        scan(archive(getattr_pickle(*other, attribute)), label="f.pt", allow=allow)


def test_a_dcp_checkpoint_asking_getattr_for_a_non_member_fails_cleanly(cli, tmp_path):
    src = tmp_path / "dcp"
    src.mkdir()
    for f in (COMMITTED / "dcp").iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    data = (src / ".metadata").read_bytes().replace(b"TORCH_CONTIGUOUS_FORMAT", b"TORCH_CONTIGUOUS_FORMAX")
    (src / ".metadata").write_bytes(data)
    result = cli("merge", src, tmp_path / "out")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "Error: '.metadata': refused to unpickle: it asks for getattr(" in result.stderr, result.stderr
    assert "'TORCH_CONTIGUOUS_FORMAX'), which is not a member of an enum ckpttool knows" in result.stderr
    assert not (tmp_path / "out").exists()
