"""The classes a Megatron checkpoint's pickles may name, each with the megatron-core releases that write it.

``model_optim_rng.pt`` (``--ckpt-format torch``) and torch_dist's ``common.pt`` pickle the training ``args`` (an
``argparse.Namespace``) and, in the legacy file, the RNG states. Their values name a few classes: Megatron's enums
(``model_type``, ``attention_backend``, ``fp8_recipe``), numpy's RNG state and dtypes. Each becomes an inert
stand-in; nothing is imported or run. :data:`TABLE` lists every accepted class with the releases whose
checkpoints were seen to pickle it (the fixtures ``megatron_*``, made by ``fixtures/make_megatron.py`` and
``fixtures/make_megatron_versions.py``, test that each listed release writes it). A class of Megatron's outside the
table is refused, naming it, the releases ckpttool was proven against and what the checkpoint records of its own
release (:func:`refusal`): megatron-core 0.9 to 0.16 record none (``metadata.json`` holds only its backends'
versions, Megatron-LM's ``checkpoint_version`` is its file format's), so the message says so.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ckpttool.errors import UnsafePickleError
from ckpttool.io.pickle_bounds import EnumStandIn
from ckpttool.io.safe_pickle import Record
from ckpttool.readers.megatron import fp8 as megatron_fp8

#: the megatron-core releases whose checkpoints ckpttool's fixtures hold (``megatron_*/producer.json``)
RELEASES = ("0.9.0", "0.12.3", "0.14.0", "0.16.1")
_ALL = RELEASES
_FROM_0_10 = RELEASES[1:]  # AttnBackend arrived in 0.10


class Opaque(Record):
    """Stand-in for an argument value of a class ckpttool does not import (an enum of megatron's, numpy's
    random state): keeps what the pickle passes, runs nothing. An enum keeps its value."""

    kind = "Opaque"

    @property
    def value(self) -> Any:
        return self._args[0] if self._args else None


@dataclass(frozen=True, slots=True)
class Allowed:
    """One class a Megatron pickle may name.

    Attributes:
        module, name: as the pickle names it.
        stand_in: what it becomes (a class or an :class:`EnumStandIn`; never the real class).
        written_by: the megatron-core releases whose checkpoints pickle it (the fixtures show it); empty for a
            class kept from Megatron's sources that no fixture writes.
        where: which value holds it.
    """

    module: str
    name: str
    stand_in: Any
    written_by: tuple[str, ...]
    where: str


def _enum(module: str, name: str, members: dict[str, Any], written_by: tuple[str, ...], where: str) -> Allowed:
    """An enum: ``Cls(value)`` and ``getattr(Cls, "NAME")`` (Python 3.11.0-3.11.4) both give an :class:`Opaque`."""
    return Allowed(module, name, EnumStandIn(f"{module}.{name}", members, Opaque), written_by, where)


# ModelType's values moved in 0.14 (retro_encoder 3 -> 2, retro_decoder 4 -> 3, encoder_and_decoder dropped);
# encoder_or_decoder, the one GPT trains with, is 1 in every release. The members are 0.9-0.13's.
_MODEL_TYPE = {"encoder_or_decoder": 1, "encoder_and_decoder": 2, "retro_encoder": 3, "retro_decoder": 4}
_ATTN_BACKEND = {"flash": 1, "fused": 2, "unfused": 3, "local": 4, "auto": 5}
_NUMPY = "the legacy file's rng_state (numpy's RNG state)"

#: every class a Megatron checkpoint's pickles may name, with the releases that write it
TABLE: tuple[Allowed, ...] = (
    Allowed("argparse", "Namespace", Record, _ALL, "args"),
    Allowed("numpy", "dtype", Opaque, _ALL, _NUMPY),
    Allowed("numpy", "ndarray", Opaque, _ALL, _NUMPY),
    # numpy's module depends on the numpy beside the release: 0.14 pins numpy < 2, the others take 2.x
    Allowed("numpy.core.multiarray", "_reconstruct", Opaque, ("0.14.0",), _NUMPY + " under numpy 1.x"),
    Allowed("numpy._core.multiarray", "_reconstruct", Opaque, ("0.9.0", "0.12.3", "0.16.1"), _NUMPY + " under numpy 2.x"),
    Allowed("numpy.core.multiarray", "scalar", Opaque, (), "a numpy scalar in args, numpy 1.x"),
    Allowed("numpy._core.multiarray", "scalar", Opaque, (), "a numpy scalar in args, numpy 2.x"),
    Allowed("_codecs", "encode", lambda *args: b"", _ALL, _NUMPY + ": its bytes, not needed"),
    _enum("megatron.core.enums", "ModelType", _MODEL_TYPE, _ALL, "args.model_type (Megatron-LM's get_model)"),
    _enum("megatron.core.transformer.enums", "ModelType", _MODEL_TYPE, (), "args.model_type (the older import)"),
    _enum("megatron.core.transformer.enums", "AttnBackend", _ATTN_BACKEND, _FROM_0_10, "args.attention_backend"),
    _enum("megatron.core.enums", "Fp8Recipe", {n: n for n in ("delayed", "tensorwise", "mxfp8", "blockwise", "custom")},
          (), "args.fp8_recipe (FP8 training needs Transformer Engine: no CPU fixture pickles it)"),
    _enum("megatron.core.enums", "Fp4Recipe", {n: n for n in ("nvfp4", "custom")}, (), "args.fp4_recipe"),
    _enum("megatron.core.transformer.enums", "LayerType",
          {"embedding": 1, "loss": 2, "encoder": 3, "decoder": 4, "mtp": 5}, (), "args of hybrid models"),
    _enum("megatron.core.transformer.enums", "AttnType", {"self_attn": 1, "cross_attn": 2}, (), "args"),
    _enum("megatron.core.transformer.enums", "AttnMaskType",
          {"padding": 1, "causal": 2, "no_mask": 3, "padding_causal": 4, "arbitrary": 5, "causal_bottom_right": 6},
          (), "args"),
    _enum("megatron.core.transformer.enums", "CudaGraphScope",
          {"full_iteration": 1, "attn": 2, "mlp": 3, "moe": 4, "moe_router": 5, "moe_preprocess": 6, "mamba": 7,
           "full_iteration_inference": 8}, (), "args.cuda_graph_scope"),
)
_BY_NAME = {(a.module, a.name): a for a in TABLE}


def is_megatron(module: str) -> bool:
    """Whether a pickle's ``module`` is one of Megatron's (megatron-core's or Megatron-LM's)."""
    return module == "megatron" or module.startswith("megatron.")


def refusal(label: str, qualified: str, recorded: str | None = None) -> str:
    """The message refusing a Megatron class outside :data:`TABLE`; ``recorded``: the release the checkpoint
    records, where it records one."""
    release = (f"the checkpoint records megatron-core {recorded}" if recorded else
               "the checkpoint records no megatron-core version (megatron-core writes none)")
    return (
        f"'{label}': refused to unpickle: it asks for '{qualified}', a class of Megatron's that ckpttool does not "
        f"know (nothing was executed); {release}. ckpttool reads the classes that megatron-core "
        f"{', '.join(RELEASES)} write. If a newer or older release wrote this checkpoint, report the class and the "
        "release: an allowed class is listed with the releases that write it, and loads as an inert stand-in"
    )


class ArgsAllow(megatron_fp8.RefusingAllowList):
    """:data:`TABLE` as the allow-list of :func:`ckpttool.io.torch_save.scan`: a listed class gives its stand-in;
    another of Megatron's is refused by :func:`refusal`, one of Transformer Engine's by
    :func:`.fp8.refusal`; anything else is refused by ``scan`` itself."""

    def __init__(self, label: str = "checkpoint", recorded: str | None = None) -> None:
        self.label = label  # the file whose pickle asks
        self.recorded = recorded

    def __getitem__(self, key: tuple[str, str]) -> Any:
        found = _BY_NAME.get(key)
        if found is not None:
            return found.stand_in
        module = key[0]
        if is_megatron(module):
            raise UnsafePickleError(refusal(self.label, f"{module}.{key[1]}", self.recorded))
        if megatron_fp8.is_te(module):
            raise UnsafePickleError(megatron_fp8.refusal(self.label, f"{module}.{key[1]}"))
        raise KeyError(key)

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(_BY_NAME)

    def __len__(self) -> int:
        return len(_BY_NAME)
