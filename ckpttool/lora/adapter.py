"""A PEFT LoRA adapter folder, read: ``adapter_config.json`` and ``adapter_model.safetensors`` (or ``.bin``,
through the safe unpickler), as the modules it changes, each a :class:`~.delta.LoraDelta`. Reads headers only.

What PEFT 0.21's ``save_pretrained`` writes: keys ``base_model.model.<module>.lora_A.weight`` ``(r, in)`` and
``...lora_B.weight`` ``(out, r)`` (the adapter's name left out), and a config whose ``r`` and ``lora_alpha`` hold for
every module unless ``rank_pattern`` / ``alpha_pattern`` name it (a key matches a module whose name ends with it,
at a dot: PEFT's ``get_pattern_key``). The scaling is ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with
``use_rslora``. What ckpttool cannot fuse exactly is refused by name: DoRA (``use_dora``), trained biases (``bias``
other than ``"none"``, ``lora_bias``), ``modules_to_save``, embedding LoRA (``lora_embedding_A``), and any other PEFT method than LoRA. LoRA on a 2-D
parameter (``target_parameters`` naming a ``weight``: PEFT moves Mixtral's router ``mlp.gate``, no ``nn.Linear`` in
transformers 5, there) is fused: its delta is rounded to the weight's dtype before the add, as PEFT's
``ParamWrapper.get_delta_weight`` does. So is LoRA on stacked expert parameters (``target_parameters`` naming
``mlp.experts.gate_up_proj`` / ``down_proj``): PEFT nests one ``ParamWrapper`` per parameter on the experts module,
so their keys are ``mlp.experts.base_layer.lora_A.weight`` (the first parameter) and ``mlp.experts.lora_A.weight``
(the last), which do not say which parameter each is; A is ``(r*E, in)`` and B ``(out, r*E)``, and the base's
shapes tell the parameter when the adapter is attached (:mod:`ckpttool.lora.attach`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ckpttool.errors import SourceError, SourceNotFoundError
from ckpttool.io import torch_save
from ckpttool.io.jsonfile import loads
from ckpttool.io.paths import JSON_LIMIT, open_source, read_source_text
from ckpttool.io.safetensors_format import read_header
from ckpttool.plan.lora import AdapterTensor, LoraDelta

CONFIG = "adapter_config.json"
WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
#: PEFT's prefix of every key its save_pretrained writes for a model wrapped by get_peft_model
PREFIX = "base_model.model."
_KEY = re.compile(r"(?P<module>.+)\.lora_(?P<which>A|B)\.weight")


@dataclass(frozen=True, slots=True)
class Adapter:
    """A PEFT LoRA adapter: its folder, config and the modules it changes.

    Attributes:
        root: the adapter folder.
        weights: its weights file.
        config: ``adapter_config.json`` as read.
        deltas: per module name in the base (``model.layers.0.self_attn.q_proj``), its delta.
        target_modules: the config's ``target_modules`` (a list, or PEFT's regular expression as a string).
    """

    root: str
    weights: str
    config: Mapping[str, object]
    deltas: Mapping[str, LoraDelta]
    target_modules: tuple[str, ...] | str


def read_adapter(folder: str | Path) -> Adapter:
    """Read the PEFT LoRA adapter saved in ``folder``.

    Raises:
        SourceNotFoundError: no folder, no ``adapter_config.json`` or no ``adapter_model.safetensors`` / ``.bin``.
        SourceError: the config or weights are malformed, name what ckpttool does not fuse (DoRA, biases,
            ``modules_to_save``...), or a module's A and B do not fit each other or its rank; the message names the
            file and the tensor.

    Example:
        >>> read_adapter("fixtures/lora_llama/adapter").deltas["model.layers.0.self_attn.q_proj"].rank  # doctest: +SKIP
        4
    """
    root = Path(folder)
    if not root.is_dir():
        raise SourceNotFoundError(f"'{root}': no such adapter folder (a PEFT adapter is a folder holding {CONFIG} "
                                  f"and {WEIGHTS[0]})")
    config_path = root / CONFIG
    if not config_path.is_file():
        raise SourceNotFoundError(f"'{config_path}': no such file; a PEFT adapter folder holds {CONFIG} beside its "
                                  "weights (what save_pretrained writes)")
    weights = next((root / name for name in WEIGHTS if (root / name).is_file()), None)
    if weights is None:
        raise SourceNotFoundError(f"'{root}': {CONFIG} but no {' or '.join(WEIGHTS)} beside it; "
                                  "the adapter's weights are missing")
    config = read_adapter_config(config_path)
    tensors = _tensors(weights)
    return Adapter(str(root), str(weights), config, lora_deltas(str(root), config, str(config_path), tensors, str(weights)),
                   target_modules(config))


def read_adapter_config(path: Path) -> dict[str, object]:
    """``adapter_config.json`` read and checked: LoRA, nothing ckpttool cannot fuse, ranks and alphas positive.

    Raises:
        SourceError: not a JSON object, another PEFT method, or what ckpttool refuses (DoRA, biases, ...), naming it.
    """
    try:
        config = loads(read_source_text(path, str(path), limit=2**20))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SourceError(f"'{path}': not a JSON adapter config ({e})") from None
    if not isinstance(config, dict):
        raise SourceError(f"'{path}': not a JSON object")
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise SourceError(f"'{path}': peft_type = {kind!r}; ckpttool fuses LoRA adapters only (peft_type 'LORA')")
    refused = [
        ("use_dora", bool(config.get("use_dora")), "DoRA (use_dora = true): its magnitude vector rescales each "
         "column by the norm of W + scale*B@A, which ckpttool does not compute; fuse it with peft's merge_and_unload"),
        ("bias", config.get("bias", "none") not in (None, "none"), f"bias = {config.get('bias')!r}: the adapter "
         "trained biases of the base, which ckpttool does not fuse yet"),
        ("lora_bias", bool(config.get("lora_bias")), "lora_bias = true: lora_B's bias is not fused yet"),
        ("modules_to_save", bool(config.get("modules_to_save")), f"modules_to_save = {config.get('modules_to_save')!r}"
         ": whole modules saved beside the adapter are not fused yet"),
    ]
    for _key, bad, why in refused:
        if bad:
            raise SourceError(f"'{path}': {why}")
    for key in ("r", "lora_alpha"):
        value = config.get(key, 8)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise SourceError(f"'{path}': {key} = {value!r}; expected a positive number")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(key) or {}, dict):
            raise SourceError(f"'{path}': {key} = {config.get(key)!r}; expected an object of module name: value")
    return config


def read_json_object(path: Path, what: str) -> dict[str, object]:
    """A small JSON object that states a LoRA's rank and alpha (verl's ``lora_train_meta.json``, a Megatron-Core
    LoRA's dim and alpha), read.

    Raises:
        SourceError: not JSON (``what`` says what was expected) or not an object, naming the file.
    """
    try:
        found = loads(read_source_text(path, str(path), limit=JSON_LIMIT))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SourceError(f"'{path}': not {what} ({e})") from None
    if not isinstance(found, dict):
        raise SourceError(f"'{path}': not a JSON object")
    return found


def check_positive(found: Mapping[str, object], keys: tuple[str, ...], path: Path, why: str) -> None:
    """Each of ``keys`` of ``found`` (read from ``path``) is a positive number.

    Raises:
        SourceError: one is missing or not a positive number, naming the file and the key; ``why`` follows.
    """
    for key in keys:
        value = found.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise SourceError(f"'{path}': {key} = {value!r}; expected a positive number ({why})")


def target_modules(config: Mapping[str, object]) -> tuple[str, ...] | str:
    """The config's ``target_modules``: a tuple of names, or PEFT's regular expression as a string."""
    found = config.get("target_modules") or ()
    return found if isinstance(found, str) else tuple(str(m) for m in found)  # type: ignore[union-attr]


def _tensors(weights: Path) -> dict[str, AdapterTensor]:
    """Every tensor of the weights file, located (not loaded)."""
    label = str(weights)
    if weights.suffix == ".safetensors":
        header = read_header(weights, label)
        return {k: AdapterTensor(label, k, e.shape, e.dtype, e.begin) for k, e in header.entries.items()}
    with open_source(weights, label) as f:
        saved = torch_save.scan(f, label=label)
    if not isinstance(saved, dict):
        raise SourceError(f"'{label}': holds a {type(saved).__name__}, not a state dict of tensors")
    found = {}
    for key, stored in saved.items():
        if not isinstance(stored, torch_save.StoredTensor):
            raise SourceError(f"'{label}': '{key}' is a {type(stored).__name__}, not a tensor")
        found[str(key)] = AdapterTensor(label, str(key), stored.shape, stored.dtype, stored.required_offset(label, key))
    return found


def pattern_key(patterns: Mapping[str, object], module: str) -> str | None:
    """The key of ``rank_pattern`` / ``alpha_pattern`` that names ``module`` (PEFT's ``get_pattern_key``: the
    first key such that the module's name is it, or ends with ``.`` and it, as a regular expression)."""
    return next((key for key in patterns if re.match(rf"(.*\.)?({key})$", module)), None)


def lora_deltas(root: str, config: Mapping[str, object], config_label: str, tensors: Mapping[str, AdapterTensor],
                label: str) -> dict[str, LoraDelta]:
    """Per module, its delta: ``tensors`` by their key as ``save_pretrained`` writes it (``<module>.lora_A.weight``,
    with or without :data:`PREFIX`; any object with ``AdapterTensor``'s attributes and ``read_rows``), each pair
    checked and scaled as ``config`` says. ``root``: the adapter, for messages; ``label``: where the tensors are.

    Raises:
        SourceError: a key that is no LoRA weight, an A without its B, shapes or dtypes that do not fit, a rank the
            config does not state; the message names ``label`` and the tensor.
    """
    pairs: dict[str, dict[str, AdapterTensor]] = {}
    for key, tensor in tensors.items():
        name = key[len(PREFIX):] if key.startswith(PREFIX) else key
        found = _KEY.fullmatch(name)
        if found is None:
            what = ("embedding LoRA (lora_embedding_A / _B) is not fused yet" if "lora_embedding_" in key else
                    "DoRA's magnitude vector: DoRA is not fused" if "lora_magnitude_vector" in key else
                    "not a LoRA weight (expected <module>.lora_A.weight and <module>.lora_B.weight)")
            raise SourceError(f"'{label}': '{key}': {what}")
        pairs.setdefault(found["module"], {})[found["which"]] = tensor
    parameters = [str(p) for p in config.get("target_parameters") or ()]  # type: ignore[union-attr]
    deltas = {}
    for module, pair in sorted(pairs.items()):
        missing = "A" if "A" not in pair else "B" if "B" not in pair else None
        if missing is not None:
            raise SourceError(f"'{label}': '{PREFIX}{module}.lora_{missing}.weight' is missing; "
                              f"'{module}' has only its lora_{'B' if missing == 'A' else 'A'}")
        a, b = pair["A"], pair["B"]
        if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[0] != b.shape[1]:
            raise SourceError(f"'{label}': '{a.key}' {list(a.shape)} and '{b.key}' {list(b.shape)} do not fit: "
                              "expected A (r, in) and B (out, r) of one rank r")
        if a.dtype != b.dtype or a.dtype not in ("F32", "BF16", "F16", "F64"):
            raise SourceError(f"'{label}': '{a.key}' is {a.dtype} and '{b.key}' {b.dtype}; expected one floating dtype")
        stacked = stacked_parameters(module, parameters)
        # PEFT matches the patterns against a stacked parameter's own name (experts.gate_up_proj), a module's else
        found = [_rank_alpha(config, name) for name in stacked or (module,)]
        if len({(r, alpha) for r, alpha, _ in found}) > 1:
            raise SourceError(f"'{label}': '{a.key}' is the LoRA of one of {list(stacked)}, to which {config_label}'s "
                              "rank_pattern / alpha_pattern give different (r, alpha) "
                              f"{[(r, alpha) for r, alpha, _ in found]}; not fused yet")
        r, alpha, r_key = found[0]
        scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r  # type: ignore[operator]
        if stacked:  # r rows of A per expert
            if a.shape[0] % r:
                raise SourceError(f"'{label}': '{a.key}' has {a.shape[0]} rows, not a multiple of r = {r} "
                                  f"(LoRA on the stacked experts {list(stacked)}: r rows per expert)")
            deltas[module] = LoraDelta(root, module, a, b, scaling, rounded=True, experts=a.shape[0] // r,
                                       parameters=stacked)
            continue
        if r != a.shape[0]:
            raise SourceError(f"'{label}': '{a.key}' has rank {a.shape[0]} but {config_label} says r = {r} for "
                              f"'{module}'{' (rank_pattern)' if r_key is not None else ''}")
        parameter = any(f"{module}.weight" == p or f"{module}.weight".endswith(f".{p}") for p in parameters)
        deltas[module] = LoraDelta(root, module, a, b, scaling, bool(config.get("fan_in_fan_out")) and not parameter,
                                   rounded=parameter)
    if not deltas:
        raise SourceError(f"'{label}': holds no LoRA weights (no '<module>.lora_A.weight'); is it a LoRA adapter?")
    return deltas


def _rank_alpha(config: Mapping[str, object], name: str) -> tuple[object, object, str | None]:
    """``r``, ``lora_alpha`` and the ``rank_pattern`` key for module or parameter ``name``, as PEFT finds them."""
    ranks, alphas = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    r_key, alpha_key = pattern_key(ranks, name), pattern_key(alphas, name)  # type: ignore[arg-type]
    r = ranks[r_key] if r_key is not None else config.get("r", 8)  # type: ignore[index]
    alpha = alphas[alpha_key] if alpha_key is not None else config.get("lora_alpha", 8)  # type: ignore[index]
    return r, alpha, r_key


def stacked_parameters(module: str, parameters: list[str]) -> tuple[str, ...]:
    """The stacked parameters (in-memory names) of ``target_parameters`` that PEFT's key module ``module`` may hold
    LoRA for: ``model.layers.0.mlp.experts.base_layer`` (nested ``ParamWrapper``) and ``model.layers.0.mlp.experts``
    both give ``model.layers.0.mlp.experts.gate_up_proj`` and ``...down_proj`` for those two. Empty for a module
    that is no stacked parameter's (a 2-D ``weight`` is a module's own)."""
    owner = re.sub(r"(\.base_layer)+$", "", module)
    found = []
    for parameter in parameters:
        leaf = parameter.rsplit(".", 1)[-1]
        name = f"{owner}.{leaf}"
        if leaf != "weight" and (name == parameter or name.endswith(f".{parameter}")):
            found.append(name)
    return tuple(found)
