"""The commands a user runs, each a pipeline over the rooms below it: ``merge`` (source -> HuggingFace
safetensors), ``split`` (the way back, to DCP or Megatron-Core ``torch_dist`` for a mesh) and ``diff``.
The ``audit`` and ``verify`` commands have rooms of their own (:mod:`ckpttool.audit`, :mod:`ckpttool.verify`).
"""
