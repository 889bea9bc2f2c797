"""torchtitan 0.3.0 itself, run on this CPU (``fixtures/make_torchtitan.py``): its ``Trainer`` trains a tiny Llama 3
(FSDP2 over 2 ranks, and TP 2) and its ``CheckpointManager`` writes ``step-2/``, a DCP holding the model under
torchtitan's names (``tok_embeddings``, ``layers.N.attention.qkv_linear.wq``, ``feed_forward.w1``...) beside its
optimizer, lr_scheduler, dataloader and train_state, with Q and K rows in Meta's interleaved RoPE order. Given the
HF config, ckpttool merges it bit for bit into what torchtitan's own ``Llama3StateDictAdapter.to_hf`` makes, with
the reference's logits; given no config, or torchtitan's job config, it refuses with a message that says what to
pass."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import assert_failed_cleanly, fixture_dir, load_output, tree_digest

import ckpttool
from ckpttool.families.conventions import torchtitan
from ckpttool.families.registry import convention_for
from ckpttool.layout.layout import Box, Layout, Piece, TensorLayout
from ckpttool.model.description import ModelInfo
from ckpttool.plan.transforms import transform_tensor

NAMES = ("torchtitan_llama3_fsdp2", "torchtitan_llama3_tp2", "torchtitan_qwen3_fsdp2")
INPUT_IDS = torch.tensor([[1, 5, 9, 12, 3, 7, 16, 2]])


@pytest.fixture(scope="module", params=NAMES)
def merged(request, tmp_path_factory):
    name = request.param
    out = tmp_path_factory.mktemp(name) / "out"
    src = fixture_dir(name) / "checkpoint"
    before = tree_digest(src)
    result = ckpttool.merge(src, out, config=fixture_dir(name) / "reference" / "config.json")
    assert tree_digest(src) == before
    return name, result, out


@pytest.mark.parametrize("name", NAMES)
def test_the_producer_was_torchtitan_itself(name):
    producer = json.loads((fixture_dir(name) / "producer.json").read_text())
    assert producer["versions"]["torchtitan"] == "0.3.0"
    assert producer["world_size"] == 2
    assert producer["case"]["model"] == ("qwen3" if "qwen3" in name else "llama3")
    assert producer["entries"]["skipped_entries"] == ["dataloader", "lr_scheduler", "optimizer", "train_state"]
    assert "layers.0.attention.qkv_linear.wq.weight" in producer["entries"]["model_entries"]
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(fixture_dir(name) / "checkpoint")).read_metadata().state_dict_metadata
    for state in ("optimizer.state.", "lr_scheduler.", "dataloader.", "train_state."):
        assert any(key.startswith(state) for key in saved), state


def test_merge_is_bit_identical_to_torchtitans_own_to_hf(merged):
    name, _, out = merged
    got, want = load_output(out), load_output(fixture_dir(name) / "reference")
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key


def test_output_loads_strictly_with_the_reference_logits(merged):
    import transformers

    name, _, out = merged
    config = json.loads((fixture_dir(name) / "reference" / "config.json").read_text())
    cls = getattr(transformers, config["architectures"][0])
    ours, info = cls.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    reference = cls.from_pretrained(fixture_dir(name) / "reference")
    with torch.no_grad():
        assert torch.equal(ours.eval()(INPUT_IDS).logits, reference.eval()(INPUT_IDS).logits)


def test_the_merge_says_what_it_did_and_its_audit_passes(merged):
    name, result, out = merged
    notes = result.plan.notes
    if "qwen3" in name:  # torchtitan's Qwen3 rotates halves as transformers does, and ties the head
        assert result.adapter == "qwen3 (torchtitan convention)"
        assert "torchtitan names mapped to HuggingFace's (24 tensors)" in notes
        assert "dropped lm_head.weight: the config ties lm_head to the embeddings" in notes
        assert not [n for n in notes if "RoPE" in n]
        assert "skipped 60 optimizer/training-state tensors" in notes
    else:
        assert result.adapter == "llama (torchtitan convention)"
        assert "torchtitan names mapped to HuggingFace's (21 tensors)" in notes
        assert ("Q/K rows of 4 tensors permuted from Meta's interleaved RoPE pairs to HF's halves (head_dim 8), as "
                "torchtitan's state-dict adapter does") in notes
        assert "skipped 51 optimizer/training-state tensors" in notes
    report = ckpttool.audit(out)
    assert report.ok, [f.message for f in report.findings]


@pytest.mark.parametrize("name", NAMES)
def test_the_audit_of_the_checkpoint_with_its_config_passes_and_blames_no_pipeline_stage(name):
    src = fixture_dir(name) / "checkpoint"
    report = ckpttool.audit(src, config=fixture_dir(name) / "reference" / "config.json", data=False)
    assert report.ok, [f.message for f in report.findings]
    assert not [f for f in report.findings if "pipeline stage" in f.message]


def test_the_cli_merge_prints_the_convention_and_passes(cli, tmp_path):
    name = NAMES[0]
    out = tmp_path / "out"
    result = cli("merge", fixture_dir(name) / "checkpoint", out, "--config", fixture_dir(name) / "reference")
    assert result.exit_code == 0, result.output
    assert "family:   llama (torchtitan convention)" in result.output
    assert "audit: PASS" in result.output


# --- what is refused -----------------------------------------------------------------------------------------------

def test_without_a_config_the_merge_is_refused_naming_the_convention(cli, tmp_path):
    src = fixture_dir(NAMES[0]) / "checkpoint"
    out = tmp_path / "out"
    result = cli("merge", src, out)
    assert_failed_cleanly(
        result, out,
        f"'{src}': its tensors are named in the torchtitan convention, not HuggingFace's, and no config.json was "
        "found in or next to it",
        "Pass --config path/to/config.json (the config of the HuggingFace model)",
    )


def test_a_torchtitan_toml_given_as_the_config_is_refused_naming_the_file(cli, tmp_path):
    toml = tmp_path / "llama3_debugmodel.toml"
    toml.write_text('[job]\ndump_folder = "./outputs"\n\n[model]\nname = "llama3"\nflavor = "debugmodel"\n\n'
                    "[training]\nsteps = 2\n\n[parallelism]\ndata_parallel_shard_degree = 2\n")
    out = tmp_path / "out"
    result = cli("merge", fixture_dir(NAMES[0]) / "checkpoint", out, "--config", toml)
    assert_failed_cleanly(
        result, out,
        f"'{toml}': is a training job config (TOML with sections [job], [model], [parallelism], [training]), not a "
        "HuggingFace config.json: ckpttool needs the config.json of the HuggingFace model",
        "Pass that one (torchtitan keeps it in hf_assets_path",
    )


def test_torchtitans_own_job_config_json_given_as_the_config_is_refused(cli, tmp_path):
    job = fixture_dir(NAMES[0]) / "job_config.json"
    out = tmp_path / "out"
    result = cli("merge", fixture_dir(NAMES[0]) / "checkpoint", out, "--config", job)
    assert_failed_cleanly(
        result, out,
        f"'{job}': is a training job config (JSON with keys checkpoint, lr_scheduler, model_spec, optimizer, "
        "parallelism, training), not a HuggingFace config.json",
    )


def test_an_moe_tensor_is_refused_by_name():
    layout = _layout({"tok_embeddings.weight": (8, 4), "layers.0.moe.experts.w1": (2, 8, 4)})
    specs, _, problems = torchtitan.CONVENTION.cut(layout, _info(), None)
    assert [s.name for s in specs] == ["model.embed_tokens.weight"]
    assert problems == [("layers.0.moe.experts.w1", "'layers.0.moe.experts.w1': not a torchtitan name ckpttool maps "
                         "to HuggingFace for llama (MoE and MLA layers are not supported yet)")]


# --- the names and the permutation, on made-up layouts --------------------------------------------------------------

def _layout(shapes: dict[str, tuple[int, ...]]) -> Layout:
    tensors = {n: TensorLayout(n, s, "F32", (Piece("f", n, Box.whole(s), "F32", "raw", 0, 4 * int(torch.tensor(s).prod())),))
               for n, s in shapes.items()}
    return Layout("/titan", "dcp", tensors)


def _info(model_type: str = "llama", tied: bool = False) -> ModelInfo:
    config = {"model_type": model_type, "hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2}
    disk = {} if tied else {"lm_head.weight": (8, 16)}
    return ModelInfo(model_type, config, {}, disk, tied={"lm_head.weight": "model.embed_tokens.weight"} if tied else {})


def _meta_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """torchtitan's ``Llama3StateDictAdapter._permute`` (HF's conversion script), written out."""
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def test_the_names_before_0_3_are_recognised_and_mapped_too():
    """torchtitan 0.1/0.2 name ``attention.wq`` (no ``qkv_linear``) and the head ``output``."""
    layout = _layout({"tok_embeddings.weight": (8, 16), "layers.0.attention.wq.weight": (16, 16),
                      "layers.0.attention.wk.weight": (8, 16), "layers.0.feed_forward.w3.weight": (32, 16),
                      "layers.0.ffn_norm.weight": (16,), "output.weight": (8, 16)})
    assert convention_for(layout) is torchtitan.CONVENTION
    specs, _, problems = torchtitan.CONVENTION.cut(layout, _info(), None)
    assert problems == []
    assert {s.name: s.slices[0].source for s in specs} == {
        "model.embed_tokens.weight": "tok_embeddings.weight",
        "model.layers.0.self_attn.q_proj.weight": "layers.0.attention.wq.weight",
        "model.layers.0.self_attn.k_proj.weight": "layers.0.attention.wk.weight",
        "model.layers.0.mlp.up_proj.weight": "layers.0.feed_forward.w3.weight",
        "model.layers.0.post_attention_layernorm.weight": "layers.0.ffn_norm.weight",
        "lm_head.weight": "output.weight",
    }


@pytest.mark.parametrize("rows, heads", [(16, 4), (8, 2)])
def test_q_and_k_rows_are_permuted_as_torchtitans_adapter_does(rows, heads):
    name = "layers.3.attention.qkv_linear.wq.weight" if rows == 16 else "layers.3.attention.qkv_linear.wk.weight"
    specs, _, _ = torchtitan.CONVENTION.cut(_layout({name: (rows, 16)}), _info(), None)
    w = torch.arange(rows * 16, dtype=torch.float32).reshape(rows, 16)
    assert torch.equal(transform_tensor(specs[0].transform, w), _meta_permute(w, heads))
    assert torch.equal(transform_tensor(specs[0].transform.inverse(), _meta_permute(w, heads)), w)


def test_qwen3_rows_are_not_permuted_and_a_tied_head_is_dropped():
    """torchtitan's Qwen3 rotates halves as transformers does (its adapter permutes nothing)."""
    layout = _layout({"layers.0.attention.qkv_linear.wq.weight": (16, 16), "lm_head.weight": (8, 16),
                      "layers.0.attention.q_norm.weight": (4,)})
    specs, notes, problems = torchtitan.CONVENTION.cut(layout, _info("qwen3", tied=True), None)
    assert problems == [] and all(s.transform is None for s in specs)
    assert [s.name for s in specs] == ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_norm.weight"]
    assert "dropped lm_head.weight: the config ties lm_head to the embeddings" in notes


def test_a_layout_with_transformers_names_is_not_torchtitans():
    assert not torchtitan.CONVENTION.holds_names(["model.norm.weight", "tok_embeddings.weight"], None)
    assert not torchtitan.CONVENTION.holds_names(["model.layers.0.self_attn.q_proj.weight"], None)


def test_a_fixture_copy_with_a_config_beside_it_merges_without_config(tmp_path):
    """A user who copies the HF config.json next to the step folder needs no --config."""
    src = tmp_path / "step-2"
    shutil.copytree(fixture_dir(NAMES[0]) / "checkpoint", src)
    shutil.copy(fixture_dir(NAMES[0]) / "reference" / "config.json", src / "config.json")
    ckpttool.merge(src, tmp_path / "out")
    got, want = load_output(tmp_path / "out"), load_output(fixture_dir(NAMES[0]) / "reference")
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_every_fixture_stays_small():
    for name in NAMES:
        size = sum(p.stat().st_size for p in Path(fixture_dir(name)).rglob("*") if p.is_file())
        assert size < 1_200_000, (name, size)


def test_the_dry_run_names_the_rope_transform_and_reads_nothing(cli, tmp_path):
    name = NAMES[1]
    out = tmp_path / "out"
    result = cli("merge", fixture_dir(name) / "checkpoint", out, "--config", fixture_dir(name) / "reference",
                 "--dry-run", "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["adapter"] == "llama (torchtitan convention)"
    transforms = {t["name"]: t.get("transform") for t in plan["targets"]}
    assert transforms["model.layers.1.self_attn.k_proj.weight"] == "RoPE pairs to halves (head_dim 8)"
    assert transforms["model.layers.1.self_attn.v_proj.weight"] is None
    assert not out.exists()
