"""The commands a user runs, each a pipeline over the rooms below it: ``merge`` (source -> HuggingFace
safetensors), ``split`` (the way back, to DCP or Megatron-Core ``torch_dist`` for a mesh), ``diff`` and ``verify``
(the forward check of :mod:`ckpttool.verify`, with a sharded reference merged first). The ``audit`` command has a
room of its own (:mod:`ckpttool.audit`).
"""
