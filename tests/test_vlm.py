"""Vision-language models: a Qwen2.5-VL saved by torch FSDP2 + DCP (fixtures/make_vlm.py) merges into what
``save_pretrained`` writes (both towers under their on-disk names), loads strictly into its image-text-to-text class
and gives the reference's logits on text and on an image; its processor files come along; a checkpoint without its
vision tower is refused, naming the missing tensors."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from ckpttool.families import adapter_for, map_from_hf
from ckpttool.families.rules import cut
from ckpttool.layout.layout import TensorLayout
from ckpttool.model.architecture import model_info
from ckpttool.model.config_file import read_config
from ckpttool.writers.destination import EXTRA_FILES
from conftest import FIXTURES, assert_failed_cleanly, fixture_dir, load_output, tree_digest

NAME = "qwen2_5_vl_fsdp2_dcp"
PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json",
                   "chat_template.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def info():
    return model_info(read_config(fixture_dir(NAME) / "checkpoint" / "config.json"))


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    from click.testing import CliRunner

    from ckpttool.cli import main

    out = tmp_path_factory.mktemp("vlm") / "merged"
    result = CliRunner().invoke(main, ["merge", str(fixture_dir(NAME) / "checkpoint"), str(out)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out, result.output


def test_both_towers_are_expected_from_the_image_text_to_text_class(info):
    """transformers has no causal LM for Qwen2.5-VL: the expectations come from its ...ForConditionalGeneration,
    with the vision tower and merger, in memory as the model holds them and on disk as save_pretrained writes."""
    assert info.architecture == "Qwen2_5_VLForConditionalGeneration"
    assert "model.visual.patch_embed.proj.weight" in info.memory_shapes
    assert "model.language_model.layers.0.self_attn.q_proj.weight" in info.memory_shapes
    assert "visual.merger.mlp.0.weight" in info.disk_shapes and "model.layers.1.mlp.up_proj.weight" in info.disk_shapes
    assert not any(n.startswith(("model.visual.", "model.language_model.")) for n in info.disk_shapes)


def test_the_adapter_rules_give_transformers_on_disk_names_and_back(info):
    """The family adapter's renames, run forwards, turn every in-memory name into transformers' own reverted name
    with its shape (nothing left over); run backwards (split), every in-memory tensor is one on-disk tensor."""
    family = adapter_for(info)
    assert family.name == "qwen2_5_vl"
    forward = {}
    for name, shape in info.memory_shapes.items():
        (spec,) = cut(TensorLayout(name, shape, "", ()), name, family.rules)
        forward[spec.name] = spec.shape
    assert forward == dict(info.disk_shapes)
    back = {t.name: [s.source for s in t.slices] for t in map_from_hf(info)}
    assert back["model.visual.blocks.0.attn.qkv.weight"] == ["visual.blocks.0.attn.qkv.weight"]
    assert back["model.language_model.norm.weight"] == ["model.norm.weight"]


def test_merge_is_bit_exact_with_save_pretrained_and_copies_the_processor(merged):
    out, output = merged
    ours, want = load_output(out), load_output(fixture_dir(NAME) / "reference")
    assert sorted(ours) == sorted(want)
    for name, tensor in want.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name
    assert "family:   qwen2_5_vl" in output and "audit: PASS" in output
    for name in ("preprocessor_config.json", "chat_template.jinja", "tokenizer.json"):
        assert (out / name).read_bytes() == (fixture_dir(NAME) / "checkpoint" / name).read_bytes()
    summary = json.loads((out / "ckpttool-audit.json").read_text())["summary"]
    assert summary["verdict"] == "pass" and summary["adapter"] == "qwen2_5_vl (its rules)"


def test_processor_files_are_extra_files():
    """Copied with the tokenizer (same link rules: :data:`EXTRA_FILES`), and owned by a merge's output (--force)."""
    assert set(PROCESSOR_FILES) <= set(EXTRA_FILES)


def test_merged_loads_strictly_and_gives_the_references_logits_on_text_and_image(merged):
    from transformers import AutoModelForImageTextToText

    out, _ = merged
    ours, loading = AutoModelForImageTextToText.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    assert type(ours).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert not any(loading[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), loading
    reference = AutoModelForImageTextToText.from_pretrained(fixture_dir(NAME) / "reference", dtype=torch.float32)
    text = torch.tensor([[1, 5, 9, 17, 30, 2]])
    # one 16x16 image: a 4x4 grid of 4x4 patches (temporal 2), merged 2x2 into 4 image tokens
    cfg = ours.config
    image_tokens = [cfg.vision_start_token_id] + [cfg.image_token_id] * 4 + [cfg.vision_end_token_id]
    ids = torch.tensor([[1, 5, *image_tokens, 9, 2]])
    pixels = torch.randn(16, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(0))
    grid = torch.tensor([[1, 4, 4]])
    with torch.no_grad():
        assert torch.equal(ours(input_ids=text).logits, reference(input_ids=text).logits)
        got = ours(input_ids=ids, pixel_values=pixels, image_grid_thw=grid).logits
        want = reference(input_ids=ids, pixel_values=pixels, image_grid_thw=grid).logits
        blind = ours(input_ids=ids, pixel_values=torch.zeros_like(pixels), image_grid_thw=grid).logits
    assert torch.equal(got, want)
    assert not torch.equal(got, blind)  # the image went through the vision tower


def _without_vision_tower(tmp_path: Path) -> Path:
    """The fixture re-saved with DCP (one process) without any ``model.visual.*`` tensor: a training script that
    saved only the language model's state."""
    import torch.distributed.checkpoint as dcp

    sys.path.insert(0, str(FIXTURES))
    import make_fixtures

    source = fixture_dir(NAME) / "checkpoint"
    state = make_fixtures.read_checkpoint_no_dist(source, hf=False)
    dropped = tmp_path / "dropped" / "checkpoint"
    dcp.save({k: v for k, v in state.items() if not k.startswith("model.visual.")}, checkpoint_id=str(dropped),
             no_dist=True)
    shutil.copy(source / "config.json", dropped)
    return dropped


def test_a_checkpoint_without_its_vision_tower_is_refused_naming_the_missing_tensors(tmp_path, cli):
    source = _without_vision_tower(tmp_path)
    before = tree_digest(source)
    out = tmp_path / "out"
    result = cli("merge", source, out)
    assert_failed_cleanly(result, out, "does not match its qwen2_5_vl config (30 problems)",
                          "'visual.patch_embed.proj.weight': expected by the config but not in the checkpoint",
                          "'visual.merger.mlp.2.weight': expected by the config but not in the checkpoint")
    assert tree_digest(source) == before
    assert tree_digest(source) == before


def test_the_audit_gives_one_root_cause_for_a_missing_vision_tower(tmp_path, cli):
    source = _without_vision_tower(tmp_path)
    audit = cli("audit", source)
    assert audit.exit_code == 3, audit.output
    assert ("tensor-missing  the vision side 'visual' of a vision-language model is missing (30 tensors); the "
            "config declares it") in audit.output
    report = cli("audit", "--json", source)
    causes = json.loads(report.stdout)["causes"]
    assert len(causes) == 1 and causes[0]["code"] == "tensor-missing"
    assert "visual.merger.mlp.2.weight" in causes[0]["tensors"] and len(causes[0]["tensors"]) == 30


def test_split_to_dcp_gives_back_what_fsdp2_saved(merged, tmp_path, cli):
    """``split --to dcp --fsdp 2`` of the merged model: the producer's in-memory names, values bit for bit and the
    chunks FSDP2 made on 2 ranks; the processor files come along."""
    from torch.distributed.checkpoint import FileSystemReader

    sys.path.insert(0, str(FIXTURES))
    import make_fixtures

    out, _ = merged
    split = tmp_path / "split"
    result = cli("split", out, split, "--to", "dcp", "--fsdp", "2")
    assert result.exit_code == 0, result.output
    source = fixture_dir(NAME) / "checkpoint"
    got = make_fixtures.read_checkpoint_no_dist(split, hf=False)
    want = make_fixtures.read_checkpoint_no_dist(source, hf=False)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name

    def chunks(path):
        meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        return {k: sorted((tuple(c.offsets), tuple(c.sizes)) for c in v.chunks) for k, v in meta.items()}

    assert chunks(split) == chunks(source)
    assert (split / "preprocessor_config.json").read_bytes() == (out / "preprocessor_config.json").read_bytes()


def test_processor_files_linking_out_are_skipped_with_a_note_as_tokenizer_files_are(tmp_path, cli):
    """The link rules of tokenizer files hold for the processor's: a link out of the checkpoint is never followed
    (not copied, a note names it and where it leads); the files inside are copied."""
    source = tmp_path / "ckpt"
    shutil.copytree(fixture_dir(NAME) / "checkpoint", source)
    secret = tmp_path / "elsewhere" / "preprocessor_config.json"
    secret.parent.mkdir()
    shutil.move(source / "preprocessor_config.json", secret)
    (source / "preprocessor_config.json").symlink_to(secret)
    (source / "video_preprocessor_config.json").symlink_to("/etc/passwd")
    out = tmp_path / "out"
    result = cli("merge", source, out, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    for name, target in (("preprocessor_config.json", str(secret)), ("video_preprocessor_config.json", "/etc/passwd")):
        assert not (out / name).exists()
        note = next(n for n in doc["notes"] if f"{name}' not copied" in n)
        assert f"it is a symlink to '{target}" in note and "outside the checkpoint" in note
    assert (out / "chat_template.jinja").read_bytes() == (source / "chat_template.jinja").read_bytes()
    assert "chat_template.jinja" in doc["extras"]


def test_verify_runs_the_merged_vlm_against_its_dcp_source_through_its_class(merged, cli):
    """``verify`` loads both sides with the class ``config.architectures`` names and compares text logits."""
    out, _ = merged
    result = cli("verify", out, "--against", fixture_dir(NAME) / "checkpoint")
    assert result.exit_code == 0, result.output
    assert f"output:    {out} (Qwen2_5_VLForConditionalGeneration, float32)" in result.output
    assert "max |Δlogit| 0 " in result.output and "verified: equal to the reference" in result.output


def test_split_with_tensor_parallel_keeps_the_vision_side_whole_and_the_language_model_cut(merged, tmp_path, cli):
    """``--tp 2``: the vision tower and merger replicated (transformers' plan for Qwen2.5-VL leaves them out), the
    language model cut as a Llama's; read back, every tensor is the producer's bit for bit. (No TP producer of a
    VLM proves the cut yet: the placements are transformers' plan's, the values are checked.)"""
    from torch.distributed.checkpoint import FileSystemReader

    sys.path.insert(0, str(FIXTURES))
    import make_fixtures

    out, _ = merged
    split = tmp_path / "split"
    result = cli("split", out, split, "--to", "dcp", "--tp", "2")
    assert result.exit_code == 0, result.output
    got = make_fixtures.read_checkpoint_no_dist(split, hf=False)
    want = make_fixtures.read_checkpoint_no_dist(fixture_dir(NAME) / "checkpoint", hf=False)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    meta = FileSystemReader(str(split)).read_metadata().state_dict_metadata
    chunks = {k: [(tuple(c.offsets), tuple(c.sizes)) for c in v.chunks] for k, v in meta.items()}
    assert all(len(chunks[k]) == 1 for k in chunks if k.startswith("model.visual."))
    assert chunks["model.language_model.layers.0.self_attn.q_proj.weight"] == [((0, 0), (16, 32)), ((16, 0), (16, 32))]
    assert chunks["model.language_model.layers.0.self_attn.o_proj.weight"] == [((0, 0), (32, 16)), ((0, 16), (32, 16))]


def test_a_tied_head_renamed_by_the_conversion_is_not_expected_on_disk(tmp_path):
    """Gemma 3 with vision: its tied ``lm_head`` is reverted to ``language_model.lm_head.weight``, which
    save_pretrained never writes; the expected on-disk tensors are exactly what save_pretrained writes."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = dict(model_type="gemma3", mm_tokens_per_image=4, image_token_index=299, boi_token_index=297,
                  eoi_token_index=298,
                  text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=16, vocab_size=300, sliding_window=16),
                  vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     image_size=16, patch_size=4))
    info = model_info(config)
    assert info.architecture == "Gemma3ForConditionalGeneration" and "lm_head.weight" in info.tied
    model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(**config))
    model.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        written = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert dict(info.disk_shapes) == written
