"""Megatron-LM checkpoints: ``torch_dist`` (:mod:`.dist`) and the legacy ``torch`` format (:mod:`.legacy`),
what they share (:mod:`.common`: the iteration directory, ``args``, vocab padding, and :class:`.common.ConventionTables`,
what the source convention tells the readers), and FP8 training's extra state (:mod:`.fp8`)."""
