"""The real consumer of an FP8 DeepSeek-V3 release split ``--to megatron --dtype bfloat16`` at a TP whose shards cut
through the FP8 blocks (``tests/test_split_fp8_tp.py``): megatron-core 0.16.1 builds the release's own model (its
sizes read from the split's ``config.json``; the producer's local layer spec and shims, ``make_megatron_deepseek``),
at TP ``tp`` with expert TP ``tp``, in float32, loads the split with ``dist_checkpointing.load``
(``strict="raise_all"``) and runs its forward; TP rank 0 writes the tokens and the logits (gathered over TP).

    torchrun --nproc_per_node TP tests/megatron_fp8_split_consumer.py CONFIG_JSON CHECKPOINT_DIR LOGITS_OUT DIVISIBLE_BY
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))

import make_megatron_deepseek as producer  # noqa: E402  (the producer's model builder, its sizes set below)
from megatron_load import load_strictly, poison, tp_logits  # noqa: E402


def sized_from(config: dict) -> None:
    """The producer's module-level sizes set to the HF ``config``'s (its builder reads them when called)."""
    layers, first = config["num_hidden_layers"], config["first_k_dense_replace"]
    producer.LAYERS, producer.HIDDEN, producer.FFN = layers, config["hidden_size"], config["intermediate_size"]
    producer.MOE_FFN, producer.HEADS = config["moe_intermediate_size"], config["num_attention_heads"]
    producer.KV_LORA, producer.QK_NOPE = config["kv_lora_rank"], config["qk_nope_head_dim"]
    producer.QK_ROPE, producer.V_DIM = config["qk_rope_head_dim"], config["v_head_dim"]
    producer.EXPERTS, producer.TOPK = config["n_routed_experts"], config["num_experts_per_tok"]
    producer.GROUPS, producer.GROUP_TOPK = config["n_group"], config["topk_group"]
    producer.SCALING, producer.MTP = config["routed_scaling_factor"], None
    producer.MOE_LAYER_FREQ = [0] * first + [1] * (layers - first)
    producer.VOCAB, producer.EPS = config["vocab_size"], config["rms_norm_eps"]
    producer.ROPE_THETA = float(config["rope_parameters"]["rope_theta"])


def main(config_path: str, checkpoint: str, out: str, divisible_by: str) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    config = json.loads(Path(config_path).read_text())
    sized_from(config)
    tp = int(os.environ["WORLD_SIZE"])  # torchrun's: every rank is one TP rank
    case = {"tp": tp, "pp": 1, "ep": 1, "etp": tp, "q_lora_rank": config["q_lora_rank"]}
    producer._init(case, tp, 1, 1)
    from megatron.core import parallel_state as ps

    rows = producer.base.padded_vocab(producer.VOCAB, int(divisible_by), tp)
    model = producer._build(case, tp, 1, 1, rows)
    poison([model], buffers="expert_bias")
    load_strictly({"model": model}, checkpoint, {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)})
    ids = torch.tensor(producer.tokens(), dtype=torch.long)
    logits = tp_logits(model, ids, tp)
    if ps.get_tensor_model_parallel_rank() == 0:
        save_file({"tokens": ids, "logits": logits}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5])
