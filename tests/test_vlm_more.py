"""More vision-language models from torch FSDP2 + DCP (fixtures/make_vlm.py): Gemma 3 with vision (the LLaVA family's
renames, a tied head), Qwen3-VL (deepstack mergers) and Qwen3-VL-MoE (stacked experts). Each merges into exactly
what ``save_pretrained`` writes, loads strictly into the class ``config.architectures`` names and gives the
reference's logits on text and on an image."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
# imported with the module: configs are then described in this process (no subprocess importing it per config)
from transformers import AutoModelForImageTextToText

from ckpttool.families import adapter_for, map_from_hf, tied_on_disk
from ckpttool.families.rules import cut
from ckpttool.layout.layout import TensorLayout
from ckpttool.model.architecture import model_info
from ckpttool.model.config_file import read_config
from conftest import FIXTURES, assert_failed_cleanly, fixture_dir, load_output, tree_digest

#: fixture -> (the class transformers builds, the adapter serving it, a name only its on-disk layout has)
CASES = {
    "gemma3_vl_fsdp2_dcp": ("Gemma3ForConditionalGeneration", "llava", "vision_tower.encoder.layers.1.mlp.fc2.weight"),
    "qwen3_vl_fsdp2_dcp": ("Qwen3VLForConditionalGeneration", "qwen3_vl",
                           "model.visual.deepstack_merger_list.1.linear_fc2.weight"),
    "qwen3_vl_moe_fsdp2_dcp": ("Qwen3VLMoeForConditionalGeneration", "qwen3_vl_moe",
                               "model.language_model.layers.1.mlp.experts.gate_up_proj"),
}

TINY_TEXT = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=300)
TINY_SIGLIP = dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                   num_attention_heads=2, image_size=16, patch_size=4)
#: LLaVA-family configs transformers aliases to "llava": the adapter's renames must give their save_pretrained names
LLAVA_FAMILY = {
    "llava": dict(model_type="llava", text_config=TINY_TEXT, image_token_index=299, tie_word_embeddings=False,
                  vision_config=dict(TINY_SIGLIP, model_type="clip_vision_model")),
    "paligemma": dict(model_type="paligemma", text_config=dict(TINY_TEXT, model_type="gemma", head_dim=16),
                      vision_config=TINY_SIGLIP, image_token_index=299),
    "mistral3": dict(model_type="mistral3", text_config=dict(TINY_TEXT, model_type="mistral"), image_token_index=299,
                     vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, image_size=16, patch_size=4, head_dim=8)),
}


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    """Each fixture merged once, by the CLI: name -> (output folder, its terminal output)."""
    from click.testing import CliRunner

    from ckpttool.cli import main

    done = {}
    for name in CASES:
        out = tmp_path_factory.mktemp(name) / "merged"
        result = CliRunner().invoke(main, ["merge", str(fixture_dir(name) / "checkpoint"), str(out)],
                                    catch_exceptions=False)
        assert result.exit_code == 0, result.output
        done[name] = (out, result.output)
    return done


def _info(name: str):
    return model_info(read_config(fixture_dir(name) / "checkpoint" / "config.json"))


@pytest.mark.parametrize("name", sorted(LLAVA_FAMILY))
def test_one_adapter_serves_the_llava_family_as_transformers_reverts_it(name):
    """transformers' conversion mapping shares one entry across LLaVA, PaliGemma, Mistral 3 and Gemma 3: the
    adapter's renames, run forwards on the in-memory names, give exactly its reverted on-disk names and shapes."""
    info = model_info(LLAVA_FAMILY[name])
    family = adapter_for(info)
    assert info.family == "llava" and family.name == "llava"
    forward = {}
    for fqn, shape in info.memory_shapes.items():
        if fqn not in info.tied:
            (spec,) = cut(TensorLayout(fqn, shape, "", ()), fqn, family.rules)
            forward[spec.name] = spec.shape
    assert forward == dict(info.disk_shapes)


def test_gemma3_tied_head_is_named_on_disk_as_its_partner_is():
    """The tied head is dropped under its on-disk name (``language_model.lm_head.weight``) and split gives it back
    from the embedding's on-disk name."""
    info = _info("gemma3_vl_fsdp2_dcp")
    tied = tied_on_disk(info)
    assert tied["language_model.lm_head.weight"] == "language_model.model.embed_tokens.weight"
    assert tied["lm_head.weight"] == "language_model.model.embed_tokens.weight"
    back = {t.name: [s.source for s in t.slices] for t in map_from_hf(info)}
    assert back["lm_head.weight"] == ["language_model.model.embed_tokens.weight"]
    assert back["model.vision_tower.encoder.layers.0.self_attn.q_proj.weight"] == [
        "vision_tower.encoder.layers.0.self_attn.q_proj.weight"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_merge_is_bit_exact_with_save_pretrained(merged, name):
    klass, family, on_disk = CASES[name]
    out, output = merged[name]
    ours, want = load_output(out), load_output(fixture_dir(name) / "reference")
    assert sorted(ours) == sorted(want) and on_disk in ours
    for fqn, tensor in want.items():
        assert ours[fqn].dtype == tensor.dtype and torch.equal(ours[fqn], tensor), fqn
    assert "audit: PASS" in output
    assert ("family:   gemma3 as llava (its rules)" if family == "llava" else
            f"family:   {family} (names as transformers saves them)") in output
    assert (out / "preprocessor_config.json").read_bytes() == (
        fixture_dir(name) / "checkpoint" / "preprocessor_config.json").read_bytes()
    assert _info(name).architecture == klass


def _image_inputs(model) -> dict[str, torch.Tensor]:
    """A 16x16 synthetic image (4x4 patches of 4 pixels) and a prompt holding its 4 image tokens, as the model's
    processor would give them: Gemma 3 a pixel grid, Qwen3-VL its flattened temporal patches and their grid."""
    cfg = model.config
    gen = torch.Generator().manual_seed(0)
    if cfg.model_type == "gemma3":
        image = [cfg.boi_token_index] + [cfg.image_token_index] * cfg.mm_tokens_per_image + [cfg.eoi_token_index]
        return dict(input_ids=torch.tensor([[1, 5, *image, 9, 2]]),
                    pixel_values=torch.randn(1, 3, 16, 16, generator=gen))
    image = [cfg.vision_start_token_id] + [cfg.image_token_id] * 4 + [cfg.vision_end_token_id]
    ids = torch.tensor([[1, 5, *image, 9, 2]])
    return dict(input_ids=ids, mm_token_type_ids=(ids == cfg.image_token_id).int(),
                pixel_values=torch.randn(16, 3 * 2 * 4 * 4, generator=gen), image_grid_thw=torch.tensor([[1, 4, 4]]))


@pytest.mark.parametrize("name", sorted(CASES))
def test_merged_loads_strictly_and_gives_the_references_logits_on_text_and_image(merged, name):
    out, _ = merged[name]
    ours, loading = AutoModelForImageTextToText.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    assert type(ours).__name__ == CASES[name][0]
    assert not any(loading[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), loading
    reference = AutoModelForImageTextToText.from_pretrained(fixture_dir(name) / "reference", dtype=torch.float32)
    text = torch.tensor([[1, 5, 9, 17, 30, 2]])
    inputs = _image_inputs(ours)
    blind = dict(inputs, pixel_values=torch.zeros_like(inputs["pixel_values"]))
    with torch.no_grad():
        assert torch.equal(ours(input_ids=text).logits, reference(input_ids=text).logits)
        got, want, dark = ours(**inputs).logits, reference(**inputs).logits, ours(**blind).logits
    assert torch.equal(got, want)
    assert not torch.equal(got, dark)  # the image went through the vision tower


def test_gemma3_split_to_dcp_gives_back_what_fsdp2_saved(merged, tmp_path, cli):
    """The way back: ``split --to dcp --fsdp 2`` of the merged Gemma 3 gives FSDP2's names (the tied head from the
    embedding), chunks and values."""
    from torch.distributed.checkpoint import FileSystemReader

    sys.path.insert(0, str(FIXTURES))
    import make_fixtures

    out, _ = merged["gemma3_vl_fsdp2_dcp"]
    split = tmp_path / "split"
    result = cli("split", out, split, "--to", "dcp", "--fsdp", "2")
    assert result.exit_code == 0, result.output
    source = fixture_dir("gemma3_vl_fsdp2_dcp") / "checkpoint"
    got = make_fixtures.read_checkpoint_no_dist(split, hf=False)
    want = make_fixtures.read_checkpoint_no_dist(source, hf=False)
    assert sorted(got) == sorted(want)
    assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)

    def chunks(path):
        meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        return {k: sorted((tuple(c.offsets), tuple(c.sizes)) for c in v.chunks) for k, v in meta.items()}

    assert chunks(split) == chunks(source)


def test_a_gemma3_checkpoint_without_its_projector_is_refused_naming_it(tmp_path, cli):
    """A training script that saved everything but the multi-modal projector: merge refuses it (exit 1), naming the
    two missing tensors under their on-disk names; nothing is written, the source is untouched."""
    import shutil

    import torch.distributed.checkpoint as dcp

    sys.path.insert(0, str(FIXTURES))
    import make_fixtures

    source = fixture_dir("gemma3_vl_fsdp2_dcp") / "checkpoint"
    state = make_fixtures.read_checkpoint_no_dist(source, hf=False)
    dropped = tmp_path / "dropped"
    dcp.save({k: v for k, v in state.items() if not k.startswith("model.multi_modal_projector.")},
             checkpoint_id=str(dropped), no_dist=True)
    shutil.copy(source / "config.json", dropped)
    before = tree_digest(dropped)
    out = tmp_path / "out"
    result = cli("merge", dropped, out)
    assert_failed_cleanly(result, out, "does not match its gemma3 config (2 problems)",
                          "'multi_modal_projector.mm_input_projection_weight': expected by the config but not in "
                          "the checkpoint",
                          "'multi_modal_projector.mm_soft_emb_norm.weight': expected by the config but not in the "
                          "checkpoint")
    assert tree_digest(dropped) == before


# --- issue 30: a transformers-distributed save of a VLM -----------------------------------------------------------

HF_TP2 = "qwen2_5_vl_hf_tp2"


def test_a_transformers_distributed_vlm_save_merges_bit_exact(tmp_path, cli):
    """transformers' own TP (``DistributedConfig(tp_size=2)``) + ``save_pretrained(distributed_checkpoint=True)`` of
    a Qwen2.5-VL: the config is read next to the shards and the merge is what ``save_pretrained`` writes."""
    out = tmp_path / "out"
    result = cli("merge", fixture_dir(HF_TP2) / "checkpoint", out)
    assert result.exit_code == 0, result.output
    assert "(hf-distributed)" in result.output and "family:   qwen2_5_vl (its rules)" in result.output
    ours, want = load_output(out), load_output(fixture_dir(HF_TP2) / "reference")
    assert sorted(ours) == sorted(want)
    assert all(ours[k].dtype == want[k].dtype and torch.equal(ours[k], want[k]) for k in want)
    assert (out / "preprocessor_config.json").is_file()


def test_a_distributed_save_whose_config_transformers_cannot_build_names_why_not_a_missing_config(tmp_path, cli):
    """The refusal of issue 30 said "put config.json in or next to the checkpoint" while it was there: a config of
    a model type transformers does not know (remote code, here ``internvl_chat``) now says so, for merge and audit
    (exit 1, nothing written, the source untouched)."""
    import json
    import shutil

    source = tmp_path / "checkpoint"
    shutil.copytree(fixture_dir(HF_TP2) / "checkpoint", source)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps(dict(config, model_type="internvl_chat")))
    before = tree_digest(source)
    out = tmp_path / "out"
    needles = (f"'{source}': transformers distributed checkpoints record no global shapes; ckpttool takes them from "
               f"the model config, and '{source / 'config.json'}' is there, but transformers ",
               "has no causal-LM or image-text-to-text class for model_type 'internvl_chat', or does not know that "
               "model type (a model of remote code)", "Pass --config with the config of a model transformers builds")
    result = cli("merge", source, out)
    assert_failed_cleanly(result, out, *needles)
    assert "Put config.json in" not in result.output
    audit = cli("audit", source)
    assert audit.exit_code == 1, audit.output
    assert all(n in audit.output for n in needles) and "Traceback" not in audit.output
    assert tree_digest(source) == before


# --- verify with an image ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["gemma3_vl_fsdp2_dcp", "qwen3_vl_moe_fsdp2_dcp"])
def test_verify_runs_text_and_an_image_against_the_dcp_source(merged, name, cli):
    """``verify`` of a VLM: the class ``config.architectures`` names, a text forward and a second one with a small
    synthetic image (laid out from the config here: this environment has no PIL for the image processor), each
    compared with the reference's."""
    out, _ = merged[name]
    result = cli("verify", out, "--against", fixture_dir(name) / "checkpoint", "--json")
    assert result.exit_code == 0, result.output
    doc = __import__("json").loads(result.stdout)
    assert doc["output"]["architecture"] == CASES[name][0] and doc["status"] == "ok"
    assert "synthetic 16x16 image" in doc["image_from"] and doc["image_from"].endswith("4 image tokens")
    assert doc["comparison"]["max_abs_diff"] == 0 and doc["image_comparison"]["max_abs_diff"] == 0


def test_verify_finds_a_damaged_vision_tower_that_text_alone_misses(merged, tmp_path, cli):
    """One vision weight changed (the patch embedding of Qwen3-VL): text logits stay equal, the image's differ, and
    verify fails (exit 3) saying so; the output folder is not modified."""
    import shutil

    from safetensors.torch import load_file, save_file

    out, _ = merged["qwen3_vl_fsdp2_dcp"]
    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged)
    weights = load_file(damaged / "model.safetensors")
    weights["model.visual.patch_embed.proj.weight"] = weights["model.visual.patch_embed.proj.weight"].flip(0)
    save_file(weights, damaged / "model.safetensors", metadata={"format": "pt"})
    before = tree_digest(damaged)
    result = cli("verify", damaged, "--against", out)
    assert result.exit_code == 3, result.output
    assert "max |Δlogit| 0 (0 of scale" in result.output  # the text alone: equal
    assert "  - differs with an image: max |Δlogit| is " in result.output and "failed: " in result.output
    assert tree_digest(damaged) == before


def test_verify_of_a_vlm_without_a_known_image_layout_says_it_ran_text_only(tmp_path):
    """A vision-language config of a family whose image layout ckpttool does not know: a note, text only."""
    from ckpttool.verify.image import image_input

    assert image_input(tmp_path, {"model_type": "idefics3", "vision_config": {}}) == (
        "idefics3 is verified on text only: ckpttool does not know how its images are laid out")
    assert image_input(tmp_path, {"model_type": "llama"}) is None
    note = image_input(tmp_path, {"model_type": "qwen3_vl", "vision_config": {"patch_size": 4}})
    assert note == "qwen3_vl is verified on text only: its config does not give the image layout ('spatial_merge_size')"


@pytest.mark.skipif(importlib.util.find_spec("PIL") is None, reason="no PIL: transformers builds no image processor")
def test_verify_takes_the_image_through_the_checkpoints_own_processor_where_it_can_be_built(merged, cli):
    """With PIL installed, the image processor is built from the copied ``preprocessor_config.json`` (no hub, no
    remote code) and its pixels are fed (skipped where PIL is absent, as in the project's venv)."""
    out, _ = merged["qwen3_vl_fsdp2_dcp"]
    result = cli("verify", out, "--against", fixture_dir("qwen3_vl_fsdp2_dcp") / "checkpoint")
    assert result.exit_code == 0, result.output
    assert "image:     a synthetic 16x16 image through Qwen2VLImageProcessor" in result.output
    assert "with the image: top-1 agreement 100.0%; max |Δlogit| 0 (0 of scale)" in result.output
