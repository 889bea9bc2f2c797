"""The real consumer of a gpt-oss ``split --to megatron``: megatron-core 0.16.1 builds gpt-oss as its producer
(``fixtures/make_megatron_gpt_oss.py``) does, at TP=2 x EP=2 on 2 ranks (expert TP 1), loads the split with
``dist_checkpointing.load`` (``strict="raise_all"``: every key asked for is in the checkpoint and nothing else) and
runs its forward; rank 0 writes the logits (gathered over tensor parallel) for the test to compare.

    torchrun --nproc_per_node 2 tests/megatron_gpt_oss_consumer.py CHECKPOINT_DIR LOGITS_OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))

import make_megatron_gpt_oss as producer  # noqa: E402  (the producer's own model and layout)
from megatron_load import load_strictly, poison  # noqa: E402


def main(checkpoint: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    producer._init(producer.TP, producer.EP)
    from megatron.core import parallel_state as ps

    rows = producer.base.padded_vocab(producer.VOCAB, producer.DIVISIBLE_BY, producer.TP)
    model = producer._build(producer.TP, producer.EP, rows)
    poison([model])
    load_strictly({"model": model}, checkpoint, {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)})
    ids = torch.tensor(producer.tokens(), dtype=torch.long)
    s = ids.shape[1]
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        result = model(ids, torch.arange(s).unsqueeze(0), mask)
        parts = [torch.empty_like(result) for _ in range(producer.TP)]
        dist.all_gather(parts, result.contiguous(), group=ps.get_tensor_model_parallel_group())
    if dist.get_rank() == 0:
        save_file({"tokens": ids, "logits": torch.cat(parts, dim=-1).float().contiguous()}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
