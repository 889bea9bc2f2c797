"""DeepSpeed checkpoints (``engine.save_checkpoint``): the reader (:mod:`.reader`) and the variants it reads:
ZeRO partitions (:mod:`.zero`), whole tensors (:mod:`.whole`), MoE experts (:mod:`.moe`), AutoTP (:mod:`.autotp`)
and universal checkpoints (:mod:`.universal`), over the rank files of :mod:`.files`."""
