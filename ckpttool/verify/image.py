"""The image input of ``verify`` for a vision-language model: a small synthetic image and a prompt holding its image
tokens, so that the forward runs through the vision tower and its projector or merger, not only the language model.

The image goes through the model's own image processor when it can be built from the checkpoint's processor files
(``preprocessor_config.json``, copied by merge; never from the hub, never remote code). transformers' image
processors need PIL or torchvision; where neither is installed, or the checkpoint has no processor files, the
pixels are laid out from the config as the processor would lay them out, for the families whose layout is known:

- Qwen2-VL, Qwen2.5-VL, Qwen3-VL (dense, MoE): flattened patches ``[patches, 3 * temporal * patch * patch]`` of a
  grid ``(1, 2m, 2m)`` (``m`` the spatial merge size), ``image_grid_thw``, and ``4`` image tokens after the merge;
- GLM-4V (dense, MoE): as Qwen2-VL, between its ``image_start_token_id`` and ``image_end_token_id``;
- Gemma 3: one ``image_size`` square image ``[1, 3, size, size]`` and ``mm_tokens_per_image`` image tokens between
  its begin- and end-of-image tokens.

For these the pixels always come from the config (their processors cut images into tiles, crops or rows of tokens
that add nothing to a check of the weights): one ``image_size`` square image ``[1, 3, size, size]`` and the number
of image tokens the vision side gives for it:

- LLaVA (CLIP, SigLIP towers): ``(size / patch)²``, plus the class token when ``vision_feature_select_strategy``
  is ``full``; PaliGemma: ``(size / patch)²``;
- LLaVA-Next: the image and one tile of the same size (``[1, 2, 3, size, size]``, ``image_sizes``), the tile's
  patches with one ``image_newline`` per row after the image's: ``2 (size / patch)² + size / patch``;
- Mistral 3 (Pixtral tower): ``(size / patch / spatial_merge_size)²``, with ``image_sizes``;
- Llama 4: ``(size / patch)² * pixel_shuffle_ratio²``.

Any other vision-language model is verified on text only (a note says so). The image is fixed (seeded), the same
for the output and the reference.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

#: the seed of the synthetic image; its side in pixels when the processor takes any size
SEED, SIDE = 0, 32
_QWEN = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "glm4v_moe")
#: the model types whose one square image is laid out from the config alone (:func:`_square`)
_SQUARE = ("llava", "llava_next", "paligemma", "mistral3", "llama4")


@dataclass(frozen=True, slots=True)
class ImageInput:
    """The keyword inputs of one forward with an image (``input_ids``, ``pixel_values``, ...), how they were
    made, in words (for the report), and the image token's id."""

    inputs: dict[str, torch.Tensor]
    source: str
    image_token: int


def image_input(path: Path, config: dict[str, Any]) -> ImageInput | str | None:
    """The image input for the vision-language model in ``path`` (``config``: its config), a note saying why it is
    verified on text only, or None when it is no vision-language model (its config has no ``vision_config``)."""
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        return None
    model_type = config.get("model_type")
    if model_type not in (*_QWEN, *_SQUARE, "gemma3"):
        return f"{model_type} is verified on text only: ckpttool does not know how its images are laid out"
    try:
        if model_type in _QWEN:
            return _qwen(path, config, vision)
        if model_type in _SQUARE:
            return _square(model_type, config, vision)
        return _gemma3(path, config, vision)
    except (KeyError, TypeError, ValueError) as e:  # a config without the sizes its family needs
        return f"{model_type} is verified on text only: its config does not give the image layout ({e})"


def with_token_types(model: torch.nn.Module, image: ImageInput) -> dict[str, torch.Tensor]:
    """``image``'s inputs, with the ``mm_token_type_ids`` (1 at image tokens) a model that takes them needs
    (Qwen3-VL computes its multimodal RoPE from them)."""
    inputs = dict(image.inputs)
    if "mm_token_type_ids" in inspect.signature(model.forward).parameters:
        inputs["mm_token_type_ids"] = (inputs["input_ids"] == image.image_token).int()
    return inputs


def _pixels(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.rand(shape, generator=torch.Generator().manual_seed(SEED))


def _processor(path: Path):
    """The checkpoint's image processor, or the reason there is none (a string)."""
    if not (path / "preprocessor_config.json").is_file():
        return "no preprocessor_config.json"
    try:
        from transformers import AutoImageProcessor

        return AutoImageProcessor.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (ImportError, OSError, ValueError) as e:  # no PIL / torchvision here, or files it cannot use
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        if len(lines) > 1 and lines[0].endswith(":"):  # "... You can install it with pip:" and the command after it
            return f"{lines[0]} {lines[1].split('. ')[0].rstrip('.')}"
        return lines[0] if lines else type(e).__name__


def _image(side: int) -> torch.Tensor:
    """A fixed RGB image, ``[3, side, side]`` uint8."""
    return (_pixels((3, side, side)) * 255).to(torch.uint8)


def _qwen(path: Path, config: dict[str, Any], vision: dict[str, Any]) -> ImageInput:
    patch, merge, temporal = int(vision["patch_size"]), int(vision["spatial_merge_size"]), int(
        vision["temporal_patch_size"])
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    glm = str(config.get("model_type")).startswith("glm4v")  # GLM-4V names its image's bounds otherwise
    start_key, end_key = ("image_start_token_id", "image_end_token_id") if glm else (
        "vision_start_token_id", "vision_end_token_id")
    image_token = int(config.get("image_token_id", text.get("image_token_id", -1)))
    start = int(config.get(start_key, text.get(start_key, -1)))
    end = int(config.get(end_key, text.get(end_key, -1)))
    processor = _processor(path)
    if isinstance(processor, str):
        side = 2 * merge
        grid = torch.tensor([[1, side, side]])
        pixels = _pixels((side * side, 3 * temporal * patch * patch)) * 2 - 1
        how = (f"a synthetic {side * patch}x{side * patch} image laid out from the config (no image processor: "
               f"{processor})")
    else:
        done = processor(images=[_image(2 * merge * patch)], return_tensors="pt")
        pixels, grid = done["pixel_values"], done["image_grid_thw"]
        how = f"a synthetic {2 * merge * patch}x{2 * merge * patch} image through {type(processor).__name__}"
    tokens = int(grid.prod()) // (merge * merge)
    ids = torch.tensor([[start, *[image_token] * tokens, end, *_TEXT]])
    return ImageInput(dict(input_ids=ids, pixel_values=pixels, image_grid_thw=grid), f"{how}, {tokens} image tokens",
                      image_token)


def _gemma3(path: Path, config: dict[str, Any], vision: dict[str, Any]) -> ImageInput:
    size, tokens = int(vision["image_size"]), int(config["mm_tokens_per_image"])
    image_token, start, end = (int(config[k]) for k in ("image_token_index", "boi_token_index", "eoi_token_index"))
    processor = _processor(path)
    if isinstance(processor, str):
        pixels = _pixels((1, 3, size, size)) * 2 - 1
        how = f"a synthetic {size}x{size} image laid out from the config (no image processor: {processor})"
    else:
        pixels = processor(images=[_image(size)], return_tensors="pt")["pixel_values"]
        how = f"a synthetic {size}x{size} image through {type(processor).__name__}"
    ids = torch.tensor([[start, *[image_token] * tokens, end, *_TEXT]])
    return ImageInput(dict(input_ids=ids, pixel_values=pixels), f"{how}, {tokens} image tokens", image_token)


def _square(model_type: str, config: dict[str, Any], vision: dict[str, Any]) -> ImageInput:
    """One ``image_size`` square image laid out from the config, and as many image tokens as the vision side of
    ``model_type`` gives for it (see the module's docstring)."""
    size, patch = int(vision["image_size"]), int(vision["patch_size"])
    side = size // patch
    image_token = int(config.get("image_token_id", config.get("image_token_index")))
    inputs: dict[str, torch.Tensor] = {}
    if model_type == "llava_next":
        pixels = _pixels((1, 2, 3, size, size)) * 2 - 1
        tokens = 2 * side * side + side
    else:
        pixels = _pixels((1, 3, size, size)) * 2 - 1
        tokens = side * side
    if model_type == "llava" and config.get("vision_feature_select_strategy") == "full":
        tokens += 1  # the class token is kept
    elif model_type == "mistral3":
        tokens //= int(config.get("spatial_merge_size", 2)) ** 2
    elif model_type == "llama4":
        tokens = int(tokens * float(vision["pixel_shuffle_ratio"]) ** 2)
    if model_type in ("llava_next", "mistral3"):
        inputs["image_sizes"] = torch.tensor([[size, size]])
    ids = torch.tensor([[*_TEXT[:1], *[image_token] * tokens, *_TEXT]])
    how = f"a synthetic {size}x{size} image laid out from the config (as {model_type}'s processor would)"
    return ImageInput(dict(input_ids=ids, pixel_values=pixels, **inputs), f"{how}, {tokens} image tokens",
                      image_token)


#: text after the image: fixed ids low in every vocabulary
_TEXT = (5, 9, 17)
