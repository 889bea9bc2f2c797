"""Findings grouped by root cause (``ckpttool.audit.causes``): seeded faults through the CLI, in the table and JSON."""

from __future__ import annotations

import json
import sys

from test_audit import MOE, reference, write_hf

from ckpttool.audit.causes import span
from ckpttool.cli.show import CAUSE_LINES
from ckpttool.io.sidecar import PieceSpec, save_shard

ROUTER = "model.layers.{layer}.block_sparse_moe.gate.weight"


def causes(result) -> list[dict]:
    return json.loads(result.stdout)["causes"]


def diverged_router(tmp_path):
    """The Mixtral reference on 8 ranks, every tensor replicated; ranks 1-7 hold another router in every layer."""
    tensors, config = reference("mixtral_fsdp2_dcp")
    root = tmp_path / "tp8"
    for rank in range(8):
        local = {name: t.clone() for name, t in tensors.items()}
        for layer in (0, 1):
            local[ROUTER.format(layer=layer)] += 0.01 if rank else 0.0
        save_shard(local, {n: PieceSpec.replicated(tuple(t.shape)) for n, t in local.items()}, root, rank=rank,
                   world_size=8)
    (root / "config.json").write_text(json.dumps(config))
    return root


def test_a_missing_rank_file_is_one_cause_naming_the_file(cli, copy_fixture):
    src = copy_fixture("llama_tp2_dcp")
    (src / "__1_0.distcp").unlink()
    result = cli("audit", src)
    assert result.exit_code == 3
    lines = result.stdout.splitlines()
    assert lines[0] == "error    coverage  file '__1_0.distcp' is missing: 21 tensors uncovered"
    assert lines[1].startswith("         e.g. 'lm_head.weight': rows 501..1001 covered by no piece")
    assert lines[2:7] == [f"         - {n}" for n in ("lm_head.weight", "model.embed_tokens.weight",
                                                       "model.layers.0.input_layernorm.weight",
                                                       "model.layers.0.mlp.down_proj.weight",
                                                       "model.layers.0.mlp.gate_proj.weight")]
    assert lines[7] == "         ... and 16 more (--json lists them all)"
    assert lines[-1] == "audit: FAIL, 21 errors, 0 warnings, 0 info (21 tensors, data and headers)"  # counts unchanged

    doc = json.loads(cli("audit", src, "--json").stdout)
    coverage = [c for c in doc["causes"] if c["code"] == "coverage"]
    assert len(coverage) == 1 and coverage[0]["count"] == 21 and len(coverage[0]["tensors"]) == 21
    assert coverage[0]["severity"] == "error" and "'__1_0.distcp' is missing" in coverage[0]["cause"]
    # the per-tensor findings are still there, as before, with what the grouping read
    per_tensor = [f for f in doc["findings"] if f["code"] == "coverage"]
    assert len(per_tensor) == 21 and {f["file"] for f in per_tensor} == {"__1_0.distcp"}
    assert per_tensor[0]["detail"] == {"missing_file": "__1_0.distcp"}
    assert doc["summary"]["errors"] == 21 and doc["summary"]["causes"] == 1 and doc["summary"]["verdict"] == "fail"


def test_a_router_diverged_on_seven_ranks_in_every_layer_is_one_cause(cli, tmp_path):
    src = diverged_router(tmp_path)
    result = cli("audit", src)
    assert result.exit_code == 3
    assert result.stdout.splitlines()[0] == (
        "error    replica-divergence  'model.layers.{L}.block_sparse_moe.gate.weight' diverges between rank 0 and "
        "ranks 1-7 in layers 0-1"
    )
    assert "audit: FAIL, 14 errors" in result.stdout  # 7 copies x 2 layers, each still a finding
    (cause,) = causes(cli("audit", src, "--json"))
    assert cause["count"] == 2 and cause["tensors"] == [ROUTER.format(layer=0), ROUTER.format(layer=1)]


def test_a_dead_expert_in_every_layer_is_one_cause(cli, tmp_path):
    tensors, config = reference("mixtral_fsdp2_dcp")
    for layer in (0, 1):
        for w in ("w1", "w2", "w3"):
            tensors[MOE.format(layer=layer, expert=2, w=w)].zero_()
    result = cli("audit", write_hf(tmp_path / "hf", tensors, config), "--json")
    assert result.exit_code == 3
    (cause,) = causes(result)
    assert cause["cause"] == ("expert 2 of 'model.layers.{L}.block_sparse_moe.experts' in layers 0-1 (6 tensors): "
                              "a weight that is all zeros (a dead expert, a zero-filled missing piece)")
    assert cause["code"] == "zero-tensor" and cause["count"] == 6


def test_a_missing_expert_in_every_layer_is_one_cause(cli, tmp_path):
    tensors, config = reference("mixtral_fsdp2_dcp")
    for layer in (0, 1):
        for w in ("w1", "w2", "w3"):
            del tensors[MOE.format(layer=layer, expert=3, w=w)]
    result = cli("audit", write_hf(tmp_path / "hf", tensors, config), "--json")
    assert result.exit_code == 3
    (cause,) = causes(result)
    assert cause["code"] == "expert-missing" and cause["count"] == 2
    assert cause["cause"].startswith("expert 3 of 'model.layers.{L}.block_sparse_moe.experts' in layers 0-1 (2 tensors)")
    assert cause["tensors"] == ["model.layers.0.block_sparse_moe.experts.3", "model.layers.1.block_sparse_moe.experts.3"]


def test_a_single_finding_keeps_its_message_and_strict_promotes_its_cause(cli, tmp_path):
    tensors, config = reference("llama_fsdp2_dcp")
    tensors["model.layers.1.mlp.up_proj.weight"].fill_(0.5)
    hf = write_hf(tmp_path / "hf", tensors, config)
    result = cli("audit", hf)
    assert result.exit_code == 0
    assert result.stdout.splitlines()[:2] == [
        "warning  constant-tensor  model.layers.1.mlp.up_proj.weight",
        "         'model.layers.1.mlp.up_proj.weight' is 0.5 everywhere (2048 elements)",
    ]
    strict = cli("audit", hf, "--strict", "--json")
    assert strict.exit_code == 3
    assert [(c["severity"], c["code"]) for c in causes(strict)] == [("error", "constant-tensor")]


def test_quiet_lists_only_the_causes_that_are_errors(cli, tmp_path):
    tensors, config = reference("llama_fsdp2_dcp")
    tensors["model.layers.1.mlp.up_proj.weight"].fill_(0.5)  # a warning
    tensors["model.layers.0.mlp.down_proj.weight"].zero_()  # an error
    hf = write_hf(tmp_path / "hf", tensors, config)
    assert "warning  constant-tensor" in cli("audit", hf).stdout
    quiet = cli("audit", hf, "-q")
    assert quiet.exit_code == 3
    assert quiet.stdout.splitlines()[0] == "error    zero-tensor  model.layers.0.mlp.down_proj.weight"
    assert "constant-tensor" not in quiet.stdout


def test_indices_are_written_as_ranges():
    assert span([7, 0, 1, 2, 5, 8, 2]) == "0-2, 5, 7-8"
    assert span([3]) == "3" and span([]) == ""


def test_ranks_are_read_out_of_the_file_names_of_every_format():
    from ckpttool.audit.causes import _ranks

    assert _ranks(["rank-00003-of-00008.safetensors", "mp_rank_01/model_optim_rng.pt", "__2_0.distcp"]) == "ranks 1-3"
    assert _ranks(["shard.safetensors"]) == "'shard.safetensors'"


def test_the_table_stays_short_on_a_91k_tensor_checkpoint(cli, monkeypatch):
    """DeepSeek-V3's size: 61 layers of 256 experts. One missing rank file uncovers 47k expert tensors and 44k
    others; one router diverged on ranks 1-7 in every layer. Two causes, a dozen lines each at most."""
    from ckpttool.audit.causes import group_findings
    from ckpttool.findings import Report, finding

    names = [f"model.layers.{layer}.mlp.experts.{e}.{w}.weight" for layer in range(61) for e in range(256)
             for w in ("gate_proj", "up_proj", "down_proj")]
    names += [f"model.layers.{layer}.extra.{i}.weight" for layer in range(61) for i in range(730)]
    found = [finding("coverage", f"'{n}': rows 0..7 covered by no piece", tensor=n, file="__3_0.distcp",
                     detail=(("missing_file", "__3_0.distcp"),)) for n in names]
    found += [finding("replica-divergence", f"'{ROUTER}': copies differ", tensor=f"model.layers.{layer}.mlp.gate.weight",
                      file=f"__{rank}_0.distcp", detail=(("reference", "__0_0.distcp"),))
              for layer in range(61) for rank in range(1, 8)]
    report = Report("ckpt", "dcp", None, None, False, len(names), tuple(found), causes=group_findings(found))
    monkeypatch.setattr(sys.modules["ckpttool.audit"], "audit", lambda *args, **kwargs: report)
    result = cli("audit", "ckpt", "--no-data")
    assert result.exit_code == 3
    lines = result.stdout.splitlines()
    assert len(names) > 91_000 and len(lines) <= 2 * (2 + CAUSE_LINES + 1) + 1
    assert lines[0] == f"error    coverage            file '__3_0.distcp' is missing: {len(names)} tensors uncovered"
    assert "replica-divergence  'model.layers.{L}.mlp.gate.weight' diverges between rank 0 and ranks 1-7 in layers 0-60" in result.stdout
    assert lines[-1].startswith(f"audit: FAIL, {len(found)} errors")
