"""The real consumer of a DeepSeek-V3 ``split --to megatron``: megatron-core 0.16.1 builds the model as its producer
(``fixtures/make_megatron_deepseek.py``) does, at the case's own layout (TP2 x EP2 with expert TP 2, or PP2 with
2 + 1 layers x EP2; MLA, dense-first MoE, shared expert, expert bias, one MTP layer), loads the split with
``dist_checkpointing.load`` (``strict="raise_all"``: every key asked for is in the checkpoint and nothing else) and
runs its forward; the last stage's TP rank 0 writes the main and the MTP logits (gathered over tensor parallel).

    torchrun --nproc_per_node N tests/megatron_deepseek_consumer.py CASE CHECKPOINT_DIR LOGITS_OUT [ETP]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))

import make_megatron_deepseek as producer  # noqa: E402  (the producer's own model and layout)
from megatron_load import load_strictly, poison  # noqa: E402


def main(name: str, checkpoint: str, out: str, etp: str | None = None) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    case = producer.CASES[name.removeprefix("megatron_")]
    if etp is not None:  # the same layout with another expert TP
        case = {**case, "etp": int(etp)}
    tp, pp, ep = case["tp"], case["pp"], case["ep"]
    producer._init(case, tp, pp, ep)
    from megatron.core import parallel_state as ps

    model = producer._build(case, tp, pp, ep, producer.base.padded_vocab(producer.VOCAB, producer.DIVISIBLE_BY, tp))
    poison([model], buffers="expert_bias")
    load_strictly({"model": model}, checkpoint, {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)})
    ids = torch.tensor(producer.tokens(), dtype=torch.long)
    s = ids.shape[1]
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    outputs = []  # the output layer's: the MTP layer's first, then the main model's (as the producer keeps them)
    hook = (model.output_layer.register_forward_hook(lambda m, a, o: outputs.append(o[0].detach().clone()))
            if ps.is_pipeline_last_stage() else None)
    with torch.no_grad():
        if not ps.is_pipeline_first_stage():
            hidden = torch.empty(s, ids.shape[0], producer.HIDDEN)
            dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        result = model(ids, torch.arange(s).unsqueeze(0), mask, labels=ids)
        if not ps.is_pipeline_last_stage():
            dist.send(result.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
    if hook is not None:
        hook.remove()
        if len(outputs) != 1 + producer.MTP:
            raise SystemExit(f"expected {1 + producer.MTP} output-layer calls, got {len(outputs)}")
        gathered = []
        for part in (outputs[-1], outputs[0]):
            parts = [torch.empty_like(part) for _ in range(tp)]
            dist.all_gather(parts, part.contiguous(), group=ps.get_tensor_model_parallel_group())
            gathered.append(torch.cat(parts, dim=-1).transpose(0, 1).float().contiguous())
        if ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
            save_file({"tokens": ids, "logits": gathered[0], "mtp_logits": gathered[1]}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5])
