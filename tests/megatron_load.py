"""What every megatron-core consumer of a ``split --to megatron`` does before its forward (run in the Megatron venv,
imported by the ``tests/megatron_*_consumer.py`` scripts): poison the model, load the checkpoint strictly, check that
every weight came from it; and the forward of a model without pipeline stages, its logits gathered over TP."""

from __future__ import annotations


def poison(modules, buffers: str | None = None) -> None:
    """Fill every parameter (and every buffer whose name ends with ``buffers``) with NaN: anything the load leaves
    alone shows in the logits."""
    import torch

    with torch.no_grad():
        for module in modules:
            for p in [*module.parameters(), *(b for n, b in module.named_buffers() if buffers and n.endswith(buffers))]:
                p.fill_(float("nan"))


def load_strictly(chunks: dict, checkpoint: str, metadata: dict) -> None:
    """``dist_checkpointing.load`` of the model ``chunks`` (``{"model": model}``, or ``model0``, ``model1``, ... with
    virtual stages) with ``strict="raise_all"``: every key the model's whole sharded state dict asks for (its
    linear layers' ``_extra_state`` objects included) is in the checkpoint, and nothing else; ``common.pt`` gives
    the iteration and args; every weight is loaded. Leaves the chunks in eval mode.

    Raises:
        SystemExit: naming what is missing or unexpected.
    """
    from megatron.core import dist_checkpointing

    sharded = {key: chunk.sharded_state_dict(metadata=metadata) for key, chunk in chunks.items()}
    loaded = dist_checkpointing.load(sharded, checkpoint, strict="raise_all")
    if loaded.get("iteration") is None or loaded.get("args") is None:
        raise SystemExit(f"common.pt gave no iteration or args: {sorted(loaded)}")
    for key, chunk in chunks.items():
        missing, unexpected = chunk.load_state_dict(loaded[key], strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise SystemExit(f"{key}: megatron-core did not load every weight: missing {missing}, unexpected {unexpected}")
        chunk.eval()


def tp_logits(model, ids, tp: int):
    """The causal forward of ``model`` (no pipeline stages) on the token ``ids``, its vocab columns gathered over the
    ``tp`` ranks of tensor parallel: the whole logits, in float32, on every rank."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    s = ids.shape[1]
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        logits = model(ids, torch.arange(s).unsqueeze(0), mask)  # [b, s, rows / tp]: this rank's vocab columns
    parts = [torch.empty_like(logits) for _ in range(tp)]
    dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1).float().contiguous()
