"""Megatron-LM checkpoints: ``torch_dist`` (:mod:`.dist`) and the legacy ``torch`` format (:mod:`.legacy`),
what they share (:mod:`.common`: the iteration directory, ``args``, vocab padding), the training ``args`` checked
against a config (:mod:`.args`), and FP8 training's extra state (:mod:`.fp8`)."""
