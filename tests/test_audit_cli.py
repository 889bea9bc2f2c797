"""The ``audit`` and ``diff`` commands, the merge's own audit, and the HTML report in a real Chromium."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

import ckpttool
from conftest import assert_failed_cleanly, fixture_dir, load_output, tree_digest
from test_audit import MOE, reference, write_hf

LLAMA = "llama_fsdp2_dcp"


def dead_expert_mixtral(tmp_path):
    tensors, config = reference("mixtral_fsdp2_dcp")
    for w in ("w1", "w2", "w3"):
        tensors[MOE.format(layer=1, expert=2, w=w)].zero_()
    return write_hf(tmp_path / "faulty", tensors, config)


# ------------------------------------------------------------------------------------------------- audit


def test_audit_of_a_clean_checkpoint_exits_0(cli):
    result = cli("audit", fixture_dir(LLAMA) / "checkpoint")
    assert result.exit_code == 0, result.output
    assert "audit: PASS, 0 errors, 0 warnings, 0 info (21 tensors, data and headers)" in result.stdout


def test_audit_errors_exit_3_with_a_table(cli, tmp_path):
    result = cli("audit", dead_expert_mixtral(tmp_path))
    assert result.exit_code == 3
    assert ("error    zero-tensor  expert 2 of 'model.layers.{L}.block_sparse_moe.experts' in layer 1 (3 tensors): "
            "a weight that is all zeros") in result.stdout  # one cause, its three tensors under it
    assert "         - model.layers.1.block_sparse_moe.experts.2.w1.weight" in result.stdout
    assert "audit: FAIL, 3 errors" in result.stdout


def test_audit_json_is_one_document(cli, tmp_path):
    result = cli("audit", dead_expert_mixtral(tmp_path), "--json")
    assert result.exit_code == 3
    doc = json.loads(result.stdout)
    assert doc["summary"]["verdict"] == "fail"
    assert {f["code"] for f in doc["findings"]} == {"zero-tensor"}
    assert result.stderr == ""


def test_strict_turns_warnings_into_errors(cli, tmp_path):
    tensors, config = reference(LLAMA)
    tensors["model.layers.1.mlp.up_proj.weight"].fill_(0.5)  # a constant matrix: a warning
    hf = write_hf(tmp_path / "hf", tensors, config)
    assert cli("audit", hf).exit_code == 0
    strict = cli("audit", hf, "--strict", "-q")
    assert strict.exit_code == 3
    assert "error    constant-tensor" in strict.stdout


def test_no_data_reads_headers_only(cli, tmp_path):
    result = cli("audit", dead_expert_mixtral(tmp_path), "--no-data")
    assert result.exit_code == 0  # a zeroed expert has the right shape: only the data checks can see it
    assert "(41 tensors, headers only)" in result.stdout


def test_unreadable_input_exits_1(cli, tmp_path):
    result = cli("audit", tmp_path / "nope")
    assert result.exit_code == 1
    assert f"Error: '{tmp_path / 'nope'}': no such file or directory" in result.stderr
    assert "Traceback" not in result.output


def test_usage_error_exits_2(cli):
    assert cli("audit", fixture_dir(LLAMA) / "checkpoint", "--format", "zip").exit_code == 2


def test_html_report_that_cannot_be_written(cli, tmp_path):
    result = cli("audit", fixture_dir(LLAMA) / "checkpoint", "--no-data", "--html", tmp_path / "no" / "r.html")
    assert result.exit_code == 1
    assert f"Error: '{tmp_path / 'no' / 'r.html'}': cannot write the HTML report: No such file or directory" in result.stderr


# -------------------------------------------------------------------------------------- merge's own audit


def test_merge_writes_its_audit_report(cli, tmp_path):
    out = tmp_path / "hf"
    result = cli("merge", fixture_dir(LLAMA) / "checkpoint", out)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "ckpttool-audit.json").read_text())
    assert report["summary"]["verdict"] == "pass" and report["summary"]["data_checked"] is False
    assert report["summary"]["source"] == str(out)
    assert f"audit: PASS, 0 errors, 0 warnings, 0 info (21 tensors, headers only) (report: {out}/ckpttool-audit.json)" in result.stderr


def test_merge_refuses_to_publish_an_output_that_fails_its_audit(cli, tmp_path):
    tensors, config = reference(LLAMA)
    name = "model.layers.0.input_layernorm.weight"
    tensors[name] = tensors[name].to(torch.bfloat16)
    src = write_hf(tmp_path / "src", tensors, config)
    before = tree_digest(src)
    out = tmp_path / "hf"
    result = cli("merge", src, out)
    assert_failed_cleanly(
        result, out,
        f"Error: the merged checkpoint fails its audit (1 error); nothing was published at '{out}':",
        f"  - [dtype-mix] '{name}' is BF16, but 20 of 21 floating-point tensors are F32",
        "Pass --no-audit to publish it anyway.",
    )
    assert tree_digest(src) == before
    published = cli("merge", src, out, "--no-audit")
    assert published.exit_code == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert load_file(out / "model.safetensors")[name].dtype == torch.bfloat16


def test_merge_of_unrecorded_vocab_padding_says_why_it_will_not_strip_it(cli, tmp_path):
    tensors, config = reference(LLAMA)
    tensors["model.embed_tokens.weight"] = torch.cat([tensors["model.embed_tokens.weight"], torch.zeros(23, 32)])
    out = tmp_path / "hf"
    assert_failed_cleanly(
        cli("merge", write_hf(tmp_path / "src", tensors, config), out), out,
        "'model.embed_tokens.weight': shape [1024, 32], but the config gives [1001, 32] (vocab padding not stripped: "
        "1024 rows is vocab_size 1001 padded to a multiple of 32; rows 1001..1024 are padding)",
        "ckpttool strips padding the source recorded (sidecar 'padding') and never guesses it.",
    )


def test_merge_result_carries_the_report(tmp_path):
    result = ckpttool.merge(fixture_dir("mixtral_fsdp2_dcp") / "checkpoint", tmp_path / "hf")
    assert result.audit is not None and result.audit.ok
    assert result.to_json()["audit"]["summary"]["tensors"] == 41


# ------------------------------------------------------------------------------------------------- diff


def test_merges_of_different_layouts_are_equal(cli, tmp_path):
    ckpttool.merge(fixture_dir("llama_fsdp2_dcp") / "checkpoint", tmp_path / "fsdp")
    ckpttool.merge(fixture_dir("llama_tp2_dcp") / "checkpoint", tmp_path / "tp")
    result = cli("diff", tmp_path / "fsdp", tmp_path / "tp")
    assert result.exit_code == 0, result.output
    assert "equal: 21 tensors identical" in result.stdout


def test_sharded_sources_compare_without_merging(cli):
    result = cli("diff", fixture_dir("llama_tp2_fsdp2_dcp") / "checkpoint", fixture_dir("llama_hf_tp2") / "checkpoint", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["equal"] and doc["tensors"] == 21 and doc["differences"] == []
    # the fingerprints do not depend on the layout: they are those of the reference's tensors
    reference_prints = ckpttool.audit(fixture_dir(LLAMA) / "reference").stats
    assert doc["fingerprints"] == {s.name: s.fingerprint for s in reference_prints}


def test_one_changed_element_is_found_and_named(cli, tmp_path):
    ref = fixture_dir(LLAMA) / "reference"
    tensors = load_output(ref)
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name][5, 7] += 0.125
    changed = tmp_path / "changed"
    changed.mkdir()
    shutil.copy(ref / "config.json", changed / "config.json")
    save_file(tensors, str(changed / "model.safetensors"), metadata={"format": "pt"})
    result = cli("diff", fixture_dir("llama_tp2_dcp") / "checkpoint", changed)
    assert result.exit_code == 3
    assert f"  {name}: 1 of 2048 elements differ, max |A-B| = 0.125" in result.stdout
    assert ("different: 0 tensors only in A, 0 only in B, 20 in both and equal, 1 in both and different "
            "(A has 21 tensors, B 21)\n") in result.stdout


def test_diff_names_missing_and_reshaped_tensors(tmp_path):
    tensors, config = reference(LLAMA)
    del tensors["model.norm.weight"]
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"][:32].contiguous()
    tensors["model.layers.0.self_attn.q_proj.weight"] = tensors["model.layers.0.self_attn.q_proj.weight"].double()
    b = write_hf(tmp_path / "b", tensors, config)
    (b / "config.json").unlink()  # B is read generically: its names as stored
    result = ckpttool.diff(fixture_dir(LLAMA) / "reference", b)
    got = {d.name: d.describe() for d in result.differences}
    assert got == {
        "model.norm.weight": "only in A (F32 [32])",
        "model.layers.0.mlp.up_proj.weight": "shapes differ: A F32 [64, 32], B F32 [32, 32]",
        "model.layers.0.self_attn.q_proj.weight": "dtypes differ (A F32 [32, 32], B F64 [32, 32]); the values are equal",
    }


def test_diff_of_an_incomplete_source_is_an_error(cli, copy_fixture):
    src = copy_fixture("llama_tp2_dcp")
    (src / "__1_0.distcp").unlink()
    result = cli("diff", src, fixture_dir(LLAMA) / "reference")
    assert result.exit_code == 1
    assert "rows 501..1001 covered by no piece" in result.stderr


# ------------------------------------------------------------------------------------ HTML in Chromium

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
HEADLESS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.mark.skipif(CHROMIUM is None and os.environ.get("CKPTTOOL_REQUIRE_CHROMIUM") != "1",
                    reason="no chromium on PATH (scripts/test.sh, which CI runs, installs it and requires this test)")
def test_html_report_renders_in_chromium_and_shows_the_findings(cli, tmp_path):
    assert CHROMIUM is not None, "CKPTTOOL_REQUIRE_CHROMIUM=1 but no chromium on PATH"
    page = tmp_path / "report.html"
    result = cli("audit", dead_expert_mixtral(tmp_path), "--html", page)
    assert result.exit_code == 3
    browser = [CHROMIUM, *HEADLESS, f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*browser, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120, check=True).stdout
    assert '<span class="verdict fail" id="verdict">FAIL</span>' in dom
    for w in ("w1", "w2", "w3"):
        assert f'<td><code>{MOE.format(layer=1, expert=2, w=w)}</code></td>' in dom
    assert dom.count('<tr class="finding error">') == 3
    assert dom.count("<svg") >= 5  # per-layer charts: attention, norms, gate
    assert 'class="flag" style="background:#212121;color:#fff" title="model.layers.1.block_sparse_moe.experts.2.w1.weight"' in dom
    shot = tmp_path / "report.png"
    subprocess.run([*browser, f"--screenshot={shot}", "--window-size=1280,2000", page.as_uri()],
                   capture_output=True, timeout=120, check=True)
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert int.from_bytes(png[16:20], "big") == 1280 and len(png) > 20_000  # a rendered page, not a blank one
