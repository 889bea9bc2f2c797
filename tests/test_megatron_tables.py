"""The Megatron readers carry no family tables (issue 29): which dim each local tensor is split on across TP ranks,
and the checks of the training args, are the Megatron-Core convention's (ckpttool.families.conventions.megatron_tp,
megatron_args) and the family adapters' (``args_checks``), told to the readers by the one place that reads a source.

The fixtures are tests/test_megatron.py's and tests/test_gpt_oss.py's (fixtures/make_megatron*.py).
"""

from __future__ import annotations

import argparse
import ast
import json
from dataclasses import replace
from pathlib import Path

import pytest

import ckpttool
from ckpttool.errors import ConfigError, SourceError
from ckpttool.families.registry import MEGATRON_TP, READER_TABLES
from ckpttool.model.architecture import model_info
from ckpttool.readers import read_layout as read_untold
from conftest import FIXTURES, assert_failed_cleanly, tree_digest

READERS = Path(ckpttool.__file__).parent / "readers"
GPT_OSS = FIXTURES / "megatron_gpt_oss_tp2_ep2"
LLAMA = FIXTURES / "megatron_tp2_padvocab"
#: Megatron-Core module names a table of TP splits would hold
MODULES = ("linear_qkv", "linear_fc1", "linear_fc2", "linear_proj", "softmax_offset", "down_proj", "up_proj")


def _strings(path: Path) -> list[tuple[int, str]]:
    """The string constants of a module that are not docstrings (what a table is made of)."""
    tree = ast.parse(path.read_text())
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs]


def test_no_reader_holds_a_table_of_megatron_core_modules():
    found = [f"{path.relative_to(READERS)}:{line}: {text!r}" for path in sorted(READERS.rglob("*.py"))
             for line, text in _strings(path) if any(module in text for module in MODULES)]
    assert found == []


def test_readers_never_import_the_families():
    imports = [f"{path.relative_to(READERS)}: {name}" for path in sorted(READERS.rglob("*.py"))
               for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, (ast.Import, ast.ImportFrom))
               for name in ([a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""])
               if name.startswith("ckpttool.families")]
    assert imports == []


def test_the_convention_tells_both_megatron_readers():
    assert set(READER_TABLES) == {"megatron-dist", "megatron-legacy"}
    assert all(table is MEGATRON_TP for table in READER_TABLES.values())


# ------------------------------------------------------------------------------------------------
# the legacy reader places what the table says, and refuses without one
# ------------------------------------------------------------------------------------------------


def test_the_legacy_reader_places_pieces_by_the_conventions_table():
    """SwiGLU's fc1 is placed as gate[r] and up[r] halves because the table says it is paired; a table that does
    not say so concatenates the ranks (the shape is the same, the boxes are not)."""
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
    told = read_untold(LLAMA / "legacy", tables=READER_TABLES).tensors[fc1]
    plain = read_untold(LLAMA / "legacy", tables={"megatron-legacy": replace(MEGATRON_TP, paired=())}).tensors[fc1]
    assert told.global_shape == plain.global_shape
    rows = told.global_shape[0]
    assert sorted(p.box.offsets[0] for p in told.pieces) == [0, rows // 4, rows // 2, 3 * rows // 4]
    assert sorted(p.box.offsets[0] for p in plain.pieces) == [0, rows // 2]


def test_the_public_read_layout_tells_the_readers():
    proj = ckpttool.read_layout(LLAMA / "legacy").tensors["decoder.layers.0.self_attention.linear_proj.weight"]
    assert sorted(p.box.offsets for p in proj.pieces) == [(0, 0), (0, proj.global_shape[1] // 2)]  # row parallel


def test_the_legacy_reader_untold_refuses_naming_the_source():
    before = tree_digest(LLAMA)
    with pytest.raises(SourceError) as e:
        read_untold(LLAMA / "legacy")
    assert str(e.value) == (
        f"'{LLAMA / 'legacy'}': the megatron-legacy format records no global shapes, and its reader was not told how "
        "Megatron-Core splits each tensor over TP ranks; read it with ckpttool.read_layout, which tells it")
    assert tree_digest(LLAMA) == before


def test_torch_dist_untold_says_its_args_were_not_checked():
    info = model_info(json.loads((LLAMA / "config.json").read_text()))
    notes = read_untold(LLAMA / "torch_dist", model=info).notes
    assert any("were not checked against the config" in note for note in notes)
    assert not any("were not checked" in note for note in ckpttool.read_layout(LLAMA / "torch_dist", model=info).notes)


# ------------------------------------------------------------------------------------------------
# the args: the convention's checks, then the family's (gpt-oss's are live)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_gpt_oss_args_check_refuses_a_megatron_source_of_another_clamp(cli, fmt, tmp_path):
    """The args record activation_func_clamp_value 7.0; a config saying swiglu_limit 10.0 has the same shapes."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**json.loads((GPT_OSS / "config.json").read_text()), "swiglu_limit": 10.0}))
    before = tree_digest(GPT_OSS / fmt)
    out = tmp_path / "out"
    result = cli("merge", GPT_OSS / fmt, out, "--config", config)
    assert_failed_cleanly(result, out, "the checkpoint's training args disagree with the config (1):",
                          "  - activation_func_clamp_value: 10.0 expected (config.json swiglu_limit), found 7.0 in the args",
                          "Pass the config of the model this checkpoint trained (--config).")
    assert tree_digest(GPT_OSS / fmt) == before


def test_gpt_oss_args_check_refuses_an_audit_too(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**json.loads((GPT_OSS / "config.json").read_text()), "sliding_window": 16}))
    with pytest.raises(ConfigError, match=r"window_size: \(15, 0\) expected \(config.json sliding_window - 1\), "
                                          r"found \(7, 0\) in the args"):
        ckpttool.audit(GPT_OSS / "legacy", config=config, data=False)


def test_the_refusal_lists_the_conventions_problems_then_the_familys():
    info = model_info(json.loads((GPT_OSS / "config.json").read_text()))
    args = {"norm_epsilon": 1e-6, "softmax_type": "vanilla"}
    with pytest.raises(ConfigError) as e:
        MEGATRON_TP.check_args(args, info, "common.pt")
    assert str(e.value) == (
        "'common.pt': the checkpoint's training args disagree with the config (2):\n"
        "  - norm_epsilon: config.json rms_norm_eps = 1e-05 expected, found 1e-06 in the args\n"
        "  - softmax_type: 'learnable' expected (gpt-oss's attention sinks), found 'vanilla' in the args\n"
        "Pass the config of the model this checkpoint trained (--config).")
    MEGATRON_TP.check_args(argparse.Namespace(norm_epsilon=1e-5, softmax_type="learnable"), info, "common.pt")
    MEGATRON_TP.check_args(None, info, "common.pt")  # no args: nothing to compare
