"""The real consumer of a gpt-oss ``split --to megatron``: megatron-core 0.16.1 builds gpt-oss as its producer
(``fixtures/make_megatron_gpt_oss.py``) does, at TP=2 x EP=2 on 2 ranks (expert TP 1), loads the split with
``dist_checkpointing.load`` (``strict="raise_all"``: every key asked for is in the checkpoint and nothing else) and
runs its forward; rank 0 writes the logits (gathered over tensor parallel) for the test to compare. With a CASE of
the producer (``gpt_oss_tp2_etp2``: TP 2 x expert TP 2), it is built at that layout instead, and every rank also
writes its local weights to ``LOGITS_OUT.rank<r>`` and what the producer's legacy file of that rank holds to
``LOGITS_OUT.legacy<r>``.

    torchrun --nproc_per_node 2 tests/megatron_gpt_oss_consumer.py CHECKPOINT_DIR LOGITS_OUT [CASE]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))

import make_megatron_gpt_oss as producer  # noqa: E402  (the producer's own model and layout)
from megatron_load import load_strictly, poison, tp_logits  # noqa: E402


def main(checkpoint: str, out: str, case: str = "") -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    if case:
        producer._use(case)
    producer._init(producer.TP, producer.EP, producer.ETP)
    from megatron.core import parallel_state as ps

    rows = producer.base.padded_vocab(producer.VOCAB, producer.DIVISIBLE_BY, producer.TP)
    model = producer._build(producer.TP, producer.EP, rows, producer.ETP)
    poison([model])
    load_strictly({"model": model}, checkpoint, {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)})
    if case:  # this rank's weights, and what the producer's legacy file of this rank holds (it needs megatron to load)
        rank = dist.get_rank()
        local = {k: v.detach().contiguous() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
        save_file(local, f"{out}.rank{rank}")
        legacy = producer.HERE / f"megatron_{case}" / "legacy" / "iter_0000010" / f"mp_rank_{rank:02d}" / "model_optim_rng.pt"
        saved = torch.load(legacy, weights_only=False)["model"]
        save_file({k: v.contiguous() for k, v in saved.items() if not k.endswith("_extra_state")}, f"{out}.legacy{rank}")
    ids = torch.tensor(producer.tokens(), dtype=torch.long)
    logits = tp_logits(model, ids, producer.TP)
    if dist.get_rank() == 0:
        save_file({"tokens": ids, "logits": logits}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
