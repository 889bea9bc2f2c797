"""LoRA adapters: a PEFT adapter folder read (:mod:`.adapter`), its deltas attached to a merge plan's targets
(:mod:`.attach`) and the proof of a fuse (:mod:`.audit`). The deltas themselves, data of the plan and computed chunk
by chunk as PEFT computes them, are :mod:`ckpttool.plan.lora`'s: the plan and the executor below this room use them."""
