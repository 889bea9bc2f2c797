"""LoRA adapters: a PEFT adapter folder read (:mod:`.adapter`), its deltas attached to a merge plan's targets
(:mod:`.attach`) and computed chunk by chunk as PEFT computes them (:mod:`.delta`), and the proof of a fuse
(:mod:`.audit`)."""
