"""No PASS for an output transformers cannot use: a merge without a config says so on stderr, in its JSON and
in the audit; a merge refused for a tensor that is wrong as saved never suggests dropping the config."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import torch

from conftest import FIXTURES, assert_failed_cleanly, fixture_dir

UNCHECKED = "tensor names are kept as the source recorded them and nothing was checked against an architecture"
MISSING = (
    "no config.json beside the weights: transformers cannot load this directory (from_pretrained reads config.json "
    "first); its names and shapes are not checked against an architecture. Merge again with the model's config, or "
    "copy its config.json here"
)


def _bare_source(tmp_path: Path) -> Path:
    """The Llama TP=2 DCP checkpoint with no config.json in or next to it."""
    src = tmp_path / "bare" / "checkpoint"
    shutil.copytree(fixture_dir("llama_tp2_dcp") / "checkpoint", src)
    return src


def test_a_merge_without_config_warns_on_stderr_and_its_audit_does_not_pass_bare(cli, tmp_path):
    out = tmp_path / "out"
    result = cli("merge", _bare_source(tmp_path), out)
    assert result.exit_code == 0, result.output
    assert (f"warning: generic merge (no config.json found): {UNCHECKED}; transformers cannot load '{out}' without a "
            "config.json (merge again with --config)\n") in result.stderr
    assert (f"audit: PASS WITH WARNINGS, 0 errors, 1 warning, 0 info (21 tensors, headers only) (report: "
            f"{out}/ckpttool-audit.json)") in result.stderr
    report = json.loads((out / "ckpttool-audit.json").read_text())
    assert report["findings"] == [
        {"code": "config-missing", "severity": "warning", "tensor": None, "file": "config.json", "message": MISSING},
    ]
    assert not (out / "config.json").exists()


def test_the_audit_of_an_output_without_config_warns(cli, tmp_path):
    out = tmp_path / "out"
    assert cli("merge", _bare_source(tmp_path), out, "-q").exit_code == 0
    audit = cli("audit", out, "--no-data")
    assert audit.exit_code == 0, audit.output
    assert f"warning  config-missing  config.json\n         {MISSING}\n" in audit.stdout
    assert "audit: PASS WITH WARNINGS, 0 errors, 1 warning, 0 info (21 tensors, headers only)" in audit.stdout
    assert cli("audit", out, "--no-data", "--strict").exit_code == 3
    html = tmp_path / "report.html"
    assert cli("audit", out, "--no-data", "--html", html).exit_code == 0
    assert '<span class="verdict pass" id="verdict">PASS WITH WARNINGS</span>' in html.read_text()
    # a config from elsewhere checks names and shapes, but transformers still finds none in the directory
    given = cli("audit", out, "--no-data", "--json", "--config", FIXTURES / "llama_tp2_dcp" / "config.json")
    findings = json.loads(given.stdout)["findings"]
    assert [(f["code"], f["severity"]) for f in findings] == [("config-missing", "warning")]
    assert findings[0]["message"] == (
        "no config.json beside the weights: transformers cannot load this directory (from_pretrained reads "
        "config.json first). Merge again with the model's config, or copy its config.json here"
    )


def test_the_json_says_generic(cli, tmp_path):
    generic = cli("merge", _bare_source(tmp_path), tmp_path / "generic", "--json")
    assert generic.exit_code == 0, generic.output
    doc = json.loads(generic.stdout)
    assert doc["generic"] is True and doc["config"] is None
    assert [f["code"] for f in doc["audit"]["findings"]] == ["config-missing"]
    assert "warning: generic merge" not in generic.stderr  # --json: the document says it
    mapped = cli("merge", fixture_dir("llama_tp2_dcp") / "checkpoint", tmp_path / "mapped", "--json")
    assert mapped.exit_code == 0, mapped.output
    doc = json.loads(mapped.stdout)
    assert doc["generic"] is False and doc["audit"]["findings"] == []
    dry = cli("merge", _bare_source(tmp_path / "dry"), tmp_path / "dry-out", "--dry-run", "--json")
    assert json.loads(dry.stdout)["generic"] is True


def test_a_mapped_merge_passes_bare_and_prints_no_warning(cli, tmp_path):
    result = cli("merge", fixture_dir("llama_tp2_dcp") / "checkpoint", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "warning:" not in result.stderr
    assert "audit: PASS, 0 errors, 0 warnings, 0 info" in result.stderr


def test_a_config_transformers_cannot_build_is_a_generic_merge_too(cli, tmp_path):
    import torch.distributed.checkpoint as dcp

    src = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"encoder.w": torch.arange(6.0).reshape(2, 3)}, checkpoint_id=str(src))
    (src / "config.json").write_text(json.dumps({"model_type": "not-a-real-model", "vocab_size": 3}))
    result = cli("merge", src, tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert (f"warning: generic merge (transformers has no causal LM for the config '{src / 'config.json'}'): "
            f"{UNCHECKED}\n") in result.stderr
    report = json.loads((tmp_path / "out" / "ckpttool-audit.json").read_text())
    assert [(f["code"], f["message"]) for f in report["findings"]] == [
        ("no-config", "transformers has no causal LM for model_type 'not-a-real-model': names and shapes are not "
                      "checked against an architecture"),
    ]
    assert "audit: PASS, 0 errors, 0 warnings, 1 info" in result.stderr


def test_the_vocab_piece_refusal_never_suggests_dropping_the_config(cli, tmp_path):
    """The seed incident: embed_tokens is one TP piece [512, 32] of a padded vocab. Without the config, a merge
    would publish that piece as the embedding, so the error must not offer it."""
    out = tmp_path / "out"
    result = cli("merge", fixture_dir("colossalai_llama_tp2_vocab_piece") / "checkpoint", out)
    assert_failed_cleanly(
        result, out,
        "512 rows is one of 2 TP pieces of a vocab padded to 1024 (multiple of 128x2); the other piece is missing)\n"
        "A tensor above is wrong as saved (vocab-tp-piece): a merge without a config would publish it unchanged, so "
        "do not drop the config. Save the checkpoint again with every piece, or pass the config the model was trained "
        "with (--config) if this one is not it.",
    )
    assert "generic" not in result.stderr and "no config" not in result.stderr


def test_a_config_of_another_depth_still_offers_a_generic_merge(cli, tmp_path):
    """Missing layers say nothing about the tensors that are there: a wrong config is as likely."""
    src = tmp_path / "llama" / "checkpoint"
    shutil.copytree(fixture_dir("llama_tp2_dcp") / "checkpoint", src)
    config = json.loads((FIXTURES / "llama_tp2_dcp" / "config.json").read_text())
    config["num_hidden_layers"] += 1
    (src.parent / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    assert_failed_cleanly(
        cli("merge", src, out), out,
        "expected by the config but not in the checkpoint",
        "\nPass the config the model was trained with (--config), or no config for a generic merge.",
    )
