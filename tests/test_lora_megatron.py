"""Megatron-Core LoRA saved with its base (Megatron-Bridge's adapter.linear_in / linear_out, ckpttool.lora.megatron):
fused into the HuggingFace model bit for bit as Megatron-Bridge's own LoRAMerge merges it, and exported by
`merge --adapter-only` as the PEFT adapter of that model. Refusals: message, exit 1, nothing written.

The fixture megatron_bridge_lora_tp2 (fixtures/make_megatron_lora.py: Megatron-Bridge 0.3.1 on megatron-core 0.16.1,
gloo TP=2) holds the checkpoint, its reference/ (Megatron-Bridge's LoRAMerge of the checkpoint loaded at TP=1, mapped
to HF names by the producer, not by ckpttool), logits.safetensors (Megatron's forward of the unmerged LoRA model) and
lora.json (the LoRA's dim and alpha, which the checkpoint does not hold)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from ckpttool.errors import SourceError
from ckpttool.lora.embedded import SourceTensor, split_embedded
from ckpttool.lora.megatron import split_bridge
from conftest import FIXTURES, assert_failed_cleanly, tree_digest

pytestmark = pytest.mark.usefixtures("describe_inline")

BRIDGE = FIXTURES / "megatron_bridge_lora_tp2"
SOURCE = BRIDGE / "torch_dist"
CONFIG = BRIDGE / "config.json"
LORA = BRIDGE / "lora.json"
PREFIX = "base_model.model."


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """The source fused and its adapter exported, once each, through the CLI; the base alone, read by its plan."""
    from click.testing import CliRunner

    from ckpttool.cli import main
    from ckpttool.commands.source import plan_source

    root = tmp_path_factory.mktemp("bridge")
    before = tree_digest(BRIDGE)
    runner = CliRunner()
    common = ["--config", str(CONFIG), "--adapter-config", str(LORA)]
    fused = runner.invoke(main, ["merge", str(SOURCE), str(root / "fused"), "--json", *common], catch_exceptions=False)
    exported = runner.invoke(main, ["merge", str(SOURCE), str(root / "adapter"), "--adapter-only", *common],
                             catch_exceptions=False)
    targets = plan_source(SOURCE, config=CONFIG).plan.targets
    base = {t.name: SourceTensor(str(SOURCE), t, t.name).read_rows(0, t.shape[0]) for t in targets}
    return {"root": root, "fused": fused, "adapter": exported, "base": base, "before": before}


def test_the_fuse_is_bit_exact_with_megatron_bridges_lora_merge(outputs):
    result = outputs["fused"]
    assert result.exit_code == 0, result.output
    written = load_file(outputs["root"] / "fused" / "model.safetensors")
    reference = load_file(BRIDGE / "reference" / "model.safetensors")
    assert sorted(written) == sorted(reference)
    for name, tensor in reference.items():
        assert written[name].dtype == tensor.dtype and torch.equal(written[name], tensor), name
    changed = sorted(n for n in reference if not torch.equal(reference[n], outputs["base"][n]))
    assert len(changed) == 14 and all(n.endswith(("_proj.weight")) for n in changed)  # q k v o gate up down x 2
    note = f"LoRA adapter '{SOURCE}' fused into 14 tensors (rank 4, scaling 2)"
    assert result.stderr == f"note: {note}, as it was saved with the base\n"
    doc = json.loads(result.stdout)
    assert doc["embedded_adapter"] == note and doc["audit"]["summary"]["errors"] == 0
    assert tree_digest(BRIDGE) == outputs["before"]


def test_the_fused_model_loads_strictly_with_megatrons_lora_logits(outputs):
    from transformers import AutoModelForCausalLM

    saved = load_file(BRIDGE / "logits.safetensors")
    model, info = AutoModelForCausalLM.from_pretrained(outputs["root"] / "fused", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    with torch.no_grad():
        logits = model.eval()(saved["tokens"]).logits
    # Megatron's forward of the unmerged LoRA model, its vocab padding cut off: another program, so within 1e-4
    torch.testing.assert_close(logits, saved["logits"][..., :logits.shape[-1]], atol=1e-4, rtol=0)


def test_the_adapter_only_export_is_the_peft_adapter_of_the_hf_model(outputs):
    result = outputs["adapter"]
    assert result.exit_code == 0, result.output
    out = outputs["root"] / "adapter"
    assert result.stdout == (f"wrote the LoRA adapter of '{SOURCE}' (14 modules, rank 4) to '{out}': "
                             "adapter_config.json, adapter_model.safetensors\n")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config == {"bias": "none", "inference_mode": True, "lora_alpha": 8, "peft_type": "LORA", "r": 4,
                      "target_modules": ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"],
                      "task_type": "CAUSAL_LM"}
    weights = load_file(out / "adapter_model.safetensors")
    assert len(weights) == 28
    reference = load_file(BRIDGE / "reference" / "model.safetensors")
    for layer in range(2):
        m = f"{PREFIX}model.layers.{layer}."
        a = {p: weights[f"{m}{p}.lora_A.weight"] for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")}
        assert torch.equal(a["self_attn.q_proj"], a["self_attn.k_proj"])  # linear_in is one A for q, k and v
        assert torch.equal(a["self_attn.q_proj"], a["self_attn.v_proj"])
        assert torch.equal(weights[f"{m}mlp.gate_proj.lora_A.weight"], weights[f"{m}mlp.up_proj.lora_A.weight"])
    for key in (k for k in weights if ".lora_A." in k):  # each pair is the reference's delta on the base, bit for bit
        module = key[len(PREFIX):].removesuffix(".lora_A.weight")
        b = weights[f"{PREFIX}{module}.lora_B.weight"]
        assert torch.equal(outputs["base"][f"{module}.weight"] + 2.0 * (b @ weights[key]), reference[f"{module}.weight"])


def test_the_exported_adapter_loads_in_peft_with_the_fused_models_logits(outputs):
    """Checked by hand with /tmp/venv-peft (PEFT 0.21): logits within 4e-7 of the fused model's, and PEFT's own
    merge_and_unload of the exported adapter is the reference bit for bit."""
    peft = pytest.importorskip("peft")  # not in the project venv: the bit-exact pairs above are the proof there
    from transformers import AutoConfig, AutoModelForCausalLM

    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(CONFIG.parent))
    missing, unexpected = base.load_state_dict(outputs["base"], strict=False)
    assert not missing and not unexpected
    tokens = load_file(BRIDGE / "logits.safetensors")["tokens"]
    fused = AutoModelForCausalLM.from_pretrained(outputs["root"] / "fused").eval()
    model = peft.PeftModel.from_pretrained(base, outputs["root"] / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, fused(tokens).logits, atol=1e-5, rtol=0)
    merged = model.merge_and_unload().state_dict()
    for name, tensor in load_file(BRIDGE / "reference" / "model.safetensors").items():
        assert torch.equal(merged[name], tensor), name


def test_without_its_lora_config_the_fuse_is_refused(cli, tmp_path):
    out = tmp_path / "out"
    result = cli("merge", SOURCE, out, "--config", CONFIG)
    assert_failed_cleanly(result, out)
    assert result.stderr.strip() == (
        f"Error: '{SOURCE}': holds a Megatron-Core LoRA adapter saved with the base (8 tensors, e.g. "
        "'decoder.layers.self_attention.linear_proj.adapter.linear_in.weight'), and no adapter_config.json beside it. "
        "The scaling (alpha / dim) is not in the checkpoint: give --adapter-config FILE, a JSON object with "
        "Megatron-Bridge's LoRA dim and alpha (as its run_config.yaml records them under peft), e.g. "
        '{"dim": 32, "alpha": 32}')


def test_a_peft_adapter_config_beside_the_checkpoint_gives_the_scaling(cli, tmp_path):
    import shutil

    src, out = tmp_path / "torch_dist", tmp_path / "out"
    shutil.copytree(SOURCE, src)
    (src / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "lora_alpha": 8}')
    result = cli("merge", src, out, "--config", CONFIG, "-q")
    assert result.exit_code == 0, result.output
    assert (out / "model.safetensors").read_bytes() == (BRIDGE / "reference" / "model.safetensors").read_bytes()


def test_without_the_models_config_the_fuse_is_refused(cli, tmp_path):
    import shutil

    src, out = tmp_path / "torch_dist", tmp_path / "out"
    shutil.copytree(SOURCE, src)  # no config.json beside it or above it
    result = cli("merge", src, out, "--adapter-config", LORA)
    assert_failed_cleanly(result, out)
    assert result.stderr.strip() == (
        f"Error: '{src}': holds a Megatron-Core LoRA adapter saved with the base (e.g. "
        "'decoder.layers.self_attention.linear_proj.adapter.linear_in.weight'), which is fused into the HuggingFace "
        "model's tensors: give the model's config.json (--config)")


@pytest.mark.parametrize("text, message", [
    ('{"dim": 4}', "alpha = None; expected a positive number"),
    ('{"r": 4, "lora_alpha": 8, "use_rslora": true}', "use_rslora = True; Megatron-Bridge's LoRA has one dim and alpha"),
    ('[4, 8]', "not a JSON object"),
], ids=["no-alpha", "rslora", "not-an-object"])
def test_a_lora_config_that_does_not_say_alpha_over_dim_is_refused(cli, tmp_path, text, message):
    config, out = tmp_path / "lora.json", tmp_path / "out"
    config.write_text(text)
    result = cli("merge", SOURCE, out, "--config", CONFIG, "--adapter-config", config)
    assert_failed_cleanly(result, out, f"'{config}': {message}")


def test_a_config_for_a_rank_the_checkpoint_does_not_have_is_refused(cli, tmp_path):
    config, out = tmp_path / "lora.json", tmp_path / "out"
    config.write_text('{"dim": 8, "alpha": 8}')
    result = cli("merge", SOURCE, out, "--config", CONFIG, "--adapter-config", config, "--adapter-only")
    assert_failed_cleanly(result, out, "has rank 4 but", "says r = 8")


def _renamed(old: str, new: str):
    from ckpttool.commands.source import read_layout

    layout = read_layout(SOURCE)
    tensors = {(new if k == old else k): (replace(t, fqn=new) if k == old else t) for k, t in layout.tensors.items()}
    return replace(layout, tensors=tensors)


QKV = "decoder.layers.self_attention.linear_qkv"


@pytest.mark.parametrize("new, message", [
    (f"{QKV}.adapter.weight_magnitude", "DoRA's weight_magnitude (Megatron-Bridge's DoRA): DoRA is not fused"),
    (f"{QKV}.adapter.adapter_q.linear_in.weight", "canonical LoRA (Megatron-Bridge's CanonicalLoRA: one adapter per "
     "q / k / v and gate / up) is not fused yet"),
    ("decoder.layers.mlp.experts.local_experts.0.linear_fc1.adapter.linear_in.weight",
     "LoRA on MoE experts (Megatron-Bridge) is not fused yet"),
], ids=["dora", "canonical", "experts"])
def test_what_megatron_bridge_saves_and_ckpttool_does_not_fuse_is_refused_by_name(new, message):
    layout = _renamed(f"{QKV}.adapter.linear_out.weight", new)
    with pytest.raises(SourceError) as e:
        split_embedded(layout)
    assert str(e.value) == (f"'{SOURCE}': '{new}': {message}; merge it into the base with Megatron-Bridge's own merge "
                            "(LoRAMerge, DoRA's merge) before saving")


def test_a_lora_module_without_its_linear_out_is_refused():
    layout = _renamed(f"{QKV}.adapter.linear_out.weight", f"{QKV}.lora_out_elsewhere.weight")
    with pytest.raises(SourceError) as e:
        split_bridge(layout)
    assert str(e.value) == (f"'{SOURCE}': '{QKV}.adapter.linear_in.weight' has no '{QKV}.adapter.linear_out.weight': "
                            "a LoRA module needs both")


def test_another_module_s_adapter_is_refused_by_name():
    name = "decoder.layers.self_attention.linear_q_up_proj.adapter.linear_in.weight"
    layout = _renamed("decoder.layers.self_attention.linear_proj.adapter.linear_in.weight", name)
    with pytest.raises(SourceError) as e:
        split_bridge(layout)
    assert str(e.value) == (f"'{SOURCE}': '{name}': a Megatron-Core adapter tensor ckpttool does not fuse (it fuses "
                            "LoRA's adapter.linear_in / linear_out on linear_qkv, linear_proj, linear_fc1 and "
                            "linear_fc2)")


class _Held:
    """An adapter tensor held in memory (AdapterTensor's interface)."""

    def __init__(self, tensor: torch.Tensor, dtype: str):
        self.tensor, self.dtype, self.shape, self.key, self.file, self.byte_offset = tensor, dtype, tuple(tensor.shape), \
            "t", "mem", 0

    def read_rows(self, start: int, stop: int) -> torch.Tensor:
        return self.tensor[start:stop].clone()


def test_a_bf16_model_is_fused_in_bf16_as_lora_merge_computes_it():
    """Megatron-Bridge's LoRAMerge.merge (0.3.1), on a bf16 model: ``base + alpha / dim * (linear_out @ linear_in)``,
    every step in bf16; PEFT's upcast (float32 product, one rounding) gives other bytes."""
    from ckpttool.plan.lora import LoraDelta, fuse_rows

    g = torch.Generator().manual_seed(0)
    w, b, a = (torch.randn(shape, generator=g).to(torch.bfloat16) for shape in ((512, 96), (512, 16), (16, 96)))
    alpha, dim = 32, 16
    merged = w + alpha / dim * (b @ a)  # megatron/bridge/peft/lora.py, LoRAMerge.merge
    delta = LoraDelta("src", "m", _Held(a, "BF16"), _Held(b, "BF16"), alpha / dim, upcast=False)
    buffers: dict[str, torch.Tensor] = {}

    def scratch(name, shape, dtype):
        from ckpttool.io.dtypes import torch_dtype

        buffers[name] = torch.empty(shape, dtype=torch_dtype(dtype))
        return buffers[name]

    assert torch.equal(fuse_rows(w, (delta,), 0, 512), merged)
    chunks = [fuse_rows(w[i:i + 256].clone(), (delta,), i, i + 256, scratch) for i in (0, 256)]
    assert torch.equal(torch.cat(chunks), merged)
    assert not torch.equal(fuse_rows(w, (replace(delta, upcast=True),), 0, 512), merged)


@pytest.fixture(scope="module")
def o_proj():
    """linear_proj's adapter tensors, and the base's o_proj targets of layers 0 and 1."""
    from ckpttool.commands.source import plan_source, read_layout

    targets = {t.name: t for t in plan_source(SOURCE, config=CONFIG).plan.targets}
    lora = {k: t for k, t in read_layout(SOURCE).tensors.items() if ".linear_proj.adapter." in k}
    return lora, [targets[f"model.layers.{i}.self_attn.o_proj.weight"] for i in range(2)]


PROJ = "decoder.layers.self_attention.linear_proj.adapter"


def test_a_base_plan_that_moves_more_than_b_s_rows_is_refused(o_proj):
    from ckpttool.lora.megatron import bridge_targets
    from ckpttool.plan.transforms import Transpose

    lora, targets = o_proj
    moved = replace(targets[0], transform=Transpose(0, 1))
    with pytest.raises(SourceError) as e:
        bridge_targets("src", lora, lambda tensors: [moved])
    assert str(e.value) == (f"'src': '{PROJ}.linear_out.weight': planned as 'model.layers.0.self_attn.o_proj.weight', "
                            f"which the base's plan makes with {moved.transform.name}; only a permutation of B's rows "
                            "keeps B @ A the delta of that tensor, so it is not fused")


def test_a_b_the_base_plan_makes_nothing_of_or_an_a_without_its_layer_is_refused(o_proj):
    from ckpttool.lora.megatron import bridge_targets

    lora, targets = o_proj
    with pytest.raises(SourceError) as e:
        bridge_targets("src", lora, lambda tensors: [])
    assert str(e.value) == f"'src': '{PROJ}.linear_out.weight': the base's plan makes no HuggingFace tensor of it"

    def one_layer_of_a(tensors):  # B (out, dim) planned whole, A (dim, in) for layer 0 only
        return targets if next(iter(tensors.values())).global_shape[-1] == 4 else targets[:1]

    with pytest.raises(SourceError) as e:
        bridge_targets("src", lora, one_layer_of_a)
    assert str(e.value) == (f"'src': '{PROJ}.linear_in.weight': no layer's A for "
                            "'model.layers.1.self_attn.o_proj.weight' (its layers are not planned one target each)")
