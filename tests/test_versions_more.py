"""The rest of issue 26's version matrix: ColossalAI and verl list every class their pickles may name with the
releases that write it (the fixtures prove each cell), refuse any other class naming it and what the checkpoint
records of its writer, Lightning 1.9.5's path in its callbacks state is read as text, and ``ckpttool diff`` finds
two layouts of one training run equal."""

from __future__ import annotations

import collections
import json
import pathlib
import pickletools
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, assert_failed_cleanly, fixture_dir, load_output, tree_digest

import ckpttool
from ckpttool.io.torch_pickle import accepted_classes
from ckpttool.io.torch_save import scan
from ckpttool.readers import colossalai_classes
from ckpttool.readers.lightning import classes as lightning_classes
from ckpttool.readers.verl import classes as verl_classes

INPUT_IDS = torch.tensor([[1, 5, 9, 42, 100, 999, 1000, 7]])


def _globals(path: Path) -> set[str]:
    """The classes a torch.save file's pickle names (read with pickletools: nothing is built)."""
    with zipfile.ZipFile(path) as archive:
        data = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    found, strings = set(), []
    for op, arg, _ in pickletools.genops(data):
        if op.name == "GLOBAL":
            found.add(arg.replace(" ", "."))
        elif op.name == "STACK_GLOBAL":
            found.add(".".join(strings[-2:]))
        if isinstance(arg, str):
            strings.append(arg)
    return found


def _repickle(path: Path, old: bytes, new: bytes) -> None:
    """Rewrite the pickle of a torch.save file with ``old`` replaced by ``new`` (same length keeps offsets)."""
    with zipfile.ZipFile(path) as archive:
        entries = [(info, archive.read(info)) for info in archive.infolist()]
    assert any(old in data for info, data in entries if info.filename.endswith("data.pkl")), old
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for info, data in entries:
            archive.writestr(info, data.replace(old, new) if info.filename.endswith("data.pkl") else data)


# ------------------------------------------------------------------------------------------------ ColossalAI

def _versions(folder: Path) -> dict[str, str]:
    return json.loads((folder / "producer.json").read_text())["versions"]


#: the fixtures ColossalAI itself wrote (make_colossalai.py's reproduce its source with torch alone)
COLOSSALAI = sorted(p.name for p in FIXTURES.glob("colossalai_*")
                    if (p / "producer.json").is_file() and "colossalai" in _versions(p))


def _colossalai_release(name: str) -> str:
    return _versions(fixture_dir(name))["colossalai"]


def test_the_colossalai_table_covers_every_class_the_reader_accepts():
    # what scan accepts for any torch.save file is listed, so the table is all a ColossalAI shard may name
    assert {a.qualified for a in colossalai_classes.TABLE} == set(accepted_classes())
    for entry in colossalai_classes.TABLE:
        assert set(entry.written_by) <= set(colossalai_classes.RELEASES), entry
        assert entry.where, entry


@pytest.mark.parametrize("name", COLOSSALAI)
def test_the_colossalai_table_lists_each_class_with_the_release_that_pickled_it(name):
    release = _colossalai_release(name)
    assert release in colossalai_classes.RELEASES
    by_name = {a.qualified: a for a in colossalai_classes.TABLE}
    for shard in (fixture_dir(name) / "checkpoint").glob("pytorch_model*.bin"):
        for qualified in _globals(shard):
            assert qualified in by_name, f"{shard.name}: {qualified}"
            assert release in by_name[qualified].written_by, f"{qualified} is pickled by ColossalAI {release}"


def test_every_release_the_colossalai_table_names_is_proven_by_a_fixture():
    # no cell claimed without a fixture: each (class, release) of the table is pickled by a fixture of that release
    seen: dict[str, set[str]] = {}
    for name in COLOSSALAI:
        release = _colossalai_release(name)
        for shard in (fixture_dir(name) / "checkpoint").glob("pytorch_model*.bin"):
            for qualified in _globals(shard):
                seen.setdefault(qualified, set()).add(release)
    for entry in colossalai_classes.TABLE:
        assert set(entry.written_by) <= seen.get(entry.qualified, set()), entry


# one case per release (the merge describes the model from its config first: the suite's cache has these)
@pytest.mark.parametrize("release, name", [("0.5.0", "colossalai_real_llama_tp2_bin"),
                                           ("0.4.9", "colossalai_v0_4_llama_tp2_bin")])
def test_an_unknown_class_in_a_colossalai_shard_is_refused_naming_it_and_the_release(
        release, name, cli, copy_fixture, tmp_path):
    root = copy_fixture(name)
    shard = sorted(root.glob("pytorch_model*.bin"))[-1]
    _repickle(shard, b"collections\nOrderedDict", b"collections\nOrderedDixt")
    before = tree_digest(root)
    result = cli("merge", root, tmp_path / "hf")
    transformers = json.loads((root / "config.json").read_text())["transformers_version"]
    assert_failed_cleanly(
        result, tmp_path / "hf", f"'{shard.name}': refused to unpickle: it asks for 'collections.OrderedDixt', which "
        "no ColossalAI model shard ckpttool knows pickles (nothing was executed)",
        "the checkpoint records no ColossalAI version (ColossalAI writes none: its index holds only "
        f"metadata.total_size); its config.json records transformers {transformers}, the release ColossalAI "
        f"{release} pins",
        f"ckpttool reads the classes that ColossalAI {' and '.join(colossalai_classes.RELEASES)} write")
    assert tree_digest(root) == before


def test_an_unknown_class_without_a_config_says_nothing_is_recorded(cli, copy_fixture, tmp_path):
    root = copy_fixture("colossalai_real_llama_pp2_bin")
    (root / "config.json").unlink()
    shard = sorted(root.glob("pytorch_model-stage-*.bin"))[0]
    _repickle(shard, b"torch._utils\n_rebuild_tensor_v2", b"torch._utils\n_rebuild_tensor_v9")
    result = cli("merge", root, tmp_path / "hf")
    assert_failed_cleanly(result, tmp_path / "hf", "'torch._utils._rebuild_tensor_v9'",
                          "the checkpoint records no ColossalAI version (ColossalAI writes none: its index holds only "
                          "metadata.total_size).")


#: the fixtures an older ColossalAI release wrote (make_colossalai_real.py run by it: colossalai_v0_4_*)
COLOSSALAI_OLDER = sorted(n for n in COLOSSALAI if n.startswith("colossalai_v"))


def test_the_older_colossalai_fixtures_are_the_release_the_table_names():
    assert COLOSSALAI_OLDER == ["colossalai_v0_4_llama_tp2_bin", "colossalai_v0_4_mixtral_ep2_bin",
                                "colossalai_v0_4_mixtral_pp2_ep2_bin"]
    for name in COLOSSALAI_OLDER:
        producer = json.loads((fixture_dir(name) / "producer.json").read_text())
        assert producer["fixture"] == name and producer["versions"]["colossalai"] == "0.4.9"
        assert producer["versions"]["transformers"] in colossalai_classes.TRANSFORMERS_PINS
        assert producer["plugin"] == ("MoeHybridParallelPlugin" if "mixtral" in name else "HybridParallelPlugin")


@pytest.mark.parametrize("name", COLOSSALAI_OLDER)
def test_an_older_colossalai_checkpoint_merges_bit_for_bit_loads_strictly_and_audits(name, tmp_path):
    from transformers import AutoModelForCausalLM

    src = fixture_dir(name) / "checkpoint"
    before = tree_digest(src)
    result = ckpttool.merge(src, tmp_path / "hf")
    assert tree_digest(src) == before
    if "mixtral" in name:
        # transformers 4.39.3 kept rotary buffers in every attention layer; ColossalAI 0.4.9's MoE IO saved them
        assert ("not read: 6 rotary buffers of the attention layers (model.layers.0.self_attn.rotary_emb.cos_cached, "
                "...), which transformers 4.39 and older kept there: non-persistent, never weights"
                ) in result.plan.notes
    got, want = load_output(tmp_path / "hf"), load_output(fixture_dir(name) / "reference")
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key
    ours, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.values()), info
    reference = AutoModelForCausalLM.from_pretrained(fixture_dir(name) / "reference")
    with torch.no_grad():
        assert torch.equal(ours.eval()(INPUT_IDS).logits, reference.eval()(INPUT_IDS).logits)
    assert ckpttool.audit(src, data=False).ok


# ------------------------------------------------------------------------------------------------------ verl

VERL = sorted(p.name for p in FIXTURES.glob("verl_*") if (p / "producer.json").is_file())
#: the verl fixtures written under an older torch (make_verl.py run by that torch: verl_torch2_<minor>_*)
VERL_OLDER_MODELS = sorted(n for n in VERL if n.startswith("verl_torch") and n.endswith("_llama_fsdp4"))


def _torch_release(folder: Path) -> str:
    return ".".join(_versions(folder)["torch"].split("+")[0].split(".")[:2])


def _pickled_classes(folder: Path) -> set[str]:
    """What a verl fixture's rank files name beyond what scan reads for any torch.save file (tensors, dtypes)."""
    found = set().union(*(_globals(p) for p in (folder / "checkpoint").glob("model_world_size_*.pt")))
    return {q for q in found if q not in accepted_classes()
            and not (q.startswith("torch.") and isinstance(getattr(torch, q[6:], None), torch.dtype))}


def test_the_verl_table_names_the_torch_releases_of_the_matrix():
    assert sorted({_torch_release(fixture_dir(n)) for n in VERL}, key=lambda v: tuple(map(int, v.split(".")))) == \
        list(verl_classes.TORCH)
    for key, entry in verl_classes.TABLE.items():
        assert set(entry.torch) <= set(verl_classes.TORCH) and entry.where, key
    assert verl_classes.ALLOW == {key: entry.stand_in for key, entry in verl_classes.TABLE.items()}


@pytest.mark.parametrize("name", VERL)
def test_the_verl_table_lists_each_class_with_the_torch_that_pickled_it(name):
    release = _torch_release(fixture_dir(name))
    for qualified in _pickled_classes(fixture_dir(name)):
        module, _, cls = qualified.rpartition(".")
        assert (module, cls) in verl_classes.TABLE, f"{name}: {qualified}"
        assert release in verl_classes.TABLE[(module, cls)].torch, f"{qualified} is pickled under torch {release}"


def test_every_torch_release_the_verl_table_names_is_proven_by_a_fixture():
    seen: dict[str, set[str]] = {}
    for name in VERL:
        for qualified in _pickled_classes(fixture_dir(name)):
            seen.setdefault(qualified, set()).add(_torch_release(fixture_dir(name)))
    for (module, cls), entry in verl_classes.TABLE.items():
        assert set(entry.torch) <= seen.get(f"{module}.{cls}", set()), (module, cls, entry.torch)


@pytest.mark.parametrize("name", VERL_OLDER_MODELS)
def test_an_older_torchs_verl_checkpoint_merges_bit_for_bit_loads_strictly_and_audits(name, tmp_path):
    from transformers import AutoModelForCausalLM

    src = fixture_dir(name) / "checkpoint"
    before = tree_digest(src)
    ckpttool.merge(src, tmp_path / "hf")
    assert tree_digest(src) == before
    got, want = load_output(tmp_path / "hf"), load_output(fixture_dir(name) / "reference")
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key
    ours, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.values()), info
    reference = AutoModelForCausalLM.from_pretrained(fixture_dir(name) / "reference")
    with torch.no_grad():
        assert torch.equal(ours.eval()(INPUT_IDS).logits, reference.eval()(INPUT_IDS).logits)
    assert ckpttool.audit(src, data=False).ok


def _rank_map(ranks: list[int]):
    import io

    from ckpttool.io.torch_save import StoredTensor

    data = b"".join(r.to_bytes(4, "little", signed=True) for r in ranks)
    return io.BytesIO(data), StoredTensor("I32", (len(ranks),), (1,), "0", 0, 0, len(ranks))


def test_torch_2_10s_mesh_layout_keeps_shape_and_stride_per_dim_itself():
    # torch 2.10 pickles _MeshLayout(shape, stride) for the whole mesh; 2.13 one layout per dim under 'axes'
    from ckpttool.io.safe_pickle import Record
    from ckpttool.readers.verl.entries import _mesh

    f, ranks = _rank_map([0, 1, 2, 3])
    mesh = _mesh(Record(_rank_map=ranks, _layout=Record(shape=(2, 2), stride=(2, 1)), _mesh_dim_names=("dp", "tp")),
                 2, f, "x.pt")
    assert (mesh.shape, mesh.ranks, mesh.coordinate(2)) == ((2, 2), (0, 1, 2, 3), (1, 0))
    sub = _mesh(Record(_rank_map=ranks, _layout=Record(shape=(2,), stride=(2,)), _mesh_dim_names=("dp",)), 3, f, "x.pt")
    assert (sub.shape, sub.ranks) == ((2,), (1, 3))


def test_torch_2_10s_mesh_layout_with_a_stride_missing_is_malformed():
    from ckpttool.errors import SourceError
    from ckpttool.io.safe_pickle import Record
    from ckpttool.readers.verl.entries import _mesh

    f, ranks = _rank_map([0, 1, 2, 3])
    with pytest.raises(SourceError) as e:
        _mesh(Record(_rank_map=ranks, _layout=Record(shape=(2, 2), stride=(2,)), _mesh_dim_names=("dp", "tp")),
              0, f, "model_world_size_4_rank_0.pt")
    assert str(e.value) == ("'model_world_size_4_rank_0.pt': malformed device mesh layout: expected a stride per dim "
                            "of its shape, found ((2, 2), (2,)) (a tuple)")


def test_an_older_torchs_strided_dtensors_merge_to_their_full_tensors(tmp_path):
    for name in (n for n in VERL if n.startswith("verl_torch") and n.endswith("_dtensor_strided")):
        ckpttool.merge(fixture_dir(name) / "checkpoint", tmp_path / name)
        got, want = load_output(tmp_path / name), load_output(fixture_dir(name) / "reference")
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want), name


def test_an_unknown_class_in_a_verl_rank_file_is_refused_naming_it_and_what_is_recorded(cli, copy_fixture, tmp_path):
    root = copy_fixture("verl_llama_fsdp4")
    _repickle(root / "model_world_size_4_rank_2.pt", b"placement_types\nShard\n", b"placement_types\nShaxd\n")
    before = tree_digest(root)
    result = cli("merge", root, tmp_path / "hf")
    transformers = json.loads((root / "huggingface" / "config.json").read_text())["transformers_version"]
    assert_failed_cleanly(
        result, tmp_path / "hf", "'model_world_size_4_rank_2.pt': refused to unpickle: it asks for "
        "'torch.distributed.tensor.placement_types.Shaxd', which no verl rank file ckpttool knows pickles (nothing "
        "was executed); the checkpoint records no verl or torch version (verl writes neither); it records "
        f"FSDP_version 2 in 'fsdp_config.json' and transformers_version {transformers} in 'huggingface/config.json'",
        f"the DTensor classes that torch {', '.join(verl_classes.TORCH[:-1])} and {verl_classes.TORCH[-1]} pickle")
    assert tree_digest(root) == before


def test_an_unknown_class_in_a_bare_rank_file_says_nothing_is_recorded(cli, tmp_path):
    root = tmp_path / "step"
    root.mkdir()
    for p in (fixture_dir("verl_dtensor_strided") / "checkpoint").glob("model_world_size_*.pt"):
        (root / p.name).write_bytes(p.read_bytes())
    _repickle(root / "model_world_size_4_rank_0.pt", b"torch._utils\n_rebuild_wrapper_subclass",
              b"torch._utils\n_rebuild_wrapper_subclasz")
    result = cli("merge", root, tmp_path / "hf")
    assert_failed_cleanly(result, tmp_path / "hf", "'torch._utils._rebuild_wrapper_subclasz'",
                          "the checkpoint records no verl or torch version (verl writes neither). ")


# ------------------------------------------------------------------------------------------------ Lightning 1.x

L19_CKPT = "epoch=0-step=1.ckpt"


class _PathOf:
    """Pickled as ``pathlib.PosixPath`` called with ``parts``, whatever they are (a path as a pickle may name it)."""

    def __init__(self, *parts: object) -> None:
        self.parts = parts

    def __reduce__(self):
        return pathlib.PosixPath, self.parts


def _lightning_ckpt(folder: Path, dirpath: object) -> Path:
    """The 1.9.5 fixture's weights in a ``.ckpt`` whose ModelCheckpoint state holds ``dirpath``."""
    ours = fixture_dir("lightning_v1_9_ddp_llama")
    folder.mkdir()
    state = collections.OrderedDict((f"model.{k}", t) for k, t in load_output(ours / "reference").items())
    torch.save({"pytorch-lightning_version": "1.9.5", "state_dict": state, "optimizer_states": [],
                "callbacks": {"ModelCheckpoint{}": {"dirpath": dirpath}}, "loops": {}}, folder / L19_CKPT)
    (folder / "config.json").write_bytes((ours / "reference" / "config.json").read_bytes())
    return folder


def test_lightning_1_9s_checkpoint_dirpath_is_read_as_its_text_never_as_a_path(tmp_path):
    # 1.9.5 keeps ModelCheckpoint's dirpath as the user gave it (a Path here): the one class 2.x does not pickle
    fixture = fixture_dir("lightning_v1_9_ddp_llama") / "checkpoint" / L19_CKPT
    assert "pathlib.PosixPath" in _globals(fixture)
    assert [a.releases for a in lightning_classes.TABLE if a.name == "PosixPath"] == [("1.9.5",)]
    with open(fixture, "rb") as f:
        tree = scan(f, label=L19_CKPT, allow=lightning_classes.CkptAllow(L19_CKPT, "1.9.5"))
    (callback,) = tree["callbacks"].values()
    assert callback["dirpath"] == "fixtures/lightning_v1_9_ddp_llama/checkpoint"
    src = _lightning_ckpt(tmp_path / "abs", pathlib.PosixPath("/runs/llama/checkpoints"))
    with open(src / L19_CKPT, "rb") as f:
        tree = scan(f, label=L19_CKPT, allow=lightning_classes.CkptAllow(L19_CKPT, "1.9.5"))
    assert tree["callbacks"]["ModelCheckpoint{}"]["dirpath"] == "/runs/llama/checkpoints"
    assert ckpttool.audit(src, data=False).ok


def test_a_path_in_a_lightning_ckpt_that_is_not_text_is_refused_naming_the_file(cli, tmp_path):
    src = _lightning_ckpt(tmp_path / "src", _PathOf("runs", 7))
    before = tree_digest(src)
    out = tmp_path / "hf"
    assert_failed_cleanly(cli("merge", src, out), out, f"'{L19_CKPT}'", "a name that is a int, not a string")
    assert tree_digest(src) == before


# ---------------------------------------------------- diff: two layouts of one training run, and one that differs

#: (A, B) folders holding one run's weights in two layouts (same seed, same data, same steps)
ONE_RUN = {
    "ColossalAI 0.4.9 against 0.5.0: TP=2 .bin, the same seed (the release is no layout)": (
        "colossalai_v0_4_llama_tp2_bin/checkpoint", "colossalai_real_llama_tp2_bin/checkpoint"),
    "ColossalAI 0.5.0: TP=2 .bin against TP=2 x PP=2 safetensors": (
        "colossalai_real_llama_tp2_bin/checkpoint", "colossalai_real_llama_tp2_pp2_st/checkpoint"),
    "ColossalAI 0.4.9 MoE: EP=2 against PP=2 x EP=2 (each stage keeps its layers' rotary buffers)": (
        "colossalai_v0_4_mixtral_ep2_bin/checkpoint", "colossalai_v0_4_mixtral_pp2_ep2_bin/checkpoint"),
    "ColossalAI 0.5.0 MoE: EP=2 against PP=2 x EP=2": (
        "colossalai_real_mixtral_ep2_bin/checkpoint", "colossalai_real_mixtral_pp2_ep2_bin/checkpoint"),
    "megatron-core 0.16.1: torch_dist against legacy (TP=2 x PP=2)": (
        "megatron_v0_16_tp2_pp2/torch_dist", "megatron_v0_16_tp2_pp2/legacy"),
    "DeepSpeed 0.19.8 MoE bf16: ZeRO-1 against ZeRO-2 (EP=2)": (
        "deepspeed_moe_bf16_zero1_ep2/checkpoint", "deepspeed_moe_bf16_zero2_ep2/checkpoint"),
    "Lightning 1.9.5 against 2.6.6: DDP .ckpt, the same seed (the release is no layout)": (
        "lightning_v1_9_ddp_llama/checkpoint", "lightning_ddp_llama/checkpoint"),
}


@pytest.mark.parametrize("pair", list(ONE_RUN))
def test_diff_finds_two_layouts_of_one_run_equal(pair, cli):
    a, b = (FIXTURES / rel for rel in ONE_RUN[pair])
    result = cli("diff", a, b)
    assert result.exit_code == 0, result.output
    assert "equal: " in result.stdout and "tensors identical" in result.stdout


def test_diff_names_what_zero3_changed_against_zero2_of_one_release(cli):
    # one seed, one batch, the same steps: ZeRO-3 reduces its partitioned gradients in another order, so the
    # weights differ in their last bits; diff names each tensor, how many elements and by how much
    a, b = FIXTURES / "deepspeed_v0_16_zero2/checkpoint", FIXTURES / "deepspeed_v0_16_zero3/checkpoint"
    result = cli("diff", a, b)
    assert result.exit_code == 3, result.output
    assert "model.layers.1.self_attn.q_proj.weight: 679 of 1024 elements differ, max |A-B| = 4.692e-06" in result.stdout
    assert ("different: 0 tensors only in A, 0 only in B, 2 in both and equal, 19 in both and different (A has 21 "
            "tensors, B 21)") in result.stdout
