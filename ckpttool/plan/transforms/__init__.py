"""Transforms: a target that is a named, invertible index map of the tensor its slices tile.

A :class:`Box` is offsets and sizes, so a target that is a *permutation* of its source (Q/K rows in Meta's interleaved
RoPE order, which HF wants as two halves per head; gpt-oss's gate/up interleaved by column; a projection stored
transposed) would be one slice per row. Instead a :class:`~ckpttool.plan.plan.TargetSpec` carries a transform: its
slices tile the *pre* tensor of shape :meth:`source_shape` (``spec.shape``), and the target is ``transform(pre)``.
Every transform is a bijection of elements, so tiling the pre tensor exactly once is tiling the target exactly once:
the plan's proof (:func:`~ckpttool.plan.tiling.check_tiling`) runs unchanged on the pre shape.

Kinds (frozen data, compared and hashed like any part of a plan):

- :class:`Permute`: within each block of ``period`` along ``dim``, target index ``i`` is pre index ``order[i]``;
  made by :func:`rope_halves` and :func:`interleave`.
- :class:`Transpose`: dims ``dim0`` and ``dim1`` swapped.
- :class:`Chain`: steps applied in order (pre -> step 1 -> step 2 -> target).
- :class:`Take`: one of ``parts`` interleaved parts along ``dim`` (``pre[..., part::parts, ...]``). The one kind
  that is *not* a bijection: the pre tensor holds the other parts too, which its target leaves unread. It is how a
  split writes one part of a de-interleaved tensor from the contiguous block that holds it (gpt-oss's gate rows of an
  expert-TP rank: its gate and up columns lie interleaved in one HuggingFace box, and its DCP chunks hold them
  apart, :func:`within_part`); the merge's plans never use it (every stored element is read).

Each has ``name`` (words for ``--dry-run`` and the audit), :meth:`source_shape`, :meth:`target_shape`,
:meth:`inverse`, :meth:`bound` (the checks against a target's shape, with messages naming it) and :meth:`pre_box`
(the box of the pre tensor a box of the target is the same transform of, for a split's per-rank boxes). The streaming
executor writes a transformed target in chunks of target rows ``[a, b)``: :meth:`pre_rows` says which rows of the
pre tensor (along dim 0) a chunk needs, :meth:`align` how many target rows a chunk should take (whole periods when
a :class:`Permute` works on dim 0, everything when a :class:`Transpose` moves dim 0), :meth:`apply` computes the
chunk from those rows on the thread's buffers and :meth:`scratch_bytes` says how large they get (``--dry-run``'s
peak). Dims may be negative until :meth:`bound` makes them plain; the streaming helpers take bound transforms.

Rooms: :mod:`.base` (the scratch buffers and dim checks every kind shares), :mod:`.permute` (:class:`Permute`,
:func:`rope_halves`, :func:`interleave`), :mod:`.transpose`, :mod:`.take`, and :mod:`.chain` (:class:`Chain`, the
:data:`Transform` union, :func:`within_part`, :func:`transform_tensor`). Import the public names from here.
"""

from ckpttool.plan.transforms.chain import Chain, Transform, transform_tensor, within_part
from ckpttool.plan.transforms.permute import Permute, interleave, rope_halves
from ckpttool.plan.transforms.take import Take
from ckpttool.plan.transforms.transpose import Transpose

__all__ = ["Chain", "Permute", "Take", "Transform", "Transpose", "interleave", "rope_halves", "transform_tensor",
           "within_part"]
