"""One rank of a live-gather job on GPUs (NCCL) or on CPU (gloo), launched by ``tests/test_live_cuda.py`` through
``torchrun`` (not a test module itself).

    python -m torch.distributed.run --standalone --nproc_per_node N tests/live_cuda_worker.py \
        --backend nccl --out DIR SCENARIO [SCENARIO ...]

With ``--backend nccl`` rank r uses GPU r (``LOCAL_RANK``); with ``gloo`` everything stays on the CPU. Every rank
loads the fixtures' Llama reference model (as ``tests/live_worker.py`` does), moves it to its device, shards it,
calls :func:`ckpttool.live.save_hf` into ``DIR/SCENARIO``, then gathers torch's own full state dict
(``get_model_state_dict(full_state_dict=True, cpu_offload=True)``), which rank 0 writes to
``DIR/SCENARIO.full.safetensors`` for the test to compare with. Rank 0 prints what the gather ran on
(``DATA DEVICE``, ``PINNED ARENAS``: the pinned host arenas it allocated) and ``DONE <scenario>`` after each.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from live_worker import LLAMA, fsdp2, load, tp_plan

seen: dict[str, object] = {"devices": set(), "pinned": 0}


def spy() -> None:
    """Record which device the gather moved data on and how many pinned host arenas it allocated."""
    from ckpttool.live import gather

    real_device, real_init = gather._data_device, gather.Arena.__init__

    def data_device(views):
        device = real_device(views)
        seen["devices"].add(str(device))
        return device

    def arena_init(self, nbytes, device):
        real_init(self, nbytes, device)
        if self.host is not None:
            assert self.host.is_pinned()
            seen["pinned"] += 1

    gather._data_device = data_device
    gather.Arena.__init__ = arena_init


def save(model, out: Path, name: str) -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    from ckpttool.live import save_hf

    save_hf(model, out / name, config=model.config, max_shard_size="60KB", bucket_bytes=96 * 1024)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        from safetensors.torch import save_file

        save_file({k: v.detach().cpu().contiguous().clone() for k, v in full.items()},
                  str(out / f"{name}.full.safetensors"))


def scenario_fsdp2(out: Path, device: str, world: int) -> None:
    """FSDP2 over a 1-D mesh of every rank (vocab 1001 splits unevenly)."""
    from torch.distributed.device_mesh import init_device_mesh

    model = load(LLAMA).to(device)
    fsdp2(model, init_device_mesh(device, (world,)))
    save(model, out, "fsdp2")


def scenario_tp(out: Path, device: str, world: int) -> None:
    """DTensor tensor parallel over every rank: embed_tokens and lm_head split over the uneven vocab."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    model = load(LLAMA).to(device)
    parallelize_module(model, init_device_mesh(device, (world,)), tp_plan(model))
    save(model, out, "tp")


def scenario_mesh2d(out: Path, device: str, world: int) -> None:
    """TP on mesh['tp'], FSDP2 on mesh['dp'] (needs an even world of at least 4)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    model = load(LLAMA).to(device)
    mesh = init_device_mesh(device, (2, world // 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], tp_plan(model))
    fsdp2(model, mesh["dp"])
    save(model, out, "mesh2d")


SCENARIOS = {name.removeprefix("scenario_"): fn for name, fn in globals().items() if name.startswith("scenario_")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("nccl", "gloo"), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("scenarios", nargs="+", choices=sorted(SCENARIOS))
    args = parser.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    if args.backend == "nccl":
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        device = "cuda"
    else:
        device = "cpu"
    torch.set_num_threads(1)
    spy()
    dist.init_process_group(args.backend, timeout=timedelta(seconds=180))
    rank = dist.get_rank()
    if rank == 0:
        print(f"BACKEND {dist.get_backend()} WORLD {world} DEVICE {device}", flush=True)
    for name in args.scenarios:
        SCENARIOS[name](args.out, device, world)
        dist.barrier()
        if rank == 0:
            print(f"DATA DEVICE {' '.join(sorted(seen['devices']))}", flush=True)
            print(f"PINNED ARENAS {seen['pinned']}", flush=True)
            print(f"DONE {name}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
