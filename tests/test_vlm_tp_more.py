"""Falcon-H1 from a real torch FSDP2 producer (``fixtures/falcon_h1_fsdp2_dcp``, made by ``fixtures/make_hybrid.py``):
every layer a Mamba-2 mixer beside attention, then an MLP; its in-memory names are its on-disk names.

The merge equals ``save_pretrained`` bit for bit, loads strictly into ``FalconH1ForCausalLM`` with the reference's
logits and passes the audit; ``split --to dcp --fsdp 2`` gives back what FSDP2 saved (names, chunks, values); a
checkpoint that lost its Mamba-2 mixers is one root cause, not one per tensor. (``--tp`` is refused: transformers
has no tensor-parallel plan for Falcon-H1, so there is no producer's cut to follow; test_hybrid.py tests that.)

The transformers-TP producers of the other vision-language models (``fixtures/make_vlm_tp.py``) are not committed:
their cuts are those ``glm4v_hf_tp2``, ``llama4_hf_tp2`` and ``qwen3_next_hf_tp2`` already hold.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import ckpttool
from conftest import FIXTURES, fixture_dir, load_output, tree_digest
from test_hybrid import assert_bit_exact, logits_of

FALCON = "falcon_h1_fsdp2_dcp"

#: transformers is imported here anyway: configs are described in this process (conftest.describe_inline)
pytestmark = pytest.mark.usefixtures("describe_inline")


@pytest.fixture(scope="module")
def falcon_merged(tmp_path_factory):
    """The Falcon-H1 DCP merged once through the CLI (the source unchanged)."""
    from click.testing import CliRunner

    from ckpttool.cli import main

    src = fixture_dir(FALCON) / "checkpoint"
    out = tmp_path_factory.mktemp("falcon") / "out"
    before = tree_digest(src)
    result = CliRunner().invoke(main, ["merge", str(src), str(out)])
    assert result.exit_code == 0, result.output
    assert tree_digest(src) == before
    return out


def test_falcon_h1_merges_bit_exact_loads_strictly_with_the_references_logits_and_passes_the_audit(falcon_merged):
    reference = fixture_dir(FALCON) / "reference"
    assert_bit_exact(load_output(falcon_merged), load_output(reference))
    assert torch.equal(logits_of(falcon_merged), logits_of(reference))
    summary = json.loads((falcon_merged / "ckpttool-audit.json").read_text())["summary"]
    assert (summary["verdict"], summary["errors"], summary["warnings"]) == ("pass", 0, 0), summary


def test_the_audit_of_the_falcon_h1_dcp_passes_with_its_data():
    report = ckpttool.audit(fixture_dir(FALCON) / "checkpoint")
    assert report.data_checked
    assert not [f.message for f in report.findings if f.severity in ("error", "warning")]


def test_falcon_h1_split_to_dcp_gives_back_what_fsdp2_saved(falcon_merged, tmp_path, cli):
    from torch.distributed.checkpoint import FileSystemReader

    sys.path.insert(0, str(FIXTURES))
    import make_fixtures

    split = tmp_path / "split"
    result = cli("split", falcon_merged, split, "--to", "dcp", "--fsdp", "2")
    assert result.exit_code == 0, result.output
    source = fixture_dir(FALCON) / "checkpoint"
    got = make_fixtures.read_checkpoint_no_dist(split, hf=False)
    want = make_fixtures.read_checkpoint_no_dist(source, hf=False)
    assert_bit_exact(got, want)

    def chunks(path):
        meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        return {k: sorted((tuple(c.offsets), tuple(c.sizes)) for c in v.chunks) for k, v in meta.items()}

    assert chunks(split) == chunks(source)


def test_a_falcon_h1_without_its_mamba_mixers_is_one_root_cause(tmp_path, cli):
    """A converter that knows only attention drops the Mamba-2 mixer of every layer: one cause, not seven."""
    reference = fixture_dir(FALCON) / "reference"
    src = tmp_path / "seeded"
    shutil.copytree(reference, src)
    tensors = load_file(reference / "model.safetensors")
    save_file({n: t for n, t in tensors.items() if ".mamba." not in n}, src / "model.safetensors",
              metadata={"format": "pt"})
    before = tree_digest(src)
    result = cli("audit", src, "--json")
    assert result.exit_code == 3, result.output
    causes = json.loads(result.stdout)["causes"]
    assert [(c["code"], c["cause"]) for c in causes] == [(
        "tensor-missing",
        "the Mamba-2 mixer 'model.layers.{L}.mamba' is missing (falcon_h1: every layer holds one): 14 tensors in "
        "layers 0-1")]
    assert tree_digest(src) == before



# ------------------------------------------------------------------------------------------------
# Qwen3-VL (dense and MoE): split --to dcp --tp 2, the vision side whole, the language model as a Llama's
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ("qwen3_vl_fsdp2_dcp", "qwen3_vl_moe_fsdp2_dcp"))
def test_qwen3_vl_splits_over_tp_with_its_vision_tower_whole_and_merges_back_bit_for_bit(name, tmp_path):
    """No adapter serves Qwen3-VL; the default plan replicates the vision tower, its merger and deepstack mergers
    (transformers' plans leave them out: its TP=2 save of Qwen3-VL holds them whole) and cuts the language model as
    Qwen3-VL-MoE's text plan does (the routed experts replicated: ``ep`` shards them). Refused before (no placement
    known for ``model.visual.*``)."""
    from torch.distributed.checkpoint import FileSystemReader

    reference = fixture_dir(name) / "reference"
    ckpttool.split(reference, tmp_path / "dcp", tp=2)
    meta = FileSystemReader(str(tmp_path / "dcp")).read_metadata().state_dict_metadata
    chunks = {k: sorted((tuple(c.offsets), tuple(c.sizes)) for c in v.chunks) for k, v in meta.items()}
    visual = [k for k in chunks if k.startswith("model.visual.")]
    assert "model.visual.deepstack_merger_list.1.linear_fc2.weight" in visual
    assert all(len(chunks[k]) == 1 for k in visual)
    assert chunks["model.language_model.layers.0.self_attn.q_proj.weight"] == [((0, 0), (16, 32)), ((16, 0), (16, 32))]
    assert chunks["model.language_model.layers.0.self_attn.o_proj.weight"] == [((0, 0), (32, 16)), ((0, 16), (32, 16))]
    if name == "qwen3_vl_moe_fsdp2_dcp":
        assert chunks["model.language_model.layers.0.mlp.experts.gate_up_proj"] == [((0, 0, 0), (4, 16, 32))]  # [E, 2I, H]
    ckpttool.merge(tmp_path / "dcp", tmp_path / "hf", config=reference)
    assert_bit_exact(load_output(tmp_path / "hf"), load_output(reference))


# ------------------------------------------------------------------------------------------------
# verify without PIL: what a user reads when the checkpoint's image processor cannot be built
# ------------------------------------------------------------------------------------------------
@pytest.mark.skipif(importlib.util.find_spec("PIL") is not None, reason="PIL installed: the processor is built")
def test_verify_without_pil_says_how_to_get_the_checkpoints_own_image_processor():
    """transformers' image processors need PIL to decode images; without it the pixels are laid out from the config
    and the note names the missing library and the command that installs it (transformers' message spans two lines:
    the command used to be cut off after "with pip:")."""
    from ckpttool.verify.image import image_input

    checkpoint = fixture_dir("qwen3_vl_fsdp2_dcp") / "checkpoint"
    image = image_input(checkpoint, json.loads((checkpoint / "config.json").read_text()))
    assert image.source == (
        "a synthetic 16x16 image laid out from the config (no image processor: AutoImageProcessor requires the PIL "
        "library but it was not found in your environment. You can install it with pip: `pip install pillow`), "
        "4 image tokens")
