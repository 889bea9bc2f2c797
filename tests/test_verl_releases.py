"""verl itself, at the releases people run (issue 26): step directories written by each release's own
``FSDPCheckpointManager.save_checkpoint`` (``fixtures/make_verl_releases.py``: verl 0.3.0.post1 FSDP1, 0.5.0 FSDP1
and FSDP2, 0.9.1 FSDP2) merge bit for bit to the producer's gathered weights, load strictly with equal logits, audit
PASS, skip the optimizer and RNG files, and two layouts of one run diff equal."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import FIXTURES, assert_failed_cleanly, fixture_dir, load_output, tree_digest

import ckpttool
from ckpttool.readers import detect_format
from ckpttool.readers.verl import classes as verl_classes

pytestmark = pytest.mark.usefixtures("describe_inline")  # the module loads transformers models anyway

#: every fixture a released verl wrote itself (``verl_v<major>_<minor>_*``)
RELEASES = sorted(p.name for p in FIXTURES.glob("verl_v*") if (p / "producer.json").is_file())
INPUT_IDS = torch.tensor([[1, 5, 9, 42, 100, 200, 250, 7]])  # below every fixture's vocabulary (251, 257)


def _producer(name: str) -> dict:
    return json.loads((fixture_dir(name) / "producer.json").read_text())


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    outs = {}
    for name in RELEASES:
        src = fixture_dir(name) / "checkpoint"
        before = tree_digest(src)
        out = tmp_path_factory.mktemp(name) / "hf"
        ckpttool.merge(src, out)
        assert tree_digest(src) == before
        outs[name] = out
    return outs


def test_three_verl_releases_wrote_the_fixtures_with_fsdp1_and_fsdp2():
    producers = [_producer(n) for n in RELEASES]
    assert {p["versions"]["verl"] for p in producers} >= {"0.3.0.post1", "0.5.0", "0.9.1"}
    assert {p["fsdp_version"] for p in producers} == {1, 2}
    assert all("FSDPCheckpointManager.save_checkpoint" in p["producer"] for p in producers)
    assert tuple(verl_classes.VERL_RELEASES) == tuple(sorted({p["versions"]["verl"] for p in producers},
                                                           key=lambda v: [int(x) for x in v.split(".")[:3]]))


@pytest.mark.parametrize("name", RELEASES)
def test_a_verl_release_merges_bit_for_bit_to_the_gathered_weights(merged, name):
    assert detect_format(fixture_dir(name) / "checkpoint") == "verl"
    got, want = load_output(merged[name]), load_output(fixture_dir(name) / "reference")
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("name", RELEASES)
def test_a_verl_release_loads_strictly_with_the_reference_logits_and_audits_pass(merged, name):
    from transformers import AutoModelForCausalLM

    ours, info = AutoModelForCausalLM.from_pretrained(merged[name], output_loading_info=True)
    assert not any(info.values()), info
    reference = AutoModelForCausalLM.from_pretrained(fixture_dir(name) / "reference")
    with torch.no_grad():
        assert torch.equal(ours.eval()(INPUT_IDS).logits, reference.eval()(INPUT_IDS).logits)
    assert ckpttool.audit(fixture_dir(name) / "checkpoint", data=False).ok


def test_the_optimizer_and_rng_files_verl_writes_are_skipped(cli, tmp_path):
    name = next(n for n in RELEASES if n.startswith("verl_v0_3_"))
    result = cli("merge", fixture_dir(name) / "checkpoint", tmp_path / "out", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "skipped 8 optimizer/extra-state files" in result.stdout
    assert "parallel: fsdp=4" in result.stdout
    assert not (tmp_path / "out").exists()


def test_diff_finds_fsdp1_and_fsdp2_of_one_release_equal(cli):
    a, b = (fixture_dir(f"verl_v0_5_fsdp{v}_llama") / "checkpoint" for v in (1, 2))
    result = cli("diff", a, b)
    assert result.exit_code == 0, result.output
    assert "equal: " in result.stdout and "tensors identical" in result.stdout


def test_diff_finds_two_releases_of_one_seed_equal(cli):
    a, b = (fixture_dir(n) / "checkpoint" for n in ("verl_v0_3_fsdp1_llama", "verl_v0_9_fsdp2_llama"))
    result = cli("diff", a, b)
    assert result.exit_code == 0, result.output
    assert "tensors identical" in result.stdout


def _pickled(name: str) -> set[tuple[str, str]]:
    """The classes a fixture's rank files name that only the verl table accepts."""
    from test_versions_more import _pickled_classes

    return {tuple(q.rsplit(".", 1)) for q in _pickled_classes(fixture_dir(name))}


def test_the_verl_table_names_each_release_that_pickles_a_class_and_no_other():
    seen: dict[tuple[str, str], set[str]] = {}
    for name in RELEASES:
        producer = _producer(name)
        for key in _pickled(name):
            assert key in verl_classes.TABLE, f"{name}: {key}"
            if producer["versions"]["torch"].startswith("2.13"):
                seen.setdefault(key, set()).add(producer["versions"]["verl"])
    for key, entry in verl_classes.TABLE.items():
        assert set(entry.verl) == seen.get(key, set()), (key, entry.verl)


# ---------------------------------------------- verl's LoRA actor: base and adapter in one state dict (0.9 on)

LORA = "verl_v0_9_fsdp2_llama_lora"


def test_verls_lora_actor_is_fused_with_the_rank_and_alpha_of_its_lora_train_meta(cli, tmp_path):
    # the reference is PEFT's merge_and_unload of the producer's gathered weights (make_verl_releases.merged_lora)
    src = fixture_dir(LORA) / "checkpoint"
    assert json.loads((src / "lora_train_meta.json").read_text()) == {"r": 4, "lora_alpha": 8, "task_type": "CAUSAL_LM"}
    assert not (src / "adapter_config.json").exists()
    result = cli("merge", src, tmp_path / "hf", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "fused into 14 tensors (rank 4, scaling 2)" in result.stdout


def _lora_copy(tmp_path, meta: str):
    root = tmp_path / "step"
    shutil.copytree(fixture_dir(LORA) / "checkpoint", root)
    (root / "lora_train_meta.json").write_text(meta)
    return root


@pytest.mark.parametrize(("meta", "why"), [
    ('{"r": 0, "lora_alpha": 8}',
     "r = 0; expected a positive number (verl writes the LoRA actor's rank and alpha here)"),
    ('{"r": 4}', "lora_alpha = None; expected a positive number"),
    ("[4, 8]", "not a JSON object"),
    ("{r: 4", "not verl's JSON LoRA metadata"),
])
def test_a_bad_lora_train_meta_is_refused_naming_the_file(cli, tmp_path, meta, why):
    root = _lora_copy(tmp_path, meta)
    before = tree_digest(root)
    result = cli("merge", root, tmp_path / "hf")
    assert_failed_cleanly(result, tmp_path / "hf", f"'{root / 'lora_train_meta.json'}': {why}")
    assert tree_digest(root) == before


def test_a_lora_train_meta_whose_rank_is_not_the_adapters_is_refused(cli, tmp_path):
    root = _lora_copy(tmp_path, '{"r": 8, "lora_alpha": 16, "task_type": "CAUSAL_LM"}')
    before = tree_digest(root)
    result = cli("merge", root, tmp_path / "hf")
    assert_failed_cleanly(result, tmp_path / "hf", "'base_model.model.model.layers.0.mlp.down_proj.lora_A.default."
                          f"weight' has rank 4 but {root / 'lora_train_meta.json'} says r = 8 for "
                          "'model.layers.0.mlp.down_proj'")
    assert tree_digest(root) == before


def test_the_adapter_config_in_verls_lora_adapter_folder_is_used_before_lora_train_meta(cli, tmp_path):
    # verl 0.5's FSDP worker writes lora_adapter/adapter_config.json (asdict of its LoraConfig) beside the rank files
    # and no lora_train_meta.json: the fuse reads it there (here with another alpha, to see which file was read)
    root = _lora_copy(tmp_path, '{"r": 4, "lora_alpha": 8, "task_type": "CAUSAL_LM"}')
    (root / "lora_train_meta.json").unlink()
    (root / "lora_adapter").mkdir()
    (root / "lora_adapter" / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 4, "bias": "none", "use_dora": False,
         "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {}, "target_modules": "all-linear"}))
    result = cli("merge", root, tmp_path / "hf", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "fused into 14 tensors (rank 4, scaling 1)" in result.stdout


def test_an_unknown_class_in_a_real_verl_rank_file_is_refused_naming_the_verl_releases_known(cli, tmp_path):
    from test_versions_more import _repickle

    root = tmp_path / "step"
    shutil.copytree(fixture_dir("verl_v0_3_fsdp1_llama") / "checkpoint", root)
    _repickle(root / "model_world_size_4_rank_1.pt", b"placement_types\nShard\n", b"placement_types\nShaxd\n")
    before = tree_digest(root)
    result = cli("merge", root, tmp_path / "hf")
    transformers = json.loads((root / "huggingface" / "config.json").read_text())["transformers_version"]
    assert_failed_cleanly(  # verl 0.3 writes no fsdp_config.json: only the transformers version is recorded
        result, tmp_path / "hf", "'model_world_size_4_rank_1.pt': refused to unpickle: it asks for "
        "'torch.distributed.tensor.placement_types.Shaxd'", "the checkpoint records no verl or torch version (verl "
        f"writes neither); it records transformers_version {transformers} in 'huggingface/config.json'.",
        "in verl 0.3.0.post1, 0.5.0 and 0.9.1's FSDPCheckpointManager (FSDP1 and FSDP2;")
    assert tree_digest(root) == before
