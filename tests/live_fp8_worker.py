"""One rank of a live-gather job over FP8 weights, launched by ``tests/test_live_fp8.py`` (not a test module).

    python tests/live_fp8_worker.py --rank R --world N --port P --out DIR SCENARIO [SCENARIO ...]

Every rank builds the model a transformers FP8 checkpoint loads into: the reference Llama with each Linear of the
decoder replaced by transformers' own ``FP8Linear`` (``replace_with_fp8_linear``, as its finegrained-FP8 loader does
on a GPU), whose parameters are the ``float8_e4m3fn`` ``weight`` and the float32 ``weight_scale_inv`` beside it, and
loads ``DIR/<reference>/model.safetensors`` into it (a checkpoint ``ckpttool merge --quantize fp8`` wrote, so the
user's round trip). Then it shards the model as a job would and calls :func:`ckpttool.live.save_hf`.

gloo's collectives refuse float8 tensors ("Invalid scalar type"), so ``distribute_tensor`` cannot scatter them:
the tensor-parallel plan is applied with ``src_data_rank=None`` (every rank cuts its own piece), and FSDP2 shards
without communication. The live gather itself moves pieces with point-to-point sends, as bytes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from gloo_worker import run_scenarios

sys.path.insert(0, str(Path(__file__).resolve().parent))
from live_worker import fsdp2, tp_plan  # noqa: E402


def fp8_model(reference: Path):
    """The model transformers builds for an FP8 checkpoint on a GPU, on this CPU: FP8Linear modules, loaded."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

    config = AutoConfig.from_pretrained(reference)
    raw = dict(config.quantization_config)
    quantization = FineGrainedFP8Config(**{k: v for k, v in raw.items() if k != "quant_method"})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    replace_with_fp8_linear(model, modules_to_not_convert=quantization.modules_to_not_convert,
                            quantization_config=quantization, pre_quantized=True)
    model.to_empty(device="cpu")
    model.load_state_dict(load_file(reference / "model.safetensors"), strict=True)
    q = model.model.layers[0].self_attn.q_proj
    if q.weight.dtype != torch.float8_e4m3fn or q.weight_scale_inv.dtype != torch.float32:
        raise AssertionError(f"not an FP8 model: {q.weight.dtype}, {q.weight_scale_inv.dtype}")
    return model.eval()


def tensor_parallel(model, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    # colwise modules shard every parameter on dim 0 (weight and weight_scale_inv alike); rowwise ones shard the
    # weight on dim 1 and leave the scale a plain tensor, whole on every rank
    parallelize_module(model, init_device_mesh("cpu", (world,)), tp_plan(model), src_data_rank=None)
    return model


def scenario_fp8_tp(out: Path, world: int) -> None:
    """DTensor TP over FP8 weights and their scales (8x8 blocks: every split on a block boundary); one file."""
    from ckpttool.live import save_hf

    model = tensor_parallel(fp8_model(out / "q8"), world)
    save_hf(model, out / "fp8_tp", config=model.config)


def scenario_fp8_tp_dequantized(out: Path, world: int) -> None:
    """The same TP job saved with dtype="bfloat16": each weight dequantized with the scales gathered beside it."""
    from ckpttool.live import save_hf

    model = tensor_parallel(fp8_model(out / "q8"), world)
    save_hf(model, out / "fp8_tp_bf16", config=model.config, dtype="bfloat16", max_shard_size="30KB",
            bucket_bytes=16 * 1024)


def scenario_fp8_fsdp2(out: Path, world: int) -> None:
    """FSDP2 over FP8 weights and their scales (dim 0 of each, 8x8 blocks); files written by every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    from ckpttool.live import save_hf

    model = fp8_model(out / "q8")
    fsdp2(model, init_device_mesh("cpu", (world,)))
    result = save_hf(model, out / "fp8_fsdp2", config=model.config, max_shard_size="30KB", bucket_bytes=32 * 1024)
    if dist.get_rank() == 0:
        print(f"WRITERS {sorted(set(result.writers.values()))}", flush=True)


def scenario_fp8_unaligned(out: Path, world: int) -> None:
    """TP over 16x16 blocks: k_proj and v_proj ([16, 32]) split at row 8, inside a block. Every rank refuses."""
    from ckpttool.errors import ConfigError
    from ckpttool.live import save_hf

    model = tensor_parallel(fp8_model(out / "q16"), world)
    try:
        save_hf(model, out / "fp8_unaligned", config=model.config)
    except ConfigError as e:
        print(f"RANK {dist.get_rank()} REFUSED: {e}", flush=True)
    else:
        raise AssertionError("a split inside an FP8 block was not refused")


SCENARIOS = {name.removeprefix("scenario_"): fn for name, fn in globals().items() if name.startswith("scenario_")}


def main() -> None:
    run_scenarios(SCENARIOS, "out", timeout=120)


if __name__ == "__main__":
    main()
