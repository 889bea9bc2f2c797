"""A LoRA adapter saved together with its base in one sharded source: a PEFT-wrapped model (``get_peft_model``)
saved as a whole, as FSDP2 with ``torch.distributed.checkpoint`` (``get_model_state_dict``), accelerate, or verl's
per-rank ``model_world_size_W_rank_R.pt`` save it.

What such a source holds, in PEFT 0.21's in-memory names (the adapter's name, ``default`` unless the run named it,
sits in every LoRA key)::

    base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight      the base's weight of a targeted module
    base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight  A (r, in)
    base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight  B (out, r)
    base_model.model.model.embed_tokens.weight                              an untargeted tensor

:func:`split_embedded` sets the LoRA tensors aside and gives the base under transformers' names (PEFT's
``base_model.model.`` and every ``.base_layer`` dropped), which any family then plans as it plans a plain source.
:func:`embedded_adapter` makes the set-aside tensors an :class:`~.adapter.Adapter` whose A and B are read from the
source's pieces (:class:`SourceTensor`), with the scaling of the adapter's config: the weights do not record
``lora_alpha``, so without ``adapter_config.json`` (beside the checkpoint, or given) the fuse is refused.
What PEFT saves with the base and ckpttool does not fuse is refused by name: several adapters in one model,
``modules_to_save`` copies, embedding LoRA, DoRA's magnitude vectors. A Megatron-Core LoRA saved with its base
(Megatron-Bridge's ``adapter.linear_in`` / ``linear_out``) is set aside too, under Megatron's names; its pairs become
the HuggingFace model's once the base is planned (:mod:`.megatron`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from ckpttool.errors import ArgumentError, SourceError
from ckpttool.execute.buffers import Chunk, piece_uses
from ckpttool.execute.reads import Reader
from ckpttool.execute.assembly import build
from ckpttool.fast.deferred import torch
from ckpttool.layout.layout import Layout, TensorLayout
from ckpttool.lora import megatron
from ckpttool.lora.adapter import (CONFIG, Adapter, check_positive, lora_deltas, read_adapter_config,
                                   read_json_object, target_modules)
from ckpttool.plan.plan import Target, plan_merge

#: the folder verl's FSDP worker (0.5 on) writes beside a LoRA actor's rank files: PEFT's adapter_config.json (of
#: ``asdict(peft_config)``) and the adapter's weights
VERL_ADAPTER = "lora_adapter"
#: what verl (0.9 on) writes beside a LoRA actor's rank files: the adapter's r and lora_alpha
VERL_META = "lora_train_meta.json"
#: the prefix of every name of a model wrapped by ``get_peft_model`` (its ``base_model`` is the LoraModel, whose
#: ``model`` is the transformers model)
WRAPPED = "base_model.model."
_LORA = re.compile(r"(?P<module>.+)\.lora_(?P<which>A|B)\.(?P<name>[^.]+)\.weight")
#: what PEFT keeps beside a LoRA module that ckpttool does not fuse, and why
_REFUSED = (
    (re.compile(r"\.lora_embedding_[AB]\."), "embedding LoRA (lora_embedding_A / _B) is not fused yet"),
    (re.compile(r"\.lora_magnitude_vector\."), "DoRA's magnitude vector: DoRA is not fused"),
    (re.compile(r"\.(modules_to_save|original_module)\."), "a modules_to_save copy: whole modules trained beside "
     "the adapter are not fused yet"),
    (re.compile(r"\.lora_(A|B)\.[^.]+\.bias$"), "a trained bias of lora_B (lora_bias) is not fused yet"),
)


@dataclass(frozen=True, slots=True)
class Embedded:
    """A source split in two: its base under transformers' names, and its LoRA tensors.

    Attributes:
        base: the layout without the LoRA tensors, renamed (:data:`WRAPPED` and ``.base_layer`` dropped).
        lora: per PEFT adapter-file key (``model.layers.0.self_attn.q_proj.lora_A.weight``: what
            ``save_pretrained`` would write, less its prefix), the source's tensor.
        name: the adapter's name in the source's keys (``default``), or :data:`.megatron.NAME` for a
            Megatron-Core LoRA, whose ``lora`` holds the source's tensors under their own names (Megatron's).
        targets: a Megatron-Core LoRA's A and B as targets of the source, per PEFT adapter-file key of the
            HuggingFace model and with the source's name of each (:func:`.megatron.bridge_targets`, once the base
            is planned); None until then, and for PEFT's.
    """

    base: Layout
    lora: Mapping[str, TensorLayout]
    name: str
    targets: Mapping[str, tuple[Target, str]] | None = None


def split_embedded(layout: Layout) -> Embedded | None:
    """``layout`` split into its base and its LoRA tensors when it holds a PEFT-wrapped model; None otherwise.

    Raises:
        SourceError: the source holds what ckpttool does not fuse (two adapters, ``modules_to_save``, embedding
            LoRA, DoRA; a Megatron-Core adapter other than LoRA's: :func:`.megatron.split_bridge`), naming the tensor.
    """
    bridge = megatron.split_bridge(layout)
    if bridge is not None:  # Megatron-Bridge's names: HF's are the family's to give (ckpttool.commands.source)
        return Embedded(bridge[0], bridge[1], megatron.NAME)
    if not any(".lora_A." in fqn or ".base_layer." in fqn for fqn in layout.tensors):
        return None
    base: dict[str, TensorLayout] = {}
    lora: dict[str, TensorLayout] = {}
    names: dict[str, str] = {}
    for fqn, tensor in layout.tensors.items():
        for pattern, why in _REFUSED:
            if pattern.search(fqn):
                raise SourceError(f"'{layout.root}': '{fqn}': {why}; the source holds a PEFT model ckpttool "
                                  "cannot fuse exactly (fuse it with peft's merge_and_unload)")
        name = fqn[len(WRAPPED):] if fqn.startswith(WRAPPED) else fqn
        found = _LORA.fullmatch(name)
        if found is not None:
            names.setdefault(found["name"], fqn)
            lora[f"{found['module']}.lora_{found['which']}.weight"] = tensor
            continue
        renamed = name.replace(".base_layer.", ".")
        if renamed in base:
            raise SourceError(f"'{layout.root}': '{fqn}' and another tensor are both '{renamed}' once PEFT's "
                              "wrapper names are dropped")
        base[renamed] = replace(tensor, fqn=renamed)
    if len(names) > 1:
        listed = ", ".join(f"'{n}' (e.g. '{k}')" for n, k in sorted(names.items()))
        raise SourceError(f"'{layout.root}': holds {len(names)} LoRA adapters ({listed}); ckpttool fuses one adapter "
                          "saved with the base. Save the one to fuse (or fuse each with peft's merge_and_unload)")
    if not lora:
        raise SourceError(f"'{layout.root}': PEFT's wrapped names ('.base_layer.') but no lora_A / lora_B tensor; "
                          "is the adapter saved elsewhere? Give the base alone and the adapter with --adapter")
    note = (f"a LoRA adapter ('{next(iter(names))}', {len(lora) // 2} modules) saved with the base: set aside from "
            f"the base, whose names are transformers' ({WRAPPED!r} and '.base_layer' dropped)")
    return Embedded(replace(layout, tensors=base, notes=(*layout.notes, note)), lora, next(iter(names)))


@dataclass(frozen=True, slots=True)
class SourceTensor:
    """A LoRA tensor of a sharded source, read from its pieces (:class:`~ckpttool.plan.lora.AdapterTensor`'s
    interface: ``file``, ``key``, ``shape``, ``dtype``, ``byte_offset`` and :meth:`read_rows`).

    Attributes:
        root: the source directory.
        target: the tensor planned as itself (its copies tile it exactly once).
        key: its name in the source.
    """

    root: str
    target: Target
    key: str

    @property
    def shape(self) -> tuple[int, ...]:
        return self.target.shape

    @property
    def dtype(self) -> str:
        return self.target.source_dtype

    @property
    def file(self) -> str:
        """The file of its first piece (where a journal looks to see whether the adapter changed)."""
        return str(Path(self.root) / self.target.copies[0].piece.file)

    @property
    def byte_offset(self) -> int:
        return self.target.copies[0].piece.byte_offset

    def read_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``start..stop``, gathered from the pieces that hold them (a fresh tensor)."""
        reader = Reader(self.root, piece_uses([]))
        try:
            return build(Chunk(self.target, start, stop, 0, 0), reader).clone()
        finally:
            reader.close()


def verl_meta_config(path: Path, embedded: Embedded) -> dict[str, object]:
    """The adapter config that verl's ``lora_train_meta.json`` (``{"r", "lora_alpha", "task_type"}``, written by
    ``FSDPCheckpointManager.save_checkpoint`` from verl 0.9 on beside a LoRA actor's rank files) stands for: LoRA with
    that rank and alpha on the modules the source's lora_A / lora_B name. verl's actor builds its ``LoraConfig`` from
    ``lora_rank``, ``lora_alpha``, ``target_modules`` and ``bias="none"`` only (no rsLoRA, no DoRA, no patterns), so
    the scaling is ``lora_alpha / r``.

    Raises:
        SourceError: not a JSON object, or ``r`` / ``lora_alpha`` missing or not a positive number, naming the file.
    """
    meta = read_json_object(path, "verl's JSON LoRA metadata")
    check_positive(meta, ("r", "lora_alpha"), path, "verl writes the LoRA actor's rank and alpha here")
    modules = sorted({key.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for key in embedded.lora})
    return {"peft_type": "LORA", "r": meta["r"], "lora_alpha": meta["lora_alpha"], "bias": "none",
            "task_type": str(meta.get("task_type", "CAUSAL_LM")), "target_modules": modules}


def embedded_adapter(embedded: Embedded, root: str | Path, config: str | Path | None = None) -> Adapter:
    """The adapter saved with the base, as :func:`~.adapter.read_adapter` gives a PEFT folder's: its config read
    from ``config`` or, when None, from ``adapter_config.json`` in ``root`` (the source), or else from the one in
    verl's ``lora_adapter/`` there, or else from verl's ``lora_train_meta.json`` there (:func:`verl_meta_config`).

    Raises:
        SourceError: no config given and none beside the checkpoint (the scaling is only there); the config is
            not one ckpttool fuses; A and B do not fit; a LoRA tensor is not covered exactly once.
    """
    source = Path(root)
    path = Path(config) if config is not None else source / CONFIG
    if config is None and not path.is_file() and (source / VERL_ADAPTER / CONFIG).is_file():
        path = source / VERL_ADAPTER / CONFIG
    if config is None and not path.is_file() and (source / VERL_META).is_file():
        path = source / VERL_META
        read = verl_meta_config(path, embedded)
    elif not path.is_file() and embedded.targets is not None:
        given = f"'{path}': no such file" if config is not None else f"no {CONFIG} beside it"
        raise SourceError(
            f"'{source}': holds a Megatron-Core LoRA adapter saved with the base ({len(embedded.lora)} tensors, "
            f"e.g. '{next(iter(embedded.lora))}'), and {given}. The scaling (alpha / dim) is not in the checkpoint: "
            "give --adapter-config FILE, a JSON object with Megatron-Bridge's LoRA dim and alpha (as its "
            "run_config.yaml records them under peft), e.g. {\"dim\": 32, \"alpha\": 32}")
    elif not path.is_file():
        given = f"'{path}': no such file" if config is not None else f"no {CONFIG} beside it"
        raise SourceError(
            f"'{source}': holds a LoRA adapter saved with the base ({len(embedded.lora) // 2} modules, e.g. "
            f"'{next(iter(embedded.lora.values())).fqn}'), and {given}. The scaling (lora_alpha / r) is only in the "
            f"adapter's config: give --adapter-config path/to/{CONFIG} (what save_pretrained or "
            f"LoraConfig.save_pretrained writes), or put it beside the checkpoint")
    elif embedded.targets is not None:
        read = megatron.bridge_config(path, embedded.targets)
    else:
        read = read_adapter_config(path)
    if embedded.targets is not None:
        tensors = {k: SourceTensor(str(source), t, fqn) for k, (t, fqn) in embedded.targets.items()}
        deltas = lora_deltas(str(source), read, str(path), tensors, str(source))
        # Megatron-Bridge's LoRAMerge computes in the adapter's own dtype (bf16 on a bf16 model): so does the fuse
        deltas = {module: replace(delta, upcast=False) for module, delta in deltas.items()}
        return Adapter(str(source), str(source), read, deltas, target_modules(read))
    planned = plan_merge(Layout(str(source), embedded.base.format, {k: replace(t, fqn=k) for k, t in
                                                                     embedded.lora.items()}))
    tensors = {t.name: SourceTensor(str(source), t, embedded.lora[t.name].fqn) for t in planned.targets}
    deltas = lora_deltas(str(source), read, str(path), tensors, str(source))
    return Adapter(str(source), str(source), read, deltas, target_modules(read))


def source_adapter(root: Path, embedded: Embedded | None, config: str | Path | None) -> list[Adapter]:
    """The adapter ``root`` holds with its base, read with its config (``config``, or the one beside it), as a
    list of none or one.

    Raises:
        ArgumentError: ``config`` given for a source that holds no adapter.
        SourceError: as :func:`embedded_adapter`.
    """
    if embedded is None:
        if config is not None:
            raise ArgumentError(f"'{root}' holds no LoRA adapter with its base (no lora_A / lora_B tensor), so the "
                                f"adapter config '{config}' applies to nothing; a PEFT adapter folder is fused with "
                                "--adapter")
        return []
    return [embedded_adapter(embedded, root, config)]
