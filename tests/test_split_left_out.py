"""``split --to dcp`` in transformers' names says what of the source its DCP cannot hold: a DeepSeek-V3 release's MTP
layers, which transformers' causal LM does not build, were left out without a word before."""

from __future__ import annotations

import json
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
RELEASE = FIXTURES / "deepseek_v3_hf_mtp" / "checkpoint"  # DeepSeek-V3-like with one MTP layer at model.layers.3


def test_split_to_dcp_names_the_mtp_layers_it_leaves_out(cli, tmp_path):
    result = cli("split", RELEASE, tmp_path / "out", "--to", "dcp", "--fsdp", "2", "--json")
    assert result.exit_code == 0, result.output
    notes = json.loads(result.output)["notes"]
    left = [n for n in notes if "left out" in n]
    assert len(left) == 1, notes
    held = json.loads((RELEASE / "model.safetensors.index.json").read_text())["weight_map"]
    mtp = sorted(n for n in held if n.startswith("model.layers.3."))
    assert left[0].startswith(f"{len(mtp)} source tensors left out: transformers' deepseek_v3 model holds no such tensor")
    assert f"'{mtp[0]}'" in left[0] and f"and {len(mtp) - 3} more" in left[0]
    assert "its MTP layers are kept by --to megatron" in left[0]


def test_split_to_megatron_and_a_source_without_mtp_note_nothing_left_out(cli, tmp_path):
    plain = FIXTURES / "deepseek_v3_hf_mtp" / "reference"  # the same model saved without its MTP layer
    result = cli("split", plain, tmp_path / "out", "--to", "dcp", "--fsdp", "2", "--json")
    assert result.exit_code == 0, result.output
    assert not [n for n in json.loads(result.output)["notes"] if "left out" in n]
