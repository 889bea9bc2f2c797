"""Tensors with dims of size 1 (``[1]``, ``[1, 1]``, ``[1, 5]``, ``[5, 1]``, a 0-d scalar) go through merge, audit
and diff like any other: as a whole HF tensor and as sidecar pieces of one row or one column each."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ckpttool.io.sidecar import PieceSpec, save_shard

#: one of each shape where dims of size 1 can end up without a stride (the last dim, every dim, no dim)
TENSORS = {
    "one": torch.tensor([3.5]),
    "one_by_one": torch.tensor([[-2.0]]),
    "row": torch.arange(5, dtype=torch.float32).reshape(1, 5),
    "column": torch.arange(5, dtype=torch.float32).reshape(5, 1) + 10,
    "scalar": torch.tensor(7.25),
    "one_int": torch.tensor([42], dtype=torch.int64),
}


def _hf_source(directory: Path) -> Path:
    directory.mkdir()
    save_file(TENSORS, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def _sidecar_source(directory: Path) -> Path:
    """Two ranks: [4, 1] split into [2, 1] rows, [2, 1] into [1, 1] rows, [1, 2] into [1, 1] columns; [1] and
    [1, 1] replicated."""
    column = torch.tensor([[1.0], [2.0], [3.0], [4.0]])
    tiny_rows = torch.tensor([[5.0], [6.0]])
    tiny_cols = torch.tensor([[8.0, 9.0]])
    for rank in range(2):
        save_shard(
            {"column": column[2 * rank:2 * rank + 2], "tiny_rows": tiny_rows[rank:rank + 1],
             "tiny_cols": tiny_cols[:, rank:rank + 1], "one": TENSORS["one"], "one_by_one": TENSORS["one_by_one"]},
            {"column": PieceSpec.split((4, 1), dim=0, index=rank, count=2),
             "tiny_rows": PieceSpec.split((2, 1), dim=0, index=rank, count=2),
             "tiny_cols": PieceSpec.split((1, 2), dim=1, index=rank, count=2),
             "one": PieceSpec.replicated((1,)), "one_by_one": PieceSpec.replicated((1, 1))},
            directory, rank=rank, world_size=2,
        )
    return directory


def _as_bytes(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    return {k: (str(t.dtype), tuple(t.shape), t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            for k, t in tensors.items()}


def test_merge_audit_and_diff_of_an_hf_directory_of_one_element_tensors(tmp_path, cli):
    src = _hf_source(tmp_path / "src")
    result = cli("merge", src, tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert _as_bytes(load_file(tmp_path / "out" / "model.safetensors")) == _as_bytes(TENSORS)
    for args in (("audit", src), ("audit", tmp_path / "out"), ("diff", src, tmp_path / "out")):
        result = cli(*args)
        assert result.exit_code == 0, result.output
        assert "Traceback" not in result.output and "internal error" not in result.output
    assert f"{len(TENSORS)} tensors identical" in cli("diff", src, tmp_path / "out").stdout


def test_diff_names_a_one_element_tensor_that_differs(tmp_path, cli):
    src = _hf_source(tmp_path / "src")
    other = tmp_path / "other"
    other.mkdir()
    save_file({**TENSORS, "one": torch.tensor([4.5])}, other / "model.safetensors", metadata={"format": "pt"})
    result = cli("diff", src, other)
    assert result.exit_code == 3, result.output
    assert "one: 1 of 1 elements differ" in result.stdout
    assert "Traceback" not in result.output and "internal error" not in result.output


def test_merge_of_sidecar_pieces_of_one_row_or_one_column(tmp_path, cli):
    src = _sidecar_source(tmp_path / "src")
    result = cli("merge", src, tmp_path / "out")
    assert result.exit_code == 0, result.output
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert _as_bytes(got) == _as_bytes({
        "column": torch.tensor([[1.0], [2.0], [3.0], [4.0]]), "tiny_rows": torch.tensor([[5.0], [6.0]]),
        "tiny_cols": torch.tensor([[8.0, 9.0]]), "one": TENSORS["one"], "one_by_one": TENSORS["one_by_one"],
    })
    for args in (("audit", src), ("diff", src, tmp_path / "out")):
        result = cli(*args)
        assert result.exit_code == 0, result.output
