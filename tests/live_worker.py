"""One rank of a live-gather job, launched by ``tests/test_live.py`` (not a test module itself).

    python tests/live_worker.py --rank R --world N --port P --out DIR SCENARIO [SCENARIO ...]

Every rank loads the same reference model (``fixtures/*/reference``: the unsharded weights the fixtures were
made from), shards it as a real job would, and calls :func:`ckpttool.live.save_hf`. Scenarios run one after
another in one process group. Rank 0 prints ``DONE <scenario>`` after each.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from gloo_worker import run_scenarios

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
LLAMA = FIXTURES / "llama_fsdp2_dcp" / "reference"
MIXTRAL = FIXTURES / "mixtral_fsdp2_dcp" / "reference"


def load(reference: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()


def tp_plan(model):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(len(model.model.layers)):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    return plan


def fsdp2(model, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def scenario_fsdp2(out: Path, world: int) -> None:
    """FSDP2 over a 1-D mesh (vocab 1001 splits unevenly); also a DCP save for the offline merge."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from ckpttool.live import save_hf

    model = load(LLAMA)
    fsdp2(model, init_device_mesh("cpu", (world,)))
    result = save_hf(model, out / "fsdp2", config=model.config, max_shard_size="60KB", bucket_bytes=96 * 1024)
    if dist.get_rank() == 0:
        print(f"WRITERS {sorted(set(result.writers.values()))}", flush=True)
    dcp.save(get_model_state_dict(model), checkpoint_id=str(out / "fsdp2_dcp"))


def scenario_tp(out: Path, world: int) -> None:
    """DTensor TP: embed_tokens and lm_head split over the vocab (1001 rows: uneven)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from ckpttool.live import save_hf

    model = load(LLAMA)
    parallelize_module(model, init_device_mesh("cpu", (world,)), tp_plan(model))
    save_hf(model, out / "tp", config=model.config, max_shard_size="100KB")


def scenario_mesh2d(out: Path, world: int) -> None:
    """TP on mesh['tp'], then FSDP2 on mesh['dp']: the placements include _StridedShard."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from ckpttool.live import save_hf

    model = load(LLAMA)
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], tp_plan(model))
    fsdp2(model, mesh["dp"])
    save_hf(model, out / "mesh2d", config=model.config, max_shard_size="100KB")


def scenario_moe(out: Path, world: int) -> None:
    """Mixtral with its stacked experts sharded over the ranks (expert parallel), the rest replicated."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ckpttool.live import save_hf

    model = load(MIXTRAL)
    mesh = init_device_mesh("cpu", (world,))
    state = {}
    for name, tensor in model.state_dict().items():
        stacked = ".experts." in name and tensor.dim() == 3
        state[name] = distribute_tensor(tensor, mesh, [Shard(0)]) if stacked else tensor
    assert any(".experts." in n for n in state), "no stacked experts in this transformers version"
    save_hf(state, out / "moe", config=model.config, max_shard_size="80KB")


def scenario_empty(out: Path, world: int) -> None:
    """Tensors with no elements, sharded or replicated, beside one split unevenly so that a rank holds none of
    it: the empty ones are written with their shapes, none is dropped."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ckpttool.live import save_hf

    mesh = init_device_mesh("cpu", (world,))
    state = {
        "rows.empty": distribute_tensor(torch.zeros(0, 4), mesh, [Shard(0)]),
        "cols.empty": distribute_tensor(torch.zeros(4, 0), mesh, [Shard(0)]),
        "plain.empty": torch.zeros(0),
        "uneven": distribute_tensor(torch.arange(4.0).reshape(1, 4), mesh, [Shard(0)]),
    }
    save_hf(state, out / "empty")


def scenario_hf_tp(out: Path, world: int) -> None:
    """A transformers DistributedConfig(tp_size=N) model."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from ckpttool.live import save_hf

    model = AutoModelForCausalLM.from_pretrained(LLAMA, distributed_config=DistributedConfig(tp_size=world),
                                                 dtype=torch.float32)
    save_hf(model, out / "hf_tp", config=model.config)


def scenario_spec(out: Path, world: int) -> None:
    """Plain local tensors with PieceSpecs (a framework without DTensor): the vocab padded to a multiple of
    8 * world and split over the ranks, the seed incident at tiny scale; the rest replicated."""
    from ckpttool.live import save_hf
    from ckpttool.io.sidecar import PieceSpec

    model = load(LLAMA)
    rank = dist.get_rank()
    vocab = model.config.vocab_size
    padded = -(-vocab // (8 * world)) * (8 * world)
    per = padded // world
    state, specs = {}, {}
    for name, tensor in model.state_dict().items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            full = torch.cat([tensor, torch.full((padded - vocab, tensor.shape[1]), 7.0)])  # junk padding rows
            state[name] = full[rank * per:(rank + 1) * per].clone()
            specs[name] = PieceSpec.split(tuple(full.shape), dim=0, index=rank, count=world, true_size=vocab,
                                          tp_rank=rank)
        else:
            state[name] = tensor
    save_hf(state, out / "spec", config=model.config, specs=specs, max_shard_size="100KB")


def scenario_spec_missing(out: Path, world: int) -> None:
    """As ``spec``, but the last rank forgets its vocab piece: every rank must refuse, nothing written."""
    from ckpttool.errors import CoverageError
    from ckpttool.live import save_hf
    from ckpttool.io.sidecar import PieceSpec

    model = load(LLAMA)
    rank = dist.get_rank()
    vocab = model.config.vocab_size
    per = -(-vocab // world)
    state, specs = {}, {}
    for name, tensor in model.state_dict().items():
        if name == "model.embed_tokens.weight" and rank == world - 1:
            continue
        if name == "model.embed_tokens.weight":
            state[name] = tensor[rank * per:(rank + 1) * per]
            specs[name] = PieceSpec(tuple(tensor.shape), (rank * per, 0))
        else:
            state[name] = tensor
    try:
        save_hf(state, out / "spec_missing", config=model.config, specs=specs)
    except CoverageError as e:
        print(f"RANK {rank} REFUSED: {e}", flush=True)
    else:
        raise AssertionError("a missing piece was not refused")


def scenario_partial(out: Path, world: int) -> None:
    """A DTensor still holding partial sums cannot be saved: every rank refuses before anything moves."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    from ckpttool.errors import SourceError
    from ckpttool.live import save_hf

    state = dict(load(LLAMA).state_dict())
    mesh = init_device_mesh("cpu", (world,))
    state["model.norm.weight"] = DTensor.from_local(state["model.norm.weight"], mesh, [Partial()])
    try:
        save_hf(state, out / "partial")
    except SourceError as e:
        print(f"RANK {dist.get_rank()} REFUSED: {e}", flush=True)
    else:
        raise AssertionError("a Partial DTensor was saved")


def scenario_die(out: Path, world: int) -> None:
    """The last rank is killed in the middle of the gather; the others must stop naming it."""
    from ckpttool import live
    from ckpttool.live import LiveGatherError, save_hf

    model = load(LLAMA)
    if dist.get_rank() == world - 1:
        real = live.Gather.exchange

        def die(self, number, *args):
            if number == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(self, number, *args)

        live.Gather.exchange = die
    try:
        save_hf(model, out / "die", config=model.config, max_shard_size="60KB", bucket_bytes=64 * 1024, timeout=20)
    except LiveGatherError as e:
        print(f"RANK {dist.get_rank()} FAILED: {e}", flush=True)
        sys.exit(3)


def scenario_absent(out: Path, world: int) -> None:
    """The last rank never calls save_hf (it hangs in its own code); the others must stop naming it."""
    import time

    from ckpttool.live import LiveGatherError, save_hf

    model = load(LLAMA)
    gave_up = out / "absent-gave-up"
    if dist.get_rank() == world - 1:
        deadline = time.monotonic() + 60
        while not gave_up.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        os._exit(0)
    start = time.monotonic()
    try:
        save_hf(model, out / "absent", config=model.config, timeout=5)
    except LiveGatherError as e:
        print(f"RANK {dist.get_rank()} FAILED after {time.monotonic() - start:.0f} s: {e}", flush=True)
        gave_up.touch()
        os._exit(3)  # the process group cannot be torn down cleanly without the absent rank


SCENARIOS = {name.removeprefix("scenario_"): fn for name, fn in globals().items() if name.startswith("scenario_")}


def main() -> None:
    run_scenarios(SCENARIOS, "out", timeout=120)


if __name__ == "__main__":
    main()
