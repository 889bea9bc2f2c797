"""The fuse adds each delta in buffers the merge predicts: PEFT's promoted add (float(W) + delta) and its rounded one
(delta rounded to W's dtype) widen or round into the thread's ``lora-add`` buffer, never into a fresh tensor per
chunk (which let each thread's heap grow: the 2 GiB fuse of benchmarks/lora_bench.py peaked 75 MiB over its
prediction before)."""

from __future__ import annotations

import torch

from conftest import FIXTURES, build_in_row_chunks, load_output


def _plan(name: str):
    from ckpttool.commands.merge import prepare
    from ckpttool.families.registry import adapter_for
    from ckpttool.lora.adapter import read_adapter
    from ckpttool.lora.attach import attach_to_family

    prepared = prepare(FIXTURES / name / "checkpoint")
    return attach_to_family(prepared.plan, [read_adapter(FIXTURES / name / "adapter")], adapter_for(prepared.model))


def _check(name: str, rounded: bool):
    plan = _plan(name)
    targets = [t for t in plan.targets if t.lora][:4]
    assert targets and all(d.rounded is rounded for t in targets for d in t.lora)
    parts, sizes, allocated = build_in_row_chunks(plan, targets, rows=3)
    reference = load_output(FIXTURES / name / "reference")
    for target in targets:
        assert torch.equal(torch.cat(parts[target.name]), reference[target.name]), target.name
    assert "lora-add" in allocated  # the add used the thread's buffer
    assert all(allocated[n] <= sizes[n] for n in allocated), (allocated, sizes)


def test_the_promoted_add_widens_the_weight_in_a_predicted_buffer():
    _check("lora_llama", rounded=False)  # a bf16 base, a float32 adapter: float(W) + delta, rounded once


def test_the_rounded_add_rounds_the_delta_in_a_predicted_buffer():
    _check("lora_mixtral_experts", rounded=True)  # LoRA on a parameter: the delta rounded to W's dtype first
