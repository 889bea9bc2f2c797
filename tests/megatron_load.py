"""What every megatron-core consumer of a ``split --to megatron`` does before its forward (run in the Megatron venv,
imported by the ``tests/megatron_*_consumer.py`` scripts): poison the model, load the checkpoint strictly, check that
every weight came from it."""

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
