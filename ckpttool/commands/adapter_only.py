"""``merge --adapter-only``: the LoRA adapter a sharded source holds with its base, written as a PEFT adapter folder
(:mod:`ckpttool.lora.export`), published atomically like every output."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ckpttool.commands.source import plan_source_and_adapter
from ckpttool.errors import SourceError
from ckpttool.families.registry import adapter_for
from ckpttool.lora.attach import attach_adapters
from ckpttool.lora.embedded import embedded_adapter
from ckpttool.lora.export import ADAPTER_OUTPUT, write_adapter_folder
from ckpttool.writers.destination import check_destination
from ckpttool.writers.staging import Staging


@dataclass(frozen=True, slots=True)
class AdapterExport:
    """What :func:`export_adapter` wrote."""

    source: str
    output: str
    files: tuple[str, ...]
    #: LoRA modules written, and their ranks ("8", or "4/8" with a rank pattern)
    modules: int
    ranks: str
    #: an earlier output that a killed run had moved aside, put back first (see ckpttool.writers.staging)
    restored: str | None = None

    def to_json(self) -> dict[str, object]:
        return {"status": "ok", "source": self.source, "output": self.output, "files": list(self.files),
                "modules": self.modules, "ranks": self.ranks, "restored": self.restored}


def export_adapter(src: str | Path, out: str | Path, *, format: str | None = None, config: str | Path | None = None,
                   adapter_config: str | Path | None = None, force: bool = False) -> AdapterExport:
    """Write the LoRA adapter ``src`` holds with its base as a PEFT adapter folder ``out`` (``adapter_config.json``
    + ``adapter_model.safetensors``, keys as ``save_pretrained`` writes them), which
    ``PeftModel.from_pretrained(base, out)`` loads.

    Args:
        src: a source holding a PEFT-wrapped model (base and adapter saved together: FSDP2 / DCP, verl).
        out: the adapter folder to write; must not exist or be empty unless ``force``.
        format, config: as :func:`ckpttool.merge` takes them (the base's config, to check the base's names).
        adapter_config: the adapter's ``adapter_config.json``; by default the one beside ``src``.

    Raises:
        SourceError: ``src`` holds no adapter, or no config for it; as :func:`ckpttool.merge` for a bad source.
        DestinationError, OutputError: the destination cannot be written; nothing is published.

    Example:
        >>> export_adapter("fixtures/peft_llama_fsdp2_dcp/checkpoint", "out/adapter")  # doctest: +SKIP
    """
    root, dest = Path(src), Path(out)
    planned, embedded = plan_source_and_adapter(root, format=format, config=config)
    if embedded is None:
        raise SourceError(f"'{root}': holds no LoRA adapter (no '<module>.lora_A.<name>.weight' tensor of a PEFT "
                          "model); --adapter-only writes the adapter a source holds with its base")
    adapter = embedded_adapter(embedded, root, adapter_config)
    # every module is one the base has, with the shape A and B make: what from_pretrained will look for
    attach_adapters(planned.plan, [adapter], adapter_for(planned.model).rules if planned.model is not None else ())
    check_destination(dest, [root], force, ADAPTER_OUTPUT)
    staging = Staging(dest, sources=[root], force=force, output=ADAPTER_OUTPUT)
    path = staging.open()
    try:
        files = write_adapter_folder(adapter, path)
        staging.publish()
    except BaseException as e:
        staging.abandon(e)
        raise
    ranks = "/".join(map(str, sorted({d.rank for d in adapter.deltas.values()})))
    return AdapterExport(str(root), str(dest), tuple(files), len(adapter.deltas), ranks, staging.restoration)
