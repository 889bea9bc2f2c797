"""Hybrid models as families: Qwen3-Next (gated DeltaNet linear attention beside gated full attention, MoE with a
shared expert) and Nemotron-H (Mamba-2 mixers beside attention and MLP layers, ``hybrid_override_pattern``).

Fixtures from ``fixtures/make_hybrid.py``: ``qwen3_next_fsdp2_dcp`` and ``nemotron_h_fsdp2_dcp`` (torch FSDP2 + DCP
on gloo) and ``qwen3_next_hf_tp2`` (transformers ``DistributedConfig(tp_size=2)`` with Qwen3-Next's own tp plan).
Every merge equals ``reference/`` bit for bit, loads strictly with equal logits and passes the audit; ``split --to
dcp`` goes back bit for bit and cuts the grouped projections as the producer did; the audit names a dropped
linear-attention mixer and a half-TP-cut ``in_proj_qkvz`` as causes of their own.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import ckpttool
from conftest import fixture_dir, load_output, tree_digest
from ckpttool.families import nemotron_h, qwen3_next
from ckpttool.families.hybrid import grouped_rows_note, layer_kinds, missing_mixer_cause
from ckpttool.families.registry import adapter_for
from ckpttool.model.description import ModelInfo
from ckpttool.model.architecture import special_floats

SOURCES = ("qwen3_next_fsdp2_dcp", "qwen3_next_hf_tp2", "nemotron_h_fsdp2_dcp")
TOKENS = [[5, 17, 199, 3, 250, 42, 7, 100, 11, 128, 64, 2]]
QKVZ = "model.layers.0.linear_attn.in_proj_qkvz.weight"


#: transformers is imported here anyway: configs are described in this process (conftest.describe_inline)
pytestmark = pytest.mark.usefixtures("describe_inline")


def assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


def logits_of(directory: Path) -> torch.Tensor:
    """transformers' logits on :data:`TOKENS` after a strict load (no missing, unexpected or mismatched key)."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(directory), output_loading_info=True, dtype=torch.float32)
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info.get(key), (key, info[key])
    with torch.no_grad():
        return model.eval()(torch.tensor(TOKENS)).logits


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    """Each source merged once through the CLI (the source unchanged), shared by the tests that read the output."""
    from click.testing import CliRunner

    from ckpttool.cli import main

    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            src = fixture_dir(name) / "checkpoint"
            out = tmp_path_factory.mktemp(name) / "out"
            before = tree_digest(src)
            result = CliRunner().invoke(main, ["merge", str(src), str(out)])
            assert result.exit_code == 0, result.output
            assert tree_digest(src) == before
            done[name] = out
        return done[name]

    return get


# ------------------------------------------------------------------------------------------------
# merge: bit for bit, strict load, logits, audit PASS
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", SOURCES)
def test_a_hybrid_checkpoint_merges_to_the_reference_bit_for_bit_and_passes_the_audit(name, merged):
    out = merged(name)
    assert_bit_exact(load_output(out), load_output(fixture_dir(name) / "reference"))
    summary = json.loads((out / "ckpttool-audit.json").read_text())["summary"]
    assert (summary["verdict"], summary["errors"], summary["warnings"]) == ("pass", 0, 0), summary


@pytest.mark.parametrize("name", ("qwen3_next_fsdp2_dcp", "nemotron_h_fsdp2_dcp"))
def test_the_merged_model_loads_strictly_with_the_reference_logits(name, merged):
    assert torch.equal(logits_of(merged(name)), logits_of(fixture_dir(name) / "reference"))


@pytest.mark.parametrize("name", SOURCES)
def test_the_audit_of_a_clean_sharded_source_passes_with_its_data(name):
    report = ckpttool.audit(fixture_dir(name) / "checkpoint")
    assert report.data_checked and report.adapter == f"{name.split('_fsdp2')[0].split('_hf')[0]} (its rules)"
    assert not [f.message for f in report.findings if f.severity in ("error", "warning")]


@pytest.mark.parametrize("name, adapter", [("qwen3_next_fsdp2_dcp", "qwen3_next (its rules)"),
                                           ("nemotron_h_fsdp2_dcp", "nemotron_h (its rules)")])
def test_each_family_has_its_adapter(cli, name, adapter):
    info = ModelInfo("qwen3_next", {}, {}, {}, family="qwen2_moe")  # transformers converts it as qwen2_moe
    assert adapter_for(info) is qwen3_next.ADAPTER
    assert adapter_for(ModelInfo("nemotron_h", {}, {}, {}, family="nemotron_h")) is nemotron_h.ADAPTER
    result = cli("merge", fixture_dir(name) / "checkpoint", "--dry-run", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["adapter"] == adapter


# ------------------------------------------------------------------------------------------------
# split --to dcp: back bit for bit, the producer's own cut
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ("qwen3_next_fsdp2_dcp", "nemotron_h_fsdp2_dcp"))
@pytest.mark.parametrize("mesh", [dict(fsdp=2), dict(tp=2), dict(fsdp=2, tp=2)],
                         ids=lambda m: "-".join(f"{k}{n}" for k, n in m.items()))
def test_split_to_dcp_then_merge_gives_the_reference_back_bit_for_bit(name, mesh, tmp_path):
    source = fixture_dir(name) / "reference"
    ckpttool.split(source, tmp_path / "dcp", **mesh)
    ckpttool.merge(tmp_path / "dcp", tmp_path / "hf")
    assert_bit_exact(load_output(tmp_path / "hf"), load_output(source))


def _chunks(metadata) -> dict[str, list]:
    return {name: sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)
            for name, md in metadata.state_dict_metadata.items()}


def test_split_tp2_cuts_every_tensor_as_transformers_tp_plan_did(tmp_path):
    """The chunks of ``split --to dcp --tp 2`` are the producer's (transformers' Qwen3-Next plan on 2 ranks) for
    every tensor; since issue 30's fifth round the routed experts too, which transformers' plan cuts by their packed
    gate/up rows and saves as contiguous halves (``ckpttool/families/expert_tp.py``); before, they were kept whole."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    fixture = fixture_dir("qwen3_next_hf_tp2")
    ckpttool.split(fixture / "reference", tmp_path / "dcp", tp=2)
    ours = _chunks(FileSystemReader(str(tmp_path / "dcp")).read_metadata())
    theirs = _chunks(HuggingFaceStorageReader(str(fixture / "checkpoint")).read_metadata())
    assert sorted(ours) == sorted(theirs)
    differ = sorted(name for name in theirs if ours[name] != theirs[name])
    assert differ == []
    assert ours[QKVZ] == theirs[QKVZ] == [((0, 0), (48, 32)), ((48, 0), (48, 32))]


def test_a_tp_rank_of_in_proj_qkvz_holds_whole_key_head_groups():
    """transformers' Shard(0) of the grouped projections is a cut by key head: the rows transformers' own
    ``fix_query_key_value_ordering`` gives key head h (its q, k, v, z; its b, a) are rank h's rows at tp=2."""
    from transformers import AutoConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    config = AutoConfig.from_pretrained(str(fixture_dir("qwen3_next_fsdp2_dcp") / "reference"))
    with torch.device("meta"):
        layer = Qwen3NextGatedDeltaNet(config, layer_idx=0)
    rows_qkvz, rows_ba = layer.in_proj_qkvz.out_features, layer.in_proj_ba.out_features
    # the row index as the "activation" of each output row: where each row lands after transformers' split
    q, k, v, z, b, a = layer.fix_query_key_value_ordering(
        torch.arange(rows_qkvz, dtype=torch.float32).reshape(1, 1, -1),
        torch.arange(rows_ba, dtype=torch.float32).reshape(1, 1, -1))
    heads, per_v = config.linear_num_key_heads, config.linear_num_value_heads // config.linear_num_key_heads
    for h in range(heads):
        values = slice(h * per_v, (h + 1) * per_v)
        qkvz = torch.cat([q[0, 0, h], k[0, 0, h], v[0, 0, values].flatten(), z[0, 0, values].flatten()])
        ba = torch.cat([b[0, 0, values], a[0, 0, values]])
        per_rank_qkvz, per_rank_ba = rows_qkvz // heads, rows_ba // heads
        assert sorted(qkvz.long().tolist()) == list(range(h * per_rank_qkvz, (h + 1) * per_rank_qkvz))
        assert sorted(ba.long().tolist()) == list(range(h * per_rank_ba, (h + 1) * per_rank_ba))


# ------------------------------------------------------------------------------------------------
# audit: the layer kinds, a dropped linear-attention mixer, a half-TP-cut in_proj_qkvz
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference_tensors():
    ref = fixture_dir("qwen3_next_fsdp2_dcp") / "reference"
    return load_file(ref / "model.safetensors"), ref


def seeded(tmp_path: Path, reference_tensors, change) -> Path:
    """The Qwen3-Next reference with ``change`` applied to its tensors, as an HF directory."""
    tensors, ref = reference_tensors
    out = tmp_path / "seeded"
    shutil.copytree(ref, out)
    save_file(change(dict(tensors)), out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_a_dropped_linear_attention_mixer_is_one_cause_naming_the_layer(cli, tmp_path, reference_tensors):
    src = seeded(tmp_path, reference_tensors,
                 lambda t: {n: v for n, v in t.items() if ".layers.1.linear_attn." not in n})
    before = tree_digest(src)
    result = cli("audit", src, "--json")
    assert result.exit_code == 3, result.output
    causes = json.loads(result.stdout)["causes"]
    assert len(causes) == 1, causes
    assert causes[0]["code"] == "tensor-missing"
    assert causes[0]["cause"] == (
        "the gated DeltaNet linear-attention mixer 'model.layers.{L}.linear_attn' is missing (config layer_types: "
        "'linear_attention'): 7 tensors in layer 1")
    assert len(causes[0]["tensors"]) == 7
    assert tree_digest(src) == before  # the audit writes nothing into the source


def test_a_half_tp_cut_in_proj_qkvz_is_its_own_cause_saying_which_key_heads(cli, tmp_path, reference_tensors):
    src = seeded(tmp_path, reference_tensors, lambda t: {**t, QKVZ: t[QKVZ][:48].clone()})
    before = tree_digest(src)
    result = cli("audit", src, "--json")
    assert result.exit_code == 3, result.output
    causes = json.loads(result.stdout)["causes"]
    assert [(c["code"], c["tensors"]) for c in causes] == [("shape-tp-piece", [QKVZ])]
    assert causes[0]["cause"] == (
        f"'{QKVZ}': shape [48, 32], but the config gives [96, 32] (dim 0 has 48 of 96 (rows: a column-parallel "
        "split): one of 2 TP pieces; the other piece is missing); its rows are grouped per key head (2 groups of 48: "
        "q, k, v, z of one key head each), and these 48 are 1 whole group: one tensor-parallel rank of 2 saved as "
        "the whole tensor")
    assert tree_digest(src) == before


def test_a_missing_layer_names_its_kind(tmp_path, reference_tensors):
    src = seeded(tmp_path, reference_tensors, lambda t: {n: v for n, v in t.items() if ".layers.2." not in n})
    report = ckpttool.audit(src, data=False)
    assert [(c.code, c.cause) for c in report.causes] == [(
        "layers-missing",
        "layers 2 (linear_attention) of 'model.layers' are missing entirely (26 tensors; present: 0..1, 3 of 4 "
        "layers): a pipeline stage missing?")]


def test_layer_kinds_come_from_any_of_the_config_keys():
    assert layer_kinds({"layer_types": ["linear_attention", "full_attention"]}) == ["linear_attention", "full_attention"]
    assert layer_kinds({"layers_block_type": ["mamba", "attention", "mlp"]}) == [
        "linear_attention", "full_attention", "mlp"]  # legacy words, as transformers renames them
    assert layer_kinds({"hybrid_override_pattern": "M*-E"}) == ["linear_attention", "full_attention", "mlp", "moe"]
    assert layer_kinds({"hybrid_override_pattern": "M?"}) is None and layer_kinds({}) is None


def test_a_missing_mamba_mixer_is_named_and_other_tensors_are_not_a_mixer_cause():
    config = {"hybrid_override_pattern": "M*M-"}
    assert missing_mixer_cause("backbone.layers.2.mixer.in_proj.weight", "nemotron_h", config) == (
        "the Mamba-2 mixer 'backbone.layers.{L}.mixer' is missing (config hybrid_override_pattern: "
        "'linear_attention')")
    assert missing_mixer_cause("backbone.layers.2.norm.weight", "nemotron_h", config) is None
    assert missing_mixer_cause("model.layers.0.linear_attn.A_log", "llama", config) is None
    # a layer past the declared kinds, or a full-attention layer's linear_attn: not the declared mixer
    assert missing_mixer_cause("model.layers.9.linear_attn.A_log", "qwen3_next", {"layer_types": ["linear_attention"]}) is None
    assert missing_mixer_cause("model.layers.0.linear_attn.A_log", "qwen3_next", {"layer_types": ["full_attention"]}) is None


def test_rows_that_cut_a_key_head_group_are_not_a_tp_rank():
    config = {"linear_num_key_heads": 4}
    assert grouped_rows_note(QKVZ, (40, 32), (96, 32), config) == (
        "; its rows are grouped per key head (4 groups of 24: q, k, v, z of one key head each), and 40 rows cut a "
        "group: not a cut by key heads (the q/k/v/z of a head are split)")
    assert grouped_rows_note(QKVZ, (48, 32), (96, 32), config).endswith(
        "these 48 are 2 whole groups: one tensor-parallel rank of 2 saved as the whole tensor")
    assert grouped_rows_note("model.layers.0.linear_attn.in_proj_ba.weight", (4, 32), (16, 32), config).startswith(
        "; its rows are grouped per key head (4 groups of 4: b, a of one key head each)")
    assert grouped_rows_note("model.layers.0.self_attn.q_proj.weight", (48, 32), (96, 32), config) == ""
    assert grouped_rows_note(QKVZ, (192, 32), (96, 32), config) == ""


def test_a_non_finite_float_as_transformers_writes_it_is_read_back():
    """Nemotron-H's config.json holds ``time_step_limit: [0.0, {"__float__": "Infinity"}]``."""
    assert special_floats({"a": [0.0, {"__float__": "Infinity"}], "b": {"__float__": "-Infinity"}}) == {
        "a": [0.0, float("inf")], "b": float("-inf")}
    assert special_floats({"__float__": "other"}) == {"__float__": "other"}
    config = json.loads((fixture_dir("nemotron_h_fsdp2_dcp") / "checkpoint" / "config.json").read_text())
    assert config["time_step_limit"] == [0.0, {"__float__": "Infinity"}]


# ------------------------------------------------------------------------------------------------
# Nemotron-H with MoE layers, Falcon-H1, Qwen3.5's language model: tiny models built here, saved by torch DCP in one process
# ------------------------------------------------------------------------------------------------
def _tiny(kind: str):
    from transformers import (FalconH1Config, FalconH1ForCausalLM, NemotronHConfig, NemotronHForCausalLM,
                              Qwen3_5ForCausalLM, Qwen3_5TextConfig)

    common = dict(vocab_size=251, hidden_size=32, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    if kind == "nemotron_h_moe":  # Mamba-2, attention, MoE (4 routed experts, stacked in memory, and a shared one)
        config = NemotronHConfig(hybrid_override_pattern="M*E", num_hidden_layers=3, mamba_num_heads=4,
                                 mamba_head_dim=8, ssm_state_size=8, n_groups=2, chunk_size=8, mamba_d_conv=4,
                                 expand=1, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                 moe_shared_expert_intermediate_size=16, **common)
        return NemotronHForCausalLM(config).float().eval()
    if kind == "qwen3_5_text":  # Qwen3.5's language model: the gated DeltaNet with unfused projections
        config = Qwen3_5TextConfig(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                                   linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
                                   linear_num_key_heads=2, linear_num_value_heads=4, **common)
        return Qwen3_5ForCausalLM(config).float().eval()
    config = FalconH1Config(num_hidden_layers=2, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=2,
                            mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=8, **common)
    return FalconH1ForCausalLM(config).float().eval()


@pytest.fixture(scope="module")
def tiny_saved(tmp_path_factory):
    """``kind`` -> (a DCP of its in-memory state dict with its config, its ``save_pretrained``), made once."""
    import torch.distributed.checkpoint as dcp

    done: dict[str, tuple[Path, Path]] = {}

    def get(kind: str) -> tuple[Path, Path]:
        if kind not in done:
            root = tmp_path_factory.mktemp(kind)
            model = _tiny(kind)
            model.save_pretrained(root / "reference")
            with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process is meant
                warnings.simplefilter("ignore", UserWarning)
                dcp.save(dict(model.state_dict()), checkpoint_id=root / "dcp", no_dist=True)
            model.config.save_pretrained(root / "dcp")
            done[kind] = (root / "dcp", root / "reference")
        return done[kind]

    return get


@pytest.mark.parametrize("kind, mesh", [("nemotron_h_moe", dict(fsdp=2, tp=2, ep=2)), ("falcon_h1", dict(fsdp=2)),
                                        ("qwen3_5_text", dict(fsdp=2, tp=2))])
def test_a_dcp_of_the_model_merges_and_splits_back_bit_for_bit(kind, mesh, tiny_saved, tmp_path):
    """Nemotron-H's experts stacked in memory are saved per expert under backbone.*; Falcon-H1 (every layer a Mamba-2
    mixer and attention side by side) and Qwen3.5's language model keep their in-memory names on disk."""
    dcp_dir, reference = tiny_saved(kind)
    ckpttool.merge(dcp_dir, tmp_path / "hf")
    assert_bit_exact(load_output(tmp_path / "hf"), load_output(reference))
    ckpttool.split(reference, tmp_path / "split", **mesh)
    ckpttool.merge(tmp_path / "split", tmp_path / "back", config=reference)
    assert_bit_exact(load_output(tmp_path / "back"), load_output(reference))


def test_falcon_h1_split_over_tp_is_refused_naming_its_mamba_tensors(cli, tiny_saved, tmp_path):
    """transformers has no tensor-parallel plan for Falcon-H1 (``base_model_tp_plan`` is None): no cut to follow."""
    _, reference = tiny_saved("falcon_h1")
    before = tree_digest(reference)
    out = tmp_path / "out"
    result = cli("split", reference, out, "--to", "dcp", "--tp", "2")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "Error: the mesh tp=2 (2 ranks) does not fit the model (14 problems):" in result.stderr
    assert "  - 'model.layers.0.mamba.in_proj.weight': no tensor-parallel placement is known for it (tp=2)" in result.stderr
    assert not out.exists() and tree_digest(reference) == before


def test_qwen3_5_in_proj_qkv_is_cut_as_transformers_plan_cuts_it(tiny_saved, tmp_path):
    """``colwise_gather_output``: a plain Shard(0) of ``[q; k; v]`` (rank 0 holds the queries and the keys, rank 1
    the values: the output is gathered before the split); the conv1d, A_log, dt_bias and gated norm whole."""
    from torch.distributed.checkpoint import FileSystemReader

    _, reference = tiny_saved("qwen3_5_text")
    ckpttool.split(reference, tmp_path / "dcp", tp=2)
    chunks = _chunks(FileSystemReader(str(tmp_path / "dcp")).read_metadata())
    layer = "model.layers.0.linear_attn."
    assert chunks[layer + "in_proj_qkv.weight"] == [((0, 0), (32, 32)), ((32, 0), (32, 32))]
    assert chunks[layer + "in_proj_b.weight"] == [((0, 0), (2, 32)), ((2, 0), (2, 32))]
    assert chunks[layer + "conv1d.weight"] == [((0, 0, 0), (64, 1, 4))]
    assert chunks[layer + "A_log"] == [((0,), (4,))]


def test_a_dropped_qwen3_5_linear_attention_mixer_is_one_cause(tiny_saved, tmp_path):
    _, reference = tiny_saved("qwen3_5_text")
    src = tmp_path / "seeded"
    shutil.copytree(reference, src)
    tensors = load_file(reference / "model.safetensors")
    save_file({n: t for n, t in tensors.items() if ".linear_attn." not in n}, src / "model.safetensors",
              metadata={"format": "pt"})
    report = ckpttool.audit(src, data=False)
    assert [(c.code, c.cause) for c in report.causes] == [(
        "tensor-missing",
        "the gated DeltaNet linear-attention mixer 'model.layers.{L}.linear_attn' is missing (config layer_types: "
        "'linear_attention'): 9 tensors in layer 0")]


def test_the_release_mtp_module_is_carried_unchecked(cli, tmp_path, reference_tensors):
    """Qwen3-Next releases keep an MTP module (``mtp.*``) that ``Qwen3NextForCausalLM`` ignores on load: merge
    carries it with a note, the audit passes, transformers loads the output strictly."""
    generator = torch.Generator().manual_seed(0)
    mtp = {"mtp.fc.weight": torch.randn(32, 64, generator=generator) * 0.05,
           "mtp.norm.weight": torch.randn(32, generator=generator) * 0.05,
           "mtp.layers.0.input_layernorm.weight": torch.randn(32, generator=generator) * 0.05}
    src = seeded(tmp_path, reference_tensors, lambda t: {**t, **mtp})
    audit = cli("audit", src, "--json")
    assert audit.exit_code == 0, audit.output
    assert json.loads(audit.stdout)["causes"] == []
    result = cli("merge", src, tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert ("note: carried mtp.fc.weight, mtp.layers.0.input_layernorm.weight, mtp.norm.weight unchecked: the "
            "qwen3_next model transformers builds ignores them on load (a release keeps them, e.g. its MTP module)"
            ) in result.output
    assert_bit_exact(load_output(tmp_path / "out"), load_output(src))
    assert torch.equal(logits_of(tmp_path / "out"), logits_of(fixture_dir("qwen3_next_fsdp2_dcp") / "reference"))
