"""One rank of a job on 4 gloo ranks for ``split --dp`` (HSDP; not a test module).

    python tests/hsdp_worker.py --rank R --world 4 --port P --splits DIR

Two meshes, as FSDP2 builds them with ``fully_shard(mesh=<2-D (replicate, shard) mesh>)``: ``hsdp`` (dp=2 x
fsdp=2: ``(Replicate(), Shard(0))``) and ``hsdp_tp`` (dp=2 x fsdp=1 x tp=2: DTensor tensor parallel on
``mesh['tp']``, then HSDP on ``mesh['dp', 'fsdp']``: a 3-D mesh). For each, every rank

- builds the HuggingFace reference model, parallelizes it and saves it with torch's own ``dcp.save`` into
  ``DIR/torch_<mesh>`` (what the test compares ckpttool's ``.metadata`` and bytes with), then
- builds the same architecture with other weights, parallelizes it, loads ``DIR/<mesh>`` (written by
  :func:`ckpttool.split` with ``dp=2``) with ``dcp.load`` and runs a forward pass; rank 0 prints
  ``RESULT <mesh> <max |logits - reference logits|>``.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from gloo_worker import join
from split_worker import LLAMA, fsdp2, load_and_run, report, scrambled, tp_plan

MESHES = {"hsdp": (2, 2, 1), "hsdp_tp": (2, 1, 2)}  # (dp, fsdp, tp)


def parallelize(model, dp: int, fsdp: int, tp: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    if tp == 1:
        fsdp2(model, init_device_mesh("cpu", (dp, fsdp), mesh_dim_names=("dp", "fsdp")))
        return
    mesh = init_device_mesh("cpu", (dp, fsdp, tp), mesh_dim_names=("dp", "fsdp", "tp"))
    parallelize_module(model, mesh["tp"], tp_plan(model))
    fsdp2(model, mesh["dp", "fsdp"])


def torch_save(name: str, splits: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(LLAMA, dtype=torch.float32).eval()
    parallelize(model, *MESHES[name])
    dcp.save(get_model_state_dict(model), checkpoint_id=str(splits / f"torch_{name}"))


def main() -> None:
    splits = join("splits", timeout=180).directory
    for name in MESHES:
        torch_save(name, splits)
        dist.barrier()
        model = scrambled(LLAMA)
        parallelize(model, *MESHES[name])
        report(name, load_and_run(model, splits / name), LLAMA)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
