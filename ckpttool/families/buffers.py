"""Historical non-persistent buffers: tensors older releases of transformers kept in a model and some savers wrote
to disk, which no model transformers builds today holds, and which are never weights.

One table (:data:`HISTORICAL`) for every reader and for both merge and audit, so that they say the same thing:

- a merge leaves them out, with one note per kind of buffer (:func:`note`);
- an audit reports each as a ``tensor-unexpected`` warning in the same words (:func:`message`): the checkpoint as it
  stands holds a tensor the architecture lacks (``from_pretrained`` lists it among its unexpected keys), and the
  merge is what removes it. A buffer the model itself still declares non-persistent (``model.rotary_emb.inv_freq``,
  :attr:`~ckpttool.model.description.ModelInfo.buffers`) is known to the model: that one is a note in both.

An unknown extra tensor is none of these: a merge refuses it by name (``--drop`` to go on deliberately).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HistoricalBuffer:
    """One kind of historical buffer.

    Attributes:
        pattern: its HuggingFace name, as a regular expression matched whole.
        what: what it is, plural, for a note (``rotary buffers of the attention layers``).
        one: the same, singular.
        why: which releases kept it and why it is no weight.
        writers: the savers and releases known to write it (documentation, and the tests' matrix).
    """

    pattern: re.Pattern[str]
    what: str
    one: str
    why: str
    writers: tuple[str, ...]


HISTORICAL: tuple[HistoricalBuffer, ...] = (
    HistoricalBuffer(
        re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.(?:inv_freq|cos_cached|sin_cached)"),
        "rotary buffers of the attention layers", "rotary buffer of the attention layers",
        "transformers 4.39 and older kept there: non-persistent, never weights",
        ("transformers <= 4.30 save_pretrained (.bin: inv_freq was persistent)",
         "ColossalAI 0.4.9 MoeHybridParallelPlugin (its MoE checkpoint IO saves every buffer; transformers 4.39.3)",
         "Lightning over transformers 4.x (the LightningModule's state_dict() with a pre-4.31 model)"),
    ),
)


def historical(name: str) -> HistoricalBuffer | None:
    """The table's entry for ``name`` (a HuggingFace name), or None when it is no historical buffer."""
    return next((b for b in HISTORICAL if b.pattern.fullmatch(name)), None)


def split_historical(names: Iterable[str]) -> dict[HistoricalBuffer, list[str]]:
    """The historical buffers among ``names``, sorted, by their entry (entries in the table's order)."""
    found: dict[HistoricalBuffer, list[str]] = {}
    for name in names:
        entry = historical(name)
        if entry is not None:
            found.setdefault(entry, []).append(name)
    return {b: sorted(found[b]) for b in HISTORICAL if b in found}


def note(entry: HistoricalBuffer, names: list[str]) -> str:
    """A merge's note for the buffers ``names`` of one ``entry`` (sorted), left out of the plan.

    Example: ``not read: 6 rotary buffers of the attention layers (model.layers.0.self_attn.rotary_emb.cos_cached,
    ...), which transformers 4.39 and older kept there: non-persistent, never weights``."""
    what = entry.what if len(names) > 1 else entry.one
    more = ", ..." if len(names) > 1 else ""
    return f"not read: {len(names)} {what} ({names[0]}{more}), which {entry.why}"


def message(entry: HistoricalBuffer, name: str) -> str:
    """An audit's warning for one historical buffer, in the words of :func:`note`."""
    return f"'{name}': a {entry.one}, which {entry.why}; a merge does not read it"
