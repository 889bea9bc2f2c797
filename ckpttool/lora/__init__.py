"""LoRA adapters: a PEFT adapter folder read (:mod:`.adapter`), or an adapter saved with its base in one sharded
source set aside and read from its shards (:mod:`.embedded`); its deltas attached to a merge plan's targets
(:mod:`.attach`), the proof of a fuse (:mod:`.audit`), and an adapter written as PEFT saves one (:mod:`.export`). The
deltas themselves, data of the plan and computed chunk by chunk as PEFT computes them, are
:mod:`ckpttool.plan.lora`'s: the plan and the executor below this room use them."""
