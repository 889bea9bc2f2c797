"""DeepSpeed across releases (fixtures/make_deepspeed_versions.py): checkpoints written by older DeepSpeed releases
(ZeRO-2, ZeRO-3, bf16, MoE with expert parallelism) merge to exactly that release's gathered fp32 master weights,
load strictly in transformers with the reference's logits, and audit PASS. The classes the pickles name are
accepted from a table naming the releases that write them; any other class is refused, naming it and the
DeepSpeed version the checkpoint records. DeepSpeed itself is not needed: the fixtures are committed."""

from __future__ import annotations

import json
import pickle
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, assert_failed_cleanly, load_output, tree_digest
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import ckpttool
from ckpttool.readers.deepspeed import classes

#: release prefix -> the DeepSpeed version that wrote its fixtures
RELEASES = {"v0_14": "0.14.5", "v0_16": "0.16.9", "v0_18": "0.18.0"}
CASES = ("zero2", "zero3", "bf16_zero1", "moe_zero2_ep2")
#: the cases each release was run with (0.18.0's bf16 ZeRO-1 run gave no fp32 master weights to gather: ZeRO-2 there)
MATRIX = {"v0_14": CASES, "v0_16": CASES, "v0_18": ("zero2", "zero3", "bf16_zero2", "moe_zero2_ep2")}
FIXTURE_NAMES = [f"deepspeed_{r}_{c}" for r, cases in MATRIX.items() for c in cases]
STEP = "global_step2"
INPUT_IDS = torch.tensor([[1, 5, 17, 249, 250, 42, 7, 3], [2, 140, 101, 100, 50, 51, 0, 9]])


def fixture(name: str) -> Path:
    path = FIXTURES / name
    assert (path / "checkpoint").is_dir(), f"fixture {name} missing: run fixtures/make_deepspeed_versions.py"
    return path


def test_every_release_fixture_is_listed_here():
    # a fixture made but not tested would pass silently: the folders on disk are exactly the matrix above
    on_disk = sorted(p.name for p in FIXTURES.glob("deepspeed_v0_*") if p.is_dir())
    assert on_disk == sorted(FIXTURE_NAMES)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_producer_json_names_the_release_and_torch(name):
    info = json.loads((fixture(name) / "producer.json").read_text())
    assert info["fixture"] == name
    assert info["versions"]["deepspeed"] == RELEASES[name.split("_", 1)[1][:5]]
    assert info["versions"]["torch"] == "2.13.0+cpu"


@pytest.fixture(scope="module", params=FIXTURE_NAMES)
def merged(request, tmp_path_factory) -> tuple[str, Path]:
    name = request.param
    out = tmp_path_factory.mktemp(name) / "hf"
    before = tree_digest(fixture(name))
    result = ckpttool.merge(fixture(name) / "checkpoint", out)
    assert result.format == ("deepspeed-moe" if "_moe_" in name else "deepspeed")
    assert tree_digest(fixture(name)) == before, "the source was modified"
    return name, out


def test_merge_equals_the_releases_gathered_fp32_master_weights_bit_for_bit(merged):
    name, out = merged
    got, want = load_output(out), load_output(fixture(name) / "reference")
    assert sorted(got) == sorted(want) and len(want) == (41 if "_moe_" in name else 21)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype == torch.float32, key
        assert torch.equal(got[key], tensor), f"{name}: {key} differs"


def test_merged_model_loads_strictly_with_the_references_logits(merged):
    name, out = merged
    ours, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info  # strict: nothing missing, unexpected or mismatched
    reference = AutoModelForCausalLM.from_pretrained(fixture(name) / "reference").eval()
    with torch.no_grad():
        assert torch.equal(ours.eval()(INPUT_IDS).logits, reference(INPUT_IDS).logits)  # tolerance: none


@pytest.mark.parametrize("name", [n for n in FIXTURE_NAMES if "_moe_" not in n and "bf16_zero1" not in n])
def test_the_reference_is_the_releases_own_zero_to_fp32_too(name):
    # the producer checked DeepSpeed's zero_to_fp32 of that release against the engine's gather, bit for bit
    assert json.loads((fixture(name) / "producer.json").read_text())["zero_to_fp32"] == (
        "equal, bit for bit, to safe_get_full_fp32_param")


@pytest.mark.parametrize("name", [n for n in FIXTURE_NAMES if "_moe_" in n])
def test_merged_mixtral_reproduces_the_releases_own_forward(name, tmp_path):
    ckpttool.merge(fixture(name) / "checkpoint", tmp_path / "hf")
    probe = load_file(fixture(name) / "deepspeed_logits.safetensors")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        logits = model(probe["input_ids"]).logits
    assert (logits - probe["logits"]).abs().max().item() < 1e-6  # the same routing, another order of float ops


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_audit_passes_on_the_source(name, cli):
    result = cli("audit", fixture(name) / "checkpoint", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["summary"]["verdict"] == "pass"


# ------------------------------------------------------------------------------ the allow-list and its versions

def test_every_allowed_class_names_the_releases_that_write_it():
    # a class the matrix has seen lists its exact releases; one it has not says where it comes from
    for (module, name), entry in classes.ALLOW.entries.items():
        assert set(entry.releases) <= set(classes.MATRIX), f"{module}.{name}: {entry.releases}"
        assert entry.where, f"{module}.{name}: no word on what pickles it"
    assert set(RELEASES.values()) | {"0.19.8"} == set(classes.MATRIX)


def _globals(path: Path) -> set[str]:
    """The classes a torch.save file's pickle names (read with pickletools: nothing is built)."""
    import pickletools

    archive = zipfile.ZipFile(path)
    data = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    found, strings = set(), []
    for op, arg, _ in pickletools.genops(data):
        if op.name == "GLOBAL":
            found.add(arg.replace(" ", "."))
        elif op.name == "STACK_GLOBAL":
            found.add(".".join(strings[-2:]))
        if isinstance(arg, str):
            strings.append(arg)
    return {g for g in found if not g.startswith(("torch.", "collections.OrderedDict"))}


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("deepspeed_*") if (p / "producer.json").is_file()))
def test_the_table_lists_each_class_with_the_release_that_pickled_it(name):
    # every DeepSpeed fixture, the 0.19.8 ones included: what its pickles name is in the table under its release
    version = json.loads((fixture(name) / "producer.json").read_text())["versions"]["deepspeed"]
    pickled = set().union(*(_globals(p) for p in (fixture(name) / "checkpoint").rglob("*.pt")))
    for qualified in pickled:
        module, _, cls = qualified.rpartition(".")
        assert (module, cls) in classes.ALLOW, qualified
        assert version in classes.ALLOW.entries[(module, cls)].releases, f"{qualified} is pickled by {version}"


def _repickle(path: Path, old: bytes, new: bytes) -> None:
    """Rewrite the pickle of a torch.save file with ``old`` replaced by ``new`` (same length keeps offsets)."""
    with zipfile.ZipFile(path) as archive:
        entries = [(info, archive.read(info)) for info in archive.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for info, data in entries:
            archive.writestr(info, data.replace(old, new) if info.filename.endswith("data.pkl") else data)


@pytest.mark.parametrize("release", list(RELEASES))
def test_an_unknown_class_is_refused_naming_it_and_the_recorded_ds_version(release, cli, copy_fixture, tmp_path):
    # a release pickling a class the table does not list: refused before anything is built, naming the class and
    # the DeepSpeed version the model states record (read from the pickle's opcodes, nothing unpickled)
    root = copy_fixture(f"deepspeed_{release}_zero2")
    optim = root / STEP / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    _repickle(optim, b"loss_scaler\nLossScaler", b"loss_scaler\nNewtScaler")
    before = tree_digest(root)
    result = cli("merge", root, tmp_path / "hf")
    assert_failed_cleanly(result, tmp_path / "hf", f"'{STEP}/zero_pp_rank_0_mp_rank_00_optim_states.pt'",
                          "'deepspeed.runtime.fp16.loss_scaler.NewtScaler'",
                          f"DeepSpeed {RELEASES[release]} (ds_version in '{STEP}/mp_rank_00_model_states.pt')",
                          "nothing was executed")
    assert tree_digest(root) == before


def test_an_unknown_class_in_the_model_states_names_the_version_they_record(cli, copy_fixture, tmp_path):
    # releases before 0.19 pickle the model states' sparse_tensor_module_names as Python 2's '__builtin__.set'
    root = copy_fixture("deepspeed_v0_16_zero2")
    _repickle(root / STEP / "mp_rank_00_model_states.pt", b"__builtin__\nset", b"__builtin__\nsex")
    result = cli("merge", root, tmp_path / "hf")
    assert_failed_cleanly(result, tmp_path / "hf", f"'{STEP}/mp_rank_00_model_states.pt': refused to unpickle",
                          "'__builtin__.sex'", f"DeepSpeed 0.16.9 (ds_version in '{STEP}/mp_rank_00_model_states.pt')")


def test_an_unknown_class_without_a_recorded_version_says_so(cli, copy_fixture, tmp_path):
    root = copy_fixture("deepspeed_v0_16_zero2")
    for path in (root / STEP).glob("*.pt"):
        _repickle(path, b"ds_version", b"ds_versioX")  # no version recorded anywhere any more
    _repickle(root / STEP / "zero_pp_rank_1_mp_rank_00_optim_states.pt", b"loss_scaler\nLossScaler",
              b"loss_scaler\nNewtScaler")
    result = cli("merge", root, tmp_path / "hf")
    assert_failed_cleanly(result, tmp_path / "hf", "'deepspeed.runtime.fp16.loss_scaler.NewtScaler'",
                          "the checkpoint records no ds_version")


def test_a_moe_checkpoint_without_param_shapes_needs_every_optimizer_file(cli, copy_fixture, tmp_path):
    # before 0.19 the MoE model states record no param_shapes: the order comes from every file's param_slice_mappings
    root = copy_fixture("deepspeed_v0_16_moe_zero2_ep2")
    (root / STEP / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    before = tree_digest(root)
    result = cli("merge", root, tmp_path / "hf")
    assert_failed_cleanly(result, tmp_path / "hf", f"'{STEP}/zero_pp_rank_1_mp_rank_00_optim_states.pt': missing",
                          "records no param_shapes", "each one is needed")
    assert tree_digest(root) == before


def test_the_version_is_read_without_unpickling(tmp_path):
    # ds_version is found in the opcodes: a pickle whose other parts would run code is never executed
    class Boom:
        def __reduce__(self):
            return (exec, ("raise SystemExit('executed')",))

    for protocol in (2, 4):
        data = pickle.dumps({"boom": Boom(), "ds_version": "0.14.5"}, protocol=protocol)
        assert classes.version_in_pickle(data) == "0.14.5"
        with zipfile.ZipFile(tmp_path / "x.pt", "w", zipfile.ZIP_STORED) as archive:
            archive.writestr("x/data.pkl", data)
        assert classes.recorded_version(tmp_path, "x.pt") == "0.14.5"
    version = "0.16.9"  # one string object stored twice: the second time a memo fetch
    assert classes.version_in_pickle(pickle.dumps({"a": version, "ds_version": version}, protocol=2)) == version
    assert classes.version_in_pickle(pickle.dumps({"ds_version": "rm -rf /"}, protocol=2)) is None
    assert classes.version_in_pickle(b"garbage") is None
