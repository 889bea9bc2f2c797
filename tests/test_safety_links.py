"""Symlinks are followed only while they stay inside the source, for every format.

For each reader a committed fixture is copied into tmp, and one file the reader opens (and, where the format has
folders, one folder) is replaced by a symlink to a copy placed outside the source: ``ckpttool merge`` exits 1 with a
message naming the link, writes nothing, and leaves the outside copy as it was. The same link to a copy kept inside
the source merges. Names taken from the file system are shown escaped (a newline in a universal checkpoint's
parameter folder cannot forge a line of the message).
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from ckpttool.io.sidecar import SUFFIX
from conftest import FIXTURES, assert_failed_cleanly, tree_digest
from test_sidecar import name as sidecar_name
from test_sidecar import save_seed_checkpoint


@dataclass(frozen=True)
class Case:
    """A source: the fixture folder it is copied from (under fixtures/), or None for the sidecar (written here);
    a file and a folder (relative to the source) the reader opens; a config to pass when it lies beside the source."""

    fixture: str | None
    file: str
    folder: str | None = None
    config: str | None = None


CASES = {
    "sidecar": Case(None, f"{sidecar_name(1)}.safetensors"),
    "sidecar-json": Case(None, f"{sidecar_name(2)}{SUFFIX}"),
    "deepspeed": Case("deepspeed_zero2/checkpoint", "global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt",
                      "global_step2"),
    "deepspeed-model-states": Case("deepspeed_zero2/checkpoint", "global_step2/mp_rank_00_model_states.pt"),
    "deepspeed-universal": Case("deepspeed_universal/checkpoint",
                                "global_step2_universal/zero/model.norm.weight/fp32.pt",
                                "global_step2_universal/zero/model.norm.weight"),
    "deepspeed-universal-zero": Case("deepspeed_universal/checkpoint",
                                     "global_step2_universal/zero/lm_head.weight/fp32.pt",
                                     "global_step2_universal/zero"),
    "deepspeed-moe": Case("deepspeed_moe_zero2_ep2/checkpoint",
                          "global_step2/layer_1_expert_3_mp_rank_00_model_states.pt", "global_step2"),
    "deepspeed-autotp": Case("deepspeed_autotp_zero1/checkpoint", "global_step2/mp_rank_01_model_states.pt",
                             "global_step2"),
    "verl": Case("verl_llama_fsdp4/checkpoint", "model_world_size_4_rank_2.pt", "huggingface"),
    "verl-config": Case("verl_llama_fsdp4/checkpoint", "fsdp_config.json"),
    "colossalai": Case("colossalai_llama_pp2_unmerged/checkpoint", "model-stage-00002-shard-00001.safetensors",
                       "tmp_index_files"),
    "colossalai-index": Case("colossalai_llama_pp2_unmerged/checkpoint",
                             "tmp_index_files/model.safetensors.index-stage-00001.json"),
    "megatron-dist": Case("megatron_tp2_pp2/torch_dist", "iter_0000010/__1_0.distcp", "iter_0000010",
                          "megatron_tp2_pp2/config.json"),
    "megatron-dist-common": Case("megatron_tp2_pp2/torch_dist", "iter_0000010/common.pt", None,
                                 "megatron_tp2_pp2/config.json"),
    "megatron-dist-metadata": Case("megatron_tp2_pp2/torch_dist", "iter_0000010/.metadata", None,
                                   "megatron_tp2_pp2/config.json"),
    "megatron-dist-json": Case("megatron_tp2_pp2/torch_dist", "iter_0000010/metadata.json", None,
                               "megatron_tp2_pp2/config.json"),
    "megatron-legacy": Case("megatron_tp2_pp2/legacy", "iter_0000010/mp_rank_01_001/model_optim_rng.pt",
                            "iter_0000010/mp_rank_01_001", "megatron_tp2_pp2/config.json"),
    "megatron-legacy-iteration": Case("megatron_tp2_pp2/legacy", "iter_0000010/mp_rank_00_000/model_optim_rng.pt",
                                      "iter_0000010", "megatron_tp2_pp2/config.json"),
    "lightning": Case("lightning_model_parallel_llama/checkpoint", "epoch=0-step=1.ckpt/__1_0.distcp",
                      "epoch=0-step=1.ckpt"),
    "dcp": Case("llama_fsdp2_dcp/checkpoint", "__2_0.distcp"),
    "dcp-metadata": Case("llama_fsdp2_dcp/checkpoint", ".metadata"),
    "hf-distributed": Case("llama_hf_tp2/checkpoint", "shard-00002-model-00001-of-00001.safetensors"),
    "hf": Case("llama_fsdp2_dcp/reference", "model.safetensors"),
}
#: the cases that replace a folder
FOLDERS = [name for name, case in CASES.items() if case.folder is not None]


def source(case: Case, tmp_path: Path) -> Path:
    """A fresh copy of the case's source in ``tmp_path/src``."""
    src = tmp_path / "src"
    if case.fixture is None:
        save_seed_checkpoint(src)
    else:
        shutil.copytree(FIXTURES / case.fixture, src, symlinks=True)
    return src


def merge(cli, case: Case, src: Path, out: Path):
    config = () if case.config is None else ("--config", FIXTURES / case.config)
    return cli("merge", src, out, *config)


def move_and_link(src: Path, rel: str, place: Path) -> Path:
    """``src/rel`` moved to ``place/<its name>`` and replaced by a symlink to it; the moved copy."""
    path = src / rel
    place.mkdir(parents=True, exist_ok=True)
    moved = place / path.name
    shutil.move(path, moved)
    path.symlink_to(moved, target_is_directory=moved.is_dir())
    return moved


#: every (case, "file" | "folder") there is something to replace for: formats without folders have no folder case
LINKS = [(name, kind) for name, case in CASES.items() for kind in ("file", "folder")
         if (case.file if kind == "file" else case.folder) is not None]


def test_every_reader_has_a_case():
    from ckpttool.readers import READERS

    covered = {name.removesuffix(suffix) for name in CASES
               for suffix in ("-json", "-model-states", "-universal", "-universal-zero", "-moe", "-autotp", "-config",
                              "-index", "-common", "-metadata", "-iteration", "")
               if name.removesuffix(suffix) in READERS}
    assert covered == set(READERS)


@pytest.mark.parametrize(("name", "kind"), LINKS)
def test_a_link_out_of_the_source_is_refused_naming_it(name, kind, tmp_path, cli):
    case = CASES[name]
    rel = case.file if kind == "file" else case.folder
    src = source(case, tmp_path)
    moved = move_and_link(src, rel, tmp_path / "elsewhere")
    before = tree_digest(tmp_path / "elsewhere")
    out = tmp_path / "out"
    result = merge(cli, case, src, out)
    assert_failed_cleanly(result, out, "outside")
    # the link, quoted as the source (or the metadata naming it) sees it: 'iter_0000010/__1_0.distcp' or '__1_0.distcp'
    assert re.search(rf"'([^'\n]*/)?{re.escape(Path(rel).name)}' is a symlink", result.stderr) or \
        re.search(rf"names '([^'\n]*/)?{re.escape(Path(rel).name)}', which leads outside", result.stderr), result.stderr
    assert tree_digest(tmp_path / "elsewhere") == before
    assert moved.exists()


@pytest.mark.parametrize(("name", "kind"), LINKS)
def test_a_link_that_stays_inside_the_source_merges(name, kind, tmp_path, cli):
    case = CASES[name]
    rel = case.file if kind == "file" else case.folder
    src = source(case, tmp_path)
    move_and_link(src, rel, src / "kept")
    out = tmp_path / "out"
    result = merge(cli, case, src, out)
    assert result.exit_code == 0, result.output
    assert (out / "model.safetensors").is_file() or (out / "model.safetensors.index.json").is_file()


# ------------------------------------------------------------------------------------------------ the helpers


def test_a_chain_of_links_is_judged_by_where_it_ends(tmp_path):
    from ckpttool.io.paths import escaping_link

    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (tmp_path / "secret").write_bytes(b"x")
    (src / "a" / "last").symlink_to(tmp_path / "secret")
    (src / "a" / "first").symlink_to("last")  # inside, but to a link out
    (src / "kept").write_bytes(b"y")
    (src / "a" / "fine").symlink_to("../kept")
    assert escaping_link(src, "a/first") == ("a/first", (tmp_path / "secret").resolve())
    assert escaping_link(src, "a/fine") is None
    assert escaping_link(src, "a/missing") is None  # no link: opening it says it is missing


def test_a_folder_link_is_named_not_the_file_below_it(tmp_path, cli):
    from ckpttool.errors import LinkOutError
    from ckpttool.io.paths import list_inside, open_inside

    src = tmp_path / "src"
    src.mkdir()
    (tmp_path / "out" / "inner").mkdir(parents=True)
    (tmp_path / "out" / "inner" / "f").write_bytes(b"z")
    (src / "d").symlink_to(tmp_path / "out")
    with pytest.raises(LinkOutError, match=r"^'d' is a symlink to '.*/out', outside the checkpoint '.*/src'; "):
        open_inside(src, "d/inner/f")
    with pytest.raises(LinkOutError, match=r"^'d' is a symlink"):
        list_inside(src, "d/inner")


# ---------------------------------------------------------------------------- names from the file system


def universal_with_a_folder_named(tmp_path: Path, name: str) -> Path:
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "deepspeed_universal" / "checkpoint", src)
    zero = src / "global_step2_universal" / "zero"
    (zero / "model.norm.weight").rename(zero / name)
    return src


def test_a_newline_in_a_universal_parameter_folder_is_shown_escaped(tmp_path, cli):
    src = universal_with_a_folder_named(tmp_path, "model.norm\nweight\x1b[31m")
    (src / "global_step2_universal" / "zero" / "model.norm\nweight\x1b[31m" / "fp32.pt").unlink()
    result = cli("merge", src, tmp_path / "out")
    assert_failed_cleanly(result, tmp_path / "out", "'global_step2_universal/zero/model.norm\\nweight\\x1b[31m/fp32.pt': "
                          "missing (the fp32 weights of 'model.norm\\nweight\\x1b[31m')")
    assert result.stderr.count("\n") == 1 and "\x1b" not in result.stderr


def test_a_universal_parameter_the_config_does_not_know_is_shown_escaped(tmp_path, cli):
    src = universal_with_a_folder_named(tmp_path, "model.norm\nweight")
    result = cli("merge", src, tmp_path / "out")
    assert_failed_cleanly(result, tmp_path / "out",
                          "\n  - 'model.norm\\nweight': not a tensor of a llama model built from this config\n",
                          "\n  - 'model.norm.weight': expected by the config but not in the checkpoint\n")


@pytest.mark.parametrize("name, kind", [("deepspeed-universal", "folder"), ("deepspeed-moe", "file"),
                                        ("megatron-legacy", "folder"), ("verl", "file")])
def test_audit_refuses_the_same_links(name, kind, tmp_path, cli):
    case = CASES[name]
    rel = case.file if kind == "file" else case.folder
    src = source(case, tmp_path)
    move_and_link(src, rel, tmp_path / "elsewhere")
    config = () if case.config is None else ("--config", FIXTURES / case.config)
    result = cli("audit", src, *config)
    assert result.exit_code == 1, result.output
    assert f"'{rel}' is a symlink to '{tmp_path / 'elsewhere' / Path(rel).name}', outside the checkpoint '{src}'" \
        in result.stderr
    assert "Traceback" not in result.output
