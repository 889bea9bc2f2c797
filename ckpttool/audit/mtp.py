"""MTP layers that are present but were never trained: at their initialisation, or copies of a main layer.

A multi-token-prediction layer (:mod:`ckpttool.families.mtp`) that a training run did not touch still has the
values transformers' ``_init_weights`` gave it: every norm exactly 1, every projection drawn from
``normal(0, initializer_range)`` (RMS about ``initializer_range``). One filled in by a converter from a main
layer holds that layer's matrices byte for byte. transformers ignores MTP layers, so the model loads; a serving
engine drafting tokens with such a layer accepts almost none of them. Both are ``mtp-untrained`` warnings, one
cause per MTP layer. A declared MTP layer that is absent is ``mtp-missing``'s.
"""

from __future__ import annotations

from collections.abc import Sequence

from ckpttool.model.description import ModelInfo
from ckpttool.model.architecture import config_value
from ckpttool.families import mtp
from ckpttool.findings import Finding, TensorStats, finding
from ckpttool.audit.shapes import LAYER_NAME

#: a projection's RMS within this ratio of initializer_range counts as initial
_INIT_RATIO = 1.2
#: the MTP layer's own copies of the embedding and head: copies by design
_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


def mtp_findings(stats: Sequence[TensorStats], model: ModelInfo) -> list[Finding]:
    """``mtp-untrained`` findings for every present MTP layer at its initialisation or copied from a main layer."""
    layers = mtp.expected(model)
    if not layers:
        return []
    by_name = {s.name: s for s in stats}
    main: dict[tuple[str, str], int] = {}
    for s in stats:
        match = LAYER_NAME.match(s.name)
        if match and int(match["index"]) not in layers and len(s.shape) >= 2:
            main.setdefault((match["rest"], s.fingerprint), int(match["index"]))
    std = config_value(model.config, "initializer_range")
    found: list[Finding] = []
    for n, names in layers.items():
        held = [by_name[name] for name in sorted(names) if name in by_name]
        matrices = [s for s in held if len(s.shape) >= 2 and not s.name.endswith(_COPIES)]
        copied = [(s, main[key]) for s in matrices if (key := (s.name.split(f".{n}.", 1)[1], s.fingerprint)) in main]
        if copied:
            sources = sorted({layer for _, layer in copied})
            cause = f"MTP layer {n} is a copy of main layer{'s' if len(sources) > 1 else ''} " + ", ".join(map(str, sources))
            found.extend(finding(
                "mtp-untrained", f"'{s.name}' is identical to the same tensor of main layer {layer}: MTP layer {n} was "
                f"not trained (a draft layer that predicts like layer {layer} proposes tokens a server rejects)",
                tensor=s.name, detail=(("cause", cause),),
            ) for s, layer in copied)
            continue
        norms = [s for s in held if len(s.shape) == 1 and s.name.endswith("norm.weight")]
        if not (norms and matrices and isinstance(std, (int, float)) and std > 0):
            continue
        if all(s.min == s.max == 1.0 for s in norms) and all(
            s.rms is not None and 1 / _INIT_RATIO <= s.rms / std <= _INIT_RATIO for s in matrices
        ):
            cause = (f"MTP layer {n} is at its initialisation (every norm exactly 1, every projection's RMS about "
                     f"initializer_range {std:g})")
            found.extend(finding(
                "mtp-untrained", f"'{s.name}' is at its initial value ({_initial(s)}): MTP layer {n} was not trained",
                tensor=s.name, detail=(("cause", cause),),
            ) for s in [*norms, *matrices])
    return found


def _initial(s: TensorStats) -> str:
    return "1 everywhere" if len(s.shape) == 1 else f"RMS {s.rms:.4g}"
