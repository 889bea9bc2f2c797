"""Multi-token prediction (MTP) layers, where DeepSeek-V3 and GLM-4.5 releases store them.

transformers builds MTP layers apart from the causal LM (``MtpModel``, for ``generate(use_mtp=True)``;
``from_pretrained`` of the causal LM ignores them), and :class:`~ckpttool.model.description.ModelInfo` keeps what it
builds (``mtp_shapes``). A release stores MTP layer ``k`` after the main layers, at index
``n = num_hidden_layers + k``: its decoder block under the names of a main layer (``model.layers.{n}.self_attn.*``,
``mlp.*`` with the experts, router and shared experts, the two layer norms), beside ``enorm``, ``hnorm`` ``(H)``,
``eh_proj`` ``(H, 2H)``, ``shared_head.norm`` ``(H)`` and its own copies of the embedding and the output layer,
``embed_tokens`` and ``shared_head.head`` ``(V, H)``. Those are the names vLLM's DeepSeek and GLM-4.5 MTP loaders
read and the ones transformers' MTP loader maps (it renames ``shared_head.norm`` to ``post_norm`` and uses the main
model's embedding and head instead of the copies).

What a source holds of an MTP layer is all of it (each tensor then checked like any other), none of it (no error:
the model was trained without MTP, or by a framework that builds none, as transformers' own; a warning, as serving
engines cannot use MTP for speculative decoding then), or part of it: an error naming what is missing. A tensor
under an MTP layer's index that is none of these is unexpected.
"""

from __future__ import annotations

import re
from collections.abc import Collection

from ckpttool.model.description import ModelInfo
from ckpttool.model.architecture import config_value
from ckpttool.layout.layout import Shape

#: model types whose releases store MTP layers as above (checked against vLLM's loaders of both)
MODEL_TYPES = frozenset({"deepseek_v3", "glm4_moe"})

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
#: transformers' MtpModel names -> a release's, within a layer
_RELEASE_NAMES = {"post_norm.weight": "shared_head.norm.weight"}
#: the embedding and head MtpModel shares with the main model -> the copy a release keeps in every MTP layer
_COPIES = {"embed_tokens.weight": "embed_tokens.weight", "shared_head.weight": "shared_head.head.weight"}


def expected(info: ModelInfo) -> dict[int, dict[str, Shape]]:
    """Layer index -> the on-disk names and shapes of that MTP layer's tensors, for every MTP layer the config
    declares; empty for a model type not in :data:`MODEL_TYPES` or a config declaring none."""
    first = config_value(info.config, "num_hidden_layers")
    if info.model_type not in MODEL_TYPES or not info.mtp_shapes or not isinstance(first, int):
        return {}
    layers: dict[int, dict[str, Shape]] = {}
    for name, shape in info.mtp_shapes.items():
        match = _LAYER.match(name)
        if match is None:
            continue
        n = first + int(match[1])
        rest = match[2].removeprefix("mtp_block.")
        layers.setdefault(n, {})[f"model.layers.{n}.{_RELEASE_NAMES.get(rest, rest)}"] = shape
    for n, layer in layers.items():
        for shared, copy in _COPIES.items():
            if shared in info.mtp_shapes:
                layer[f"model.layers.{n}.{copy}"] = info.mtp_shapes[shared]
    return dict(sorted(layers.items()))


def held(names: Collection[str], layers: dict[int, dict[str, Shape]]) -> list[int]:
    """The MTP layers of which the source holds at least one tensor (any name under the layer's index)."""
    return [n for n in layers if any(name.startswith(f"model.layers.{n}.") for name in names)]


def absent(names: Collection[str], info: ModelInfo) -> list[int]:
    """The MTP layers the config declares of which ``names`` (on-disk) hold no tensor."""
    layers = expected(info)
    present = set(held(names, layers))
    return [n for n in layers if n not in present]


def partly_held(n: int) -> str:
    """Why an expected tensor of MTP layer ``n`` counts as missing."""
    return f"MTP layer {n} is held in part; a checkpoint holds all of an MTP layer or none of it"


def missing_note(gone: Collection[int], info: ModelInfo) -> str:
    """The note (a merge) and ``mtp-missing`` warning (an audit) for the MTP layers ``gone`` that the config
    declares and the source does not hold (:func:`absent`)."""
    declared = len(expected(info))
    kept = declared - len(gone)
    them = "it" if len(gone) == 1 else "them"
    return (
        f"the config declares {declared} MTP layer{'s' if declared != 1 else ''} (num_nextn_predict_layers={declared}), "
        f"but the checkpoint holds no tensor of {', '.join(f'model.layers.{n}' for n in sorted(gone))}: transformers "
        f"loads the model without {them}, but a serving engine cannot use {them} for speculative decoding. If the "
        f"model was trained with {kept} MTP layer{'s' if kept != 1 else ''}, set num_nextn_predict_layers to {kept} "
        "in config.json"
    )
