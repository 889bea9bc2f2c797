"""Norm weights against the convention transformers applies to the model type: ``w`` or zero-centred ``1 + w``.

Gemma's RMSNorm multiplies by ``1 + weight`` and starts from zeros; Llama's multiplies by ``weight`` and starts
from ones (``modeling_gemma.py``'s ``GemmaRMSNorm`` against ``LlamaRMSNorm``). A converter that forgets the
difference adds or drops that 1: the checkpoint loads, and every norm scales by about 2, or by about 0. The
statistics show it: trained norm weights of the other convention sit around 1 where about 0 is meant, or the
reverse, in every layer (one layer's small norm, as Llama 2's first, is judged with its kind across the layers,
so it is no sign). Only model types whose convention was read from transformers' source are judged:

- zero-centred (``1.0 + self.weight``): :data:`ZERO_CENTRED`, the decoder's norms (a Qwen3-Next linear
  attention's gated norm is plain, a multimodal model's vision tower too: not judged);
- plain: :data:`PLAIN`.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence

from ckpttool.findings import Finding, TensorStats, finding
from ckpttool.audit.shapes import LAYER_NAME

#: a decoder norm's weight: ``model.norm``, ``input_layernorm``, ``post_feedforward_layernorm``, ``q_norm``...
_NORM = re.compile(r"(?:^|\.)(?:norm|\w*layernorm|q_norm|k_norm)\.weight$")
#: norms of these models that ``_NORM`` names but that are plain ``w`` (gated norms, vision towers)
_NOT_JUDGED = re.compile(r"linear_attn\.norm\.weight$|vision|visual|audio")

ZERO_CENTRED = frozenset({"gemma", "gemma2", "gemma3", "gemma3_text", "vaultgemma", "qwen3_next", "qwen3_5",
                          "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_text"})
PLAIN = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "deepseek_v3",
                   "deepseek_v2", "gpt_oss", "phi3", "olmo2"})

#: a norm is on the wrong side when all its elements sit within this distance of the other convention's
#: neutral value (1 for plain, 0 for zero-centred) and its mean within a tenth of it, in every layer
_SPREAD = 0.5


def norm_findings(stats: Sequence[TensorStats], model_type: str) -> list[Finding]:
    """A ``norm-convention`` finding for each decoder norm whose values contradict the model type's convention."""
    if model_type not in ZERO_CENTRED | PLAIN:
        return []
    zero_centred = model_type in ZERO_CENTRED
    wrong = 1.0 if zero_centred else 0.0  # the value the other convention's weights sit around
    kinds: dict[str, list[TensorStats]] = defaultdict(list)
    for s in stats:
        if _NORM.search(s.name) and not _NOT_JUDGED.search(s.name) and s.mean is not None:
            match = LAYER_NAME.match(s.name)
            kinds[f"{match['prefix']}.{{L}}.{match['rest']}" if match else s.name].append(s)
    found = []
    for members in kinds.values():
        # a converter gets the convention wrong for every layer: one layer's small norm (Llama 2's first) is no sign
        if not all(_sits_at(s, wrong) for s in members):
            continue
        for s in members:
            if zero_centred:
                why = (f"{model_type} norms multiply by 1 + weight, so these scale by about {1 + (s.mean or 0):.3g}: "
                       "weights saved for a plain norm (w); subtract 1")
                cause = f"norms saved as plain w in a {model_type} model, whose norms are 1 + w"
            else:
                why = (f"{model_type} norms multiply by the weight, so these scale by about {s.mean:.3g}: weights "
                       "saved for a zero-centred norm (1 + w); add 1")
                cause = f"norms saved as zero-centred 1 + w in a {model_type} model, whose norms are w"
            found.append(finding(
                "norm-convention",
                f"'{s.name}' has mean {s.mean:.4g} (min {s.min:.4g}, max {s.max:.4g}); {why}",
                tensor=s.name, detail=(("cause", cause),),
            ))
    return found


def _sits_at(s: TensorStats, value: float) -> bool:
    """Every element within :data:`_SPREAD` of ``value`` and the mean within a tenth; all zeros never (that is
    zero-tensor's for a plain norm, the initial value of a zero-centred one)."""
    if s.mean is None or s.min is None or s.max is None or s.min == s.max == 0.0:
        return False
    return abs(s.mean - value) < 0.1 and value - _SPREAD < s.min and s.max < value + _SPREAD
