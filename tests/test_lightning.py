"""PyTorch Lightning checkpoints (``readers/lightning/``), and the one table of historical buffers
(``families/buffers.py``) that merge and audit share whatever the reader.

The ``lightning_*`` fixtures were written by Lightning itself (``fixtures/make_lightning.py`` under torchrun, gloo):
``DDPStrategy`` (one ``.ckpt`` file) and ``ModelParallelStrategy`` (a ``.ckpt`` DCP folder with ``meta.pt``) by
Lightning 2.6.6, ``DDPStrategy`` by Lightning 2.4.0 (``lightning_v2_4_*``).
``FSDPStrategy`` refuses a CPU; its sharded folder is made here the way Lightning's ``FSDPStrategy.save_checkpoint``
writes it (``torch.distributed.checkpoint.save`` of ``{"model": ..., "optimizer_0": ...}`` plus ``meta.pt``).
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import pickletools
import shutil
import zipfile
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

import ckpttool
from conftest import FIXTURES, assert_failed_cleanly, fixture_dir, load_output, tree_digest
from ckpttool.families.buffers import HISTORICAL
from ckpttool.readers import read_layout
from ckpttool.readers.lightning import classes
from test_fuzz import only_ckpt_errors
from test_fuzz_readers import VALUES, mutate, paths

LIGHTNING = sorted(p.name for p in FIXTURES.glob("lightning_*") if (p / "producer.json").is_file())
TOKENS = torch.tensor([[5, 17, 199, 3, 250, 42, 7, 100, 11, 128, 64, 2]])
CKPT = "epoch=0-step=1.ckpt"
ROTARY = "model.layers.{}.self_attn.rotary_emb.inv_freq"


#: transformers is imported here anyway: configs are described in this process (conftest.describe_inline)
pytestmark = pytest.mark.usefixtures("describe_inline")


@pytest.fixture(scope="module")
def reference() -> tuple[dict[str, torch.Tensor], Path]:
    """The DDP fixture's own full weights and config (the producer's ``state_dict()``)."""
    folder = fixture_dir("lightning_ddp_llama") / "reference"
    return load_file(folder / "model.safetensors"), folder / "config.json"


def lightning_ckpt(folder: Path, tensors: dict[str, torch.Tensor], config: Path, *, version: str = "2.6.6",
                   **extra: object) -> Path:
    """A ``.ckpt`` file as Lightning's ``Trainer.save_checkpoint`` writes it, the model under ``self.model``."""
    folder.mkdir(parents=True)
    state = collections.OrderedDict((f"model.{name}", t) for name, t in tensors.items())
    torch.save({"epoch": 0, "global_step": 1, "pytorch-lightning_version": version, "state_dict": state,
                "loops": {}, "callbacks": {}, "optimizer_states": [], "lr_schedulers": [], **extra}, folder / CKPT)
    shutil.copy(config, folder / "config.json")
    return folder


# ------------------------------------------------------------------------------------------ the real producers


def test_the_fixtures_are_lightnings_own():
    assert LIGHTNING == ["lightning_ddp_llama", "lightning_model_parallel_llama", "lightning_v1_9_ddp_llama",
                         "lightning_v2_4_ddp_llama"]
    for name in LIGHTNING:
        producer = json.loads((fixture_dir(name) / "producer.json").read_text())
        assert producer["versions"]["lightning"] in classes.RELEASES and producer["backend"] == "gloo (CPU)"


@pytest.mark.parametrize("name", LIGHTNING)
def test_a_lightning_checkpoint_merges_bit_for_bit_loads_strictly_and_audits(name, tmp_path):
    from transformers import AutoModelForCausalLM

    src = fixture_dir(name) / "checkpoint"
    version = json.loads((fixture_dir(name) / "producer.json").read_text())["versions"]["lightning"]
    before = tree_digest(src)
    result = ckpttool.merge(src, tmp_path / "hf")
    assert tree_digest(src) == before
    assert any(n.startswith(f"read '{CKPT}' (") and f"Lightning {version}" in n and "prefix 'model.' stripped" in n
               and "(training state, never a model)" in n for n in result.plan.notes), result.plan.notes
    got, want = load_output(tmp_path / "hf"), load_output(fixture_dir(name) / "reference")
    assert sorted(got) == sorted(want)  # the optimizer's state is no model tensor
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key
    ours, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.values()), info
    theirs = AutoModelForCausalLM.from_pretrained(fixture_dir(name) / "reference")
    with torch.no_grad():
        assert torch.equal(ours.eval()(TOKENS).logits, theirs.eval()(TOKENS).logits)
    report = ckpttool.audit(src, data=False)
    assert report.ok and report.format == "lightning" and not [f for f in report.findings if f.severity != "info"]


def test_a_sharded_ckpt_folder_is_a_source_itself_and_its_optimizer_is_never_read():
    folder = fixture_dir("lightning_model_parallel_llama") / "checkpoint" / CKPT
    layout = read_layout(folder)
    assert layout.format == "lightning" and sorted(layout.tensors) == sorted(
        load_output(fixture_dir("lightning_model_parallel_llama") / "reference"))
    assert layout.notes[0] == (
        f"read '{folder}' (ModelParallelStrategy's DCP folder, key 'state_dict'; Lightning 2.6.6): the "
        "LightningModule's 'model' attribute, its prefix 'model.' stripped from every name; not read: optimizer_0, "
        "21 tensors (training state, never a model)")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_fsdp_strategys_sharded_folder_is_read_under_its_model_key(reference, tmp_path):
    """FSDPStrategy(state_dict_type="sharded") saves {"model": state_dict, "optimizer_0": ...} with DCP, and the
    rest of the dict as meta.pt (lightning/pytorch/strategies/fsdp.py); Lightning refuses FSDP on a CPU."""
    import torch.distributed.checkpoint as dcp

    tensors, config = reference
    folder = tmp_path / "run" / CKPT
    state = {f"model.{n}": t for n, t in tensors.items()}
    dcp.save({"model": state, "optimizer_0": {"state": {k: {"momentum_buffer": torch.zeros_like(t)}
                                                        for k, t in state.items()}}},
             checkpoint_id=folder, no_dist=True)
    torch.save({"epoch": 0, "global_step": 1, "pytorch-lightning_version": "2.6.6", "loops": {}}, folder / "meta.pt")
    shutil.copy(config, tmp_path / "run" / "config.json")
    result = ckpttool.merge(tmp_path / "run", tmp_path / "hf")
    assert any("FSDPStrategy(state_dict_type='sharded')'s DCP folder, key 'model'" in n for n in result.plan.notes)
    got = load_output(tmp_path / "hf")
    assert sorted(got) == sorted(tensors) and all(torch.equal(got[k], tensors[k]) for k in tensors)


# ------------------------------------------------------------------------------------------ what it pickles


def _classes(path: Path) -> set[str]:
    with zipfile.ZipFile(path) as archive:
        data = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    found, strings = set(), []
    for op, arg, _ in pickletools.genops(data):
        if op.name.endswith("UNICODE"):
            strings.append(arg)
        elif op.name == "STACK_GLOBAL":
            found.add(".".join(strings[-2:]))
        elif op.name == "GLOBAL":
            found.add(arg.replace(" ", "."))
    return found


def test_the_table_lists_exactly_what_each_release_pickles():
    seen: dict[str, set[str]] = {}
    for name in LIGHTNING:
        version = json.loads((fixture_dir(name) / "producer.json").read_text())["versions"]["lightning"]
        for pickled in (fixture_dir(name) / "checkpoint").rglob("*"):
            if pickled.name in (CKPT, "meta.pt") and pickled.is_file():
                seen.setdefault(version, set()).update(_classes(pickled))
    for release in classes.RELEASES:
        listed = {f"{a.module}.{a.name}" for a in classes.TABLE if release in a.releases}
        assert listed == seen[release]


def test_a_class_no_release_writes_is_refused_naming_it_and_the_recorded_version(reference, tmp_path, cli):
    tensors, config = reference
    src = lightning_ckpt(tmp_path / "src", tensors, config, hyper_parameters={"args": argparse.Namespace(lr=0.1)})
    before = tree_digest(src)
    out = tmp_path / "hf"
    assert_failed_cleanly(cli("merge", src, out), out,
                          f"'{CKPT}': refused to unpickle: it asks for 'argparse.Namespace', which no Lightning",
                          "nothing was executed); the checkpoint records Lightning 2.6.6 (pytorch-lightning_version), "
                          "known.", "save plain values (config.to_dict(), vars(args))")
    assert tree_digest(src) == before
    newer = lightning_ckpt(tmp_path / "newer", tensors, config, version="9.1.0", hparams={"a": argparse.Namespace()})
    result = cli("audit", newer)
    assert result.exit_code == 1
    assert "records Lightning 9.1.0 (pytorch-lightning_version), not one ckpttool has run" in result.stderr


def test_several_checkpoints_or_attributes_are_refused_by_name(reference, tmp_path, cli):
    tensors, config = reference
    src = lightning_ckpt(tmp_path / "two", tensors, config)
    shutil.copy(src / CKPT, src / "last.ckpt")
    out = tmp_path / "hf"
    assert_failed_cleanly(cli("merge", src, out), out, f"'{src}': holds 2 Lightning checkpoints; ckpttool merges one",
                          f"  - '{src / CKPT}'", f"  - '{src / 'last.ckpt'}'")
    (src / "last.ckpt").unlink()
    (src / "link.ckpt").symlink_to(CKPT)  # save_last="link": one checkpoint under two names
    assert ckpttool.merge(src, out).plan.targets
    both = {**tensors, "teacher.proj.weight": torch.zeros(2, 2)}
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    state = collections.OrderedDict((n if n.startswith("teacher") else f"model.{n}", t) for n, t in both.items())
    torch.save({"pytorch-lightning_version": "2.6.6", "state_dict": state}, mixed / CKPT)
    shutil.copy(config, mixed / "config.json")
    assert_failed_cleanly(cli("merge", mixed, tmp_path / "out2"), tmp_path / "out2",
                          f"'{CKPT}': the LightningModule's state dict holds tensors under 2 attributes: 'model' "
                          "(21 tensors), 'teacher' (1 tensor)")


# ------------------------------------------------------------------------------------------ historical buffers


def _hf_bin(folder: Path, tensors: dict[str, torch.Tensor], config: Path) -> Path:
    """transformers 4.30's save_pretrained(safe_serialization=False): inv_freq was a persistent buffer then."""
    folder.mkdir(parents=True)
    torch.save(tensors, folder / "pytorch_model.bin")
    shutil.copy(config, folder / "config.json")
    return folder


@pytest.mark.parametrize("writer", ["lightning", "hf-bin"])
def test_a_historical_buffer_is_a_note_of_the_merge_and_a_warning_of_the_audit_in_the_same_words(
        writer, reference, tmp_path):
    tensors, config = reference
    old = {**tensors, **{ROTARY.format(i): torch.arange(8, dtype=torch.float32) for i in range(2)}}
    src = (lightning_ckpt if writer == "lightning" else _hf_bin)(tmp_path / "src", old, config)
    words = HISTORICAL[0].why
    assert words == "transformers 4.39 and older kept there: non-persistent, never weights"
    result = ckpttool.merge(src, tmp_path / "hf")
    assert (f"not read: 2 rotary buffers of the attention layers ({ROTARY.format(0)}, ...), which {words}"
            in result.plan.notes)
    assert sorted(load_output(tmp_path / "hf")) == sorted(tensors)
    report = ckpttool.audit(src, data=False)
    assert report.ok
    assert [(f.severity, f.code, f.tensor, f.message) for f in report.findings if f.severity != "info"] == [
        ("warning", "tensor-unexpected", ROTARY.format(i),
         f"'{ROTARY.format(i)}': a rotary buffer of the attention layers, which {words}; a merge does not read it")
        for i in range(2)]


def test_a_missing_rank_file_or_a_truncated_ckpt_fails_cleanly_naming_it(reference, tmp_path, cli):
    src = tmp_path / "run"
    shutil.copytree(fixture_dir("lightning_model_parallel_llama") / "checkpoint", src)
    (src / CKPT / "__1_0.distcp").unlink()
    out = tmp_path / "hf"
    assert_failed_cleanly(cli("merge", src, out), out, f"'{CKPT}/__1_0.distcp'")
    tensors, config = reference
    cut = lightning_ckpt(tmp_path / "cut", tensors, config)
    (cut / CKPT).write_bytes((cut / CKPT).read_bytes()[:50_000])
    before = tree_digest(cut)
    assert_failed_cleanly(cli("merge", cut, out), out, f"'{CKPT}': cannot read it as a torch.save archive")
    assert tree_digest(cut) == before


# ------------------------------------------------------------------------------------------ any values


_TREE: list = []


def _ddp_tree():
    """The object tree the DDP fixture's ``.ckpt`` pickle holds, as the reader sees it (read once)."""
    if not _TREE:
        from ckpttool.io.torch_save import scan

        with open(fixture_dir("lightning_ddp_llama") / "checkpoint" / CKPT, "rb") as f:
            _TREE.append(scan(f, label=CKPT, allow=classes.CkptAllow(CKPT, "2.6.6")))
    return _TREE[0]


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(mutations=st.lists(st.tuples(st.integers(0, 2**20), VALUES, st.booleans()), min_size=1, max_size=3))
def test_any_values_in_a_ckpts_pickle_are_read_or_refused_cleanly(mutations):
    """``None`` for the state dict, a number as a key, a tensor's shape of 2**62...: a CkptError or a plan."""
    from ckpttool.readers.lightning import reader

    tree = _ddp_tree()
    places = paths(tree)

    def scan(f, start=0, length=None, *, label, allow=None):
        obj = copy.deepcopy(tree)
        for where, value, rename in mutations:
            obj = mutate(obj, places[where % len(places)], value, rename)
        return obj

    with mock.patch.object(reader, "scan", scan):
        only_ckpt_errors(lambda: ckpttool.prepare(fixture_dir("lightning_ddp_llama") / "checkpoint"))


@pytest.mark.parametrize("other", ["lightning_model_parallel_llama", "lightning_v2_4_ddp_llama"])
def test_diff_finds_one_run_equal_across_strategies_and_releases(other, cli):
    """The same seed, data and step: DDP's .ckpt file against FSDP2's DCP folder, and Lightning 2.6.6 against 2.4.0."""
    result = cli("diff", fixture_dir("lightning_ddp_llama") / "checkpoint", fixture_dir(other) / "checkpoint")
    assert result.exit_code == 0, result.output
    assert "equal: 21 tensors identical" in result.stdout


def test_a_sharded_folders_meta_pt_is_read_through_the_same_allow_list(tmp_path, cli):
    src = tmp_path / "run"
    shutil.copytree(fixture_dir("lightning_model_parallel_llama") / "checkpoint", src)
    meta = {"pytorch-lightning_version": "2.6.6", "hyper_parameters": {"args": argparse.Namespace(lr=0.1)}}
    torch.save(meta, src / CKPT / "meta.pt")
    before = tree_digest(src)
    out = tmp_path / "hf"
    assert_failed_cleanly(cli("merge", src, out), out, f"'{CKPT}/meta.pt': refused to unpickle: it asks for "
                          "'argparse.Namespace'", "the checkpoint records Lightning 2.6.6")
    assert tree_digest(src) == before
