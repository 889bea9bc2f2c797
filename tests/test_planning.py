"""The one entry point from a source to a plan (ckpttool.commands.source), and the family adapter it reports."""

from __future__ import annotations

import json
import shutil

import pytest

from ckpttool.errors import ConfigError, CoverageError
from ckpttool.commands.source import plan_source
from conftest import FIXTURES, fixture_dir


@pytest.mark.parametrize("source, config, adapter", [
    ("llama_tp2_dcp/checkpoint", None, "llama (names as transformers saves them)"),
    ("mixtral_fsdp2_dcp/checkpoint", None, "mixtral (its rules)"),
    ("megatron_ep2_moe/torch_dist", "megatron_ep2_moe/config.json", "mixtral (Megatron-Core convention)"),
    ("megatron_tp2_pp2/legacy", "megatron_tp2_pp2/config.json", "llama (Megatron-Core convention)"),
])
def test_dry_run_and_audit_name_the_family_adapter(cli, source, config, adapter):
    extra = ("--config", FIXTURES / config) if config else ()
    dry = cli("merge", FIXTURES / source, "--dry-run", *extra)
    assert dry.exit_code == 0, dry.output
    assert f"family:   {adapter}" in dry.stdout
    assert json.loads(cli("merge", FIXTURES / source, "--dry-run", "--json", *extra).stdout)["adapter"] == adapter
    audit = cli("audit", FIXTURES / source, "--no-data", "--json", *extra)
    assert json.loads(audit.stdout)["summary"]["adapter"] == adapter
    assert f"family: {adapter}" in cli("audit", FIXTURES / source, "--no-data", *extra).stdout


def test_a_generic_plan_says_why(tmp_path):
    src = tmp_path / "ckpt"
    shutil.copytree(fixture_dir("llama_tp2_dcp") / "checkpoint", src)
    planned = plan_source(src)
    assert planned.generic and planned.adapter == "generic (no config.json found)"
    assert planned.mismatches == () and planned.uncovered == ()


def test_what_does_not_fit_is_data_until_a_merge_refuses(tmp_path):
    src = tmp_path / "llama_tp2_dcp"
    shutil.copytree(fixture_dir("llama_tp2_dcp"), src, ignore=shutil.ignore_patterns("reference"))
    (src / "checkpoint" / "__1_0.distcp").unlink()
    planned = plan_source(src / "checkpoint")  # no error: every uncovered target is listed with its problems
    names = [spec.name for spec, _ in planned.uncovered]
    assert "model.embed_tokens.weight" in names and len(planned.plan.targets) + len(names) == 21
    assert all(problems for _, problems in planned.uncovered)
    with pytest.raises(CoverageError, match="'model.embed_tokens.weight': rows 501..1001 covered by no piece"):
        planned.refuse()
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    planned = plan_source(src / "checkpoint")
    assert "model.layers.2.input_layernorm.weight" in [m.name for m in planned.mismatches if m.kind == "missing"]
    with pytest.raises(ConfigError, match="does not match its llama config"):
        planned.refuse()  # the config's misfit comes before coverage, as a merge reports it
