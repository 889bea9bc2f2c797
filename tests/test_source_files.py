"""ckpttool opens only regular files of a source: a FIFO or a device named like a checkpoint file is refused in
seconds, naming it; a tag file's content is never echoed; an unreadable file is a SourceError naming the file and
the system's reason; a config whose sizes are absurd for the checkpoint is refused before transformers builds it."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch

from ckpttool.model.config_sizes import CHEAP_LAYERS, MAX_LAYERS, Census, check_config_sizes
from ckpttool.errors import ConfigError, SourceError
from ckpttool.io.paths import open_source, read_source, read_tag
from ckpttool.io.sidecar import PieceSpec, save_shard
from conftest import FIXTURES, assert_failed_cleanly
from test_pickle_bounds import within

SIDECAR = "rank-00001-of-00002.ckpttool.json"


def sidecar_source(tmp: Path) -> Path:
    src = tmp / "sidecar-src"
    for rank in range(2):
        save_shard({"embed": torch.randn(6, 4)}, {"embed": PieceSpec.split((12, 4), dim=0, index=rank, count=2)},
                   src, rank=rank, world_size=2)
    return src


def hf_two_shards(tmp: Path) -> Path:
    from safetensors.torch import save_file

    src = tmp / "hf-src"
    src.mkdir()
    save_file({"a": torch.ones(2)}, str(src / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.ones(2)}, str(src / "model-00002-of-00002.safetensors"))
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return src


def megatron_dist(tmp: Path) -> Path:
    src = tmp / "torch_dist"
    shutil.copytree(FIXTURES / "megatron_tp2_pp2" / "torch_dist", src)
    return src


def replace(path: Path, with_what: str) -> None:
    """Put a FIFO, a symlink to ``/dev/zero``, or a device like it, where ``path`` was."""
    path.unlink()
    if with_what == "fifo":
        os.mkfifo(path)
    elif with_what == "link to /dev/zero":
        path.symlink_to("/dev/zero")
    else:
        try:
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 5))  # what /dev/zero is
        except PermissionError:
            pytest.skip("only root makes device files; the link to /dev/zero is tested")


# name -> (make the source, the file to replace, what the error calls it)
SOURCES = {
    "sidecar": (sidecar_source, SIDECAR, f"'{SIDECAR}'"),
    "transformers shard": (hf_two_shards, "model-00001-of-00002.safetensors", "'model-00001-of-00002.safetensors'"),
    "megatron metadata.json": (megatron_dist, "iter_0000010/metadata.json", "iter_0000010/metadata.json'"),
}


@pytest.mark.parametrize("with_what", ["fifo", "link to /dev/zero", "device"])
@pytest.mark.parametrize("source", sorted(SOURCES))
def test_a_fifo_or_device_in_the_source_is_refused_in_seconds(cli, tmp_path, source, with_what):
    make, rel, named = SOURCES[source]
    src = make(tmp_path)
    replace(src / rel, with_what)
    says = f"{named}: not a regular file ({'a FIFO' if with_what == 'fifo' else 'a character device'})"
    if with_what == "link to /dev/zero" and source == "transformers shard":  # a file the index names: confined
        says = f"names {named}, which leads outside the checkpoint directory"
    with within(60):
        merged = cli("merge", src, tmp_path / "out")
        audited = cli("audit", src)
    assert_failed_cleanly(merged, tmp_path / "out", says)
    assert audited.exit_code in (1, 3) and "Traceback" not in audited.output
    assert says in audited.output  # an error (exit 1), or a finding (exit 3)


def test_open_source_refuses_without_blocking(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with within(10), pytest.raises(SourceError, match=r"^'pipe': not a regular file \(a FIFO\)"):
        open_source(fifo, "pipe")
    with pytest.raises(SourceError, match=r"not a regular file \(a directory\)"):
        open_source(tmp_path)


def test_read_source_bounds_what_it_reads(tmp_path):
    (tmp_path / "big.json").write_bytes(b" " * 1001)
    with pytest.raises(SourceError, match="'big.json': larger than 1000 bytes"):
        read_source(tmp_path / "big.json", "big.json", limit=1000)


# ------------------------------------------------------------------------------------------- tag files


def test_a_deepspeed_latest_linking_to_passwd_is_not_shown(cli, copy_fixture, tmp_path):
    src = copy_fixture("deepspeed_zero2")
    secret = tmp_path / "passwd"
    secret.write_text("root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1::/usr/sbin:/usr/sbin/nologin\n")
    (src / "latest").unlink()
    (src / "latest").symlink_to(secret)
    result = cli("merge", src, tmp_path / "hf")
    assert_failed_cleanly(result, tmp_path / "hf", f"'{src / 'latest'}': not a valid checkpoint tag")
    assert "root:" not in result.output and "nologin" not in result.output


def test_a_huge_tag_file_is_read_only_to_its_bound(tmp_path):
    (tmp_path / "latest").write_bytes(b"global_step1" + b" " * 10_000_000)
    assert read_tag(tmp_path / "latest") is None
    (tmp_path / "latest").write_text("global_step1\n")
    assert read_tag(tmp_path / "latest") == "global_step1"


def test_a_megatron_tracker_that_is_no_number_is_not_shown(cli, tmp_path):
    src = tmp_path / "legacy"
    shutil.copytree(FIXTURES / "megatron_tp2_pp2" / "legacy", src)
    (src / "latest_checkpointed_iteration.txt").write_text("root:x:0:0:root:/root:/bin/bash\n")
    result = cli("merge", src, tmp_path / "out", "--format", "megatron-legacy")
    assert_failed_cleanly(result, tmp_path / "out",
                          "'latest_checkpointed_iteration.txt': not an iteration number or 'release'")
    assert "root:" not in result.output


# --------------------------------------------------------------------------------------- unreadable files


def deny(monkeypatch, name: str) -> None:
    """Opening any file called ``name`` fails as ``chmod 000`` makes it fail (tests run as root here)."""
    real = os.open

    def guarded(path, flags, *args, **kwargs):
        if Path(path).name == name:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", guarded)


UNREADABLE = {
    "dcp metadata": ("llama_tp2_dcp", ".metadata", "'.metadata'"),
    "dcp data file": ("llama_tp2_dcp", "__0_0.distcp", "'__0_0.distcp'"),
    "transformers shard": ("llama_hf_tp2", "shard-00001-model-00001-of-00001.safetensors",
                           "'shard-00001-model-00001-of-00001.safetensors'"),
    "verl rank file": ("verl_llama_fsdp4", "model_world_size_4_rank_0.pt", "'model_world_size_4_rank_0.pt'"),
    "config": ("llama_tp2_dcp", "config.json", "config.json'"),
}


@pytest.mark.parametrize("case", sorted(UNREADABLE))
def test_an_unreadable_file_is_named_with_the_reason(cli, copy_fixture, tmp_path, monkeypatch, case):
    fixture, name, named = UNREADABLE[case]
    src = copy_fixture(fixture)
    deny(monkeypatch, name)
    result = cli("merge", src, tmp_path / "out")
    assert_failed_cleanly(result, tmp_path / "out", f"{named}: cannot read: Permission denied")
    assert "unexpected" not in result.stderr and "internal error" not in result.stderr


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a chmod 000 file; the monkeypatched test covers it")
def test_a_chmod_000_file_is_named_with_the_reason(cli, copy_fixture, tmp_path):
    src = copy_fixture("llama_tp2_dcp")
    (src / "__1_0.distcp").chmod(0)
    result = cli("merge", src, tmp_path / "out")
    assert_failed_cleanly(result, tmp_path / "out", "'__1_0.distcp': cannot read: Permission denied")


# ------------------------------------------------------------------------------------- absurd config sizes


@pytest.mark.parametrize("command", ["merge", "audit"])
def test_a_config_of_200000_layers_is_refused_before_transformers_builds_it(cli, copy_fixture, tmp_path, command):
    src = copy_fixture("llama_tp2_dcp")
    config = json.loads((src.parent / "config.json").read_text())
    (src.parent / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 200_000}))
    with within(60):
        result = cli(command, src, *([tmp_path / "out"] if command == "merge" else []))
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert (f"Error: '{src.parent / 'config.json'}': num_hidden_layers 200000, but the checkpoint holds 21 tensors, "
            "and every layer has at least one; is it the config of another model?") in result.stderr
    assert not (tmp_path / "out").exists()


def test_a_config_of_a_million_experts_is_refused(cli, copy_fixture, tmp_path):
    src = copy_fixture("mixtral_fsdp2_dcp")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "num_local_experts": 1_000_000}))
    with within(60):
        result = cli("merge", src, tmp_path / "out")
    assert_failed_cleanly(result, tmp_path / "out", "num_local_experts 1000000, but the checkpoint holds",
                          "none has a dim that large")


def test_without_a_count_the_ceilings_apply(cli, copy_fixture, tmp_path):
    src = copy_fixture("llama_hf_tp2")  # transformers distributed: no global shapes without the model
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 200_000}))
    with within(60):
        result = cli("merge", src, tmp_path / "out")
    assert_failed_cleanly(result, tmp_path / "out",
                          f"num_hidden_layers 200000 is more than any model has (ckpttool takes at most {MAX_LAYERS})")


def test_real_models_pass_and_small_configs_are_not_counted():
    deepseek_v3 = {"num_hidden_layers": 61, "n_routed_experts": 256, "text_config": {"num_hidden_layers": 61}}
    check_config_sizes(deepseek_v3, "c", lambda: pytest.fail("a real model's config needs no count"))
    check_config_sizes({"num_hidden_layers": 126}, "c", lambda: None)  # Llama 3.1 405B
    big = {"num_hidden_layers": CHEAP_LAYERS + 1, "num_local_experts": 10_000}
    check_config_sizes(big, "c", lambda: Census(tensors=(CHEAP_LAYERS + 1) * 9, largest_dim=10_000))  # stacked
    with pytest.raises(ConfigError, match="'c': num_local_experts 10000, but the checkpoint holds 600 tensors"):
        check_config_sizes(big, "c", lambda: Census(tensors=600, largest_dim=64))


def test_a_nested_text_config_is_checked_too():
    with pytest.raises(ConfigError, match="num_hidden_layers 100000, but the checkpoint holds 21 tensors"):
        check_config_sizes({"text_config": {"num_hidden_layers": 100_000}}, "c", lambda: Census(21, 1001))
