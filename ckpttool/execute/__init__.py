"""Carrying a plan out: the streaming executor writes each output tensor in row chunks from positioned reads of its
pieces, in memory bounded by a chunk; the reference executor assembles whole tensors in memory and is the tests'
oracle; several processes share the work under ``torchrun`` (:mod:`.distributed`).
"""
