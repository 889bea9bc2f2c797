"""True-scale plans without true-scale disks (benchmarks/truescale.py): DeepSeek-V3's FP8 release cut to two
layers (one dense, one with 256 routed experts + 1 shared) and its MTP layer, every dim real (hidden 7168, MLA,
experts 2048 x 7168, vocab 129280, 128 x 128 scale blocks), as sparse files: real headers, holes for the data
but the block scales (~31 GB apparent, a few MB on disk). ``merge --dry-run`` plans it with its coverage proof and predicts a peak
independent of the tensors' size; ``audit --no-data`` passes. Timing is the benchmark's business, not this file's.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
from conftest import assert_failed_cleanly

from ckpttool.execute.buffers import OVERHEAD_BYTES, CHUNK_BYTES

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name: str):
    """The benchmark script ``benchmarks/<name>.py`` as a module (it may import its siblings: this folder is no
    package)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"{name}_bench", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench():
    return _load("truescale")


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """(the release's folder, its tensors: name -> (dtype, shape), what generate reported)."""
    bench = _bench()
    root = tmp_path_factory.mktemp("truescale") / "src"
    cfg = bench.config(layers=2, dense=1)
    made = bench.generate(root, cfg, files=8)
    return root, bench.release(cfg), made


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in root.iterdir()}


def test_the_release_is_true_shape_and_sparse(release):
    root, tensors, made = release
    assert tensors["model.embed_tokens.weight"] == ("BF16", (129280, 7168))
    assert tensors["model.layers.1.mlp.experts.255.down_proj.weight"] == ("F8_E4M3", (7168, 2048))
    assert tensors["model.layers.1.mlp.experts.255.down_proj.weight_scale_inv"] == ("F32", (56, 16))
    assert tensors["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == ("F8_E4M3", (576, 7168))
    assert "model.layers.2.eh_proj.weight" in tensors  # the MTP layer, after the two main ones
    assert made["files"] == 8 and len(list(root.glob("*.safetensors"))) == 8
    assert made["apparent_bytes"] > 30e9
    # holes: the headers and the scales only (~6 MB; a file system without holes would need 31 GB)
    assert made["disk_bytes"] < 32 * 2**20


@pytest.mark.parametrize("dtype", [None, "bfloat16"], ids=["fp8-kept", "dequantized"])
def test_merge_dry_run_plans_every_tensor_once_in_bounded_memory(release, cli, dtype):
    root, tensors, _ = release
    doc = _dry_run(cli, root, *(["--dtype", dtype] if dtype else []))
    names = [t["name"] for t in doc["targets"]]
    if dtype is None:  # kept as released: the same tensors, scales included, byte for byte the same sizes
        assert set(names) == set(tensors)
        index = json.loads((root / "model.safetensors.index.json").read_text())
        assert doc["total_bytes"] == index["metadata"]["total_size"]
    else:  # dequantized: the weights without their scales, each bf16
        assert set(names) == {n for n in tensors if not n.endswith("weight_scale_inv")}
        assert {t["dtype"] for t in doc["targets"] if "experts" in t["name"]} == {"BF16"}
    assert doc["predicted_peak_bytes"] < doc["largest_tensor_bytes"]


def _dry_run(cli, root: Path, *options: str) -> dict:
    """``merge ROOT --dry-run --json``: every target once, the largest tensor DeepSeek-V3's embedding, the predicted
    peak bounded, nothing written; the JSON document, for each case's own checks."""
    before = _snapshot(root)
    result = cli("merge", root, "--dry-run", "--json", *options)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["status"] == "ok" and doc["dry_run"] and doc["output"] is None
    assert doc["coverage"] == "every target tensor is covered exactly once"
    names = [t["name"] for t in doc["targets"]]
    assert len(names) == len(set(names))
    assert doc["largest_tensor_bytes"] == 129280 * 7168 * 2  # the embedding (and head): 1.77 GiB
    # The executor streams each tensor in chunks of CHUNK_BYTES (32 MiB), whatever its size: per worker a read
    # buffer, an output buffer and, dequantizing, the block scales and a float32 scratch of one chunk's rows
    # (at most 4 bytes per value for 2 bytes written: twice the chunk). So 6 chunks per worker bound it, plus
    # the fixed overhead: 392 MiB at the default 2 workers, far below the 1.77 GiB tensor (no tensor held whole)
    # and the 2 GiB per process.
    bound = doc["workers"] * 6 * CHUNK_BYTES + OVERHEAD_BYTES
    assert 0 < doc["predicted_peak_bytes"] <= bound < 2 * 2**30
    assert _snapshot(root) == before  # a dry run writes nothing, beside the source or in it
    return doc


def _audit_no_data_passes(cli, root: Path, tensors) -> None:
    before = _snapshot(root)
    result = cli("audit", root, "--no-data", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    summary = doc["summary"]
    assert summary["verdict"] == "pass" and summary["errors"] == 0 and not summary["data_checked"], doc["findings"]
    assert summary["tensors"] == len(tensors)
    assert _snapshot(root) == before


def test_audit_no_data_passes(release, cli):
    root, tensors, _ = release
    _audit_no_data_passes(cli, root, tensors)


# ------------------------------------------------------------------------------------------------
# the sidecar reader at true scale (benchmarks/truescale_readers.py): DeepSeek-V3's BF16 model cut to two layers,
# every dim real, as 8 sparse rank files (real headers, holes for the data) with their sidecars, each 2-D tensor cut
# in two along dim 0
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory):
    """(the sidecar checkpoint's folder, its tensors: name -> (dtype, shape), what the generator reported)."""
    bench = _load("truescale_readers")
    root = tmp_path_factory.mktemp("truescale-readers") / "sidecar"
    cfg = bench.config(layers=2, dense=1, bf16=True)
    made = bench.generate_sidecar(root, cfg)
    return root, bench.release(cfg), made


def test_the_sidecar_checkpoint_is_true_shape_sparse_and_sharded(sidecar):
    root, tensors, made = sidecar
    assert tensors["model.embed_tokens.weight"] == ("BF16", (129280, 7168))
    assert made["files"] == 8 and len(list(root.glob("*.ckpttool.json"))) == 8
    assert made["tensors"] < made["pieces"] < 2 * made["tensors"]  # the 2-D tensors in two pieces, the rest whole
    assert made["apparent_bytes"] > 30e9
    assert made["disk_bytes"] < 32 * 2**20


@pytest.fixture(scope="module")
def dcp(tmp_path_factory):
    """The same model, cut the same way, as a PyTorch Distributed Checkpoint: ``.metadata`` pickled from torch's
    own classes, 8 ``__R_0.distcp`` files of torch.save archives whose data records are holes."""
    bench = _load("truescale_readers")
    root = tmp_path_factory.mktemp("truescale-readers") / "dcp"
    cfg = bench.config(layers=2, dense=1, bf16=True)
    made = bench.generate_dcp(root, cfg)
    return root, bench.release(cfg), made


@pytest.fixture(scope="module")
def torch_dist(tmp_path_factory):
    """The same model as Megatron-Core torch_dist at TP 2 x EP 4, made from its sparse BF16 HF release by split's
    plan (megatron-core names, stacked layers, expert chunks), item data holes."""
    bench = _load("truescale_readers")
    base = tmp_path_factory.mktemp("truescale-readers")
    cfg = bench.config(layers=2, dense=1, bf16=True)
    bench.generate(base / "hf", cfg, files=4)
    made = bench.generate_torch_dist(base / "torch_dist", base / "hf", tp=2, pp=1, ep=4)
    return base / "torch_dist", bench.release(cfg), made


@pytest.fixture(params=["sidecar", "dcp", "torch_dist"])
def sharded(request):
    """Each reader's true-shape checkpoint: (folder, tensors, what the generator reported)."""
    return request.getfixturevalue(request.param)


def test_the_dcp_checkpoint_is_true_shape_sparse_and_read_in_place(dcp):
    import io
    import pickle

    import torch

    from ckpttool.layout.layout import RAW
    from ckpttool.readers import read_layout

    root, tensors, made = dcp
    assert sorted(p.name for p in root.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(8)]
    assert made["tensors"] < made["pieces"] < 2 * made["tensors"]
    assert made["apparent_bytes"] > 30e9 and made["disk_bytes"] < 32 * 2**20
    layout = read_layout(root)
    assert layout.format == "dcp" and len(layout.tensors) == len(tensors)
    # every item's archive parsed and its elements located in place: real zip headers and pickles, not guessed
    assert {p.encoding for t in layout.tensors.values() for p in t.pieces} == {RAW}
    # torch itself reads the metadata and loads an item (its data record, a hole, reads as zeros)
    md = pickle.loads((root / ".metadata").read_bytes())
    info = next(v for k, v in md.storage_data.items() if k.fqn == "model.layers.0.input_layernorm.weight")
    with open(root / info.relative_path, "rb") as f:
        f.seek(info.offset)
        item = torch.load(io.BytesIO(f.read(info.length)), weights_only=True)
    assert item.shape == (7168,) and item.dtype == torch.bfloat16 and not item.any()


def test_merge_dry_run_of_each_sharded_checkpoint_covers_every_tensor_once(sharded, cli):
    root, tensors, _ = sharded
    doc = _dry_run(cli, root)
    assert {t["name"] for t in doc["targets"]} == set(tensors)


def test_audit_no_data_of_each_sharded_checkpoint_passes(sharded, cli):
    root, tensors, _ = sharded
    _audit_no_data_passes(cli, root, tensors)


# ------------------------------------------------------------------------------------------------
# the planner's fast path for slabs (ckpttool.plan.tiling.slab_copies): a tensor cut along one dim is proven by one
# sort; any other layout falls back to the general proof, whose verdict it must never contradict
# ------------------------------------------------------------------------------------------------


def _pieces(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> list:
    from ckpttool.layout.layout import RAW, Box, Piece

    return [Piece(f"rank{i}.safetensors", "w", Box(o, s), "F32", RAW, 0, 4) for i, (o, s) in enumerate(boxes)]


@pytest.mark.parametrize("boxes, slabs, tiles", [
    ([((0, 0), (3, 4)), ((3, 0), (5, 4))], True, True),                     # uneven rows
    ([((4, 0), (4, 4)), ((0, 0), (4, 4))], True, True),                     # out of order
    ([((0, 0), (8, 1)), ((0, 1), (8, 3))], True, True),                     # columns
    ([((0, 0), (8, 4)), ((0, 0), (8, 4))], False, True),                    # replicas: the general path keeps one
    ([((0, 0), (4, 2)), ((4, 0), (4, 2)), ((0, 2), (8, 2))], False, True),  # a cut along two dims
    ([((0, 0), (0, 4)), ((0, 0), (8, 4))], False, True),                    # an empty piece
    ([((0, 0), (3, 4)), ((4, 0), (4, 4))], False, False),                   # a gap
    ([((0, 0), (5, 4)), ((4, 0), (4, 4))], False, False),                   # an overlap
    ([((0, 0), (8, 2))], False, False),                                     # one piece, not the whole
])
def test_slabs_are_proven_by_a_sort_and_anything_else_by_the_general_proof(boxes, slabs, tiles):
    from ckpttool.layout.builder import LayoutBuilder
    from ckpttool.layout.layout import Box
    from ckpttool.plan.plan import TargetSpec, plan_covered
    from ckpttool.plan.tiling import Slice, check_tiling, slab_copies

    shape = (8, 4)
    builder = LayoutBuilder("/nonexistent", "test")
    builder.declare("w", shape, "F32", where="'test'")
    for p in _pieces(boxes):
        builder.add("w", p)
    layout = builder.build()
    pieces = layout.tensors["w"].pieces
    copies = slab_copies(shape, pieces)
    assert (copies is not None) == slabs
    whole = Box.whole(shape)
    plan, failed = plan_covered(layout, [TargetSpec("w", shape, (Slice("w", whole, whole),))])
    assert (not failed) == tiles
    if slabs:  # each piece whole into its box, in the layout's order: what the general path plans too
        assert [(c.piece, c.src, c.dst) for c in copies] == [(p, Box((0, 0), p.box.sizes), p.box) for p in pieces]
        assert check_tiling("w", shape, copies) == [] and plan.targets[0].copies == copies
    if not tiles:  # the general proof's message, naming the region
        assert re.search(r"'w': rows \d+\.\.\d+ (covered twice|covered by no piece)|'w': columns", failed[0][1][0])


# ------------------------------------------------------------------------------------------------
# what the config alone decides is refused before any index of the checkpoint is read (on the 671B release: 163
# headers and the model's description, 8-20 s of CPU, for an answer config.json gives at once)
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def unread(monkeypatch):
    """Reading the source (its layout, its sizes, the model's description) fails the test."""
    from ckpttool.commands import merge

    def never(*args, **kwargs):
        raise AssertionError("the checkpoint was read")

    monkeypatch.setattr(merge, "plan_source_and_adapter", never)


def test_split_to_megatron_of_the_fp8_release_without_a_dtype_is_refused_from_its_config(release, cli, unread, tmp_path):
    root = release[0]
    before = _snapshot(root)
    out = tmp_path / "out"
    result = cli("split", root, out, "--to", "megatron", "--tp", "8", "--pp", "16", "--ep", "64")
    assert_failed_cleanly(result, out)
    assert result.stderr == (
        f"Error: '{root}': a quantized source (fp8 F8_E4M3 with 128x128 blocks (float scales), the quantization_config "
        f"of '{root / 'config.json'}') cannot be split yet: split writes the model's in-memory tensors, not quantized "
        "bytes and scales. Merge it with --dtype bfloat16 first (ckpttool merge SRC HF --dtype bfloat16), then split "
        "that output; nothing was written\n")
    assert _snapshot(root) == before


def test_split_to_megatron_of_a_model_type_it_has_no_form_for_is_refused_from_its_config(release, cli, unread, tmp_path):
    root = release[0]
    config = json.loads((root / "config.json").read_text())
    del config["quantization_config"]
    config["model_type"] = "qwen3_next"
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    result = cli("split", root, out, "--to", "megatron", "--config", tmp_path / "config.json", "--dry-run")
    assert_failed_cleanly(result, out)
    assert result.stderr.startswith("Error: model_type 'qwen3_next': ckpttool knows no Megatron-Core form for it; "
                                    "split --to megatron writes llama, mistral, qwen2, mixtral, qwen2_moe, gpt_oss, ")


def test_quantizing_the_fp8_release_again_is_refused_from_its_config(release, cli, unread, tmp_path):
    root = release[0]
    out = tmp_path / "out"
    result = cli("merge", root, out, "--quantize", "fp8")
    # the command line says the option as it is typed (--quantize fp8, --dtype bfloat16)
    assert_failed_cleanly(result, out, f"'{root}' is quantized already (fp8 F8_E4M3 with 128x128 blocks (float "
                          "scales)); quantizing FP8 values again would compound their rounding. Dequantize it first")
