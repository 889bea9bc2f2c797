"""DeepSeek-V3-style Megatron-Core checkpoints (MLA, first-k dense layers, shared experts, sigmoid routing with the
expert bias, an MTP layer) merged to HuggingFace ``DeepseekV3ForCausalLM``.

Fixtures (``fixtures/make_megatron_deepseek.py``, megatron-core 0.16.1 on CPU): ``deepseek_tp2_ep2`` (TP=2 x EP=2,
q_lora_rank 16) and ``deepseek_pp2_ep2`` (PP=2 with the MTP layer on the last stage x EP=2, no q_lora_rank), each
saved as ``legacy/`` and ``torch_dist/`` from the same live model, with Megatron's own TP=PP=EP=1 reload cut into HF
tensors (reference/) and its forward (``logits``, and the MTP layer's ``mtp_logits``). A merge must equal the
reference bit for bit and give Megatron's logits in transformers (main model and MTP layer); a wrong mapping must
not.
"""

from __future__ import annotations

import json
import pickle
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import ckpttool
from ckpttool.model.architecture import model_info
from ckpttool.families import map_to_hf
from ckpttool.readers import read_layout
from conftest import FIXTURES, assert_failed_cleanly, load_output, tree_digest

CASES = ("deepseek_tp2_ep2", "deepseek_pp2_ep2")
SOURCES = [(case, fmt) for case in CASES for fmt in ("legacy", "torch_dist")]
VOCAB, PADDED, MTP_LAYER = 100, 128, 3
#: Megatron's logits against transformers' on the merged output: fp32 on CPU, different kernels (observed 3e-7)
ATOL = 1e-5
ADAPTER = "deepseek_v3 (Megatron-Core convention)"
BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"


def fixture(case: str) -> Path:
    path = FIXTURES / f"megatron_{case}"
    assert (path / "reference").is_dir(), f"fixture {path.name} missing: run fixtures/make_megatron_deepseek.py"
    return path


def config_of(case: str) -> dict:
    return json.loads((fixture(case) / "config.json").read_text())


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    """Each (case, format) merged once through the CLI, shared by the tests that read the output."""
    from click.testing import CliRunner

    from ckpttool.cli import main

    done: dict[tuple[str, str], Path] = {}

    def get(case: str, fmt: str) -> Path:
        if (case, fmt) not in done:
            out = tmp_path_factory.mktemp(f"{case}-{fmt}") / "out"
            src = fixture(case) / fmt
            before = tree_digest(src)
            result = CliRunner().invoke(main, ["merge", str(src), str(out), "--config", str(fixture(case) / "config.json")])
            assert result.exit_code == 0, result.output
            assert tree_digest(src) == before
            done[(case, fmt)] = out
        return done[(case, fmt)]

    return get


def forward(directory: Path, case: str) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' logits of the main model and of the MTP layer, on the fixture's tokens.

    The MTP layer is loaded by transformers' own ``MtpModel.from_pretrained`` (which raises on a missing tensor); it
    finds a layer by the pattern the model class registers (``model.layers.61`` for DeepSeek-V3), so the tiny
    model's index is given. Its input is Megatron's: the hidden states after the final norm, and the tokens shifted
    left by one with 0 appended (Megatron's ``roll_tensor``), at positions 0..s-1.
    """
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    tokens = load_file(fixture(case) / "logits.safetensors")["tokens"]
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()
    model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{MTP_LAYER}\..*"]
    mtp = MtpModel.from_pretrained(model).eval()
    s = tokens.shape[1]
    following = torch.roll(tokens, -1, dims=-1)
    following[:, -1] = 0
    with torch.no_grad():
        out = model(tokens, output_hidden_states=True)
        hidden = mtp.forward_layer(0, out.hidden_states[-1], torch.arange(s).unsqueeze(0), None, input_ids=following)
        return out.logits, mtp._project_to_logits(hidden)


def megatron_logits(case: str) -> tuple[torch.Tensor, torch.Tensor]:
    saved = load_file(fixture(case) / "logits.safetensors")
    assert saved["logits"].shape[-1] == PADDED  # Megatron computes logits over the padded vocab
    return saved["logits"][..., :VOCAB], saved["mtp_logits"][..., :VOCAB]


def hf_copy(tmp_path: Path, case: str, tensors: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    out = tmp_path / "hf"
    out.mkdir()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config or config_of(case)))
    return out


# ------------------------------------------------------------------------------------------------
# the real producer: bit-exact merges, Megatron's logits
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("case", "fmt"), SOURCES)
def test_merge_equals_megatrons_own_full_weights(merged, case, fmt):
    got = load_output(merged(case, fmt))
    want = load_file(fixture(case) / "reference" / "model.safetensors")
    assert sorted(got) == sorted(want)
    assert [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])] == []
    assert got[BIAS].dtype == torch.float32 and got[BIAS].abs().min() > 0  # seeded non-zero: a dropped bias shows
    mtp = {k.removeprefix(f"model.layers.{MTP_LAYER}.") for k in got if k.startswith(f"model.layers.{MTP_LAYER}.")}
    assert {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight",
            "embed_tokens.weight", "self_attn.kv_a_proj_with_mqa.weight", "mlp.experts.3.down_proj.weight",
            "mlp.shared_experts.up_proj.weight", "mlp.gate.e_score_correction_bias"} <= mtp
    assert torch.equal(got[f"model.layers.{MTP_LAYER}.embed_tokens.weight"], got["model.embed_tokens.weight"])
    assert torch.equal(got[f"model.layers.{MTP_LAYER}.shared_head.head.weight"], got["lm_head.weight"])


@pytest.mark.parametrize(("case", "fmt"), SOURCES)
def test_transformers_gives_megatrons_logits_and_mtp_logits(merged, case, fmt):
    logits, mtp_logits = forward(merged(case, fmt), case)
    want, want_mtp = megatron_logits(case)
    torch.testing.assert_close(logits, want, rtol=0, atol=ATOL)
    torch.testing.assert_close(mtp_logits, want_mtp, rtol=0, atol=ATOL)


def _swap_halves(t: torch.Tensor, heads: int, first: int) -> torch.Tensor:
    """Each head's rows ``[a; b]`` (``a`` of ``first`` rows) as ``[b; a]``: a cut that got the order wrong."""
    rows = t.view(heads, -1, t.shape[-1])
    return torch.cat([rows[:, first:], rows[:, :first]], dim=1).reshape(t.shape).contiguous()


WRONG = {
    # kv_a_proj_with_mqa as [rope; kv_lora] instead of [kv_lora; rope] (the rope part cut from the wrong end)
    "rope part first": lambda t, n: _swap_halves(t, 1, 16) if n.endswith("kv_a_proj_with_mqa.weight") else t,
    # q_b_proj per head as [rope; nope]
    "query heads as [rope; nope]": lambda t, n: _swap_halves(t, 4, 8) if n.endswith("q_b_proj.weight") else t,
    # kv_b_proj per head as [v; k_nope]
    "key/value heads as [v; k_nope]": lambda t, n: _swap_halves(t, 4, 8) if n.endswith("kv_b_proj.weight") else t,
    # the router's expert bias dropped
    "no expert bias": lambda t, n: torch.zeros_like(t) if n.endswith("e_score_correction_bias") else t,
    # eh_proj's input read as [hidden; embedding]
    "eh_proj halves swapped": lambda t, n: torch.cat(t.chunk(2, dim=1)[::-1], dim=1) if n.endswith("eh_proj.weight") else t,
}


@pytest.mark.parametrize("wrong", sorted(WRONG))
def test_negative_control_a_wrong_mapping_changes_the_logits(merged, wrong, tmp_path):
    """The logits test can fail: each plausible wrong cut of the same tensors moves Megatron's logits far past
    ATOL (in the main model, or in the MTP layer for eh_proj)."""
    case = "deepseek_tp2_ep2"
    tensors = {n: WRONG[wrong](t, n) for n, t in load_output(merged(case, "torch_dist")).items()}
    logits, mtp_logits = forward(hf_copy(tmp_path, case, tensors), case)
    want, want_mtp = megatron_logits(case)
    moved = (mtp_logits - want_mtp) if wrong == "eh_proj halves swapped" else (logits - want)
    assert moved.abs().max() > 100 * ATOL, wrong


def test_negative_control_rope_interleave_false_changes_the_logits(merged, tmp_path):
    """Megatron's MLA rotates interleaved rope pairs: transformers matches it only with rope_interleave true."""
    case = "deepseek_tp2_ep2"
    config = {**config_of(case), "rope_interleave": False}
    logits, _ = forward(hf_copy(tmp_path, case, load_output(merged(case, "legacy")), config), case)
    assert (logits - megatron_logits(case)[0]).abs().max() > 100 * ATOL


# ------------------------------------------------------------------------------------------------
# dtype, dry run and audit
# ------------------------------------------------------------------------------------------------


def test_router_bias_stays_fp32_under_dtype_bfloat16(tmp_path):
    case = "deepseek_pp2_ep2"
    ckpttool.merge(fixture(case) / "legacy", tmp_path / "out", config=fixture(case) / "config.json", dtype="bfloat16")
    got = load_output(tmp_path / "out")
    want = load_file(fixture(case) / "reference" / "model.safetensors")
    biases = [k for k in got if k.endswith("e_score_correction_bias")]
    assert biases == [f"model.layers.{n}.mlp.gate.e_score_correction_bias" for n in (1, 2, MTP_LAYER)]
    assert all(got[k].dtype == torch.float32 and torch.equal(got[k], want[k]) for k in biases)
    assert {got[k].dtype for k in got if k not in biases} == {torch.bfloat16}


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_dry_run_shows_the_adapter_and_the_mla_and_mtp_cut(cli, fmt, tmp_path):
    case = "deepseek_tp2_ep2"
    result = cli("merge", fixture(case) / fmt, tmp_path / "out", "--config", fixture(case) / "config.json", "--dry-run")
    assert result.exit_code == 0, result.output
    assert f"family:   {ADAPTER}" in result.output
    mtp = "mtp.layers.0.transformer_layer.self_attention."
    for line in (
        "model.layers.1.self_attn.kv_a_proj_with_mqa.weight  F32 [20x32]  <- "
        "decoder.layers.1.self_attention.linear_kv_down_proj.weight (2 pieces)",
        "model.layers.1.self_attn.q_a_layernorm.weight  F32 [16]  <- decoder.layers.1.self_attention.q_layernorm.weight",
        f"model.layers.3.self_attn.q_b_proj.weight  F32 [48x16]  <- {mtp}linear_q_up_proj.weight (2 pieces)",
        "model.layers.3.eh_proj.weight  F32 [32x64]  <- mtp.layers.0.eh_proj.weight (2 pieces)",
        "model.layers.3.embed_tokens.weight  F32 [100x32]  <- embedding.word_embeddings.weight (2 pieces)",
        "model.layers.1.mlp.gate.e_score_correction_bias  F32 [4]  <- decoder.layers.1.mlp.router.expert_bias",
        "MTP layer mtp.layers.0 -> model.layers.3, with copies of the embedding and output layer it shares",
    ):
        assert line in result.output, (line, result.output)
    assert not (tmp_path / "out").exists()


def test_audit_of_the_source_shows_the_adapter(cli):
    case = "deepseek_pp2_ep2"
    result = cli("audit", fixture(case) / "torch_dist", "--config", fixture(case) / "config.json")
    assert result.exit_code == 0, result.output
    assert f"family: {ADAPTER}" in result.output


# ------------------------------------------------------------------------------------------------
# what is missing is named
# ------------------------------------------------------------------------------------------------


def _copy(case: str, fmt: str, tmp_path: Path) -> Path:
    shutil.copytree(fixture(case) / fmt, tmp_path / "ckpt" / fmt)
    shutil.copy(fixture(case) / "config.json", tmp_path / "ckpt" / "config.json")
    return tmp_path / "ckpt" / fmt


def test_missing_rank_file_names_the_expert_rows_and_the_file(cli, tmp_path):
    src = _copy("deepseek_tp2_ep2", "legacy", tmp_path)
    shutil.rmtree(src / "iter_0000010" / "mp_rank_01_001")  # TP rank 1 of EP rank 1: experts 2 and 3, second halves
    out = tmp_path / "out"
    result = cli("merge", src, out)
    assert_failed_cleanly(result, out,
                          "'model.layers.1.mlp.experts.2.gate_proj.weight': rows 8..16 covered by no piece",
                          "'model.layers.3.mlp.experts.3.down_proj.weight': columns 8..16 covered by no piece",
                          "'iter_0000010/mp_rank_01_001/model_optim_rng.pt'")


def test_missing_expert_files_name_the_experts_of_the_mtp_layer_too(cli, tmp_path):
    src = _copy("deepseek_pp2_ep2", "torch_dist", tmp_path)
    for f in ("__3_0.distcp", "__3_1.distcp"):  # stage 1, EP rank 1: experts 2 and 3 of layer 2 and of the MTP layer
        (src / "iter_0000010" / f).unlink()
    out = tmp_path / "out"
    result = cli("merge", src, out)
    assert_failed_cleanly(result, out, "'model.layers.2.mlp.experts.2.gate_proj.weight'",
                          "'model.layers.3.mlp.experts.3.up_proj.weight'", "'iter_0000010/__3_0.distcp', which is missing")


def test_missing_last_stage_names_the_mtp_layer(cli, tmp_path):
    src = _copy("deepseek_pp2_ep2", "legacy", tmp_path)
    for ep in (0, 1):
        shutil.rmtree(src / "iter_0000010" / f"mp_rank_00_001_{ep:03d}")
    out = tmp_path / "out"
    result = cli("merge", src, out)
    assert_failed_cleanly(result, out, "'iter_0000010/mp_rank_00_001_000/model_optim_rng.pt' (pipeline stage 1, tp rank 0, "
                          "ep rank 0): layers 2..2, decoder.final_layernorm.weight and output_layer.weight, mtp.layers.0..0")


def test_missing_part_of_the_mtp_layer_is_named(cli, tmp_path):
    """Depends on the MTP expectations of ckpttool.families.mtp: an MTP layer is held whole or not at all."""
    from torch.distributed.checkpoint import FileSystemReader

    src = _copy("deepseek_tp2_ep2", "torch_dist", tmp_path)
    directory = src / "iter_0000010"
    metadata = FileSystemReader(directory).read_metadata()
    drop = "mtp.layers.0.eh_proj.weight"
    del metadata.state_dict_metadata[drop]
    metadata.storage_data = {k: v for k, v in metadata.storage_data.items() if k.fqn != drop}
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    out = tmp_path / "out"
    result = cli("merge", src, out)
    assert_failed_cleanly(result, out, "'model.layers.3.eh_proj.weight': expected by the config but not in the checkpoint")


def test_mtp_layer_the_config_does_not_declare_is_never_dropped(tmp_path):
    """Without args to contradict it (the cut alone), an MTP layer with no place is a problem naming it."""
    case = "deepseek_tp2_ep2"
    info = model_info({**config_of(case), "num_nextn_predict_layers": 0})
    mapping = map_to_hf(read_layout(fixture(case) / "torch_dist"), info)
    assert [message for _, message in mapping.problems] == [
        "'mtp.layers.0.enorm.weight' and 18 more tensors of MTP layer 0: the deepseek_v3 config declares 0 MTP layers "
        "(num_nextn_predict_layers), so they have no place. Is this the config the model trained with? One with "
        "num_nextn_predict_layers 1 carries them to model.layers.3"
    ]
    assert not any(s.name.startswith("model.layers.3.") for s in mapping.specs)


# ------------------------------------------------------------------------------------------------
# MLA names the fixtures cannot show
# ------------------------------------------------------------------------------------------------


def test_transformer_engine_fused_mla_norms_are_the_same_tensors():
    """TE's spec fuses q_layernorm/kv_layernorm into the up projections (``layer_norm_weight``): same targets."""
    case = "deepseek_tp2_ep2"
    info = model_info(config_of(case))
    layout = read_layout(fixture(case) / "torch_dist", model=info)
    fused = {"q_layernorm.weight": "linear_q_up_proj.layer_norm_weight",
             "kv_layernorm.weight": "linear_kv_up_proj.layer_norm_weight"}
    renamed = {}
    for fqn, t in layout.tensors.items():
        new = next((fqn.replace(a, b) for a, b in fused.items() if fqn.endswith(a)), fqn)
        renamed[new] = replace(t, fqn=new)
    want = {s.name: s.slices[0].src for s in map_to_hf(layout, info).specs}
    mapping = map_to_hf(replace(layout, tensors=renamed), info)
    assert mapping.problems == []
    assert {s.name: s.slices[0].src for s in mapping.specs} == want
    assert {s.slices[0].source for s in mapping.specs if s.name == "model.layers.2.self_attn.kv_a_layernorm.weight"} == {
        "decoder.layers.2.self_attention.linear_kv_up_proj.layer_norm_weight"}


def test_mla_rows_the_config_contradicts_and_unknown_mtp_parts_are_named():
    """The cut alone (no args to check first): each MLA projection's rows say what they hold."""
    case = "deepseek_tp2_ep2"
    layout = read_layout(fixture(case) / "torch_dist")
    strange = {**layout.tensors, "mtp.layers.0.strange.weight": replace(layout.tensors["mtp.layers.0.enorm.weight"],
                                                                        fqn="mtp.layers.0.strange.weight")}
    info = model_info({**config_of(case), "kv_lora_rank": 8})
    problems = dict(map_to_hf(replace(layout, tensors=strange), info).problems)
    down = "decoder.layers.0.self_attention.linear_kv_down_proj.weight"
    assert problems[down] == (f"'{down}': 20 rows, but the config gives 12 (kv_lora_rank 8 + qk_rope_head_dim 4: the "
                              "compressed key/value, then the rope key)")
    assert problems["mtp.layers.0.strange.weight"] == ("'mtp.layers.0.strange.weight': 'strange.weight' is not a part "
                                                       "of an MTP layer ckpttool can place")
