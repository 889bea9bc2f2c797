"""One rank of a job that saves an FP8 checkpoint with torch's DCP from DTensors (not a test module).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/fp8_dcp_worker.py SRC OUT

``SRC`` is an HF FP8 checkpoint (the fixture). Every rank loads it and wraps each tensor as a DTensor on a 1-D mesh
of the ranks: ``q_proj`` weights (and their scales) ``Shard(0)``, ``o_proj`` weights (and their scales) ``Shard(1)``
(a tensor-parallel plan: colwise and rowwise), the rest ``Replicate()``; then ``torch.distributed.checkpoint.save``
writes ``OUT`` (``.metadata`` + ``__<rank>_0.distcp``). With the fixture's 8x8 blocks both splits fall on block
boundaries (q_proj [48, 40]: rows 0..24 and 24..48; o_proj [40, 48]: columns 0..24 and 24..48); with ``--unaligned``
q_proj is split on its columns (20 of 40), inside a block.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard


def placement(name: str, unaligned: bool):
    if ".q_proj." in name:
        return Shard(1 if unaligned else 0)
    if ".o_proj." in name:
        return Shard(1)
    return Replicate()


def main() -> None:
    src, out = Path(sys.argv[1]), Path(sys.argv[2])
    unaligned = "--unaligned" in sys.argv
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    rank, world = dist.get_rank(), dist.get_world_size()
    state = {}
    for name, tensor in sorted(tensors.items()):  # each rank cuts its own piece: no collective carries FP8
        where = placement(name, unaligned)
        local = tensor.chunk(world, where.dim)[rank].contiguous() if isinstance(where, Shard) else tensor
        state[name] = DTensor.from_local(local, mesh, [where], run_check=False, shape=tensor.shape,
                                         stride=tensor.stride())
    dcp.save(state, checkpoint_id=str(out))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
