"""What the Megatron-Core convention tells the Megatron readers: how each local tensor of a Megatron-LM rank is
split over tensor-parallel ranks, and the checks of the training args.

Megatron-LM's legacy format (``mp_rank_TT/model_optim_rng.pt``) records no global shape: each rank saves its
module's local ``state_dict``, and which dim a tensor is split on is the module's business (Megatron-Core's
``ColumnParallelLinear`` splits its output rows, ``RowParallelLinear`` its input columns, ``VocabParallelEmbedding``
the vocab rows). Readers carry no such table (they sit below the families and never import them): the one place
that reads a source (:func:`ckpttool.commands.source.read_layout`, through
:data:`ckpttool.families.registry.READER_TABLES`) hands the reader a :class:`MegatronTP`, which the reader reads as
its :class:`ckpttool.readers.megatron.common.ConventionTables`.

A new Megatron-Core module whose local tensors are split differently is one suffix here; a new family's args
checks are its adapter's ``args_checks``, which :meth:`MegatronTP.check_args` runs after the convention's own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckpttool.families.adapter import FamilyAdapter
from ckpttool.families.conventions import megatron_args
from ckpttool.model.description import ModelInfo

#: split on dim 0 (the output rows of a ``ColumnParallelLinear``, the vocab rows of the embedding and output layer,
#: MLA's up projections, MTP's ``eh_proj``); ``core_attention.softmax_offset`` (``softmax_type="learnable"``,
#: gpt-oss's sinks) holds this rank's heads
COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias", "word_embeddings.weight",
          "output_layer.weight", "linear_q_proj.weight", "linear_q_up_proj.weight", "linear_kv_up_proj.weight",
          "eh_proj.weight", "core_attention.softmax_offset")
#: split on dim 1 (the input columns of a ``RowParallelLinear``; its bias is whole on every rank)
ROW = ("linear_proj.weight", "linear_fc2.weight")
#: MLA's down projections: split on rows (the local spec's ``ColumnParallelLinear``) or whole on every rank
#: (Transformer Engine's ``duplicated`` linear); the rows a rank holds against the sum of these args tell which
EITHER = (("linear_q_down_proj.weight", ("q_lora_rank",)),
          ("linear_kv_down_proj.weight", ("kv_lora_rank", "qk_pos_emb_head_dim")))
#: a gated MLP's ``linear_fc1`` holds ``[gate_r; up_r]`` on each rank: halves of the global ``[gate; up]``
PAIRED = ("linear_fc1.weight", "linear_fc1.bias")
#: the args that say the MLP is gated, each with its default when the args do not record it: SwiGLU, or gpt-oss's
#: clamped GLU (``quick_geglu``, with ``swiglu`` False: its expert fc1 is ``[gate_r; up_r]`` under expert TP too)
PAIRED_WHEN = (("swiglu", True), ("quick_geglu", False))


@dataclass(frozen=True, slots=True)
class MegatronTP:
    """The Megatron-Core convention's table for the Megatron readers (field by field: the module constants), and
    its args check.

    Attributes:
        family_of: the family adapter serving a model (:func:`ckpttool.families.registry.adapter_for`), whose
            ``args_checks`` run after the convention's.
    """

    family_of: Callable[[ModelInfo], FamilyAdapter]
    column: tuple[str, ...] = COLUMN
    row: tuple[str, ...] = ROW
    either: tuple[tuple[str, tuple[str, ...]], ...] = EITHER
    paired: tuple[str, ...] = PAIRED
    paired_when: tuple[tuple[str, bool], ...] = PAIRED_WHEN

    def check_args(self, args: Any, info: ModelInfo, where: str) -> None:
        """Compare the checkpoint's training args (recorded in ``where``) with ``info``'s config: the convention's
        checks (:func:`.megatron_args.problems`), then the family's (``args_checks`` of its adapter).

        Raises:
            ConfigError: listing every disagreement, expected vs found, and what to pass.
        """
        if args is None:
            return
        found = megatron_args.problems(args, info) + self.family_of(info).check_args(args, info)
        if found:
            raise megatron_args.refusal(found, where)
