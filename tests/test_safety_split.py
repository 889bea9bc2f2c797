"""``split`` never loses data: ``--force`` replaces only what a split wrote (its ``.ckpttool-split.json`` manifest
lists every file with its size), options and the destination are refused before the source is read, a quantized
source is refused before anything is written, and every size, count and degree is bounded before it is used.

Each case runs the command line and checks the exit code, the exact message and the file system afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings

import pytest
from conftest import FIXTURES, ROOT, assert_failed_cleanly, fixture_dir, tree_digest

import ckpttool
from ckpttool.commands.meshes import MAX_DIVISIBLE_BY, MAX_ITERATION, MAX_RANKS, MegatronMesh, Mesh
from ckpttool.errors import ArgumentError, ConfigError, DestinationError
from ckpttool.writers.destination import SPLIT_OUTPUT, foreign_entries
from ckpttool.writers.manifest import read_manifest

LLAMA = fixture_dir("llama_fsdp2_dcp") / "reference"
MEGATRON = FIXTURES / "megatron_tp2_pp2"
TORCH_DIST = MEGATRON / "torch_dist"
MANIFEST = ".ckpttool-split.json"
NOT_OURS = ("--force replaces only an earlier output of a split. Nothing was touched: choose another destination, or "
            "move those entries away yourself (an output of a split lists every file it wrote, with its size, in "
            ".ckpttool-split.json)")


def litter(directory):
    """What ckpttool leaves beside a destination while writing: staging, set-aside outputs, locks."""
    return sorted(p.name for p in directory.iterdir() if ".ckpttool-" in p.name)


def torch_dcp_save(path):
    """A real training checkpoint: torch's own ``dcp.save`` (one process, no process group)."""
    import torch
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled, unavailable or uninitialized"
        dcp.save({"model.weight": torch.arange(12.0).reshape(3, 4), "step": torch.tensor(7)}, checkpoint_id=str(path))
    return path


def megatron_split(cli, out, *more):
    return cli("split", MEGATRON / "reference", out, "--to", "megatron", "--tp", "2", "--config", MEGATRON / "config.json",
               "-q", *more)


def files_with_sizes(directory):
    return {p.relative_to(directory).as_posix(): p.stat().st_size for p in sorted(directory.rglob("*"))
            if p.is_file() and p.name != MANIFEST}


# ---- 1. --force replaces only what a split wrote ---------------------------------------------------------------


@pytest.mark.parametrize("to", ["dcp", "megatron"])
def test_force_never_replaces_torchs_own_dcp_save(cli, tmp_path, to):
    real = torch_dcp_save(tmp_path / "real")
    before = tree_digest(real)
    assert sorted(before) == [".metadata", "__0_0.distcp"]  # names a split writes too: names alone cannot tell
    result = cli("split", LLAMA, real, "--to", to, "--force")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.stderr == (f"Error: destination '{real}' holds 2 entries that ckpttool did not write (.metadata, "
                             f"__0_0.distcp); {NOT_OURS}\n")
    assert tree_digest(real) == before and litter(tmp_path) == []


@pytest.mark.parametrize("to", ["megatron", "dcp"])
def test_force_never_replaces_megatron_cores_own_torch_dist_save(cli, tmp_path, to):
    real = tmp_path / "checkpoints"
    shutil.copytree(TORCH_DIST, real)  # megatron-core 0.16.1's own save (fixtures/make_megatron.py)
    before = tree_digest(real)
    assert tree_digest(TORCH_DIST) == before
    result = cli("split", MEGATRON / "reference", real, "--to", to, "--config", MEGATRON / "config.json", "--force")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.stderr == (f"Error: destination '{real}' holds 2 entries that ckpttool did not write (iter_0000010/, "
                             f"latest_checkpointed_iteration.txt); {NOT_OURS}\n")
    assert tree_digest(real) == before and litter(tmp_path) == []


def test_every_split_lists_what_it_wrote_in_its_manifest(cli, tmp_path):
    assert cli("split", LLAMA, tmp_path / "dcp", "--to", "dcp", "--fsdp", "2", "-q").exit_code == 0
    assert megatron_split(cli, tmp_path / "megatron").exit_code == 0
    for out in (tmp_path / "dcp", tmp_path / "megatron"):
        document = json.loads((out / MANIFEST).read_text())
        assert document == {"written_by": "ckpttool", "version": ckpttool.__version__, "command": "split",
                            "files": files_with_sizes(out)}
        assert read_manifest(out / MANIFEST, "split") == files_with_sizes(out)
        assert foreign_entries(out, SPLIT_OUTPUT) == []
    assert "iter_0000000/__1_0.distcp" in document["files"] and "latest_checkpointed_iteration.txt" in document["files"]


@pytest.mark.parametrize("change, named", [
    (lambda out: (out / "config.json").write_text("{}"), "config.json"),  # another size than the manifest's
    (lambda out: (out / "__7_0.distcp").write_bytes(b"rank 7"), "__7_0.distcp"),  # a split's name, not listed
    (lambda out: (out / "iter_0000000" / "common.pt").write_bytes(b"x"), "iter_0000000/common.pt"),
    (lambda out: shutil.copytree(out / "iter_0000000", out / "iter_0000123"), "iter_0000123/.metadata, "
     "iter_0000123/__0_0.distcp, iter_0000123/__1_0.distcp, iter_0000123/common.pt, iter_0000123/metadata.json"),
])
def test_a_split_output_changed_since_is_not_replaced(cli, tmp_path, change, named):
    out = tmp_path / "out"
    assert megatron_split(cli, out).exit_code == 0
    change(out)
    before = tree_digest(out)
    result = megatron_split(cli, out, "--force")
    assert result.exit_code == 1
    count = named.count(", ") + 1
    assert result.stderr == (f"Error: destination '{out}' holds {count} entr{'y' if count == 1 else 'ies'} that ckpttool "
                             f"did not write ({named}); {NOT_OURS}\n")
    assert tree_digest(out) == before and litter(tmp_path) == []


@pytest.mark.parametrize("manifest", [None, "not json", json.dumps({"written_by": "someone", "command": "split", "files": {}}),
                                      json.dumps({"written_by": "ckpttool", "command": "merge", "files": {}}),
                                      json.dumps({"written_by": "ckpttool", "command": "split", "files": {"x": True}})])
def test_without_a_valid_manifest_nothing_is_ours(cli, tmp_path, manifest):
    out = tmp_path / "out"
    assert cli("split", LLAMA, out, "--to", "dcp", "-q").exit_code == 0
    if manifest is None:
        (out / MANIFEST).unlink()
    else:
        (out / MANIFEST).write_text(manifest)
    before = tree_digest(out)
    result = cli("split", LLAMA, out, "--to", "dcp", "--force")
    assert result.exit_code == 1
    entries = sorted(os.listdir(out))
    assert result.stderr == (f"Error: destination '{out}' holds {len(entries)} entries that ckpttool did not write "
                             f"({', '.join(entries)}); {NOT_OURS}\n")
    assert tree_digest(out) == before and litter(tmp_path) == []


def test_force_replaces_a_split_whose_files_match_its_manifest(cli, tmp_path):
    out = tmp_path / "out"
    assert cli("split", LLAMA, out, "--to", "dcp", "--fsdp", "4", "-q").exit_code == 0
    assert megatron_split(cli, out, "--force").exit_code == 0
    assert sorted(os.listdir(out)) == [MANIFEST, "config.json", "iter_0000000", "latest_checkpointed_iteration.txt"]
    assert json.loads((out / MANIFEST).read_text())["files"] == files_with_sizes(out) and litter(tmp_path) == []


def test_a_training_run_saving_into_out_while_the_split_writes_is_not_replaced(tmp_path, monkeypatch):
    from ckpttool.writers import dcp

    out = tmp_path / "out"
    ckpttool.split(LLAMA, out)
    write_files, saved = dcp.write_files, {}

    def write_while_training_saves(*args, **kwargs):
        written = write_files(*args, **kwargs)
        torch_dcp_save(out)  # the destination is checked again when publishing: it is no earlier split now
        saved.update(tree_digest(out))
        return written

    monkeypatch.setattr(dcp, "write_files", write_while_training_saves)
    with pytest.raises(DestinationError) as refused:
        ckpttool.split(LLAMA, out, force=True)
    assert str(refused.value).startswith(f"destination '{out}' holds 2 entries that ckpttool did not write (.metadata, "
                                         "__0_0.distcp); force=True replaces only an earlier output of a split")
    assert tree_digest(out) == saved and litter(tmp_path) == []


# ---- 2. options and the destination before the source ---------------------------------------------------------


def run_cli(*args):
    """The command line in a fresh interpreter: its exit code, stderr, seconds in ``main`` and whether torch or the
    split itself was imported (the source is never read without them)."""
    script = (
        "import json, sys, time\n"
        "from ckpttool.cli import main\n"
        "start = time.perf_counter()\n"
        "try:\n"
        "    main(sys.argv[1:])\n"
        "except SystemExit as e:\n"
        "    code = e.code\n"
        "seconds = time.perf_counter() - start\n"
        "print(json.dumps([code, seconds, 'torch' in sys.modules, 'ckpttool.commands.split' in sys.modules]))\n"
    )
    done = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    code, seconds, torch_loaded, split_loaded = json.loads(done.stdout.strip().splitlines()[-1])
    return code, done.stderr, seconds, torch_loaded or split_loaded


@pytest.mark.parametrize("args, code, message", [
    (["--to", "dcp"], 1, "Error: destination '{out}' exists and is not empty; pass --force to replace it\n"),
    (["--to", "megatron", "--dp", "2"], 2, (
        "Error: dp=2: a Megatron-Core torch_dist checkpoint does not depend on the data-parallel size: its chunks are "
        "those of tp x pp x ep, saved once whatever dp (only which rank's file holds a chunk differs), and a Megatron "
        "load at any dp reads it; split without dp\n")),
    (["--to", "megatron", "--fsdp", "2"], 2, "Error: fsdp=2: Megatron-Core torch_dist has no FSDP dim; give tp, pp and ep\n"),
    (["--to", "dcp", "--pp", "2"], 2, "Error: pp, make_vocab_size_divisible_by and iteration are for to='megatron'\n"),
    (["--to", "dcp", "--ep", "2"], 1, (
        "Error: ep=2 does not divide the 1 rank of fsdp=1 x tp=1: experts are split over groups of ep ranks within "
        "those (as transformers' DistributedConfig lays them out); choose an ep that divides fsdp x tp, or more ranks "
        "(fsdp=2 or tp=2)\n")),
    (["--to", "dcp", "--fsdp", "256", "--tp", "512"], 1, "Error: dp x fsdp x tp = 131072 ranks: a mesh has at most 65536 ranks\n"),
])
def test_options_and_out_are_refused_before_the_source_is_read(tmp_path, args, code, message):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep")
    missing = tmp_path / "no-such-source"  # read, it would be another error: the refusal comes first
    got, stderr, seconds, loaded = run_cli("split", missing, out, *args)
    assert got == code
    assert stderr.endswith(message.format(out=out)), stderr
    assert seconds < 1.0 and not loaded  # neither torch nor the split is imported: nothing of the source is read
    assert sorted(os.listdir(out)) == ["notes.txt"] and litter(tmp_path) == []


def test_a_training_checkpoint_under_force_is_refused_before_the_source_is_read(tmp_path):
    real = torch_dcp_save(tmp_path / "real")
    before = tree_digest(real)
    got, stderr, seconds, loaded = run_cli("split", tmp_path / "no-such-source", real, "--to", "dcp", "--force")
    assert got == 1 and "holds 2 entries that ckpttool did not write (.metadata, __0_0.distcp)" in stderr
    assert seconds < 1.0 and not loaded and tree_digest(real) == before


def test_the_api_checks_the_destination_before_the_source(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep")
    with pytest.raises(DestinationError, match=r"^destination '.*out' exists and is not empty; pass force=True"):
        ckpttool.split(tmp_path / "no-such-source", out)
    with pytest.raises(ArgumentError, match=r"^dp=2: a Megatron-Core torch_dist checkpoint does not depend"):
        ckpttool.split(tmp_path / "no-such-source", out, to="megatron", dp=2)
    assert sorted(os.listdir(out)) == ["notes.txt"]


# ---- 3. a quantized source is refused before anything is written ----------------------------------------------


@pytest.mark.parametrize("fixture, more, what", [
    ("quantized_qwen3_fp8", ["--to", "dcp"], "fp8 F8_E4M3 with 8x8 blocks (float scales)"),
    ("quantized_qwen3_fp8", ["--to", "megatron", "--dtype", "bfloat16"], "fp8 F8_E4M3 with 8x8 blocks (float scales)"),
    ("quantized_gpt_oss_mxfp4", ["--to", "dcp", "--dtype", "bfloat16"], "mxfp4 (groups of 32 values, E8M0 scales)"),
    ("quantized_gpt_oss_mxfp4", ["--to", "dcp", "--dry-run"], "mxfp4 (groups of 32 values, E8M0 scales)"),
])
def test_a_quantized_source_is_refused_before_anything_is_written(cli, tmp_path, monkeypatch, fixture, more, what):
    from ckpttool.writers import dcp

    def never(*args, **kwargs):
        raise AssertionError("a rank file was written")

    monkeypatch.setattr(dcp, "write_files", never)
    src = FIXTURES / fixture / "checkpoint"
    before = tree_digest(src)
    result = cli("split", src, tmp_path / "out", *more)
    assert_failed_cleanly(result, tmp_path / "out")
    assert result.stderr == (
        f"Error: '{src}': a quantized source ({what}, the quantization_config of '{src / 'config.json'}') cannot be "
        "split yet: split writes the model's in-memory tensors, not quantized bytes and scales. Merge it with --dtype "
        "bfloat16 first (ckpttool merge SRC HF --dtype bfloat16), then split that output; nothing was written\n")
    assert tree_digest(src) == before and litter(tmp_path) == []


# ---- 4. every size, count and degree is bounded ---------------------------------------------------------------


@pytest.mark.parametrize("option, value, bounds", [
    *((f"--{dim}", str(2**63), f"1<=x<={MAX_RANKS}") for dim in ("fsdp", "tp", "ep", "dp", "pp")),
    ("--tp", "65537", "1<=x<=65536"),
    ("--make-vocab-size-divisible-by", str(10**12), f"1<=x<={MAX_DIVISIBLE_BY}"),
    ("--iteration", str(10**30), f"0<=x<={MAX_ITERATION}"),
    ("--iteration", "10000000", "0<=x<=9999999"),
])
def test_each_option_is_bounded_before_it_is_used(cli, tmp_path, option, value, bounds):
    to = "megatron" if option in ("--pp", "--make-vocab-size-divisible-by", "--iteration") else "dcp"
    result = cli("split", LLAMA, tmp_path / "out", "--to", to, option, value, "--dry-run")
    assert result.exit_code == 2
    assert result.stderr.endswith(f"Error: Invalid value for '{option}': {value} is not in the range {bounds}.\n")
    assert os.listdir(tmp_path) == []


def test_a_float_is_not_a_vocab_rule(cli, tmp_path):
    result = cli("split", LLAMA, "--to", "megatron", "--make-vocab-size-divisible-by", "1e12", "--dry-run")
    assert result.exit_code == 2
    assert result.stderr.endswith("Error: Invalid value for '--make-vocab-size-divisible-by': '1e12' is not a valid integer range.\n")


def test_the_api_bounds_every_size_naming_it():
    for call, message in [
        (lambda: Mesh(tp=2**63), f"tp={2**63}: a mesh dim is a whole number from 1 to 65536"),
        (lambda: Mesh(dp=4, fsdp=256, tp=256), "dp x fsdp x tp = 262144 ranks: a mesh has at most 65536 ranks"),
        (lambda: MegatronMesh(tp=256, pp=256, ep=2), "tp x pp x ep = 131072 ranks: a mesh has at most 65536 ranks"),
        (lambda: MegatronMesh(divisible_by=10**12), "make_vocab_size_divisible_by=1000000000000: the vocab rule is a "
                                                    "whole number from 1 to 1048576"),
        (lambda: MegatronMesh(iteration=10**30), f"iteration={10**30}: the iteration (Megatron names it iter_%07d) is "
                                                 "a whole number from 0 to 9999999"),
        (lambda: ckpttool.split(LLAMA, None, tp=2**63, dry_run=True), f"tp={2**63}: a mesh dim is a whole number"),
    ]:
        with pytest.raises(ArgumentError) as refused:
            call()
        assert str(refused.value).startswith(message), str(refused.value)


def test_more_ranks_than_the_model_has_rows_are_refused(cli, tmp_path):
    result = cli("split", LLAMA, tmp_path / "out", "--to", "dcp", "--fsdp", "64", "--tp", "64", "--dry-run")
    assert_failed_cleanly(result, tmp_path / "out")
    assert result.stderr == (
        "Error: the mesh fsdp=64 tp=64 (4096 ranks) does not fit the model: fsdp x tp = 4096 ranks cut each tensor, "
        "more than the largest tensor dim they cut (1001, of 'model.embed_tokens.weight'); give fsdp x tp at most 1001\n")
    with pytest.raises(ConfigError, match="give fsdp x tp at most 1001"):
        ckpttool.split(LLAMA, None, fsdp=1002, dry_run=True)


def test_the_largest_bounds_end(cli, tmp_path):
    """At the bounds the plan is made, and quickly: the vocab rule pads with zero rows, counted not built."""
    result = cli("split", MEGATRON / "reference", "--to", "megatron", "--config", MEGATRON / "config.json",
                 "--make-vocab-size-divisible-by", str(MAX_DIVISIBLE_BY), "--iteration", str(MAX_ITERATION),
                 "--dry-run", "--json")
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["mesh"]["make_vocab_size_divisible_by"] == MAX_DIVISIBLE_BY
    embedding = next(t for t in document["tensors"] if t["name"] == "embedding.word_embeddings.weight")
    assert embedding["shape"][0] == MAX_DIVISIBLE_BY
