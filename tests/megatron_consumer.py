"""The real consumer of ``split --to megatron``: megatron-core 0.16.1 loads the output on CPU (gloo) at the
layout it was split for and runs the model's forward; the full logits go to a file for the test to compare with
transformers' (there is no transformers in the Megatron venv).

Run under torchrun with the Megatron venv, from ``tests/test_split_megatron.py``::

    torchrun --nproc_per_node 4 tests/megatron_consumer.py CASE CHECKPOINT_DIR LOGITS_OUT [TP,PP,EP]

``CASE`` is a case of ``fixtures/make_megatron.py`` (its model and parallel layout; the model is built with that
script's own machinery); ``TP,PP,EP`` loads the same model at another layout (expert TP = TP). Every pipeline stage runs its layers; stage 0 sends its hidden states to stage 1 by hand
(no schedule needed for a forward), the last stage gathers the vocab-parallel logits over tensor parallel.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))

import make_megatron as mm  # noqa: E402
from megatron_load import load_strictly, poison  # noqa: E402


def main(name: str, checkpoint: str, out: str, layout: str | None = None) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    mm._shim_cuda()
    from megatron.core import parallel_state as ps

    case = mm.CASES[name]
    if layout is not None:
        tp, pp, ep = (int(n) for n in layout.split(","))
        case = {**case, "tp": tp, "pp": pp, "ep": ep, "etp": tp}
    tp, pp, ep = case["tp"], case["pp"], case["ep"]
    dist.init_process_group("gloo")
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=case.get("etp", 1) if tp > 1 else None)
    rows = mm.padded_vocab(case["vocab"], case["divisible_by"], tp)
    model = mm._build(case, tp, pp, ep, rows)
    poison([model])
    # the model's whole sharded state dict, as Megatron-LM's load_checkpoint asks for it
    load_strictly({"model": model}, checkpoint, mm._metadata(case, ps.get_data_parallel_group(with_context_parallel=True)))
    tokens = torch.tensor(mm.tokens_of(case), dtype=torch.long)
    s = tokens.shape[1]
    position_ids = torch.arange(s).unsqueeze(0)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        if not ps.is_pipeline_first_stage():
            hidden = torch.empty(s, tokens.shape[0], mm.HIDDEN)
            dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        result = model(tokens, position_ids, mask)
        if not ps.is_pipeline_last_stage():
            dist.send(result.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        else:
            parts = [torch.empty_like(result) for _ in range(tp)]
            dist.all_gather(parts, result.contiguous(), group=ps.get_tensor_model_parallel_group())
            logits = torch.cat(parts, dim=-1).float().contiguous()
            if ps.get_tensor_model_parallel_rank() == 0 and ps.get_expert_model_parallel_rank() == 0 \
                    and ps.get_data_parallel_rank() == 0:
                save_file({"tokens": tokens, "logits": logits}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5])
