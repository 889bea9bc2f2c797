"""Megatron-Core hybrid sources (issue 30): megatron-core 0.16.1's ``MambaModel`` with a ``hybrid_override_pattern``
merged into Nemotron-H (``NemotronHForCausalLM``).

Fixture ``megatron_nemotron_h_tp2_pp2`` (``fixtures/make_megatron_hybrid.py``): pattern ``M*M-`` (Mamba-2,
attention, Mamba-2, squared-ReLU MLP), TP=2 x PP=2, ``torch_dist``, saved by megatron-core itself (its Mamba mixer's
``in_proj.weight.{z,x,B,C,dt}`` and ``conv1d.{weight,bias}.{x,B,C}`` split keys); ``reference/`` is transformers'
``save_pretrained`` of the tensors Megatron gathered itself (one process, ``dist_checkpointing.load``), whose logits
met Megatron's forward. The adapter (``families/nemotron_h.py`` + ``families/conventions/megatron_mamba.py``) must
give the reference bit for bit, load strictly with the same logits, and refuse what it cannot place, naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ckpttool
from conftest import FIXTURES, assert_failed_cleanly, load_output, tree_digest

MEGATRON = FIXTURES / "megatron_nemotron_h_tp2_pp2"
#: Megatron's forward (its scan through the documented stand-in) against transformers' torch path, fp32 on CPU
ATOL = 1e-4


#: transformers is imported here anyway: configs are described in this process (conftest.describe_inline)
pytestmark = pytest.mark.usefixtures("describe_inline")


@pytest.fixture(scope="module")
def merged(tmp_path_factory) -> Path:
    """The torch_dist source merged once through the CLI; the source is not modified."""
    from click.testing import CliRunner

    from ckpttool.cli import main

    src = MEGATRON / "torch_dist"
    out = tmp_path_factory.mktemp("nemotron_h") / "out"
    before = tree_digest(src)
    result = CliRunner().invoke(main, ["merge", str(src), str(out), "--config", str(MEGATRON / "config.json")])
    assert result.exit_code == 0, result.output
    assert "family:   nemotron_h (Megatron-Core convention)" in result.output
    assert tree_digest(src) == before
    return out


def logits_of(directory: Path, tokens: list[list[int]]) -> torch.Tensor:
    """transformers' logits after a strict load (no missing, unexpected or mismatched key)."""
    from transformers import NemotronHForCausalLM

    model, info = NemotronHForCausalLM.from_pretrained(str(directory), output_loading_info=True, dtype=torch.float32)
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info.get(key), (key, info[key])
    with torch.no_grad():
        return model.eval()(torch.tensor(tokens)).logits


def test_the_mamba_model_merges_to_megatrons_own_gathered_state_bit_for_bit(merged):
    got, want = load_output(merged), load_output(MEGATRON / "reference")
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    summary = json.loads((merged / "ckpttool-audit.json").read_text())["summary"]
    assert (summary["verdict"], summary["errors"], summary["warnings"]) == ("pass", 0, 0), summary


def test_the_merge_loads_strictly_and_computes_what_megatron_computed(merged):
    megatron = load_file(MEGATRON / "logits.safetensors")
    tokens = megatron["tokens"].tolist()
    logits = logits_of(merged, tokens)
    vocab = logits.shape[-1]
    torch.testing.assert_close(logits[0], megatron["logits"][0, :, :vocab], atol=ATOL, rtol=0)


def test_the_plan_fuses_the_mixer_parts_in_transformers_order():
    """``in_proj`` rows ``[z | x, B, C | dt]`` and ``conv1d`` channels ``[x, B, C]``: each Megatron part one box
    at its offset (I = 32, G*N = 16, 4 heads); every layer's pre-norm is ``norm``."""
    from ckpttool.families import map_to_hf
    from ckpttool.model.architecture import model_info
    from ckpttool.readers import read_layout

    info = model_info(json.loads((MEGATRON / "config.json").read_text()))
    mapping = map_to_hf(read_layout(MEGATRON / "torch_dist", model=info), info)
    assert mapping.adapter == "nemotron_h (Megatron-Core convention)" and not mapping.problems
    specs = {s.name: s for s in mapping.specs}
    in_proj = specs["backbone.layers.2.mixer.in_proj.weight"]
    assert in_proj.shape == (100, 32)
    assert [(sl.source.rsplit(".", 1)[1], sl.dst.offsets[0]) for sl in sorted(in_proj.slices,
                                                                              key=lambda s: s.dst.offsets)] == [
        ("z", 0), ("x", 32), ("B", 64), ("C", 80), ("dt", 96)]
    conv = specs["backbone.layers.0.mixer.conv1d.weight"]
    assert conv.shape == (64, 1, 4)
    assert sorted(sl.dst.offsets[0] for sl in conv.slices) == [0, 32, 48]
    assert specs["backbone.layers.0.norm.weight"].slices[0].source == "decoder.layers.0.norm.weight"
    assert specs["backbone.layers.1.norm.weight"].slices[0].source == "decoder.layers.1.input_layernorm.weight"
    assert specs["backbone.layers.3.mixer.up_proj.weight"].slices[0].source == "decoder.layers.3.mlp.linear_fc1.weight"
    assert specs["backbone.norm_f.weight"].slices[0].source == "decoder.final_norm.weight"


def test_the_source_audits_clean_and_the_dry_run_names_each_part(cli):
    src, config = MEGATRON / "torch_dist", MEGATRON / "config.json"
    audit = cli("audit", src, "--config", config)
    assert audit.exit_code == 0, audit.output
    assert "audit: PASS, 0 errors, 0 warnings" in audit.output
    dry = cli("merge", src, "--config", config, "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert ("backbone.layers.2.mixer.in_proj.weight  F32 [100x32]  <- decoder.layers.2.mixer.in_proj.weight.z, "
            "decoder.layers.2.mixer.in_proj.weight.x, decoder.layers.2.mixer.in_proj.weight.B, "
            "decoder.layers.2.mixer.in_proj.weight.C, decoder.layers.2.mixer.in_proj.weight.dt (10 pieces)") in dry.output


def test_megatron_args_with_another_layer_pattern_are_named():
    import argparse

    from ckpttool.families.nemotron_h import ADAPTER
    from ckpttool.model.architecture import model_info
    from ckpttool.readers.megatron.common import scan_checkpoint

    info = model_info(json.loads((MEGATRON / "config.json").read_text()))
    with open(next((MEGATRON / "torch_dist").glob("iter_*")) / "common.pt", "rb") as f:
        args = scan_checkpoint(f, label="common.pt")["args"]
    assert ADAPTER.check_args(args, info) == []
    wrong = argparse.Namespace(**{**vars(args), "hybrid_override_pattern": "M-M*"})
    assert ADAPTER.check_args(wrong, info) == [
        "hybrid_override_pattern: 'M*M-' expected (the config's hybrid_override_pattern), found 'M-M*' in the args"]


# refusals: the fixture's tensors re-saved by torch's dcp.save (recognised by their names), then damaged
# ------------------------------------------------------------------------------------------------


def megatron_as_dcp(tmp_path: Path, edit=None, config_edit=None) -> Path:
    """The fixture's tensors as a plain DCP (vocab padding cut off), after ``edit(state)``; its config after
    ``config_edit(config)``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(next((MEGATRON / "torch_dist").glob("iter_*")))
    metadata = reader.read_metadata()
    state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
             for k, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    dcp.load(state, storage_reader=reader, no_dist=True)
    config = json.loads((MEGATRON / "config.json").read_text())
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        state[name] = state[name][:config["vocab_size"]].clone()
    if edit is not None:
        edit(state)
    if config_edit is not None:
        config_edit(config)
    out = tmp_path / "megatron-dcp"
    dcp.save(state, checkpoint_id=out, no_dist=True)
    (out / "config.json").write_text(json.dumps(config))
    return out


def refused(cli, tmp_path: Path, src: Path, *needles: str) -> None:
    before = tree_digest(src)
    result = cli("merge", src, tmp_path / "out")
    assert_failed_cleanly(result, tmp_path / "out", "does not match its nemotron_h config", *needles)
    assert tree_digest(src) == before


def test_the_plain_dcp_of_the_same_tensors_merges_the_same(tmp_path):
    src = megatron_as_dcp(tmp_path)
    ckpttool.merge(src, tmp_path / "out")
    got, want = load_output(tmp_path / "out"), load_output(MEGATRON / "reference")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


B = "decoder.layers.2.mixer.in_proj.weight.B"


def test_one_tp_ranks_part_saved_as_the_whole_is_refused(cli, tmp_path):
    """Half of ``B``'s rows (one TP rank's groups): the config wants G*N = 16."""
    def half(state):
        state[B] = state[B][:8].clone()

    refused(cli, tmp_path, megatron_as_dcp(tmp_path, half),
            f"'{B}': 8 rows, expected 16 for the Mamba-2 mixer's 'in_proj.weight.B' from the config (mamba_num_heads, "
            "mamba_head_dim, n_groups, ssm_state_size)")


def test_a_fused_legacy_in_proj_is_refused(cli, tmp_path):
    """``--ckpt-format torch`` keeps each rank's ``[z, x, B, C, dt]`` fused: not cut, and the message says how."""
    def fuse(state):
        prefix = "decoder.layers.0.mixer.in_proj.weight"
        state[prefix] = torch.cat([state.pop(f"{prefix}.{p}") for p in ("z", "x", "B", "C", "dt")])

    refused(cli, tmp_path, megatron_as_dcp(tmp_path, fuse),
            "'decoder.layers.0.mixer.in_proj.weight': a fused Mamba in_proj (rows [z, x, B, C, dt] of one TP rank's "
            "heads, as --ckpt-format torch saves it) is not cut; save the checkpoint with --ckpt-format torch_dist")


def test_a_config_whose_pattern_puts_a_mamba_mixer_elsewhere_is_refused(cli, tmp_path):
    def swap(config):
        config["hybrid_override_pattern"] = "*MM-"

    refused(cli, tmp_path, megatron_as_dcp(tmp_path, config_edit=swap),
            "'decoder.layers.0.mixer.A_log': a Mamba-2 mixer tensor in layer 0, which the config's "
            "hybrid_override_pattern makes an attention layer")


def test_a_moe_layer_is_refused_naming_it(cli, tmp_path):
    def moe(config):
        config["hybrid_override_pattern"] = "M*ME"

    refused(cli, tmp_path, megatron_as_dcp(tmp_path, config_edit=moe),
            "'decoder.layers.3.mlp.linear_fc1.weight': layer 3 is a MoE layer ('E' in the config's "
            "hybrid_override_pattern), whose Megatron-Core tensors are ", "; not 'mlp.linear_fc1.weight'")


# what megatron-core 0.16.1 does not build on a CPU: its checkpoints are refused naming the model
# ------------------------------------------------------------------------------------------------


def named_dcp(tmp_path: Path, names: dict[str, tuple[int, ...]], config: Path) -> Path:
    """A plain DCP holding ``names`` (tiny tensors) next to the config of ``config``."""
    import torch.distributed.checkpoint as dcp

    out = tmp_path / "src"
    dcp.save({n: torch.zeros(shape) for n, shape in names.items()}, checkpoint_id=out, no_dist=True)
    (out / "config.json").write_text(config.read_text())
    return out


GDN = "decoder.layers.0.self_attention."


@pytest.mark.parametrize("names, config, message", [
    ({"language_model.embedding.word_embeddings.weight": (8, 4),
      "language_model.decoder.layers.0.self_attention.linear_qkv.weight": (12, 4),
      "vision_model.conv1.weight": (4, 3, 2, 2), "vision_projection.encoder.linear_fc1.weight": (4, 4)},
     "gemma3_vl_fsdp2_dcp", "'language_model.embedding.word_embeddings.weight': a Megatron-Core LLaVAModel (vision "
     "encoder, projector and language model) checkpoint, which ckpttool does not cut: megatron-core 0.16.1 does not "
     "build this model on a CPU as it ships"),
    ({"embedding.word_embeddings.weight": (8, 4), GDN + "in_proj.weight.query": (4, 4), GDN + "in_proj.weight.z": (4, 4),
      GDN + "A_log": (2,), "output_layer.weight": (8, 4)},
     "qwen3_next_fsdp2_dcp", f"'{GDN}in_proj.weight.query': a Megatron-Core GPTModel with gated DeltaNet layers "
     "(experimental_attention_variant 'gated_delta_net', Qwen3-Next style) checkpoint, which ckpttool does not cut"),
], ids=["llava", "gated_deltanet"])
def test_a_megatron_core_model_that_does_not_build_on_cpu_is_refused_naming_it(cli, tmp_path, names, config, message):
    src = named_dcp(tmp_path, names, FIXTURES / config / "checkpoint" / "config.json")
    before = tree_digest(src)
    result = cli("merge", src, tmp_path / "out")
    assert_failed_cleanly(result, tmp_path / "out", message)
    assert tree_digest(src) == before


def test_the_legacy_format_of_the_same_run_is_refused_with_one_line(cli, tmp_path):
    """``--ckpt-format torch`` keeps each rank's heads: refused once, pointing at torch_dist, nothing written."""
    before = tree_digest(MEGATRON / "legacy")
    result = cli("merge", MEGATRON / "legacy", tmp_path / "out", "--config", MEGATRON / "config.json")
    assert_failed_cleanly(result, tmp_path / "out", "'decoder.layers.0.mixer.dt_bias': a Mamba-2 mixer saved with "
                          "--ckpt-format torch (each TP rank's fused in_proj [z, x, B, C, dt] and its own heads' "
                          "conv1d, A_log, D, dt_bias and norm), which ckpttool does not regroup; merge the same run's "
                          "--ckpt-format torch_dist checkpoint")
    assert tree_digest(MEGATRON / "legacy") == before
