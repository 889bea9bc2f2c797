"""Quantized checkpoints: FP8 block-scaled (the DeepSeek convention), MXFP4 (gpt-oss), and packed 4-bit
(compressed-tensors ``pack-quantized`` INT4/INT8 and ``nvfp4-pack-quantized``, ModelOpt NVFP4), as facts.

- :mod:`.formats`: what a ``quantization_config`` says, which tensors travel together (``X.weight`` with
  ``X.weight_scale_inv``; ``X_blocks`` with ``X_scales``), and the shapes one gives the other. No torch.
- :mod:`.decode`: dequantization of a range of rows of a weight from the matching rows of its scales, the pure
  functions the streaming executor calls (:mod:`ckpttool.execute.executor`).
- :mod:`.encode`: FP8 quantization of a range of rows (values, or scales), with the round trip measured.
- :mod:`.packed`, :mod:`.packed_checks`, :mod:`.packed_decode`: the packed formats' config, names and shapes, their
  header checks, and their decoders (each producer's own arithmetic).
- :mod:`.codecs`: the one table from a computed target's method to its encoder or decoder, and their call order.

This package sits below the engine and the families: it imports neither.
"""
