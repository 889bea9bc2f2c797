"""Byte formats, read and written without a model: safetensors headers, ``torch.save`` archives and their pickles
(through an allow-list, with bounds on the work a pickle can ask for), strict JSON, ckpttool's own sidecar, element
types by their safetensors names, and the rules that keep paths taken from a checkpoint inside it.

Nothing here knows a framework's conventions or a model family: readers (:mod:`ckpttool.readers`) build on it.
"""
