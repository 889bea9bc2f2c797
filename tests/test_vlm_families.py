"""More vision-language families as sources (issue 30): GLM-4V and GLM-4V-MoE, Llama 4 with vision, LLaVA,
LLaVA-Next, Mistral 3 and PaliGemma, each built tiny by transformers (this venv's 5.23) and saved as a DCP of its
in-memory state dict (what FSDP2 writes, in one process: the multi-rank layouts are the committed fixtures' of
``test_vlm_more.py``), beside ``save_pretrained``'s output as the reference.

For each: the expected names and shapes are transformers' own for ``config.architectures``, the merge equals the
reference bit for bit and passes its audit, the output loads strictly through ``AutoModelForImageTextToText`` and
gives the reference's logits on text and on an image, ``verify`` runs the image through it, ``split --to dcp`` goes
back, and a dropped vision tower is one root cause.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
# imported with the module: configs are described in this process (no subprocess importing it per config)
from transformers import AutoConfig, AutoModelForImageTextToText

from ckpttool.families import adapter_for
from ckpttool.model.architecture import model_info
from ckpttool.verify.image import ImageInput, image_input, with_token_types
from conftest import assert_failed_cleanly, load_output, tree_digest

TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=300)
SIGLIP = dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
              num_attention_heads=2, image_size=16, patch_size=4)
CLIP = dict(SIGLIP, model_type="clip_vision_model")
GLM_VISION = dict(hidden_size=16, intermediate_size=32, depth=1, num_heads=2, patch_size=4, image_size=16,
                  out_hidden_size=32, spatial_merge_size=2, temporal_patch_size=2)
GLM_TOKENS = dict(image_token_id=290, video_token_id=291, image_start_token_id=292, image_end_token_id=293)
ROPE = dict(rope_type="default", rope_theta=10000.0)

#: family -> (its tiny config, the class ``architectures`` names, the in-memory prefix of its vision side)
FAMILIES: dict[str, tuple[dict, str, str]] = {
    "glm4v": (dict(text_config=dict(TEXT, model_type="glm4v_text", rope_parameters=dict(ROPE, mrope_section=[2, 3, 3])),
                   vision_config=dict(GLM_VISION, model_type="glm4v"), **GLM_TOKENS),
              "Glm4vForConditionalGeneration", "model.visual."),
    "glm4v_moe": (dict(text_config=dict(TEXT, model_type="glm4v_moe_text", moe_intermediate_size=8, n_routed_experts=4,
                                        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                                        topk_group=1, rope_parameters=dict(ROPE, partial_rotary_factor=0.5,
                                                                           mrope_section=[1, 1, 2])),
                       vision_config=dict(GLM_VISION, model_type="glm4v_moe"), **GLM_TOKENS),
                  "Glm4vMoeForConditionalGeneration", "model.visual."),
    "llama4": (dict(text_config=dict(TEXT, model_type="llama4_text", intermediate_size_mlp=64, head_dim=16,
                                     num_local_experts=2, interleave_moe_layer_step=1, no_rope_layers=[1, 1]),
                    vision_config=dict(model_type="llama4_vision_model", hidden_size=16, intermediate_size=64,
                                       num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=4,
                                       vision_output_dim=32, projector_input_dim=32, projector_output_dim=32,
                                       pixel_shuffle_ratio=0.5),
                    image_token_index=299, boi_token_index=297, eoi_token_index=298),
               "Llama4ForConditionalGeneration", "vision_model."),
    "llava": (dict(text_config=dict(TEXT, model_type="llama"), vision_config=CLIP, image_token_index=299,
                   tie_word_embeddings=False),
              "LlavaForConditionalGeneration", "model.vision_tower."),
    "llava_next": (dict(text_config=dict(TEXT, model_type="llama"), vision_config=CLIP, image_token_index=299,
                        tie_word_embeddings=False, image_grid_pinpoints=[[16, 16]]),
                   "LlavaNextForConditionalGeneration", "model.vision_tower."),
    "mistral3": (dict(text_config=dict(TEXT, model_type="mistral"), image_token_index=299,
                      vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, image_size=16, patch_size=4, head_dim=8)),
                 "Mistral3ForConditionalGeneration", "model.vision_tower."),
    "paligemma": (dict(text_config=dict(TEXT, model_type="gemma", head_dim=16), vision_config=SIGLIP,
                       image_token_index=299, projection_dim=32),
                  "PaliGemmaForConditionalGeneration", "model.vision_tower."),
}
NAMES = sorted(FAMILIES)
TOKENS = [[1, 5, 9, 17, 30, 2]]


#: transformers is imported here anyway: configs are described in this process (conftest.describe_inline)
pytestmark = pytest.mark.usefixtures("describe_inline")


def _build(name: str) -> torch.nn.Module:
    config, klass, _ = FAMILIES[name]
    cfg = AutoConfig.for_model(name, **config, architectures=[klass])
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(cfg).eval()
    with torch.no_grad():  # no zero or constant tensor (biases, Gemma's norms), which would hide a misplaced piece
        for param in model.parameters():
            param.add_(torch.randn(param.shape) * 0.02)
    return model


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    """Each family built once, its weights made distinct (see :func:`_build`)."""
    return {name: _build(name) for name in NAMES}


@pytest.fixture(scope="module")
def sources(models, tmp_path_factory) -> dict[str, Path]:
    """Each family saved once: ``reference/`` by ``save_pretrained``, ``checkpoint/`` a DCP of the in-memory state
    dict (FSDP2's names, tied head included) with the config ``save_pretrained`` wrote."""
    done = {}
    for name, model in models.items():
        root = tmp_path_factory.mktemp(name)
        model.save_pretrained(root / "reference")
        _save_dcp(model.state_dict(), root / "checkpoint", (root / "reference" / "config.json").read_text())
        done[name] = root
    return done


@pytest.fixture(scope="module")
def merged(sources) -> dict[str, tuple[Path, str]]:
    """Each source merged once by the CLI (the source unchanged): name -> (output, terminal output)."""
    from click.testing import CliRunner

    from ckpttool.cli import main

    done = {}
    for name, root in sources.items():
        before = tree_digest(root / "checkpoint")
        result = CliRunner().invoke(main, ["merge", str(root / "checkpoint"), str(root / "merged")])
        assert result.exit_code == 0, result.output
        assert tree_digest(root / "checkpoint") == before
        done[name] = (root / "merged", result.output)
    return done


@pytest.mark.parametrize("name", NAMES)
def test_expected_names_are_those_save_pretrained_writes_for_the_architecture(sources, name):
    """The expectations come from the class ``config.architectures`` names (image-text-to-text, never the causal LM
    Llama 4 also has), and equal the names and shapes ``save_pretrained`` wrote."""
    config = json.loads((sources[name] / "reference" / "config.json").read_text())
    info = model_info(config)
    assert info.architecture == FAMILIES[name][1]
    written = {k: tuple(v.shape) for k, v in load_output(sources[name] / "reference").items()}
    assert dict(info.disk_shapes) == written


@pytest.mark.parametrize("name", NAMES)
def test_merge_is_bit_exact_and_passes_its_audit(sources, merged, name):
    out, output = merged[name]
    ours, want = load_output(out), load_output(sources[name] / "reference")
    assert sorted(ours) == sorted(want)
    for fqn, tensor in want.items():
        assert ours[fqn].dtype == tensor.dtype and torch.equal(ours[fqn], tensor), fqn
    assert "audit: PASS" in output


def test_each_family_is_cut_by_its_adapter(sources):
    """LLaVA-Next by the LLaVA adapter (its ``image_newline`` renamed), GLM-4V-MoE by GLM-4V's (Qwen2-MoE's
    experts, its vision tower replicated under ``--tp``), Llama 4 by its own."""
    def adapter(name):
        return adapter_for(model_info(json.loads((sources[name] / "checkpoint" / "config.json").read_text())))

    assert {n: adapter(n).name for n in NAMES} == {
        "glm4v": "glm4v", "glm4v_moe": "glm4v", "llama4": "llama4", "llava": "llava", "llava_next": "llava",
        "mistral3": "llava", "paligemma": "llava"}
    assert "image_newline" in load_output(sources["llava_next"] / "reference")
    assert adapter("glm4v_moe").tp_placement("model.visual.blocks.0.mlp.gate_proj.weight").kind == "replicate"
    assert adapter("glm4v").tp_placement("model.language_model.layers.0.mlp.gate_up_proj.weight").dim == 0
    assert adapter("llama4").tp_placement("language_model.model.layers.0.feed_forward.router.weight").kind == \
        "replicate"
    assert adapter("llama4").tp_placement("vision_model.model.layers.0.mlp.fc1.weight").kind == "replicate"


@pytest.mark.parametrize("name", NAMES)
def test_merged_loads_strictly_and_gives_the_models_logits_on_text_and_an_image(models, merged, name):
    """The output loads strictly into the class ``architectures`` names and gives the saved model's logits on text
    and on the image ``verify`` feeds (:func:`ckpttool.verify.image.image_input`, laid out from the config), which
    fits the model (as many image tokens as its vision side gives) and reaches it (a dark image gives others)."""
    out, _ = merged[name]
    ours, loading = AutoModelForImageTextToText.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    assert type(ours).__name__ == FAMILIES[name][1]
    assert not any(loading[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), loading
    image = image_input(out, json.loads((out / "config.json").read_text()))
    assert isinstance(image, ImageInput), image
    inputs = with_token_types(ours, image)
    blind = dict(inputs, pixel_values=torch.zeros_like(inputs["pixel_values"]))
    text = torch.tensor(TOKENS)
    with torch.no_grad():
        assert torch.equal(ours.eval()(input_ids=text).logits, models[name](input_ids=text).logits)
        got, want, dark = ours(**inputs).logits, models[name](**inputs).logits, ours(**blind).logits
    assert torch.isfinite(got).all() and torch.equal(got, want)
    assert not torch.equal(got, dark)


#: one of each image layout: Qwen-VL's patches (and a tower read without its modules called, streamed), LLaVA-Next's
#: tiles, Llama 4's pixel shuffle (its vision model outside ``model.``)
VERIFIED = ("glm4v_moe", "llama4", "llava_next")


@pytest.mark.parametrize("name", VERIFIED)
def test_verify_loads_strictly_and_gives_the_references_logits_on_text_and_an_image(sources, merged, name, cli):
    """``verify --against`` what ``save_pretrained`` wrote, streamed from disk as the CLI does: status ok, and the
    logits equal the reference's on text and on a synthetic image laid out from the config (these families ran
    text only before)."""
    out, _ = merged[name]
    result = cli("verify", out, "--against", sources[name] / "reference", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["output"]["architecture"] == FAMILIES[name][1] and doc["status"] == "ok"
    assert not doc["output"]["problems"] and not any("text only" in n for n in doc["output"]["notes"])
    assert "synthetic 16x16 image laid out from the config" in doc["image_from"]
    assert doc["comparison"]["max_abs_diff"] == 0 and doc["image_comparison"]["max_abs_diff"] == 0


def test_merge_verify_forward_runs_the_image_and_refuses_a_projector_only_an_image_reaches(tmp_path, cli):
    """``merge --verify-forward`` of a VLM runs a forward with an image too: a projector holding an infinity leaves
    the text logits sound, and the merge is refused (exit 1) naming the image's logits; nothing is published, the
    source is untouched. The same model without it publishes."""
    model = _build("llava")
    clean = tmp_path / "clean"
    _save_dcp(model.state_dict(), clean, model.config.to_json_string())
    assert cli("merge", clean, tmp_path / "clean-out", "--verify-forward", "-q").exit_code == 0
    with torch.no_grad():
        model.model.multi_modal_projector.linear_1.weight[0, 0] = float("inf")
    source = tmp_path / "broken"
    _save_dcp(model.state_dict(), source, model.config.to_json_string())
    before = tree_digest(source)
    out = tmp_path / "out"
    result = cli("merge", source, out, "--verify-forward")
    assert_failed_cleanly(result, out, "fails its forward check (1 problem)", "  - with an image: logits: ")
    assert "NaN or infinite" in result.stderr
    assert tree_digest(source) == before


def _save_dcp(state: dict[str, torch.Tensor], directory: Path, config: str) -> None:
    """``state`` as a DCP in one process, with ``config`` (JSON text) as its ``config.json``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving in a single process"
        dcp.save(state, checkpoint_id=str(directory), no_dist=True)
    (directory / "config.json").write_text(config)


def _read_dcp(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, list]]:
    """Every tensor of a DCP read back whole, and its chunks ``(offsets, sizes)``."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(directory), no_dist=True)
    return state, {k: sorted((tuple(c.offsets), tuple(c.sizes)) for c in v.chunks) for k, v in meta.items()}


@pytest.mark.parametrize("name", NAMES)
def test_split_to_dcp_over_fsdp_and_tp_gives_the_in_memory_state_back(sources, merged, name, tmp_path, cli):
    """``split --to dcp --fsdp 2 --tp 2``: the in-memory names and values bit for bit; the vision side whole on
    each tensor-parallel rank (cut by FSDP only), the language model's attention cut as Llama's plan cuts it."""
    out, _ = merged[name]
    split = tmp_path / "split"
    result = cli("split", out, split, "--to", "dcp", "--fsdp", "2", "--tp", "2")
    assert result.exit_code == 0, result.output
    got, chunks = _read_dcp(split)
    want, _ = _read_dcp(sources[name] / "checkpoint")
    assert sorted(got) == sorted(want)
    for fqn, tensor in want.items():
        assert got[fqn].dtype == tensor.dtype and torch.equal(got[fqn], tensor), fqn
    vision = FAMILIES[name][2]
    # fsdp=2 cuts dim 0 of a replicated tensor in two at most; tp would cut it into four
    assert all(len(c) <= 2 for k, c in chunks.items() if k.startswith(vision))
    q = next(k for k in chunks if "language_model." in k and k.endswith("self_attn.q_proj.weight"))
    rows = got[q].shape[0]
    assert [offsets[0] for offsets, _ in chunks[q]] == [0, rows // 4, rows // 2, 3 * rows // 4]


@pytest.mark.parametrize("name", NAMES)
def test_a_dropped_vision_tower_is_one_root_cause(sources, name, tmp_path, cli):
    """A training script that saved only the language model and the projector: the audit (exit 3) gives one cause,
    the vision side named by its on-disk prefix, holding every missing tensor; the source is untouched."""
    state, _ = _read_dcp(sources[name] / "checkpoint")
    vision = FAMILIES[name][2]
    dropped = tmp_path / "dropped"
    _save_dcp({k: v for k, v in state.items() if not k.startswith(vision)}, dropped,
              (sources[name] / "checkpoint" / "config.json").read_text())
    before = tree_digest(dropped)
    report = cli("audit", "--json", dropped)
    assert report.exit_code == 3, report.output
    # besides notes (info): a tied head FSDP2 saved, GLM-4V-MoE's router bias buffer at its zero start
    causes = [c for c in json.loads(report.stdout)["causes"] if c["severity"] != "info"]
    missing = sum(1 for k in state if k.startswith(vision))
    assert len(causes) == 1 and causes[0]["code"] == "tensor-missing", causes
    assert len(causes[0]["tensors"]) == missing
    assert "of a vision-language model is missing" in causes[0]["cause"]
    assert tree_digest(dropped) == before



# --- a real multi-rank producer: GLM-4V under transformers' own tensor parallelism ---------------------------------

GLM_TP2 = "glm4v_hf_tp2"


def test_a_transformers_tp_save_of_glm4v_merges_bit_exact_and_splits_back_as_its_plan_cut_it(tmp_path, cli):
    """``DistributedConfig(tp_size=2)`` + ``save_pretrained(distributed_checkpoint=True)`` of GLM-4V
    (``fixtures/glm4v_hf_tp2``): the merge equals ``save_pretrained`` bit for bit; ``split --to dcp --tp 2`` cuts every
    tensor where GLM-4V's plan cut it on the producer's two ranks (the fused ``gate_up_proj`` by rows, the vision
    tower whole) and gives its values back."""
    from conftest import fixture_dir

    source = fixture_dir(GLM_TP2)
    out = tmp_path / "out"
    result = cli("merge", source / "checkpoint", out)
    assert result.exit_code == 0, result.output
    assert "(hf-distributed)" in result.output and "family:   glm4v (its rules)" in result.output
    assert "audit: PASS" in result.output
    ours, want = load_output(out), load_output(source / "reference")
    assert sorted(ours) == sorted(want)
    assert all(ours[k].dtype == want[k].dtype and torch.equal(ours[k], want[k]) for k in want)
    split = tmp_path / "split"
    result = cli("split", out, split, "--to", "dcp", "--tp", "2")
    assert result.exit_code == 0, result.output
    got, chunks = _read_dcp(split)
    assert all(torch.equal(got[k], want[k]) for k in want)  # in-memory names are GLM-4V's on-disk names
    produced = json.loads((source / "producer.json").read_text())["tensors"]
    cut = {k: sorted((tuple(r["global_offset"]), tuple(r["local_shape"])) for r in v["per_rank"])
           for k, v in produced.items() if v["dtensor"]}
    assert "model.language_model.layers.0.mlp.gate_up_proj.weight" in cut
    assert not any(k.startswith("model.visual.") for k in cut)
    assert {k: chunks[k] for k in cut} == cut


def test_a_transformers_tp_save_of_llama4_with_its_strided_experts_merges_bit_exact(tmp_path, cli):
    """Llama 4 under its own plan (``fixtures/llama4_hf_tp2``): the vision model cut too, and the stacked experts'
    ``gate_up_proj`` saved as ``_StridedShard(dim=2, sf=2)`` (each rank its half of gate and its half of up): the merge
    equals ``save_pretrained`` bit for bit and passes its audit."""
    from conftest import fixture_dir

    source = fixture_dir("llama4_hf_tp2")
    produced = json.loads((source / "producer.json").read_text())["tensors"]
    assert produced["language_model.model.layers.0.feed_forward.experts.gate_up_proj"]["placements"] == [
        "_StridedShard(dim=2, sf=2)"]
    out = tmp_path / "out"
    result = cli("merge", source / "checkpoint", out)
    assert result.exit_code == 0, result.output
    assert "family:   llama4 (its rules)" in result.output and "audit: PASS" in result.output
    ours, want = load_output(out), load_output(source / "reference")
    assert sorted(ours) == sorted(want)
    assert all(ours[k].dtype == want[k].dtype and torch.equal(ours[k], want[k]) for k in want)
