"""One forward pass of a HuggingFace checkpoint, loaded the way a user loads it, in bounded memory.

The class is the one ``config.architectures`` names, taken from transformers itself (never remote code), and
the load is strict: transformers' own loading report (``output_loading_info=True``) is read, and every missing,
unexpected or mis-shaped tensor becomes a problem named by tensor. Tensors that the class ignores by design
(``_keys_to_ignore_on_load_unexpected``, e.g. DeepSeek-V3's multi-token-prediction layer) are notes.

Memory: the model is loaded with every module offloaded to disk (``device_map={"": "disk"}``). transformers
then keeps the checkpoint's own safetensors files as the offload store (only tensors it has to convert, such as
stacked experts, are written to a temporary folder), and accelerate's hooks bring one module's weights into
memory for its forward and drop them after. The peak is the largest module plus activations, not the model.
"""

from __future__ import annotations

import contextlib
import logging
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from ckpttool.io import jsonfile
from ckpttool.errors import ConfigError, SourceError, SourceNotFoundError
from ckpttool.io.paths import JSON_LIMIT, read_source
from ckpttool.verify.guard import check_config, check_layers, check_with_transformers, refuse_remote_code
from ckpttool.verify.image import ImageInput, image_input, with_token_types
from ckpttool.readers.hf import BIN
from ckpttool.verify.prompt import choose_input
from ckpttool.io.safetensors_format import read_header

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"


@dataclass(frozen=True, slots=True)
class Forward:
    """One checkpoint's load and forward.

    Attributes:
        path: the HuggingFace directory loaded.
        architecture: the transformers class used (``LlamaForCausalLM``).
        dtype: the dtype its weights were loaded in (as transformers chose from the config).
        problems: what makes the load or the logits wrong, each naming its tensor or position.
        notes: what is worth knowing and is no fault (tensors ignored by design).
        logits: float32 logits, ``[positions, vocab]``; empty when the forward could not run.
        image_logits: a vision-language model's float32 logits with an image (:mod:`.image`), or None.
    """

    path: str
    architecture: str
    dtype: str
    problems: tuple[str, ...]
    notes: tuple[str, ...]
    logits: torch.Tensor
    image_logits: torch.Tensor | None = None

    def to_json(self) -> dict[str, object]:
        return {"path": self.path, "architecture": self.architecture, "dtype": self.dtype,
                "problems": list(self.problems), "notes": list(self.notes)}


def read_config(path: Path) -> dict[str, Any]:
    """The ``config.json`` of an HF directory as a dict.

    Raises:
        SourceNotFoundError: the directory or its ``config.json`` does not exist.
        ConfigError: the config is not a JSON object.
    """
    if not path.is_dir():
        raise SourceNotFoundError(f"'{path}': no such directory")
    file = path / "config.json"
    if not file.is_file():
        raise ConfigError(f"'{file}' not found: verify needs the model's config.json beside its weights")
    config = _json(file)
    if not isinstance(config, dict):
        raise ConfigError(f"'{file}': expected a JSON object, found {type(config).__name__}")
    return config


def _json(file: Path) -> Any:
    try:
        return jsonfile.loads(read_source(file, limit=JSON_LIMIT))
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"'{file}': not valid JSON ({e})") from None


def model_class(path: Path, config: dict[str, Any]) -> type:
    """The transformers class ``config.architectures`` names (a causal LM through the Auto class when it names none).

    Raises:
        ConfigError: the config names several classes, or one transformers does not have.
    """
    import transformers

    names = config.get("architectures") or []
    if not names:
        return transformers.AutoModelForCausalLM
    if not isinstance(names, list) or len(names) != 1 or not isinstance(names[0], str):
        raise ConfigError(f"'{path / 'config.json'}': \"architectures\" must name one class, found {names!r}")
    cls = getattr(transformers, names[0], None)
    if not isinstance(cls, type) or not hasattr(cls, "from_pretrained"):
        raise ConfigError(f"'{path / 'config.json'}': architectures names '{names[0]}', which transformers "
                          f"{transformers.__version__} does not have (verify never runs remote code)")
    return cls


def stored_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor in the directory's safetensors files (the index's files when it has one): name -> shape,
    from the headers only."""
    index = path / INDEX
    if index.is_file():
        data = _json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict):
            raise SourceError(f"'{index}': no \"weight_map\" object")
        files = sorted({path / str(f) for f in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    return {name: entry.shape for file in files for name, entry in read_header(file).entries.items()}


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' progress bars and loading warnings off: the loading report is read, not printed."""
    from transformers.utils import logging as hf_logging

    accelerate = logging.getLogger("accelerate")  # "Some parameters are on the meta device because they were offloaded"
    level, bars, accelerate_level = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled(), accelerate.level
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    accelerate.setLevel(logging.ERROR)
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        accelerate.setLevel(accelerate_level)
        if bars:
            hf_logging.enable_progress_bar()


def check_output(path: Path) -> Forward:
    """The forward check ``merge(verify_forward=True)`` runs on what it wrote, before publishing it: strict load,
    a fixed input (the tokenizer's sentence, else fixed ids), finite and informative logits; for a vision-language
    model whose image layout is known (:func:`.image.image_input`) a second forward with a synthetic image, whose
    logits must be finite and informative too (a vision tower or projector that text alone never reaches)."""
    config = read_config(path)
    ids, _ = choose_input(path, None, config, None, None, None)
    image = image_input(path, config)
    forward = run_forward(path, ids, image=image if isinstance(image, ImageInput) else None)
    return replace(forward, notes=(*forward.notes, image)) if isinstance(image, str) else forward


def run_forward(path: Path, input_ids: list[int], *, stream: bool = True, image: ImageInput | None = None) -> Forward:
    """Load the HF directory ``path`` strictly and run ``input_ids`` through it (and ``image``, a vision-language
    model's input with an image, as a second forward).

    Args:
        path: a HuggingFace directory (``config.json`` + safetensors).
        input_ids: the token ids of one sequence.
        stream: offload every module to disk and load one at a time (bounded memory); False loads it whole.
        image: see :func:`.image.image_input`; its logits are :attr:`Forward.image_logits`.

    Raises:
        ConfigError: no usable config, or an architecture transformers does not have.
        SourceNotFoundError: no safetensors weights.
        SourceError: a safetensors header is malformed (named by file and tensor), or transformers cannot load
            the directory (its message says why).
    """
    config = read_config(path)
    refuse_remote_code(path)  # before transformers reads a file: it would ask on stdin whether to run the code
    check_config(path, config, len(input_ids))
    cls = model_class(path, config)
    with _quiet_transformers():
        check_with_transformers(path, cls)
    stored = stored_shapes(path)  # every header read and checked before transformers opens a file
    if not stored:
        bins = BIN.present(path)  # never handed to transformers, which would unpickle them
        raise SourceNotFoundError(f"'{path}': no safetensors weights (model.safetensors or an index and its files)"
                                  + ("; it holds .bin weights: merge it (ckpttool merge) and verify the output, or "
                                     "give it as the reference (--against)" if bins else ""))
    check_layers(path, config, len(stored))
    with tempfile.TemporaryDirectory(prefix="ckpttool-verify-") as offload, _quiet_transformers():
        placement: dict[str, Any] = {"device_map": {"": "disk"}, "offload_folder": offload} if stream else {}
        try:
            model, info = cls.from_pretrained(str(path), dtype="auto", output_loading_info=True,
                                              ignore_mismatched_sizes=True, trust_remote_code=False, **placement)
        except ImportError as e:  # a quantization or kernel package this machine lacks: the config asks for it
            quant = config.get("quantization_config")
            method = quant.get("quant_method") if isinstance(quant, dict) else None
            asks = f"quantization_config.quant_method {method!r}" if method else "its config"
            raise ConfigError(f"'{path / 'config.json'}': transformers cannot load it as {cls.__name__} here: {asks} "
                              f"needs a package that is not installed ({e})") from None
        except KeyError as e:  # a name the config gives that transformers has no entry for ('silu2', a rope_type)
            raise SourceError(f"'{path}': transformers cannot load it as {cls.__name__}: its config names {e}, "
                              f"which transformers does not know") from None
        except (OSError, ValueError, RuntimeError, SafetensorError) as e:
            raise SourceError(f"'{path}': transformers cannot load it as {cls.__name__}: {e}") from None
        except Exception as e:  # on a config and weights it was given, transformers fails in ways of its own
            raise SourceError(f"'{path}': transformers cannot load it as {cls.__name__} ({type(e).__name__}: "
                              f"{e})") from None
        name = type(model).__name__
        mtp = _mtp_keys(config, info.get("unexpected_keys") or ())
        info = {**info, "unexpected_keys": [k for k in info.get("unexpected_keys") or () if k not in mtp]}
        if not info.get("mismatched_keys"):  # offloaded to disk, transformers does not compare shapes
            info["mismatched_keys"] = _mismatched(model, stored)
        problems = _loading_problems(name, info)
        notes = _ignored_by_design(stored, type(model))
        if mtp:
            notes.append(f"{len(mtp)} tensors of the multi-token-prediction layers the config declares "
                         f"(num_nextn_predict_layers), e.g. '{min(mtp)}': {name} does not load them")
        model.eval()
        dtype = str(getattr(model, "dtype", torch.float32)).removeprefix("torch.")
        if info.get("missing_keys") or info.get("mismatched_keys"):  # offloaded, such a model has holes, not noise
            notes.append("no forward was run: the model does not load strictly")
            return Forward(str(path), name, dtype, tuple(problems), tuple(notes), torch.empty(0))
        try:
            with torch.no_grad():
                output = model(input_ids=torch.tensor([input_ids], dtype=torch.long))
        except (ValueError, RuntimeError, IndexError, AssertionError, TypeError) as e:
            raise SourceError(f"'{path}': {name} loads but its forward fails on {len(input_ids)} tokens "
                              f"({type(e).__name__}: {e}); its config and weights do not make a model that "
                              f"runs") from None
        logits = getattr(output, "logits", None)
        if not isinstance(logits, torch.Tensor):
            raise SourceError(f"'{path}': {name} returns no logits: verify checks causal language models")
        logits = logits.detach()[0].float()
        image_logits = _image_forward(path, name, model, image) if image is not None else None
        del model, output
    problems += logit_problems(logits)
    if image_logits is not None:
        problems += [f"with an image: {p}" for p in logit_problems(image_logits)]
    return Forward(str(path), name, dtype, tuple(problems), tuple(notes), logits, image_logits)


def _image_forward(path: Path, name: str, model: torch.nn.Module, image: ImageInput) -> torch.Tensor:
    """The float32 logits of ``model`` on ``image``'s inputs (``[positions, vocab]``).

    Raises:
        SourceError: the forward fails (the vision side and the config do not make a model that runs).
    """
    try:
        _vision_in_memory(model)
        with torch.no_grad():
            output = model(**with_token_types(model, image))
    except (ValueError, RuntimeError, IndexError, AssertionError, TypeError) as e:
        raise SourceError(f"'{path}': {name} loads but its forward with an image fails ({image.source}; "
                          f"{type(e).__name__}: {e})") from None
    return output.logits.detach()[0].float()


#: the modules of a vision-language model's vision side, as transformers names them in memory
_VISION = re.compile(r"(^|\.)(visual|vision_tower|vision_model|multi_modal_projector)(\.|$)")


def _vision_in_memory(model: torch.nn.Module) -> None:
    """Load the vision side of a model streamed from disk (accelerate's offload hooks) into memory, whole.

    accelerate loads a module's parameters when that module is called; some vision towers read a child's weight
    without calling it (GLM-4V's ``embeddings.position_embedding.weight``), which an offloaded model leaves on the
    meta device. The vision side is small beside the language model, which stays streamed layer by layer.
    """
    from accelerate.hooks import remove_hook_from_module
    from accelerate.utils import set_module_tensor_to_device

    for name, module in model.named_modules():
        hook = getattr(module, "_hf_hook", None)
        if not _VISION.search(name) or hook is None or not getattr(hook, "offload", False):
            continue
        for param, _ in list(module.named_parameters(recurse=False)):
            set_module_tensor_to_device(module, param, "cpu", value=hook.weights_map[param])
        remove_hook_from_module(module)


def _loading_problems(name: str, info: dict[str, Any]) -> list[str]:
    problems = [f"'{key}': {name} has this parameter and the checkpoint does not (it was left at its random "
                f"initialisation)" for key in sorted(info.get("missing_keys") or ())]
    problems += [f"'{key}': in the checkpoint, but {name} has no such parameter (transformers drops it)"
                 for key in sorted(info.get("unexpected_keys") or ())]
    for item in sorted(info.get("mismatched_keys") or (), key=str):
        key, found, expected = (tuple(item) + (None, None))[:3]
        problems.append(f"'{key}': shape {_shape(found)} in the checkpoint, {name} expects {_shape(expected)}")
    problems += [f"transformers: {message}" for message in info.get("error_msgs") or ()]
    return problems


def _mtp_keys(config: dict[str, Any], unexpected: Any) -> set[str]:
    """Unexpected tensors of the MTP layers the config declares: numbered after the last decoder layer."""
    layers, mtp = config.get("num_hidden_layers"), config.get("num_nextn_predict_layers")
    if not isinstance(layers, int) or not isinstance(mtp, int) or mtp < 1:
        return set()
    found = set()
    for key in unexpected:
        match = re.match(r"model\.layers\.(\d+)\.", key)
        if match and layers <= int(match.group(1)) < layers + mtp:
            found.add(key)
    return found


def _shape(shape: object) -> str:
    return str(list(shape)) if isinstance(shape, (tuple, list, torch.Size)) else str(shape)


def _mismatched(model: torch.nn.Module, stored: dict[str, tuple[int, ...]]) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """Tensors stored under a parameter's own name with another shape (converted tensors have other names)."""
    expected = {n: tuple(t.shape) for n, t in (*model.named_parameters(), *model.named_buffers())}
    return [(n, stored[n], expected[n]) for n in sorted(expected) if n in stored and tuple(stored[n]) != expected[n]]


def _ignored_by_design(stored: dict[str, tuple[int, ...]], cls: type) -> list[str]:
    patterns = [p for p in getattr(cls, "_keys_to_ignore_on_load_unexpected", None) or () if isinstance(p, str)]
    if not patterns:
        return []
    ignored = [n for n in sorted(stored) if any(re.search(p, n) for p in patterns)]
    if not ignored:
        return []
    return [f"{len(ignored)} tensor{'s' if len(ignored) != 1 else ''} in the checkpoint that {cls.__name__} ignores "
            f"by design ({', '.join(repr(p) for p in patterns)}), e.g. '{ignored[0]}': not loaded, not checked"]


def logit_problems(logits: torch.Tensor) -> list[str]:
    """What makes logits ``[positions, vocab]`` unusable: non-finite values, or no information in them."""
    bad = int((~torch.isfinite(logits)).sum())
    if bad:
        first = int((~torch.isfinite(logits)).any(-1).nonzero()[0, 0])
        return [f"logits: {bad} of {logits.numel()} values are NaN or infinite (first at position {first})"]
    problems = []
    flat = [i for i, row in enumerate(logits) if float(row.max() - row.min()) == 0.0]
    if flat:
        problems.append(f"logits: every vocabulary entry gets the same logit at position{'s' if len(flat) > 1 else ''} "
                        f"{', '.join(map(str, flat[:8]))}{' ...' if len(flat) > 8 else ''} (zero variance)")
    elif logits.shape[0] > 1 and float((logits - logits[0]).abs().max()) == 0.0:
        problems.append(f"logits: all {logits.shape[0]} positions give the same logits (the input has no effect)")
    return problems
