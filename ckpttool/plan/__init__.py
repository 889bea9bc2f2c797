"""Plans: every target tensor as box copies from source pieces, proven to tile every target before any byte is read.

- :mod:`.plan`: :class:`~.plan.Plan`, :class:`~.plan.Target` and :func:`~.plan.plan_merge`.
- :mod:`.tiling`: what a target is made of and the proof that its copies cover it exactly once.
- :mod:`.transforms`: named, invertible index maps (RoPE order, interleave, transpose) a target is of its pre tensor.
- :mod:`.compose`: targets made of other targets (a plan carried through a second mapping).
- :mod:`.diagnose`: why a tensor has the wrong shape, in words (TP and vocab-padding arithmetic).
- :mod:`.source`: the one way from a source directory to a plan, used by merge, audit, diff and live.
"""
