"""The real consumer of a Nemotron-H ``split --to megatron``: megatron-core 0.16.1 builds the hybrid ``MambaModel`` as
its producer (``fixtures/make_megatron_hybrid.py``) does for CASE (``nemotron_h_tp2_pp2``: TP=2 x PP=2;
``nemotron_h_moe_tp2_ep2``: MoE layers, TP=2 x EP=2, expert TP 1; 4 ranks each), loads the split with
``dist_checkpointing.load`` (``strict="raise_all"``: every key asked for is in the checkpoint and nothing else),
runs its forward (stage 0 sends its hidden states to stage 1 by hand) and the last stage's TP rank 0 writes the
logits, gathered over tensor parallel, for the test to compare with transformers'.

The producer's ``mamba_ssm`` stand-in computes the scan; the Megatron venv of the tests has no ``einops`` (pure
Python, which ``MambaMixer`` imports): a stand-in of the three ``rearrange`` patterns a training forward uses is
put in its place, and any other pattern fails loudly.

    torchrun --nproc_per_node 4 tests/megatron_hybrid_consumer.py CASE CHECKPOINT_DIR LOGITS_OUT
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))

import make_megatron_hybrid as producer  # noqa: E402  (the producer's own model and layout)
from megatron_load import load_strictly, poison  # noqa: E402


def _einops_stand_in() -> None:
    """``einops.rearrange`` for the patterns ``MambaMixer._ssm_training`` uses, when einops is not installed."""
    import importlib.util

    if importlib.util.find_spec("einops") is not None:
        return
    moves = {"l b d -> b l d": lambda t: t.transpose(0, 1), "b l d -> l b d": lambda t: t.transpose(0, 1),
             "d 1 w -> d w": lambda t: t.squeeze(1)}

    def rearrange(tensor, pattern, **_):
        if pattern not in moves:
            raise NotImplementedError(f"the einops stand-in has no pattern {pattern!r}")
        return moves[pattern](tensor)

    def repeat(tensor, pattern, **_):
        raise NotImplementedError(f"the einops stand-in has no repeat ({pattern!r})")

    module = types.ModuleType("einops")
    module.rearrange, module.repeat, module.__version__ = rearrange, repeat, "0.0-stand-in"
    sys.modules["einops"] = module


def main(case: str, checkpoint: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    _einops_stand_in()
    producer._use(case)
    producer._init(producer.TP, producer.PP, producer.EP)
    from megatron.core import parallel_state as ps

    rows = producer.base.padded_vocab(producer.VOCAB, producer.DIVISIBLE_BY, producer.TP)
    model = producer._build(producer.TP, producer.PP, rows, producer.EP)
    poison([model])
    load_strictly({"model": model}, checkpoint, {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)})
    ids = torch.tensor(producer.tokens(), dtype=torch.long)
    s = ids.shape[1]
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        if not ps.is_pipeline_first_stage():
            hidden = torch.empty(s, ids.shape[0], producer.HIDDEN)
            dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        result = model(ids, torch.arange(s).unsqueeze(0), mask)
        if not ps.is_pipeline_last_stage():
            dist.send(result.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        else:
            parts = [torch.empty_like(result) for _ in range(producer.TP)]
            dist.all_gather(parts, result.contiguous(), group=ps.get_tensor_model_parallel_group())
            if ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
                save_file({"tokens": ids, "logits": torch.cat(parts, dim=-1).float().contiguous()}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
