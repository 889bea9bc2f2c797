"""One rank of a live-gather job whose family needs plan transforms, launched by ``tests/test_live_transforms.py``
(not a test module itself).

    python tests/live_transforms_worker.py --rank R --world N --port P --out DIR SCENARIO [SCENARIO ...]

Every rank loads the model a fixture's real producer saved (torchtitan 0.3's own trainer, megatron-core 0.16, FSDP2)
in the names that producer's model keeps in memory, holds its share of it as the job did (DTensors for torchtitan
and FSDP2, plain tensors with PieceSpecs for Megatron-Core, which has no DTensor), and calls
:func:`ckpttool.live.save_hf`. Each scenario also saves the same tensors with ``torch.distributed.checkpoint`` (or
names the producer's own save), so the test can compare the live output with the offline merge of that save.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from gloo_worker import run_scenarios

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
#: torchtitan's names -> the placement its parallelize functions give them under TP (dim), Replicate otherwise
TITAN_TP = {"tok_embeddings.weight": 1, "wq.weight": 0, "wk.weight": 0, "wv.weight": 0, "wo.weight": 1,
            "w1.weight": 0, "w3.weight": 0, "w2.weight": 1, "lm_head.weight": 0, "output.weight": 0}


def model_entries(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a DCP (not its optimizer, lr_scheduler, dataloader or train state), whole."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(str(checkpoint))
    skip = ("optimizer.", "lr_scheduler.", "dataloader.", "train_state.")
    state = {k: torch.empty(v.size, dtype=v.properties.dtype)
             for k, v in reader.read_metadata().state_dict_metadata.items()
             if isinstance(v, TensorStorageMetadata) and not k.startswith(skip)}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def config(path: Path) -> dict:
    return json.loads(path.read_text())


def save_both(state: dict, out: Path, name: str, cfg: dict) -> None:
    """The live save and a DCP save of the same tensors (what the offline merge reads)."""
    import torch.distributed.checkpoint as dcp

    from ckpttool.live import save_hf

    save_hf(state, out / name, config=cfg, max_shard_size="24KB", bucket_bytes=32 * 1024)
    dcp.save(state, checkpoint_id=str(out / f"{name}_dcp"))


def scenario_titan_fsdp2(out: Path, world: int) -> None:
    """torchtitan's Llama 3 under FSDP2: every tensor Shard(0) over the ranks (Q and K rows cut across heads'
    RoPE pairs as FSDP2 cuts them)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    fixture = FIXTURES / "torchtitan_llama3_fsdp2"
    mesh = init_device_mesh("cpu", (world,))
    state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in model_entries(fixture / "checkpoint").items()}
    save_both(state, out, "titan_fsdp2", config(fixture / "reference" / "config.json"))


def scenario_titan_midhead(out: Path, world: int) -> None:
    """torchtitan's Llama 3 with Q and K rows cut in the middle of a head (rows 0..12 | 12..32 of Q, 0..4 | 4..16 of
    K: head_dim 8) as plain tensors with PieceSpecs: a chunk of the permutation reads rows from both ranks."""
    from ckpttool.io.sidecar import PieceSpec
    from ckpttool.live import save_hf

    fixture = FIXTURES / "torchtitan_llama3_fsdp2"
    rank = dist.get_rank()
    state, specs = {}, {}
    for name, tensor in model_entries(fixture / "checkpoint").items():
        cut = {"wq.weight": 12, "wk.weight": 4}.get(name.rsplit(".", 2)[-2] + ".weight") if ".qkv_linear." in name else None
        if cut is None:
            state[name] = tensor
            continue
        start, stop = (0, cut) if rank == 0 else (cut, tensor.shape[0])
        state[name] = tensor[start:stop].clone()
        specs[name] = PieceSpec(tuple(tensor.shape), (start, 0))
    save_hf(state, out / "titan_midhead", config=config(fixture / "reference" / "config.json"), specs=specs,
            max_shard_size="24KB", bucket_bytes=32 * 1024)


def scenario_titan_tp(out: Path, world: int) -> None:
    """torchtitan's Llama 3 under TP: column-parallel Q/K/V/w1/w3/lm_head (rows), row-parallel wo/w2 and the
    embedding (columns), norms replicated."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    fixture = FIXTURES / "torchtitan_llama3_tp2"
    mesh = init_device_mesh("cpu", (world,))
    state = {}
    for name, tensor in model_entries(fixture / "checkpoint").items():
        dim = next((d for suffix, d in TITAN_TP.items() if name.endswith(suffix)), None)
        state[name] = distribute_tensor(tensor, mesh, [Replicate() if dim is None else Shard(dim)])
    save_both(state, out, "titan_tp", config(fixture / "reference" / "config.json"))


def scenario_titan_moe(out: Path, world: int) -> None:
    """torchtitan's Qwen3-MoE with its stacked experts over the ranks (EP), the rest plain replicas."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    fixture = FIXTURES / "torchtitan_qwen3moe_fsdp2"
    mesh = init_device_mesh("cpu", (world,))
    state = {k: distribute_tensor(v, mesh, [Shard(0)]) if ".moe." in k and v.dim() == 3 else v
             for k, v in model_entries(fixture / "checkpoint").items()}
    save_both(state, out, "titan_moe", config(fixture / "reference" / "config.json"))


def scenario_oss_fsdp2(out: Path, world: int) -> None:
    """gpt-oss under FSDP2 in transformers' names (its HF layout: no transform)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    fixture = FIXTURES / "gpt_oss_fsdp2_dcp"
    mesh = init_device_mesh("cpu", (world,))
    state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in model_entries(fixture / "checkpoint").items()}
    save_both(state, out, "oss_fsdp2", config(fixture / "reference" / "config.json"))


def megatron_held(checkpoint: Path, rank: int, vocab: int) -> tuple[dict[str, torch.Tensor], dict]:
    """What rank ``rank`` of the megatron-core job held in memory, rebuilt from the pieces it saved in its
    torch_dist checkpoint (``__R_*.distcp``): per layer (``decoder.layers.L.``), per expert by its global id
    (``local_experts.E.``, as a SequentialMLP job names them once renumbered), its TP share of each, with the
    PieceSpec placing it (the padded vocab's true size included)."""
    from torch.distributed.checkpoint import FileSystemReader

    from ckpttool.layout.layout import Padding
    from ckpttool.io.sidecar import PieceSpec

    whole = model_entries(checkpoint)
    metadata = FileSystemReader(str(checkpoint)).read_metadata()
    boxes: dict[str, tuple[torch.Tensor, list[tuple[tuple[int, ...], tuple[int, ...]]]]] = {}
    for index, info in metadata.storage_data.items():
        if not info.relative_path.startswith(f"__{rank}_") or index.fqn not in whole:
            continue
        full = whole[index.fqn]
        chunk = next(c for c in metadata.state_dict_metadata[index.fqn].chunks if tuple(c.offsets) == tuple(index.offset))
        offsets, sizes, name = tuple(chunk.offsets), tuple(chunk.sizes), index.fqn
        if name.startswith("decoder.layers.") and "final_layernorm" not in name:  # stacked over layers (dim 0)
            full, rest = full[offsets[0]], name.removeprefix("decoder.layers.")
            offsets, sizes = offsets[1:], sizes[1:]
            if rest.startswith("mlp.experts.experts."):  # then over experts
                full = full[offsets[0]]
                rest = f"mlp.experts.local_experts.{offsets[0]}.{rest.removeprefix('mlp.experts.experts.')}"
                offsets, sizes = offsets[1:], sizes[1:]
            name = f"decoder.layers.{chunk.offsets[0]}.{rest}"
        boxes.setdefault(name, (full, []))[1].append((offsets, sizes))
    state, specs = {}, {}
    for name, (full, parts) in boxes.items():
        low = tuple(min(o[d] for o, _ in parts) for d in range(full.dim()))
        high = tuple(max(o[d] + s[d] for o, s in parts) for d in range(full.dim()))
        state[name] = full[tuple(slice(a, b) for a, b in zip(low, high))].clone()
        padding = (Padding(0, vocab),) if name in ("embedding.word_embeddings.weight", "output_layer.weight") else ()
        specs[name] = PieceSpec(tuple(full.shape), low, padding)
    return state, specs


def scenario_oss_megatron(out: Path, world: int) -> None:
    """gpt-oss trained by megatron-core 0.16 with TP 2 and EP 2, each rank holding what it held in the job
    (:func:`megatron_held`): the experts' fc1 ``[gate; up]`` must be interleaved and transposed into HF's
    ``gate_up_proj``, fc2 transposed into ``down_proj``."""
    from ckpttool.live import save_hf

    fixture = FIXTURES / "megatron_gpt_oss_tp2_ep2"
    cfg = config(fixture / "config.json")
    state, specs = megatron_held(fixture / "torch_dist" / "iter_0000010", dist.get_rank(), cfg["vocab_size"])
    save_hf(state, out / "oss_megatron", config=cfg, specs=specs, max_shard_size="24KB", bucket_bytes=32 * 1024)


SCENARIOS = {name.removeprefix("scenario_"): fn for name, fn in globals().items() if name.startswith("scenario_")}


def main() -> None:
    from ckpttool.model.architecture import DESCRIBE_ENV

    os.environ.setdefault(DESCRIBE_ENV, "inline")  # one transformers import per rank, not a subprocess per config
    run_scenarios(SCENARIOS, "out", timeout=120)


if __name__ == "__main__":
    main()
