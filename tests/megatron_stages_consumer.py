"""The real consumer of a ``split --to megatron`` with uneven or virtual pipeline stages: megatron-core 0.16.1 builds
the Llama of ``fixtures/make_megatron.py``'s case at its layout (PP2 with 1 + 2 layers; PP2 x VPP2, one model chunk
per virtual stage, as Megatron-LM's ``get_model``), loads the split with ``dist_checkpointing.load``
(``strict="raise_all"``; the chunks as ``model0``, ``model1``) and runs the forward through every chunk in
pipeline order (stage 0 chunk 0, stage 1 chunk 0, stage 0 chunk 1, ...), sending the hidden states by hand; the
last chunk's rank writes the logits.

    torchrun --nproc_per_node 2 tests/megatron_stages_consumer.py CASE CHECKPOINT_DIR LOGITS_OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))

import make_megatron as mm  # noqa: E402  (the producer's own model and layout)
from megatron_load import load_strictly, poison  # noqa: E402


def main(name: str, checkpoint: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    mm._shim_cuda()
    from megatron.core import parallel_state as ps

    case = mm.CASES[name.removeprefix("megatron_")]
    tp, pp, ep, vpp = case["tp"], case["pp"], case["ep"], case.get("vpp")
    dist.init_process_group("gloo")
    mm._initialize_parallel(tp, pp, ep, vpp)
    rows = mm.padded_vocab(case["vocab"], case["divisible_by"], tp)
    chunks = [mm._build(case, tp, pp, ep, rows, v) for v in range(vpp)] if vpp else [mm._build(case, tp, pp, ep, rows)]
    poison(chunks)
    keys = ["model"] if len(chunks) == 1 else [f"model{v}" for v in range(len(chunks))]
    load_strictly(dict(zip(keys, chunks)), checkpoint,
                  mm._metadata(case, ps.get_data_parallel_group(with_context_parallel=True)))
    tokens = torch.tensor(mm.tokens_of(case), dtype=torch.long)
    s = tokens.shape[1]
    position_ids, mask = torch.arange(s).unsqueeze(0), torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    stage, last = ps.get_pipeline_model_parallel_rank(), len(chunks) - 1
    with torch.no_grad():
        for v, chunk in enumerate(chunks):
            if not (stage == 0 and v == 0):
                hidden = torch.empty(s, tokens.shape[0], mm.HIDDEN)
                dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
                chunk.set_input_tensor(hidden)
            result = chunk(tokens, position_ids, mask)
            if not (stage == pp - 1 and v == last):
                dist.send(result.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            elif ps.get_tensor_model_parallel_rank() == 0:
                save_file({"tokens": tokens, "logits": result.float().contiguous()}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
