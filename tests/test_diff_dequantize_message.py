"""``diff --dequantize`` of a quantized checkpoint without a config: refused in the diff's own words (its option,
and comparing stored bytes instead), never the merge's ``--dtype``."""

from __future__ import annotations

import pytest
from test_quantized import QWEN3, checkpoint, rewrite

import ckpttool
from ckpttool.errors import ConfigError

ASKED = ("dequantize=True asks to compare dequantized values, but there is no config.json to say how: 14 tensors are "
         "quantized ('model.layers.0.mlp.down_proj.weight', ...) and only the config's quantization_config gives their "
         "block size. Give the release's config.json, or diff without dequantize=True to compare the stored bytes")


@pytest.fixture
def bare(tmp_path):
    """The Qwen3 FP8 fixture without its config.json."""
    out = rewrite(checkpoint(QWEN3), tmp_path / "bare", lambda tensors, config: None)
    (out / "config.json").unlink()
    return out


def test_the_api_names_dequantize_not_dtype(bare):
    with pytest.raises(ConfigError) as e:
        ckpttool.diff(bare, checkpoint(QWEN3), dequantize=True)
    assert ASKED in str(e.value)
    assert "dtype=" not in str(e.value) and "merge without" not in str(e.value)
    assert ckpttool.diff(bare, checkpoint(QWEN3)).equal  # by bytes (no --dequantize) the same tensors


def test_the_command_line_names_the_option(bare, cli):
    result = cli("diff", bare, checkpoint(QWEN3), "--dequantize")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert ASKED.replace("dequantize=True", "--dequantize") in result.stderr
    assert "--dtype" not in result.stderr


def test_a_merge_keeps_its_own_words(bare, tmp_path):
    with pytest.raises(ConfigError, match=r"dtype= asks to dequantize, but there is no config.json to say how: 14 "
                       r"tensors .* or merge without a dtype to keep the checkpoint quantized"):
        ckpttool.merge(bare, tmp_path / "out", dtype="bfloat16")
