"""What ``verify`` refuses before transformers sees a checkpoint: code the checkpoint ships, and config values
that make transformers crash, ask a question on stdin, or fetch code of its own.

A config file with an ``auto_map`` (``{"AutoTokenizer": ["tokenization_x.XTokenizer", null]}``) tells
transformers to import a ``.py`` file beside it; unless ``trust_remote_code`` is given, transformers asks
"Do you wish to run the custom code? [y/N]" on stdin, and a ``y`` runs it. ckpttool passes
``trust_remote_code=False`` to every loading call and, before that, refuses such a directory by name: a checkpoint
is data, and checking it must never run it.

The config values checked are the ones whose failure inside transformers is an ``AssertionError``,
``ImportError`` or a bare ``ValueError`` that names no key: each becomes a :class:`~ckpttool.errors.ConfigError`
naming the file and the key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ckpttool.errors import ConfigError
from ckpttool.io import jsonfile
from ckpttool.io.paths import JSON_LIMIT, read_source

#: the files of an HF directory that transformers' Auto classes read, and in which an ``auto_map`` imports code
CODE_CONFIG_FILES = (
    "config.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json",
    "video_preprocessor_config.json", "feature_extractor_config.json", "image_processor_config.json",
    "generation_config.json",
)
#: keys with which a config names Python code to import from the checkpoint's folder (or its hub repository)
CODE_KEYS = ("auto_map", "custom_pipelines")
#: attention and MoE kernels that run on a CPU from torch alone; anything else needs a package (flash-attn) or
#: names a kernel repository on the hub, which is code from outside too
ATTENTION = ("eager", "sdpa")
EXPERTS = ("eager", "grouped_mm", "batched_mm")
#: sizes that must be positive integers where a config gives them (``num_hidden_layers: -1`` fails deep inside
#: torch with "__len__() should return >= 0")
POSITIVE_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings")
#: nesting searched for a code key; transformers reads them at the top level and in sub-configs
_DEPTH = 6


def refuse_remote_code(path: Path) -> None:
    """Refuse the HF directory ``path`` when one of its :data:`CODE_CONFIG_FILES` names code to import.

    Raises:
        ConfigError: such a file carries ``auto_map`` (or ``custom_pipelines``), at its top level or in a
            sub-config; or it is not JSON (then what transformers would make of it is unknown).
    """
    for name in CODE_CONFIG_FILES:
        file = path / name
        if not (file.exists() or file.is_symlink()):
            continue
        try:
            doc = jsonfile.loads(read_source(file, limit=JSON_LIMIT))
        except (ValueError, UnicodeDecodeError) as e:
            raise ConfigError(f"'{file}': not valid JSON ({e})") from None
        found = _code_key(doc, "", _DEPTH)
        if found is not None:
            key, value = found
            raise ConfigError(
                f"'{file}': \"{key}\" names code shipped with the checkpoint ({_short(value)}); transformers would "
                f"import and run it, and ckpttool never runs checkpoint code. Remove \"{key}\" to check the weights "
                f"with transformers' own classes")


def _code_key(doc: Any, prefix: str, depth: int) -> tuple[str, Any] | None:
    """The first code key in ``doc`` (dotted path and value), searching dicts and lists ``depth`` levels down."""
    if depth < 0:
        return None
    if isinstance(doc, dict):
        for key in CODE_KEYS:
            if key in doc and doc[key] not in (None, {}, []):
                return f"{prefix}{key}", doc[key]
        children = ((f"{prefix}{k}.", v) for k, v in doc.items())
    elif isinstance(doc, list):
        children = ((f"{prefix}{i}.", v) for i, v in enumerate(doc))
    else:
        return None
    for child_prefix, child in children:
        if isinstance(child, (dict, list)):
            found = _code_key(child, child_prefix, depth - 1)
            if found is not None:
                return found
    return None


def _short(value: Any, width: int = 120) -> str:
    text = json.dumps(value, ensure_ascii=True)
    return text if len(text) <= width else text[: width - 3] + "..."


def check_config(path: Path, config: dict[str, Any], positions: int | None = None) -> None:
    """Refuse config values that transformers cannot load on this machine, or that make it crash without naming
    them: non-positive sizes, a ``pad_token_id`` outside the vocabulary, a quantization method transformers does
    not know, an attention or MoE kernel other than torch's own, and (with ``positions``, the tokens fed) a
    ``max_position_embeddings`` below the input's length.

    Raises:
        ConfigError: naming ``path``'s ``config.json`` and the key.
    """
    file = path / "config.json"
    sections = [("", config)]
    for name in ("text_config", "language_config", "llm_config"):
        sub = config.get(name)
        if isinstance(sub, dict):
            sections.append((f"{name}.", sub))
    for prefix, section in sections:
        _check_dtype(file, prefix, section)
        _check_sizes(file, prefix, section)
        _check_pad(file, prefix, section, config)
        _check_kernels(file, prefix, section)
        if positions is not None:
            _check_positions(file, prefix, section, positions)
    _check_quantization(file, config)


def _check_dtype(file: Path, prefix: str, section: dict[str, Any]) -> None:
    import torch

    for key in ("dtype", "torch_dtype"):
        value = section.get(key)
        values = value.values() if isinstance(value, dict) else [value]  # per sub-model dtypes
        for v in values:
            if v is None or v == "auto" or (isinstance(v, str) and isinstance(getattr(torch, v, None), torch.dtype)):
                continue
            raise ConfigError(f"'{file}': {prefix}{key} is {_short(v)}; it must name a torch dtype (\"float32\", "
                              f"\"bfloat16\", ...) or be \"auto\"")


def _check_sizes(file: Path, prefix: str, section: dict[str, Any]) -> None:
    for key in POSITIVE_SIZES:
        value = section.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(f"'{file}': {prefix}{key} is {json.dumps(value)}; it must be a positive integer")


def _check_pad(file: Path, prefix: str, section: dict[str, Any], config: dict[str, Any]) -> None:
    pad = section.get("pad_token_id")
    if pad is None:
        return
    vocab = section.get("vocab_size", config.get("vocab_size"))
    if not isinstance(pad, int) or isinstance(pad, bool):
        raise ConfigError(f"'{file}': {prefix}pad_token_id is {_short(pad)}; it must be a token id (an integer) "
                          f"or null")
    if isinstance(vocab, int) and not 0 <= pad < vocab:
        raise ConfigError(f"'{file}': {prefix}pad_token_id is {pad}, outside the vocabulary (vocab_size {vocab}: ids "
                          f"0..{vocab - 1}); the embedding cannot pad with it")


def _check_kernels(file: Path, prefix: str, section: dict[str, Any]) -> None:
    for key, allowed in (("attn_implementation", ATTENTION), ("experts_implementation", EXPERTS)):
        for name in (key, f"_{key}"):
            value = section.get(name)
            values = value.values() if isinstance(value, dict) else [value]
            for v in values:
                if v is not None and v not in allowed:
                    raise ConfigError(
                        f"'{file}': {prefix}{name} is {_short(v)}; verify runs the model with torch's own kernels "
                        f"({' or '.join(repr(a) for a in allowed)}): remove the key (transformers then chooses) or "
                        f"set it to 'eager'")


def _check_positions(file: Path, prefix: str, section: dict[str, Any], positions: int) -> None:
    limit = section.get("max_position_embeddings")
    if isinstance(limit, int) and not isinstance(limit, bool) and limit < positions:
        raise ConfigError(f"'{file}': {prefix}max_position_embeddings is {limit}, fewer than the {positions} tokens "
                          f"verify feeds; feed at most {limit} (--tokens {limit}) or fix the config")


def _check_quantization(file: Path, config: dict[str, Any]) -> None:
    quant = config.get("quantization_config")
    if quant is None:
        return
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if not isinstance(method, str):
        raise ConfigError(f"'{file}': quantization_config has no \"quant_method\" string (found {_short(quant)})")
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING

    if method not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        import transformers

        raise ConfigError(f"'{file}': quantization_config.quant_method is {method!r}, which transformers "
                          f"{transformers.__version__} does not know; it cannot load the model (known: "
                          f"{', '.join(sorted(AUTO_QUANTIZATION_CONFIG_MAPPING))})")


def check_layers(path: Path, config: dict[str, Any], tensors: int) -> None:
    """Refuse a ``num_hidden_layers`` larger than the number of ``tensors`` the checkpoint stores: every decoder
    layer has weights of its own, and building a billion of them (on the meta device even) never ends.

    Raises:
        ConfigError: naming ``path``'s ``config.json`` and the key.
    """
    for prefix, section in (("", config), ("text_config.", config.get("text_config"))):
        layers = section.get("num_hidden_layers") if isinstance(section, dict) else None
        if isinstance(layers, int) and layers > tensors:
            raise ConfigError(f"'{path / 'config.json'}': {prefix}num_hidden_layers is {layers}, more than the "
                              f"{tensors} tensors the checkpoint stores (each layer has weights of its own)")


def check_with_transformers(path: Path, cls: type) -> None:
    """Let transformers parse the config as loading ``cls`` will (its own config class, never remote code), so
    that what its validators reject (``hidden_size`` not a multiple of the heads, a string ``rms_norm_eps``) is a
    named :class:`ConfigError` rather than a failure somewhere inside the load.

    Raises:
        ConfigError: transformers rejects the config; its message names the field.
    """
    from transformers import AutoConfig, PretrainedConfig

    config_class = getattr(cls, "config_class", None)
    try:
        if isinstance(config_class, type) and issubclass(config_class, PretrainedConfig) \
                and config_class is not PretrainedConfig:
            config_class.from_pretrained(str(path), local_files_only=True)
        else:
            AutoConfig.from_pretrained(str(path), trust_remote_code=False, local_files_only=True)
    except Exception as e:  # transformers validates with its own error classes, not all of them ValueErrors
        raise ConfigError(f"'{path / 'config.json'}': transformers rejects this config ({type(e).__name__}: "
                          f"{_first_lines(str(e))})") from None


def _first_lines(message: str, lines: int = 3) -> str:
    kept = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return " ".join(kept[:lines]) + (" ..." if len(kept) > lines else "")
