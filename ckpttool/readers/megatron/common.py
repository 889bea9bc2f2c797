"""What the two Megatron readers share: the iteration directory, the training ``args`` and vocab padding.

Both readers (:mod:`.megatron_dist` for ``--ckpt-format torch_dist``, :mod:`.megatron_legacy` for
``--ckpt-format torch``) describe a checkpoint with Megatron-Core's own *global* tensors, as ``torch_dist``
defines them, so one source convention (:mod:`ckpttool.families.conventions.megatron_core`) names both the same way:

- per-layer tensors are either stacked with a leading layer axis (``decoder.layers.mlp.linear_fc1.weight`` of
  shape ``(L, 2F, H)``, torch_dist) or named per global layer (``decoder.layers.3.mlp.linear_fc1.weight``,
  legacy after renumbering across pipeline stages); experts likewise, stacked ``(L, E, ...)`` under
  ``mlp.experts.linear_fc1.weight`` or per global expert ``mlp.experts.5.linear_fc1.weight``;
- ``linear_qkv`` rows are grouped by query group: for each of the ``G`` groups, ``heads/G`` query heads, then
  one key head, then one value head, ``head_dim`` rows each (TP ranks hold whole groups);
- a SwiGLU ``linear_fc1`` is ``[gate; up]`` over the whole FFN width (torch_dist's ShardedTensorFactory stores
  it so; the legacy reader rearranges each TP rank's local ``[gate_r; up_r]`` into it);
- the vocab rows of ``embedding.word_embeddings.weight`` and ``output_layer.weight`` may be padded to a
  multiple of ``make_vocab_size_divisible_by * tp``: the readers record that as :class:`~ckpttool.layout.layout.Padding`
  from the config's true vocab, checked against the args, so the cut strips it once.

Megatron checkpoints carry no HuggingFace config: the config comes from ``--config``. What the readers need to know
of Megatron-Core's modules they are told (:class:`ConventionTables`, the source convention's, never imported
here): which dim each local tensor is split on across TP ranks (the legacy format records no global shape), and
the checks of the ``args`` against the config, run before vocab padding is checked.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from ckpttool.io import torch_save
from ckpttool.model.description import ModelInfo
from ckpttool.layout.layout import Layout, Padding, TensorLayout
from ckpttool.errors import LinkOutError, SourceError
from ckpttool.io.paths import inside, read_tag
from ckpttool.io.safe_pickle import Record
from ckpttool.readers.validate import integer
from ckpttool.readers.megatron import fp8 as megatron_fp8
from ckpttool.readers.megatron.allow import ArgsAllow, Opaque

TRACKER = "latest_checkpointed_iteration.txt"
#: tensors whose rows are the (padded) vocab
VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")


class ConventionTables(Protocol):
    """What the Megatron readers are told by the Megatron-Core source convention (its
    :class:`ckpttool.families.conventions.megatron_tp.MegatronTP`): readers carry no table of Megatron-Core's modules.

    Names are suffixes of a local tensor's name, matched with ``str.endswith``; the first of these that matches
    applies: :attr:`column` (split on dim 0 across TP ranks), :attr:`row` (dim 1), :attr:`either` (dim 0 or whole on
    every rank: the rows a rank holds against the sum of the named args tell); any other tensor is whole on every
    rank. :attr:`paired` tensors hold two halves ``[a_r; b_r]`` on each rank, of the global ``[a; b]``, when one of
    the args :attr:`paired_when` names is true (each ``(name, default when absent)``).
    """

    @property
    def column(self) -> tuple[str, ...]: ...

    @property
    def row(self) -> tuple[str, ...]: ...

    @property
    def either(self) -> tuple[tuple[str, tuple[str, ...]], ...]: ...

    @property
    def paired(self) -> tuple[str, ...]: ...

    @property
    def paired_when(self) -> tuple[tuple[str, bool], ...]: ...

    def check_args(self, args: Any, info: ModelInfo, where: str) -> None:
        """Refuse ``args`` (a plain mapping: :func:`args_view`) that contradict ``info``'s config (a ConfigError
        naming ``where``)."""
        ...


def args_view(args: Any) -> dict[str, Any] | None:
    """The training args as a plain dict, enum stand-ins as their values (what a convention's checks are given:
    they never see a reader's pickle records)."""
    if args is None:
        return None
    items = args.items() if isinstance(args, dict) else vars(args).items() if isinstance(args, Record) else ()
    return {str(name): arg(args, str(name)) for name, _ in items if not str(name).startswith("_")}


# ------------------------------------------------------------------------------------------------
# the iteration directory
# ------------------------------------------------------------------------------------------------


def iteration_dir(root: Path) -> Path:
    """The directory of one saved iteration: ``root`` itself, or the one ``root``'s tracker file names
    (``latest_checkpointed_iteration.txt`` holds an iteration number, or ``release``).

    Raises:
        SourceError: the tracker file is unreadable or names a directory that is not there.
    """
    tracker = root / TRACKER
    if not tracker.is_file():
        return root
    text = read_tag(tracker, TRACKER)
    if text == "release":
        name = "release"
    elif text is not None and re.fullmatch(r"[0-9]+", text, re.ASCII):
        name = f"iter_{int(text):07d}"
    else:  # what did not parse is never shown: the file may be a link to anything
        raise SourceError(f"'{TRACKER}': not an iteration number or 'release' (what Megatron-LM writes there)")
    path = inside(root, name, named_by=TRACKER)
    if not path.is_dir():
        raise SourceError(f"'{TRACKER}' names iteration {text}, but '{name}/' is not in '{root}'")
    return path


def matched_iteration(root: Path) -> Path | None:
    """:func:`iteration_dir` for a reader's ``matches``: None where ``root`` holds no readable iteration.

    Raises:
        LinkOutError: the tracker names an iteration through a link out of the source (said, never skipped).
    """
    try:
        return iteration_dir(root)
    except LinkOutError:
        raise
    except SourceError:
        return None


# ------------------------------------------------------------------------------------------------
# args: an argparse.Namespace pickled by Megatron-LM, read without importing anything
# ------------------------------------------------------------------------------------------------


#: the table of :mod:`.allow` (the classes, with the megatron-core releases that write them)
ALLOW = ArgsAllow()


def scan_checkpoint(f: BinaryIO, *, label: str) -> Any:
    """A whole Megatron ``torch.save`` file with every tensor as a :class:`~ckpttool.io.torch_save.StoredTensor`
    (:func:`ckpttool.io.torch_save.scan` with :data:`ALLOW`).

    Raises:
        UnsafePickleError: the pickle names a class outside the allow-list (nothing is executed).
        SourceError: not a readable ``torch.save`` archive.
    """
    return torch_save.scan(f, label=label, allow=ArgsAllow(label))


def fp8_flags(args: Any) -> dict[str, Any]:
    """The training arguments that record FP8 training (:data:`.megatron_fp8.FP8_ARGS`)."""
    return {name: arg(args, name) for name in megatron_fp8.FP8_ARGS}


def arg(args: Any, name: str, default: Any = None) -> Any:
    """One training argument (None-safe); enum stand-ins give their value."""
    if args is None:
        return default
    value = args.get(name, default) if isinstance(args, (Record, dict)) else getattr(args, name, default)
    return value.value if isinstance(value, Opaque) else value


def int_arg(args: Any, name: str, file: str, default: int = 0, *, minimum: int = 0) -> int:
    """One integer training argument (``default`` when absent or None), checked.

    Raises:
        SourceError: naming ``file`` and ``args.<name>``: the value is not an integer of at least ``minimum``.
    """
    value = arg(args, name)
    return default if value is None else integer(value, f"args.{name}", file, minimum=minimum)


def parallel_of(args: Any, file: str) -> dict[str, int]:
    """``tp``, ``pp``, ``ep`` (and ``vpp``, ``dp`` when recorded) from the args of ``file``.

    Raises:
        SourceError: a parallel size that is not a positive integer.
    """
    parallel = {
        "tp": int_arg(args, "tensor_model_parallel_size", file, 1, minimum=1),
        "pp": int_arg(args, "pipeline_model_parallel_size", file, 1, minimum=1),
        "ep": int_arg(args, "expert_model_parallel_size", file, 1, minimum=1),
    }
    vpp = int_arg(args, "virtual_pipeline_model_parallel_size", file, 1, minimum=1)
    if vpp > 1:
        parallel["vpp"] = vpp
    dp = arg(args, "data_parallel_size")
    if isinstance(dp, int) and not isinstance(dp, bool) and dp > 0:
        parallel["dp"] = dp
    return parallel


def vocab_padding(fqn: str, rows: int, args: Any, info: ModelInfo | None, file: str) -> tuple[Padding, ...]:
    """The padding of a vocab tensor with ``rows`` rows (its args in ``file``): none when it holds exactly the
    config's vocab; the rows beyond it when ``rows`` is the padded vocab the args record; an error otherwise.

    Raises:
        SourceError: ``rows`` is neither the true vocab nor the padded vocab of the args.
    """
    where = f"'{file}'"
    vocab = info.config.get("vocab_size") if info is not None else None
    if not isinstance(vocab, int) or rows == vocab:
        return ()
    tp = int_arg(args, "tensor_model_parallel_size", file, 1, minimum=1)
    divisible = int_arg(args, "make_vocab_size_divisible_by", file, 0)
    recorded = arg(args, "padded_vocab_size")
    if recorded is not None:
        recorded = integer(recorded, "args.padded_vocab_size", file, minimum=1)
    if args is None or (recorded is None and not divisible > 0):
        raise SourceError(
            f"'{fqn}' in {where}: {rows} rows, but config.json says vocab_size {vocab}, and the checkpoint records no "
            "args (padded_vocab_size, make_vocab_size_divisible_by) that say the extra rows are padding"
        )
    rules = []
    padded = recorded
    if divisible > 0:
        multiple = divisible * tp
        padded = -(-vocab // multiple) * multiple  # Megatron-LM's _vocab_size_with_padding
        rules.append(f"{vocab} padded to a multiple of make_vocab_size_divisible_by {divisible} x tp {tp}")
    if recorded is not None:
        rules.append(f"args padded_vocab_size = {recorded}")
    if rows != padded or (recorded is not None and recorded != padded):
        raise SourceError(
            f"'{fqn}' in {where}: inconsistent vocab padding: {rows} rows, expected either the true vocab {vocab} "
            f"(config.json vocab_size) or the padded vocab {padded} ({'; '.join(rules)}). Is the config the one "
            "this model trained with, or was the vocab padded twice?"
        )
    return (Padding(0, vocab),)


def with_padding(layout: Layout, padding: Mapping[str, tuple[Padding, ...]]) -> Layout:
    """``layout`` with recorded padding set on the named tensors."""
    from dataclasses import replace

    tensors: dict[str, TensorLayout] = {
        fqn: replace(t, padding=padding[fqn]) if fqn in padding else t for fqn, t in layout.tensors.items()
    }
    return replace(layout, tensors=tensors)
